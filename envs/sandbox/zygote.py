"""Checks that cost a fork, not an exec: the host's side of a sandbox's zygote.

    check = Check(harness=source, payload=job_bytes, timeout_s=6.0)
    [result] = run_checks(box, [check])         # a RunResult, as Sandbox.run_task gives

A check is a harness (Python source defining `zygote_entry()`, which reads the payload on
stdin and writes its verdict on stdout) and its payload. The first check of a harness in a
sandbox starts its zygote (zygote_proc.py, read its docstring): one exec of
`python3 -c <zygote>` as the candidate's uid with stdin attached, kept open (the Podman API's
upgraded exec connection); every check after that is a frame on that connection and a fork
inside, so it pays neither Podman's exec (an API call, a conmon and a runtime exec) nor the
interpreters' start-up. A zygote serves one harness and one set of limits: its fingerprint
(the hash of its source and its configuration, echoed by the zygote) must match the check's,
else it is replaced. Any other exec in the sandbox (`Sandbox.run_task`, `reset`) ends the
zygote first, since their wrappers kill every process of the candidate's uid.

What the host still enforces, as for any exec (`Sandbox.execute`): the memory watchdog on the
candidate uid's total RSS, and a deadline past the zygote's own (it kills the check at
`timeout_s`; `ZYGOTE_GRACE_S` later the host kills the whole container, e.g. when a candidate
stopped the zygote with SIGSTOP). A zygote that dies during a check (the candidate can kill
it: same uid) gives that check exit 137 and no verdict, and leaves the sandbox dirty (reset
before its next task); one that could not clean up after a check reports it and exits.

`Check.as_job` is the same check the way it ran before zygotes: the harness as a script in a
fresh interpreter, in its own exec (PoolConfig.zygote=False; bench/sandbox.py compares them).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import msgspec
from reinforge.envs.sandbox.attached import AttachedExec
from reinforge.envs.sandbox.box import (
    WRITABLE_DIRS,
    Job,
    LimitMechanism,
    RunResult,
    Sandbox,
    SandboxInfraError,
    classify,
    rss_of_host_uid,
)

ZYGOTE_SOURCE = Path(__file__).with_name("zygote_proc.py").read_text(encoding="utf-8")
MAX_PAYLOAD_BYTES = 1024 * 1024
"""A payload is staged in one pipe inside (pipe-max-size, 1 MiB by default); a bigger check
runs as `Check.as_job`."""
ZYGOTE_GRACE_S = 5.0
"""How long past a check's deadline the host waits for the zygote's own kill and clean-up."""


class Check(msgspec.Struct, frozen=True, kw_only=True):
    """One run of a harness over a payload (see the module docstring)."""

    harness: bytes
    """Python source defining `zygote_entry()`; run as a script it must do the same."""
    payload: bytes
    """The harness's stdin."""
    timeout_s: float | None = None
    """None: the sandbox config's timeout_s."""

    def as_job(self) -> Job:
        """The same check as a plain job: the harness as a script in a fresh interpreter."""
        return Job(
            files={"harness.py": self.harness},
            argv=["python3", "-I", "-B", "harness.py"],
            stdin=self.payload,
            timeout_s=self.timeout_s,
        )

    def cache_key(self, image: str) -> str:
        """Both ways of running a check give the same outcome: one key."""
        return self.as_job().cache_key(image)


def run_checks(box: Sandbox, checks: list[Check]) -> list[RunResult | None]:
    """Run `checks` one after another in `box`'s zygote. None: not run (the box died first).

    Raises SandboxInfraError when the infrastructure failed (and marks the box unhealthy)."""
    results: list[RunResult | None] = []
    for check in checks:
        if not box.healthy:
            results.append(None)
            continue
        timeout_s = box.config.timeout_s if check.timeout_s is None else float(check.timeout_s)
        if len(check.payload) > MAX_PAYLOAD_BYTES:
            job = check.as_job()
            results.append(box.run_task(job.files, job.argv, stdin=job.stdin, timeout_s=timeout_s))
            continue
        zygote = box.zygote
        # a box's config is fixed: the harness alone decides whether the zygote fits
        if zygote is None or zygote.harness != check.harness:
            box.end_zygote()
            if box.dirty:
                box.reset()  # no leftover process of the candidate may watch the zygote start
            zygote = box.zygote = Zygote.start(box, check.harness)
        results.append(zygote.check(check.payload, timeout_s))
    return results


