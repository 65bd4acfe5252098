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
import socket
import struct
import time
from pathlib import Path

import msgspec
from reinforge.envs.sandbox.box import (
    WRITABLE_DIRS,
    Job,
    LimitMechanism,
    RunResult,
    Sandbox,
    SandboxInfraError,
    classify,
    default_podman_url,
    rss_of_host_uid,
)

ZYGOTE_SOURCE = Path(__file__).with_name("zygote_proc.py").read_text(encoding="utf-8")
MAX_PAYLOAD_BYTES = 1024 * 1024
"""A payload is staged in one pipe inside (pipe-max-size, 1 MiB by default); a bigger check
runs as `Check.as_job`."""
ZYGOTE_GRACE_S = 5.0
"""How long past a check's deadline the host waits for the zygote's own kill and clean-up."""
_API = "/v4.0.0/libpod"


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

    def __init__(self, box: Sandbox, sock: socket.socket, harness: bytes) -> None:
        self.box = box
        self.harness = harness
        self.fingerprint = self.fingerprint_of(box, harness)
        self.checks = 0
        self._sock = sock
        self._stdout = bytearray()
        self._stderr = bytearray()
        self._frames = bytearray()  # the multiplexed stream, not yet split

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
        sock = None
        try:
            exec_id = box.create_exec(
                ["python3", "-I", "-B", "-c", ZYGOTE_SOURCE], {}, attach_stdin=True
            )
            sock = _upgrade(
                box.config.podman_url or default_podman_url(), exec_id, box.config.api_timeout_s
            )
            zygote = cls(box, sock, harness)
            zygote._send(config)
            ready = json.loads(zygote._read_frame(time.monotonic() + box.config.api_timeout_s))
        except (OSError, ValueError, EOFError, TimeoutError) as exc:
            if sock is not None:
                sock.close()
            box.healthy = False
            raise SandboxInfraError(
                f"the zygote of sandbox {box.name} did not start: {exc}"
            ) from exc
        if ready.get("ready") != hashlib.sha256(config).hexdigest() or ready.get("dirt"):
            sock.close()
            box.healthy = False
            raise SandboxInfraError(
                f"the zygote of sandbox {box.name} is not the one asked for: {ready}; "
                f"stderr: {bytes(zygote._stderr[-500:]).decode(errors='replace')}"
            )
        return zygote

    def close(self) -> None:
        """End the session: the zygote reads EOF and exits (never raises)."""
        try:
            self._sock.close()
        except OSError:
            pass

    def check(self, payload: bytes, timeout_s: float) -> RunResult:
        box = self.box
        box.runs += 1
        self.checks += 1
        header = {"id": self.checks, "length": len(payload), "timeout_s": timeout_s}
        t0 = time.monotonic()
        why = ""
        peak_rss = 0
        try:
            self._send(json.dumps(header).encode(), raw=payload)
            deadline = t0 + timeout_s + ZYGOTE_GRACE_S
            watch = box.limits is LimitMechanism.RLIMIT and box.host_uid is not None
            while True:
                try:
                    reply = json.loads(
                        self._read_frame(
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
                out = self._read_frame(time.monotonic() + box.config.api_timeout_s)
                err = self._read_frame(time.monotonic() + box.config.api_timeout_s)
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

    # -- the connection: Docker's multiplexed stream, zygote frames on its stdout ----------

    def _send(self, frame: bytes, *, raw: bytes = b"") -> None:
        """A frame to the zygote, and `raw` bytes after it (a check's payload)."""
        self._sock.settimeout(self.box.config.api_timeout_s)
        self._sock.sendall(struct.pack(">I", len(frame)) + frame + raw)

    def _read_frame(self, deadline: float) -> bytes:
        """The next zygote frame on stdout. TimeoutError at `deadline`, EOFError at the end."""
        while True:
            if len(self._stdout) >= 4:
                (n,) = struct.unpack(">I", self._stdout[:4])
                if len(self._stdout) >= 4 + n:
                    frame = bytes(self._stdout[4 : 4 + n])
                    del self._stdout[: 4 + n]
                    return frame
            self._fill(deadline)

    def _fill(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer from the zygote in time")
        self._sock.settimeout(left)
        try:
            chunk = self._sock.recv(65536)
        except TimeoutError as exc:
            raise TimeoutError("no answer from the zygote in time") from exc
        if not chunk:
            raise EOFError("the zygote's session ended")
        self._frames += chunk
        while len(self._frames) >= 8:
            kind, n = self._frames[0], int.from_bytes(self._frames[4:8], "big")
            if len(self._frames) < 8 + n:
                break
            data = self._frames[8 : 8 + n]
            del self._frames[: 8 + n]
            if kind == 1:
                self._stdout += data
            else:
                self._stderr = (self._stderr + data)[-4096:]


def _upgrade(url: str, exec_id: str, timeout_s: float) -> socket.socket:
    """Start exec `exec_id` on an upgraded API connection: a socket to its stdin and output."""
    if not url.startswith("unix://"):
        raise OSError(f"zygotes need a local Podman socket (unix://), not {url}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(url[len("unix://") :])
        body = json.dumps({"Detach": False, "Tty": False}).encode()
        sock.sendall(
            (
                f"POST {_API}/exec/{exec_id}/start HTTP/1.1\r\nHost: podman\r\n"
                "Content-Type: application/json\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(1)  # byte by byte: what follows the head is the stream
            if not chunk:
                raise OSError("the Podman API closed the exec connection")
            head += chunk
            if len(head) > 16384:
                raise OSError("the Podman API sent an oversized response head")
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status and b" 200 " not in status:
            raise OSError(f"the Podman API refused the exec: {head.decode(errors='replace')}")
    except BaseException:
        sock.close()
        raise
    return sock
