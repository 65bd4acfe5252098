"""A sandbox session: one process that lives in one sandbox for a whole episode.

    async with pool.session(argv, config) as session:   # a sandbox held for the episode
        reply = await session.request({"op": "run", ...}, timeout_s=5.0)

The process (an episode driver, e.g. the terminal domain's in session mode) starts once, as
the candidate's uid, on an attached exec (`attached.py`); it reads `config` as its first
frame and answers it, then answers each request with one JSON frame. A step of the episode
is one request: it costs what the step itself runs, not a new container or exec, and not a
replay of the steps before it.

How a session can end early, and whose failure it is:
  * the process does not answer within the request's `timeout_s` plus `SESSION_GRACE_S`
    (the driver enforces each step's own limit, so it hung: the episode's code stopped it):
    the host kills the container, `SessionEnded(infra=False)`;
  * the connection ends and the container still runs: the episode's code killed the driver
    (same uid), `SessionEnded(infra=False)`;
  * the container is gone, or the API fails: `SessionEnded(infra=True)`, an infrastructure
    error (never a reward of 0).
The host's memory watchdog on the candidate uid (where limits are rlimits) runs during every
request, as it does for any exec. The pool resets the sandbox after the session, or replaces
it if it was killed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from reinforge.envs.sandbox.attached import AttachedExec
from reinforge.envs.sandbox.box import LimitMechanism, Sandbox, rss_of_host_uid

SESSION_GRACE_S = 5.0
"""How long past a request's own limit the host waits before it kills the sandbox."""


class SessionEnded(Exception):
    """The session's process is gone; `infra` says whether the infrastructure failed."""

    def __init__(self, reason: str, *, infra: bool) -> None:
        super().__init__(reason)
        self.infra = infra


class SandboxSession:
    """The host's side of one session. Not thread-safe; blocking (call from a thread)."""

    def __init__(self, box: Sandbox, io: AttachedExec, ready: dict[str, Any]) -> None:
        self.box = box
        self.ready = ready
        """The process's answer to its config."""
        self.requests = 0
        self._io = io
        self._ended: SessionEnded | None = None

    @classmethod
    def start(cls, box: Sandbox, argv: Sequence[str], config: dict[str, Any]) -> SandboxSession:
        """Start `argv` in `box` and hand it `config`. Raises SandboxInfraError (the box
        marked unhealthy) when it does not start and answer."""
        io, ready = AttachedExec.handshake(box, argv, json.dumps(config).encode(), "a session")
        box.runs += 1
        box.dirty = True  # what the episode starts may outlive it: reset after
        return cls(box, io, ready)

    def request(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request and wait for its answer (see the module docstring for the
        ways this raises SessionEnded)."""
        if self._ended is not None:
            raise self._ended
        box = self.box
        self.requests += 1
        deadline = time.monotonic() + timeout_s + SESSION_GRACE_S
        watch = box.limits is LimitMechanism.RLIMIT and box.host_uid is not None
        try:
            self._io.send(json.dumps(body).encode())
            while True:
                poll = min(deadline, time.monotonic() + box.config.memory_poll_s)
                try:
                    return json.loads(self._io.read_frame(poll if watch else deadline))
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        return self._end(f"no answer within {timeout_s + SESSION_GRACE_S:.0f} s",
                                         kill=True)
                    if rss_of_host_uid(box.host_uid) > box.config.memory_bytes:
                        return self._end("the episode's processes exceeded the memory limit",
                                         kill=True)
        except (EOFError, BrokenPipeError, ConnectionResetError):  # its pipes closed
            if box.alive():
                return self._end("the session's process was killed (by the episode's code?)",
                                 kill=False)
            return self._end(f"sandbox {box.name} died during the session", infra=True)
        except (OSError, ValueError) as exc:
            return self._end(f"the session in sandbox {box.name} failed: {exc}", infra=True)

    def _end(self, reason: str, *, kill: bool = False, infra: bool = False) -> dict[str, Any]:
        self.close()
        if kill or infra:
            self.box.kill()  # the pool replaces it
        self._ended = SessionEnded(reason, infra=infra)
        raise self._ended

    def close(self) -> None:
        """End the session: the process reads EOF and exits (never raises)."""
        self._io.close()