class Zygote:
    """One sandbox's zygote session (see the module docstring). Not thread-safe."""

    def __init__(self, box: Sandbox, io: AttachedExec, harness: bytes) -> None:
        self.box = box
        self.harness = harness
        self.fingerprint = self.fingerprint_of(box, harness)
        self.checks = 0
        self._io = io

    @staticmethod
    def config_of(box: Sandbox, harness: bytes) -> bytes:
        cfg = box.config
        config = {
            "harness": harness.decode("utf-8"),
            "limits": {
                "pids": cfg.pids_limit,
                "data_bytes": cfg.memory_bytes,
                "file_size_bytes": cfg.file_size_bytes,
                "open_files": cfg.open_files,
            },
            "nice": cfg.nice,
            "work_dir": cfg.work_dir,
            "writable": list(WRITABLE_DIRS),
            "max_output_bytes": cfg.max_output_bytes,
            "max_drained_bytes": cfg.max_drained_bytes,
        }
        return json.dumps(config, sort_keys=True).encode()

    @classmethod
    def fingerprint_of(cls, box: Sandbox, harness: bytes) -> str:
        return hashlib.sha256(ZYGOTE_SOURCE.encode() + cls.config_of(box, harness)).hexdigest()

    @classmethod
    def start(cls, box: Sandbox, harness: bytes) -> Zygote:
        """Start `box`'s zygote for `harness`. Raises SandboxInfraError (box marked unhealthy)."""
        config = cls.config_of(box, harness)
        io, ready = AttachedExec.handshake(
            box, ["python3", "-I", "-B", "-c", ZYGOTE_SOURCE], config, "the zygote"
        )
        zygote = cls(box, io, harness)
        if ready.get("ready") != hashlib.sha256(config).hexdigest() or ready.get("dirt"):
            io.close()
            box.healthy = False
            raise SandboxInfraError(
                f"the zygote of sandbox {box.name} is not the one asked for: {ready}; "
                f"stderr: {io.stderr_tail}"
            )
        return zygote

    def close(self) -> None:
        """End the session: the zygote reads EOF and exits (never raises)."""
        self._io.close()

    def check(self, payload: bytes, timeout_s: float) -> RunResult:
        box = self.box
        box.runs += 1
        self.checks += 1
        header = {"id": self.checks, "length": len(payload), "timeout_s": timeout_s}
        t0 = time.monotonic()
        why = ""
        peak_rss = 0
        try:
            self._io.send(json.dumps(header).encode(), raw=payload)
            deadline = t0 + timeout_s + ZYGOTE_GRACE_S
            watch = box.limits is LimitMechanism.RLIMIT and box.host_uid is not None
            while True:
                try:
                    reply = json.loads(
                        self._io.read_frame(
                            min(deadline, time.monotonic() + box.config.memory_poll_s)
                            if watch
                            else deadline
                        )
                    )
                    break
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        why = "timeout"
                        break
                    rss = rss_of_host_uid(box.host_uid)
                    peak_rss = max(peak_rss, rss)
                    if rss > box.config.memory_bytes:
                        why = "memory"
                        break
            if not why:
                out = self._io.read_frame(time.monotonic() + box.config.api_timeout_s)
                err = self._io.read_frame(time.monotonic() + box.config.api_timeout_s)
        except EOFError:
            return self._died(t0)
        except (OSError, ValueError, TimeoutError) as exc:
            box.healthy = False
            self.close()
            raise SandboxInfraError(f"the zygote of sandbox {box.name} failed: {exc}") from exc
        if why:  # the zygote did not answer: kill everything (the pool replaces the box)
            box.kill()
            self.close()
            return classify(
                box,
                code=137,
                why=why,
                timeout_s=timeout_s,
                duration_s=time.monotonic() - t0,
                stdout=b"",
                stderr=b"",
                counts=(0, 0),
                peak_rss=peak_rss,
            )
        if reply.get("id") != self.checks:
            box.healthy = False
            self.close()
            raise SandboxInfraError(f"the zygote of sandbox {box.name} answered out of turn")
        if not reply["clean"]:
            box.dirty = True
            box.end_zygote()
        return classify(
            box,
            code=int(reply["exit_code"]),
            why=reply["why"] or None,
            timeout_s=timeout_s,
            duration_s=float(reply["duration_s"]),
            stdout=bytes(out),
            stderr=bytes(err),
            counts=(int(reply["stdout_bytes"]), int(reply["stderr_bytes"])),
            peak_rss=peak_rss,
        )

    def _died(self, t0: float) -> RunResult:
        """The session ended during a check: the candidate killed the zygote, or the container
        is gone (then it is the infrastructure's failure)."""
        box = self.box
        box.end_zygote()
        if not box.alive():
            box.healthy = False
            raise SandboxInfraError(f"sandbox {box.name} died during a check")
        box.dirty = True  # what the candidate started may still run: reset before the next task
        return classify(
            box,
            code=137,
            why=None,
            timeout_s=float("inf"),
            duration_s=time.monotonic() - t0,
            stdout=b"",
            stderr=b"",
            counts=(0, 0),
            peak_rss=0,
            detail="the zygote was killed during the check (by the candidate's code?)",
        )
