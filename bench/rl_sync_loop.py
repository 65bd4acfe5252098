"""The synchronous baseline of bench/rl_throughput.py: the reference loop
(reinforge.rl.loop) on the cluster's parts, in one process, one phase at a time.

    repeat: draw tasks -> generate every group -> verify every sample -> once enough groups
            carry signal: one GRPO step -> checkpoint -> load it into the rollout server

Each phase waits for the last, as in a synchronous RL trainer: generation for the new
weights, verification for the whole generation round, training for the whole verification
round. The parts are the cluster's: `reinforge serve` through RolloutClient (all groups of
a round sent at once, so the server batches them), the domains' own `verify` on a Podman
SandboxPool of the verifier's size and resource limits, the learner's `Trainer`, advantages
and checkpoint format, the scheduler's curriculum and mix. There is no bus: the baseline
pays no messaging cost.

A round is sized like the scheduler's budget at max_staleness 0: the tasks expected (by
each domain's recent rate of groups with signal) to give the step's missing groups, at most
`max_in_flight`. Groups with signal beyond the step's are off-policy once it is taken and
are dropped (counted as stale).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import trio
from reinforge.actors.learner import LearnerConfig
from reinforge.actors.scheduler import SchedulerConfig
from reinforge.actors.verifier import VerifierConfig, resource_limits
from reinforge.core.messages import Rollout, ScoredRollout, Task, WeightsPublished
from reinforge.rl.curriculum import group_has_signal
from reinforge.rl.loop import LoopSettings, ReferenceLoop, Step, generate_group, verify_rollout
from reinforge.rl.trainer import Trainer
from reinforge.rollout.client import RolloutClient
from reinforge.rollout.server import ServerProcess, ServerSpec


class SyncSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the cluster config sets, for the baseline (see demo.cluster_config)."""

    group_size: int
    groups_per_version: int
    learning_rate: float
    max_in_flight: int
    max_new_tokens: int
    sandbox_pool_size: int


async def run_sync(sft: Path, domains: list[str], settings: SyncSettings, work_dir: Path,
                   *, window_s: float, warmup_timeout_s: float) -> dict[str, float]:
    """Train synchronously; after the first version, measure `window_s` seconds. Returns the
    figures of rl_throughput.window_figures (samples_per_s, generated_per_s, steps,
    learner_idle, stale_groups_dropped, cpu_busy, signal_share[/DOMAIN]), and each phase's
    share of the loop's time (phase_share/generate, verify, train, load_weights)."""
    from reinforge.envs.sandbox.runner import sandbox_runner
    from reinforge.envs.domain import DomainRegistry, ResourceLimits
    from reinforge.envs.sandbox.box import SandboxConfig
    from reinforge.envs.sandbox.pool import PoolConfig

    registry = DomainRegistry.default()
    server = ServerProcess(ServerSpec(model_path=str(sft)), work_dir / "rollout-server.log")
    server.start()
    pool = PoolConfig(size=settings.sandbox_pool_size,
                      sandbox=SandboxConfig(labels={"reinforge.run": work_dir.name}))
    try:
        url = await server.wait_url(300.0)
        async with RolloutClient(url) as client, sandbox_runner(pool) as runner:
            doms = {}
            for name in domains:
                d = registry.get(name)
                doms[name] = d.with_runner(runner) if d.resource == "sandbox" else d
            limits = ResourceLimits(resource_limits(
                VerifierConfig(sandbox_pool_size=settings.sandbox_pool_size)))
            loop = SyncLoop(sft, doms, settings, work_dir, client, limits)
            return await loop.run(window_s=window_s, warmup_timeout_s=warmup_timeout_s)
    finally:
        server.stop()


def signal_shares(groups: list[tuple[str, list[float]]]) -> dict[str, float]:
    """The share of groups whose rewards differ (the only ones a GRPO step can use), over
    all and per domain: `signal_share`, `signal_share/DOMAIN`. Where two modes generate at
    the same rate, a gap in trained samples/s comes from here."""
    out: dict[str, float] = {}
    for name in sorted({"", *(d for d, _ in groups)}):
        mine = [rewards for d, rewards in groups if name in ("", d)]
        key = f"signal_share/{name}" if name else "signal_share"
        out[key] = sum(group_has_signal(r) for r in mine) / max(1, len(mine))
    return out


class PhaseClock:
    """Wall time per phase of the sync loop; `phase_share/NAME` is its share of the total."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def timing(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - t0

    def reset(self) -> None:
        self.seconds.clear()

    def shares(self) -> dict[str, float]:
        total = sum(self.seconds.values()) or 1.0
        return {f"phase_share/{k}": v / total for k, v in sorted(self.seconds.items())}


class CpuMeter:
    """The machine's CPU busy share (all processes, all cores) since `start`. With the sync
    loop's share b, a mode that only overlaps its phases can be at most 1/b times faster
    on this machine: the overlap has nothing but the idle cycles to run in."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.t0 = psutil.cpu_times()

    def _busy_total_s(self) -> tuple[float, float]:
        t1 = psutil.cpu_times()
        # on Linux guest time is already inside user time
        delta = {k: getattr(t1, k) - getattr(self.t0, k) for k in t1._fields
                 if k not in ("guest", "guest_nice")}
        total = sum(delta.values())
        return total - delta["idle"] - delta.get("iowait", 0.0), total

    def busy_s(self) -> float:
        """CPU seconds spent since `start`, by every process on every core."""
        return self._busy_total_s()[0]

    def busy_share(self) -> float:
        busy, total = self._busy_total_s()
        return busy / total if total > 0 else 0.0


