"""Where the code and terminal domains run their jobs: the Podman sandbox pool, or (tests
of the harness logic, trusted inputs only) a plain local process.

    class CodeRunner(Protocol):
        async def run(self, *, files, argv, stdin, timeout_s) -> RunOutput
        async def check(self, *, harness, payload, timeout_s) -> RunOutput
            # a harness (source with zygote_entry()) over a payload: in the pool, a fork of
            # the sandbox's zygote (zygote.py); elsewhere, the harness run as a script
            # both raise RunnerInfraError when the infrastructure (not the candidate) failed

`PoolRunner` wraps reinforge.envs.sandbox.pool.SandboxPool: open it with
`async with sandbox_runner(PoolConfig(...)) as runner:`. `UnsafeLocalRunner` runs the
same job in a temporary directory on the host, WITHOUT isolation: never give it
untrusted code; it exists so the harness's anti-gaming logic is tested on every
machine, and the same tests run against the real sandbox under the `podman` marker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal, Protocol

import msgspec

RunStatus = Literal[
    "ok", "nonzero_exit", "timeout", "memory_limit", "output_limit", "input_too_large"
]


class RunOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What a job did (the candidate's side of things; infrastructure faults raise)."""

    status: RunStatus
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    duration_s: float
    detail: str = ""


class RunnerInfraError(RuntimeError):
    """The runner's infrastructure failed (sandbox/Podman down): never the candidate's fault."""


class CodeRunner(Protocol):
    name: str

    async def run(
        self, *, files: Mapping[str, bytes | str], argv: list[str], stdin: bytes, timeout_s: float
    ) -> RunOutput: ...

    async def check(self, *, harness: bytes, payload: bytes, timeout_s: float) -> RunOutput: ...


class PoolRunner:
    """Jobs on a SandboxPool (rootless Podman)."""

    name = "podman"

    def __init__(self, pool) -> None:
        self.pool = pool

    async def run(
        self, *, files: Mapping[str, bytes | str], argv: list[str], stdin: bytes, timeout_s: float
    ) -> RunOutput:
        from reinforge.envs.sandbox.pool import Job

        return await self._outcome(
            Job(files=dict(files), argv=list(argv), stdin=stdin, timeout_s=timeout_s)
        )

    async def check(self, *, harness: bytes, payload: bytes, timeout_s: float) -> RunOutput:
        from reinforge.envs.sandbox.zygote import Check

        return await self._outcome(Check(harness=harness, payload=payload, timeout_s=timeout_s))

    async def _outcome(self, job) -> RunOutput:
        from reinforge.envs.sandbox.pool import InfraFailure

        result = await self.pool.run(job)
        if isinstance(result, InfraFailure):
            raise RunnerInfraError(
                f"sandbox failed after {result.attempts} attempts: {result.error}"
            )
        return RunOutput(
            status=result.status.value,
            exit_code=result.exit_code,
            stdout=result.stdout,
            stderr=result.stderr,
            duration_s=result.duration_s,
            detail=result.detail,
        )

    @asynccontextmanager
    async def session(self, argv: list[str], config: dict) -> AsyncIterator[Any]:
        """A sandbox held for one episode (`SandboxPool.session`); RunnerInfraError when
        none can be had."""
        from reinforge.envs.sandbox.box import SandboxInfraError

        held = self.pool.session(argv, config)
        try:
            session = await held.__aenter__()
        except SandboxInfraError as exc:
            raise RunnerInfraError(f"no sandbox session: {exc}") from exc
        try:
            yield session
        finally:
            await held.__aexit__(None, None, None)

    def statistics(self):
        return self.pool.statistics()


@asynccontextmanager
async def sandbox_runner(config=None) -> AsyncIterator[PoolRunner]:
    """Open a SandboxPool (PoolConfig `config`) and yield a runner over it.

    Raises RunnerInfraError when Podman is not reachable.
    """
    from reinforge.envs.sandbox.box import SandboxInfraError
    from reinforge.envs.sandbox.pool import SandboxPool

    try:
        pool = SandboxPool(config)
        await pool.__aenter__()
    except SandboxInfraError as exc:
        raise RunnerInfraError(str(exc)) from exc
    try:
        yield PoolRunner(pool)
    finally:
        await pool.aclose()


class UnsafeLocalRunner:
    """Runs the job as a local process in a temp dir. NO ISOLATION: trusted inputs only."""

    name = "unsafe-local"

    def __init__(self, *, python: str | None = None, max_output_bytes: int = 64 * 1024):
        self.python = python or sys.executable
        self.max_output_bytes = max_output_bytes

    async def run(
        self, *, files: Mapping[str, bytes | str], argv: list[str], stdin: bytes, timeout_s: float
    ) -> RunOutput:
        import trio

        return await trio.to_thread.run_sync(
            self._run, dict(files), list(argv), stdin, timeout_s, abandon_on_cancel=True
        )

    async def check(self, *, harness: bytes, payload: bytes, timeout_s: float) -> RunOutput:
        """The harness run as a script (no zygote here)."""
        return await self.run(
            files={"harness.py": harness},
            argv=["python3", "-I", "-B", "harness.py"],
            stdin=payload,
            timeout_s=timeout_s,
        )

    def _run(self, files, argv, stdin, timeout_s) -> RunOutput:
        work = tempfile.mkdtemp(prefix="rf-local-")
        try:
            for name, content in files.items():
                path = os.path.join(work, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as fh:
                    fh.write(content.encode() if isinstance(content, str) else content)
            if argv and argv[0] in ("python3", "python"):
                argv = [self.python, *argv[1:]]
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": work,
                "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1",
            }
            t0 = time.monotonic()
            proc = subprocess.Popen(
                argv,
                cwd=work,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
            try:
                out, err = proc.communicate(stdin, timeout=timeout_s)
                status = "ok" if proc.returncode == 0 else "nonzero_exit"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                out, err = proc.communicate()
                status = "timeout"
            try:  # leave nothing behind in the session
                os.killpg(proc.pid, 9)
            except OSError:
                pass
            return RunOutput(
                status=status,
                exit_code=proc.returncode,
                stdout=out[: self.max_output_bytes],
                stderr=err[: self.max_output_bytes],
                duration_s=time.monotonic() - t0,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)


class WithoutSessions:
    """A runner's jobs and checks without its sessions: a multi-turn episode then replays its
    commands at every step (the path before sessions; bench/sandbox.py compares them)."""

    def __init__(self, runner: CodeRunner) -> None:
        self.name = runner.name
        self.run, self.check = runner.run, runner.check
