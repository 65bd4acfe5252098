"""The rollout server process a sampler, an evaluator or a benchmark starts and owns:
`reinforge serve` or SGLang's `launch_server`, on a free port, dying with its parent.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import trio

from reinforge.core.children import die_with_parent
from reinforge.core.ports import free_port
from reinforge.rollout.client import RolloutClient
from reinforge.rollout.command import serve_argv


class ServerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which rollout server to start."""

    backend: str = "embedded"
    """"embedded" (`reinforge serve`) or "sglang" (`python -m sglang.launch_server`)."""
    model_path: str
    """Model directory (Hugging Face format) to serve."""
    initial_version: int = 0
    """Policy version of `model_path` (the server is started with --weight-version N)."""
    server_args: list[str] = []
    """Extra command-line arguments for the server."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


BACKENDS = ("embedded", "sglang")


# ----------------------------------------------------------------------------- the gate


def server_command(cfg: ServerSpec, port_file: str) -> list[str]:
    """The command line that starts this rollout server."""
    if cfg.backend == "embedded":
        return serve_argv(cfg.model_path, port_file=port_file,
                          weight_version=cfg.initial_version, extra=cfg.server_args)
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path,
            "--host", "127.0.0.1", "--port", str(free_port()),
            "--weight-version", str(cfg.initial_version), *cfg.server_args]


class ServerProcess:
    """A rollout server started (and stopped) by its owner. Its log and port file go to
    `log_path`, or to a scratch folder of its own that `stop` removes (a failed start's
    error carries the log's tail)."""

    def __init__(self, cfg: ServerSpec, log_path: Path | None = None) -> None:
        self.cfg = cfg
        self._scratch = None if log_path else Path(tempfile.mkdtemp(prefix="rf-server-"))
        self.log_path = log_path or self._scratch / "server.log"
        self.port_file = str(self.log_path.with_suffix(".port"))
        self.argv = server_command(cfg, self.port_file)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        Path(self.port_file).unlink(missing_ok=True)  # a restarted owner's, naming a dead port
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,  # the server ends with its owner, even a kill -9
            )

    async def wait_url(self, timeout_s: float) -> str:
        assert self.proc is not None
        with trio.move_on_after(timeout_s):
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"rollout server exited with {self.proc.returncode}: "
                        f"{shlex.join(self.argv)}\n{self._log_tail()}"
                    )
                url = self._url()
                if url:
                    async with RolloutClient(url, timeout_s=5) as probe:
                        if await probe.health():
                            return url
                await trio.sleep(0.2)
        raise RuntimeError(
            f"rollout server not healthy after {timeout_s} s: {shlex.join(self.argv)}\n"
            f"{self._log_tail()}"
        )

    def _url(self) -> str:
        if self.cfg.backend == "embedded":
            try:
                return f"http://127.0.0.1:{int(Path(self.port_file).read_text())}"
            except (OSError, ValueError):
                return ""
        return f"http://127.0.0.1:{self.argv[self.argv.index('--port') + 1]}"

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        try:
            if self.proc is None or self.proc.poll() is not None:
                return
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        finally:
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)


# ----------------------------------------------------------------------------- the actor


