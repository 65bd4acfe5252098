"""reasoning-gym's scorers, run on model-written answers in a child process with limits.

Several scorers hand the answer to sympy's parser, which evaluates it: `x**(9**9**9)` as an
antiderivative computes a power for minutes and takes gigabytes (one of our evaluations grew
to 12 GB on gym-simple_integration). That call is C code: no signal or thread interrupts
it. So verification sends (dataset, tier, seed, answer) to one worker process, which makes
the item itself (`GymDomain.item`, cached there) and scores it under an address-space limit;
a score that takes longer than `SCORE_TIMEOUT_S` kills the worker, the next score starts a
fresh one, and the verdict is an `error` that says so. One worker per process, one score at a
time (a lock): scoring was already serial, since the scorer blocked the event loop.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
from typing import Any

SCORE_TIMEOUT_S = 10.0
"""A scorer's time on one answer; they take milliseconds (the slowest families' items take
0.2 s to make, once per item)."""
WORKER_MEMORY_BYTES = 4 << 30
"""The worker's address-space limit: past it the scorer's allocation fails (MemoryError, an
`error` verdict) instead of the machine's memory running out."""
START_TIMEOUT_S = 60.0


class ScorerTimeout(Exception):
    """The scorer ran past its time on an answer; its worker was killed."""


class ScorerWorker:
    """A child process that scores answers, one JSON line each way; see the module
    docstring. A plain subprocess (`python -m reinforge.envs.domains.gym_scorer`), not
    multiprocessing's: that would import the parent's `__main__` again in the child."""

    def __init__(self, timeout_s: float = SCORE_TIMEOUT_S,
                 memory_bytes: int = WORKER_MEMORY_BYTES) -> None:
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        """Workers killed for running past their time."""

    def score(self, dataset: str, tier: int, seed: int, answer: str) -> float:
        """The scorer's reward for `answer` on the item; RuntimeError naming the scorer's own
        exception; ScorerTimeout past `timeout_s`."""
        with self._lock:
            proc = self._started()
            assert proc.stdin is not None and proc.stdout is not None
            request = json.dumps({"dataset": dataset, "tier": tier, "seed": seed,
                                  "answer": answer})
            proc.stdin.write(request.encode() + b"\n")
            proc.stdin.flush()
            line = self._read_line(proc, self.timeout_s)
            if line is None:
                self._kill()
                self.restarts += 1
                raise ScorerTimeout(f"the {dataset} scorer ran past {self.timeout_s:g} s on an "
                                    "answer; its worker was killed")
            if not line:  # the worker died (killed from outside, or crashed)
                self._kill()
                raise RuntimeError(f"the {dataset} scorer's worker died")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return float(reply["score"])

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._kill()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "reinforge.envs.domains.gym_scorer",
             str(self.memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
        if self._read_line(self._proc, START_TIMEOUT_S) != b"ready\n":
            self._kill()
            raise RuntimeError("the gym scorer's worker did not start")
        return self._proc

    @staticmethod
    def _read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes | None:
        """A line of the worker's (b"" once it died), or None after `timeout_s`. The worker
        writes one whole line per request, so a readable pipe holds it."""
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        return proc.stdout.readline() if ready else None

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
        self._proc = None


def serve(memory_bytes: int) -> None:
    """The worker: score each request until stdin closes. Replies go to a copy of the
    original stdout; anything a generator or scorer prints goes to stderr."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from reinforge.envs.domains.gym import GymDomain, GymSpec, score_answer

    domains: dict[str, GymDomain] = {}
    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        r = json.loads(line)
        try:
            domain = domains.setdefault(r["dataset"], GymDomain(r["dataset"]))
            ds, entry = domain.item(GymSpec(dataset=r["dataset"], tier=r["tier"], seed=r["seed"]))
            reply: dict[str, Any] = {"score": score_answer(ds, r["answer"], entry)}
        except Exception as exc:  # noqa: BLE001 - said in the verdict, never a silent 0
            reply = {"error": f"the {r['dataset']} scorer raised {type(exc).__name__}: "
                              f"{exc}"[:300]}
        print(json.dumps(reply), file=replies, flush=True)


_worker: ScorerWorker | None = None
_worker_lock = threading.Lock()


def worker() -> ScorerWorker:
    """This process's scorer worker (started on its first score)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ScorerWorker()
            atexit.register(_worker.close)
        return _worker


def close_worker() -> None:
    """Stop this process's scorer worker, if it started one (it closes at exit anyway)."""
    with _worker_lock:
        if _worker is not None:
            _worker.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