class Window:
    """The sync loop's Watch: it runs until the first version (at most `warmup_timeout_s`),
    then `window_s` seconds, and counts what the window saw; the first version also restarts
    the phase clock and the CPU meter."""

    def __init__(self, phases: PhaseClock, *, window_s: float, warmup_timeout_s: float) -> None:
        self.phases = phases
        self.window_s = window_s
        self.warmup_timeout_s = warmup_timeout_s
        self.deadline = time.time() + warmup_timeout_s
        self.t_first: float | None = None
        self.cpu = CpuMeter()
        self.trained = self.generated = self.steps = self.stale = 0
        self.busy = 0.0
        self.groups: list[tuple[str, list[float]]] = []

    def keep_going(self) -> bool:
        if self.t_first is None:
            if time.time() > self.deadline:
                raise SystemExit(f"sync: no policy version within {self.warmup_timeout_s} s")
            return True
        return time.time() < self.t_first + self.window_s

    def scored(self, groups: list[list[ScoredRollout]]) -> None:
        if self.t_first is None:
            return
        self.generated += sum(len(g) for g in groups)
        self.groups += [(g[0].rollout.domain, [s.reward for s in g]) for g in groups]

    def stepped(self, step: Step, stale_groups: int) -> None:
        if self.t_first is None:
            self.t_first = time.time()
            self.phases.reset()
            self.cpu.start()
            return
        if time.time() <= self.t_first + self.window_s:
            self.trained += step.samples
            self.busy += step.compute_s + step.checkpoint_s
            self.steps += 1
            self.stale += stale_groups

    def figures(self) -> dict[str, float]:
        return {
            "samples_per_s": self.trained / self.window_s,
            "generated_per_s": self.generated / self.window_s,
            "steps": float(self.steps),
            "learner_idle": max(0.0, 1.0 - self.busy / self.window_s),
            "stale_groups_dropped": float(self.stale),
            "cpu_busy": self.cpu.busy_share(),
            **self.phases.shares(),
            **signal_shares(self.groups),
        }


class SyncLoop:
    """The reference loop with the cluster's parts, each phase timed: a round's groups are
    generated at once and its samples verified at once (bounded per resource, as in the
    verifier), and the GRPO step runs in a worker thread."""

    def __init__(self, sft: Path, domains: dict[str, Any], settings: SyncSettings,
                 work_dir: Path, client: RolloutClient, limits: Any) -> None:
        from reinforge.engine.tokenizer import load_tokenizer

        self.domains = domains
        self.s = settings
        self.client = client
        self.limits = limits
        self.tokenizer = load_tokenizer(sft)
        self.phases = PhaseClock()
        learner_cfg = LearnerConfig(model=str(sft), groups_per_version=settings.groups_per_version,
                                    group_size=settings.group_size,
                                    learning_rate=settings.learning_rate, torch_threads=1)
        loop_settings = LoopSettings(
            group_size=settings.group_size, groups_per_version=settings.groups_per_version,
            max_in_flight=settings.max_in_flight,
            min_signal_rate=SchedulerConfig().min_signal_rate,
            signal_share_floor=SchedulerConfig().signal_share_floor,
            advantage_norm=learner_cfg.advantage_norm)
        self.loop = ReferenceLoop(
            loop_settings, domains, Trainer(learner_cfg, sft), generate=self.generate,
            verify=self.verify, load_weights=self.load_weights, offload=self.train_in_thread,
            checkpoint_root=work_dir / "checkpoints", tokenizer_src=sft)

    async def run(self, *, window_s: float, warmup_timeout_s: float) -> dict[str, float]:
        window = Window(self.phases, window_s=window_s, warmup_timeout_s=warmup_timeout_s)
        await self.loop.run(window)
        return window.figures()

    # -- the phases, as the reference loop's parts --------------------------------------

    async def generate(self, tasks: list[Task]) -> list[list[Rollout]]:
        groups: list[list[Rollout]] = [[] for _ in tasks]
        sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": self.s.max_new_tokens}

        async def one(i: int, task: Task) -> None:
            groups[i] = await generate_group(self.client, self.tokenizer, task, sampling)

        with self.phases.timing("generate"):
            async with trio.open_nursery() as nursery:
                for i, task in enumerate(tasks):
                    nursery.start_soon(one, i, task)
        return groups

    async def verify(self, groups: list[list[Rollout]]) -> list[list[ScoredRollout]]:
        scored: list[list[ScoredRollout | None]] = [[None] * len(g) for g in groups]

        async def one(i: int, k: int, r: Rollout) -> None:
            domain = self.domains[r.domain]
            async with self.limits.hold(domain.resource):
                scored[i][k] = await verify_rollout(domain, r, verifier_id="sync-loop")

        with self.phases.timing("verify"):
            async with trio.open_nursery() as nursery:
                for i, group in enumerate(groups):
                    for k, r in enumerate(group):
                        nursery.start_soon(one, i, k, r)
        return [[s for s in g if s is not None] for g in scored]

    async def train_in_thread(self, fn: Any, *args: Any) -> Any:
        with self.phases.timing("train"):
            return await trio.to_thread.run_sync(fn, *args)

    async def load_weights(self, weights: WeightsPublished) -> None:
        with self.phases.timing("load_weights"):
            await self.client.update_weights_from_disk(weights.path,
                                                       weight_version=str(weights.version))
