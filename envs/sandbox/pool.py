"""A pool of warm sandboxes, shared by trio tasks, with a result cache and flakiness checks.

    async with SandboxPool(PoolConfig(size=2)) as pool:
        outcome = await pool.run(Job(files={"sol.py": code, "test_sol.py": tests},
                                     argv=["python3", "-m", "unittest", "-q"]))
        match outcome:
            case RunResult(): ...        # the candidate's outcome (ok, failure, timeout, ...)
            case InfraFailure(): ...     # the infrastructure failed, even after retries: no reward
        report = await pool.check_flaky(job, runs=3)
        pool.statistics()

Invariants:
  - `size` workers, one sandbox each at a time: at most `size` sandboxes run jobs at once;
    callers beyond that wait in a queue;
  - a worker runs its job, plus up to max_batch - 1 small jobs already waiting, in one exec
    (batch.py) when the image has the protected wrapper: one after another, each with
    its own checked reset (all candidate processes killed, all writable dirs wiped), limits and
    deadline; jobs a dying sandbox did not get to go back to the queue;
  - a `Check` (a harness over a payload, e.g. a code test run) goes to the sandbox's zygote
    (zygote.py): a fork per check, with the same clean start, limits and deadline, and up to
    max_batch - 1 more waiting checks after it; PoolConfig.zygote=False runs it as a job;
  - a sandbox that timed out, flooded, failed its reset or errored is closed and replaced in
    the background; one whose wrapper was killed is reset before its next job;
  - infrastructure failures are retried on a fresh sandbox `infra_attempts` times, then
    returned as InfraFailure — never as a RunResult, so never as a reward of 0;
  - a try waits at most acquire_timeout_s for a ready sandbox, and not at all while none
    can start (none left, the last `infra_attempts` starts failed): it fails at once with
    the start's error, until a start works again;
  - results are cached by a hash of (files, argv, stdin, env, timeout, image); InfraFailure
    never is.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import trio

from reinforge.envs.sandbox.box import (
    MAX_INLINE_BYTES,
    CANDIDATE_UID_BASE,
    CANDIDATE_UID_SPAN,
    Job,
    RunStatus,
    RunResult,
    Sandbox,
    SandboxConfig,
    SandboxInfraError,
    probe_limits,
)
from reinforge.envs.sandbox.batch import can_batch, inline_size, run_tasks
from reinforge.envs.sandbox.session import SandboxSession
from reinforge.envs.sandbox.zygote import Check, run_checks


class InfraFailure(msgspec.Struct, frozen=True, kw_only=True):
    """The infrastructure failed for this job after every retry. Not a candidate outcome."""

    error: str
    attempts: int
    image: str


class FlakeReport(msgspec.Struct, frozen=True, kw_only=True):
    """The same job run several times without the cache."""

    statuses: list[str]
    exit_codes: list[int | None]
    flaky: bool
    """True when the runs did not all end the same (status and exit code)."""
    infra_failures: int


class PoolStatistics(msgspec.Struct, frozen=True, kw_only=True):
    size: int
    ready: int
    busy: int
    jobs: int
    cache_hits: int
    cache_entries: int
    infra_retries: int
    infra_failures: int
    sandboxes_started: int
    sandboxes_replaced: int
    start_failures: int
    latency_p50_s: float
    latency_p95_s: float
    flaky_checks: int
    flaky_found: int
    batches: int
    """Execs that ran jobs (one or more each)."""
    batched_jobs: int
    checks: int
    """Checks run by the sandboxes' zygotes (no exec of their own)."""
    sessions: int
    """Episode sessions held (`SandboxPool.session`), each a sandbox for a whole episode."""
    session_requests: int
    """Their steps, each a request to the session's process."""
    last_infra_error: str


class PoolConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A pool of identical sandboxes."""

    sandbox: SandboxConfig = SandboxConfig()
    size: int = 2
    """Warm sandboxes, and the most jobs that run at once."""
    infra_attempts: int = 3
    """Tries of one job on fresh sandboxes before it is reported as an InfraFailure."""
    acquire_timeout_s: float = 60.0
    """How long one try waits for a ready sandbox before it counts as an infrastructure failure;
    none at all while no sandbox can start (no sandbox left and the last `infra_attempts`
    starts failed): then a try fails at once with the start's error."""
    restart_backoff_s: float = 0.5
    """First pause after a failed sandbox start (doubles, up to 10 s)."""
    cache_entries: int = 4096
    """Cached results kept (least recently used dropped); 0 disables the cache."""
    latency_window: int = 1024
    """Latest job latencies kept for the p50/p95 figures."""
    max_batch: int = 4
    """Most small jobs one sandbox runs in one exec when they are waiting together (each with
    its own reset, limits and deadline; see batch.py); 1 disables batching."""
    zygote: bool = True
    """Run checks (`Check`) in each sandbox's zygote, a fork per check (zygote.py); False: as
    jobs, a fresh interpreter per check in its own exec."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"PoolConfig.size must be >= 1, got {self.size}")
        if self.infra_attempts < 1:
            raise ValueError(f"PoolConfig.infra_attempts must be >= 1, got {self.infra_attempts}")
        if self.acquire_timeout_s <= 0 or self.restart_backoff_s < 0:
            raise ValueError("PoolConfig.acquire_timeout_s must be > 0 and restart_backoff_s >= 0")
        if self.max_batch < 1:
            raise ValueError(f"PoolConfig.max_batch must be >= 1, got {self.max_batch}")
        if self.cache_entries < 0:
            raise ValueError(f"PoolConfig.cache_entries must be >= 0, got {self.cache_entries}")


class _Slot:
    """A queued job and where its outcome goes."""

    def __init__(self, job: Job | Check) -> None:
        self.job = job
        self.done = trio.Event()
        self.result: RunResult | None = None
        self.error = ""
        self.abandoned = False

    def finish(self, result: RunResult) -> None:
        self.result = result
        self.done.set()

    def fail(self, error: str) -> None:
        self.error = error
        self.done.set()


def _small(job: Job) -> bool:
    """Batchable: small inline input, argv and env within the limits of one exec."""
    return (
        inline_size(job) <= MAX_INLINE_BYTES // 4
        and all(len(a) <= 100_000 for a in job.argv)
        and len(job.stdin) <= MAX_INLINE_BYTES // 4
    )


class SandboxPool:
    """Warm sandboxes for trio tasks. Use as `async with SandboxPool(config) as pool:`."""

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        self._queue_send, self._queue_recv = trio.open_memory_channel[_Slot](math.inf)
        self._ready_send, self._ready_recv = trio.open_memory_channel[Sandbox](self.config.size)
        self._cache: collections.OrderedDict[str, RunResult] = collections.OrderedDict()
        self._latencies: collections.deque[float] = collections.deque(
            maxlen=self.config.latency_window
        )
        self._nursery: trio.Nursery | None = None
        self._all: set[Sandbox] = set()
        self._uids: set[int] = set()
        self._limits = None
        self._counts = collections.Counter()
        self._last_error = ""
        self._busy = 0
        self._pending: set[_Slot] = set()
        self._start_streak = 0
        """Sandbox starts failed in a row (0 after any start that worked)."""
        self._start_error = ""
        """The last start's error (`_last_error` is also a job's, which quotes this one)."""
        self._waiting: set[trio.CancelScope] = set()
        """The waits for a ready sandbox, cancelled when no sandbox can start."""

    # -- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> SandboxPool:
        cfg = self.config.sandbox
        self._limits = await trio.to_thread.run_sync(
            functools.partial(probe_limits, cfg.podman_url, timeout_s=cfg.api_timeout_s)
        )
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        for _ in range(self.config.size):
            self._nursery.start_soon(self._start_one, False)
            self._nursery.start_soon(self._worker)
        return self

    async def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Wait until every sandbox is started and ready (warm); False at the timeout."""
        with trio.move_on_after(timeout_s):
            while self._ready_recv.statistics().current_buffer_used < self.config.size:
                await trio.sleep(0.02)
            return True
        return False

    async def __aexit__(self, *exc_info) -> bool | None:
        await self.aclose()
        return None

    async def aclose(self) -> None:
        """Cancel refills, close every sandbox (containers removed)."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
            await self._nursery_cm.__aexit__(None, None, None)
            self._nursery = None
        for slot in list(self._pending):
            slot.fail("the sandbox pool was closed before this job ran")
        boxes, self._all = list(self._all), set()
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as n:
                for box in boxes:
                    n.start_soon(trio.to_thread.run_sync, box.close)

    def _new_uid(self) -> int:
        while True:
            uid = CANDIDATE_UID_BASE + secrets.randbelow(CANDIDATE_UID_SPAN)
            if uid not in self._uids:
                self._uids.add(uid)
                return uid

    async def _start_one(self, is_replacement: bool) -> None:
        """Start a sandbox and make it ready; retry with backoff until the pool closes."""
        backoff_s = self.config.restart_backoff_s
        while True:
            uid = self._new_uid()
            try:
                box = await trio.to_thread.run_sync(
                    functools.partial(
                        Sandbox.start, self.config.sandbox, uid=uid, limits=self._limits
                    )
                )
            except SandboxInfraError as exc:
                self._uids.discard(uid)
                self._counts["start_failures"] += 1
                self._last_error = self._start_error = str(exc)
                self._start_streak += 1
                if self._unstartable():  # nobody may wait acquire_timeout_s for nothing
                    for scope in list(self._waiting):
                        scope.cancel()
                await trio.sleep(backoff_s)
                backoff_s = min(10.0, max(backoff_s * 2, 0.1))
                continue
            self._all.add(box)
            self._start_streak = 0
            self._counts["started"] += 1
            self._counts["replaced"] += is_replacement
            await self._ready_send.send(box)
            return

    async def _retire(self, box: Sandbox) -> None:
        """Close a misbehaving sandbox and start its replacement (in the background)."""
        self._all.discard(box)
        self._uids.discard(box.uid)
        assert self._nursery is not None, "pool used outside `async with`"
        self._nursery.start_soon(self._start_one, True)
        with trio.CancelScope(shield=True):  # a container must never outlive its pool
            await trio.to_thread.run_sync(box.close)

    async def _give_back(self, box: Sandbox) -> None:
        """Make a used sandbox ready again, or retire it if it misbehaved. Every task starts
        with a reset inside its own exec (Sandbox.run_task) and kills what it left when it ends;
        only when that end was skipped (the wrapper was killed) is a separate reset done here,
        so no leftover process lives on while the sandbox waits or sees the next task's input."""
        if box.healthy and box.dirty:
            try:
                await trio.to_thread.run_sync(box.reset)
            except SandboxInfraError:
                pass
        if box.healthy:
            await self._ready_send.send(box)
        else:
            await self._retire(box)

    def _unstartable(self) -> bool:
        """No sandbox is left and the last `infra_attempts` starts failed (Podman is down, the
        image is missing, every container start fails): waiting for one is pointless."""
        return not self._all and self._start_streak >= self.config.infra_attempts

    async def _acquire(self) -> Sandbox | None:
        """A ready sandbox, or None: after acquire_timeout_s, or as soon as no sandbox can
        start (see `_unstartable`)."""
        if not self._unstartable():
            with trio.move_on_after(self.config.acquire_timeout_s) as scope:
                self._waiting.add(scope)
                try:
                    return await self._ready_recv.receive()
                finally:
                    self._waiting.discard(scope)
            return None
        try:
            return self._ready_recv.receive_nowait()
        except trio.WouldBlock:
            return None

    def _no_sandbox(self) -> str:
        if self._unstartable():
            return (f"no sandbox became ready: the last {self._start_streak} sandbox starts "
                    f"failed; last error: {self._start_error}")
        return (f"no sandbox became ready within {self.config.acquire_timeout_s} s"
                + (f"; last start error: {self._start_error}" if self._start_error else ""))

    # -- jobs ----------------------------------------------------------------------

    async def run(self, job: Job | Check, *, use_cache: bool = True) -> RunResult | InfraFailure:
        """Run `job` on a clean warm sandbox: its RunResult, or InfraFailure after retries."""
        if isinstance(job, Check) and not self.config.zygote:
            job = job.as_job()
        image = self.config.sandbox.image
        key = job.cache_key(image)
        if use_cache and self.config.cache_entries and key in self._cache:
            self._cache.move_to_end(key)
            self._counts["cache_hits"] += 1
            return self._cache[key]
        self._counts["jobs"] += 1
        t0 = time.monotonic()
        error = ""
        for attempt in range(1, self.config.infra_attempts + 1):
            if attempt > 1:
                self._counts["infra_retries"] += 1
            try:
                result = await self._run_once(job)
            except SandboxInfraError as exc:
                error = str(exc)
                self._last_error = error
                continue
            self._latencies.append(time.monotonic() - t0)
            if self.config.cache_entries and result.status is not RunStatus.INPUT_TOO_LARGE:
                self._cache[key] = result
                while len(self._cache) > self.config.cache_entries:
                    self._cache.popitem(last=False)
            return result
        self._counts["infra_failures"] += 1
        return InfraFailure(error=error, attempts=self.config.infra_attempts, image=image)

    async def _run_once(self, job: Job | Check) -> RunResult:
        """Queue the job for the workers and wait for its result (or its infra error)."""
        if self._nursery is None:
            raise SandboxInfraError("the sandbox pool is not open: use `async with SandboxPool()`")
        slot = _Slot(job)
        self._pending.add(slot)
        self._queue_send.send_nowait(slot)
        try:
            await slot.done.wait()
        finally:
            slot.abandoned = not slot.done.is_set()
            self._pending.discard(slot)
        if slot.error:
            raise SandboxInfraError(slot.error)
        assert slot.result is not None
        return slot.result

    async def _worker(self) -> None:
        """One of `size` workers: take a job (and, when the image allows, up to max_batch - 1
        more small ones that are already waiting), take a ready sandbox, run them in one exec,
        hand out the results; jobs the sandbox did not get to go back to the queue."""
        carry: list[_Slot] = []
        while True:
            slot = carry.pop(0) if carry else await self._queue_recv.receive()
            if slot.abandoned:
                continue
            box = await self._acquire()
            if box is None:
                slot.fail(self._no_sandbox())
                continue
            batch = [slot]
            checks = isinstance(slot.job, Check)
            if checks:
                while len(batch) < self.config.max_batch:
                    try:
                        more = self._queue_recv.receive_nowait()
                    except trio.WouldBlock:
                        break
                    if not more.abandoned:
                        (batch if isinstance(more.job, Check) else carry).append(more)
            elif can_batch(box) and _small(slot.job):
                budget = MAX_INLINE_BYTES - inline_size(slot.job)
                while len(batch) < self.config.max_batch:
                    try:
                        more = self._queue_recv.receive_nowait()
                    except trio.WouldBlock:
                        break
                    if more.abandoned:
                        continue
                    if isinstance(more.job, Check):
                        carry.append(more)
                        continue
                    size = inline_size(more.job)
                    if _small(more.job) and size <= budget:
                        batch.append(more)
                        budget -= size
                    else:
                        carry.append(more)
            self._busy += 1
            try:
                tasks = [s.job for s in batch]
                results = await trio.to_thread.run_sync(
                    run_checks if checks else run_tasks, box, tasks
                )
            except SandboxInfraError as exc:
                box.healthy = False
                for s in batch:
                    s.fail(str(exc))
                results = []
            finally:
                self._busy -= 1
                self._nursery.start_soon(self._give_back, box)
            for s, r in zip(batch, results, strict=False):
                if r is None:
                    carry.append(s)  # not run: the sandbox died before it; run it elsewhere
                else:
                    s.finish(r)
            if checks:
                self._counts["checks"] += len(batch)
            else:
                self._counts["batches"] += 1
                self._counts["batched_jobs"] += len(batch)

    @contextlib.asynccontextmanager
    async def session(
        self, argv: Sequence[str], config: dict[str, Any]
    ) -> AsyncIterator[PoolSession]:
        """A sandbox held for one episode, its process started with `config` (see
        `session.py`); given back reset, or replaced if the session killed it. Raises
        SandboxInfraError when no sandbox is ready in time or the process does not start."""
        if self._nursery is None:
            raise SandboxInfraError("the sandbox pool is not open: use `async with SandboxPool()`")
        box = await self._acquire()
        if box is None:
            raise SandboxInfraError(self._no_sandbox())
        self._busy += 1
        raw: SandboxSession | None = None
        try:
            if box.dirty:
                await trio.to_thread.run_sync(box.reset)
            raw = await trio.to_thread.run_sync(SandboxSession.start, box, list(argv), config)
            self._counts["sessions"] += 1
            yield PoolSession(raw, self._counts)
        finally:
            self._busy -= 1
            if raw is not None:
                raw.close()
            if self._nursery is not None:
                self._nursery.start_soon(self._give_back, box)
            else:  # the pool closed while the episode held its sandbox
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(box.close)

    async def check_flaky(self, job: Job, *, runs: int = 3) -> FlakeReport:
        """Run `job` `runs` times, bypassing the cache: do the outcomes agree?"""
        if runs < 2:
            raise ValueError(f"check_flaky needs runs >= 2, got {runs}")
        outcomes = [await self.run(job, use_cache=False) for _ in range(runs)]
        results = [o for o in outcomes if isinstance(o, RunResult)]
        signatures = {(r.status, r.exit_code) for r in results}
        flaky = len(signatures) > 1
        self._counts["flaky_checks"] += 1
        self._counts["flaky_found"] += flaky
        return FlakeReport(
            statuses=[r.status.value for r in results],
            exit_codes=[r.exit_code for r in results],
            flaky=flaky,
            infra_failures=len(outcomes) - len(results),
        )

    def statistics(self) -> PoolStatistics:
        lat = sorted(self._latencies)

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, math.ceil(q * len(lat)) - 1)] if lat else 0.0

        c = self._counts
        return PoolStatistics(
            size=self.config.size,
            ready=self._ready_recv.statistics().current_buffer_used,
            busy=self._busy,
            jobs=c["jobs"],
            cache_hits=c["cache_hits"],
            cache_entries=len(self._cache),
            infra_retries=c["infra_retries"],
            infra_failures=c["infra_failures"],
            sandboxes_started=c["started"],
            sandboxes_replaced=c["replaced"],
            start_failures=c["start_failures"],
            latency_p50_s=pct(0.5),
            latency_p95_s=pct(0.95),
            flaky_checks=c["flaky_checks"],
            flaky_found=c["flaky_found"],
            batches=c["batches"],
            batched_jobs=c["batched_jobs"],
            checks=c["checks"],
            sessions=c["sessions"],
            session_requests=c["session_requests"],
            last_infra_error=self._last_error,
        )


class PoolSession:
    """A session held from the pool, awaitable from trio (the blocking calls run in a
    thread)."""

    def __init__(self, raw: SandboxSession, counts: collections.Counter) -> None:
        self.raw = raw
        self._counts = counts

    @property
    def ready(self) -> dict[str, Any]:
        return self.raw.ready

    async def request(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self._counts["session_requests"] += 1
        return await trio.to_thread.run_sync(self.raw.request, body, timeout_s)
