"""The synchronous baseline of bench/rl_throughput.py: one process, one phase at a time.

    repeat: draw tasks -> generate every group -> verify every sample -> once enough groups
            carry signal: one GRPO step -> checkpoint -> load it into the rollout server

Each phase waits for the last, as in a synchronous RL trainer: generation for the new
weights, verification for the whole generation round, training for the whole verification
round. The parts are the cluster's: `reinforge serve` through RolloutClient (all groups of
a round sent at once, so the server batches them), the domains' own `verify` on a Podman
SandboxPool of the verifier's size and resource limits, the learner's `prepare_samples`,
`Trainer` and checkpoint format, the scheduler's curriculum and mix. There is no bus: the
baseline pays no messaging cost.

A round is sized like the scheduler's budget at max_staleness 0: the tasks expected (by
each domain's recent rate of groups with signal) to give the step's missing groups, at most
`max_in_flight`. Groups with signal beyond the step's are off-policy once it is taken and
are dropped (counted as stale).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import trio
from reinforge.rl import checkpoint as ckpt
from reinforge.rl.curriculum import (
    CurriculumConfig,
    DomainCurriculum,
    draw_domain,
    group_has_signal,
    issue_budget,
    mix_probabilities,
    new_task_signal_rate,
    updated_signal_rate,
)
from reinforge.actors.learner import LearnerConfig, prepare_samples, sample_is_valid
from reinforge.rollout.client import RolloutClient, parse_weight_version
from reinforge.rollout.server import ServerProcess, ServerSpec
from reinforge.rl.prompts import task_prompt_ids
from reinforge.actors.scheduler import SchedulerConfig
from reinforge.rl.trainer import Trainer
from reinforge.actors.verifier import VerifierConfig, resource_limits, scored_from_verdict
from reinforge.core.messages import Rollout, ScoredRollout, rollout_id


class SyncSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the cluster config sets, for the baseline (see demo.cluster_config)."""

    group_size: int
    groups_per_batch: int
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
            loop = SyncLoop(sft, doms, settings, work_dir, client)
            limits = ResourceLimits(resource_limits(
                VerifierConfig(sandbox_pool_size=settings.sandbox_pool_size)))
            return await loop.run(limits, window_s=window_s, warmup_timeout_s=warmup_timeout_s)
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

    def busy_share(self) -> float:
        t1 = psutil.cpu_times()
        # on Linux guest time is already inside user time
        delta = {k: getattr(t1, k) - getattr(self.t0, k) for k in t1._fields
                 if k not in ("guest", "guest_nice")}
        total = sum(delta.values())
        idle = delta["idle"] + delta.get("iowait", 0.0)
        return 1.0 - idle / total if total > 0 else 0.0


class SyncLoop:
    def __init__(self, sft: Path, domains: dict[str, Any], settings: SyncSettings,
                 work_dir: Path, client: RolloutClient) -> None:
        from reinforge.engine.tokenizer import load_tokenizer

        self.sft = sft
        self.domains = domains
        self.s = settings
        self.root = work_dir / "checkpoints"
        self.client = client
        self.tokenizer = load_tokenizer(sft)
        self.learner_cfg = LearnerConfig(model=str(sft), groups_per_batch=settings.groups_per_batch,
                                         group_size=settings.group_size,
                                         learning_rate=settings.learning_rate, torch_threads=1)
        self.trainer = Trainer(self.learner_cfg, sft)
        self.min_signal_rate = SchedulerConfig().min_signal_rate
        self.curricula = {n: DomainCurriculum.new(CurriculumConfig(), len(d.tiers))
                          for n, d in domains.items()}
        self.signal = {n: 0.5 for n in domains}  # the scheduler's prior
        self.probs = mix_probabilities(dict.fromkeys(domains, 1.0))
        self.rng = random.Random(0)
        self.version = 0
        self.issued = 0

    # -- the phases ---------------------------------------------------------------------

    def draw_tasks(self, missing_groups: int) -> list[tuple[str, Any]]:
        rate = new_task_signal_rate(self.probs, self.signal, floor=self.min_signal_rate)
        n = issue_budget(in_flight=0, max_in_flight=self.s.max_in_flight,
                         groups_per_version=missing_groups, max_staleness=0,
                         done_since_version=0, expected_in_flight=0.0, signal_rate=rate)
        out = []
        for _ in range(n):
            name = draw_domain(self.probs, self.rng)
            tier = self.curricula[name].choose_tier(self.rng, self.s.group_size)
            out.append((name, self.domains[name].sample_task(self.rng, tier)))
        return out

    async def generate(self, tasks: list[tuple[str, Any]]) -> list[list[Rollout]]:
        groups: list[list[Rollout]] = [[] for _ in tasks]

        async def one(i: int, name: str, spec: Any) -> None:
            prompt = self.domains[name].prompt(spec)
            ids = task_prompt_ids(self.tokenizer, prompt)
            samples = await self.client.generate(input_ids=ids, sampling_params={
                "n": self.s.group_size, "temperature": 1.0, "top_p": 1.0,
                "max_new_tokens": self.s.max_new_tokens})
            task_id = f"{spec.task_id}@{self.issued + i}"
            groups[i] = [Rollout(
                rollout_id=rollout_id(task_id, k, 1), task_id=task_id, sample_index=k,
                domain=name, tier=spec.tier, prompt=prompt, completion=smp.text,
                prompt_ids=ids, output_ids=list(smp.output_ids), logprobs=list(smp.logprobs),
                policy_version=parse_weight_version(smp.weight_version),
                finish_reason=smp.finish_reason, spec=dict(spec.spec),
                group_size=self.s.group_size, purpose="train",
            ) for k, smp in enumerate(samples)]

        async with trio.open_nursery() as nursery:
            for i, (name, spec) in enumerate(tasks):
                nursery.start_soon(one, i, name, spec)
        self.issued += len(tasks)
        return groups

    async def verify(self, groups: list[list[Rollout]], tasks: list[tuple[str, Any]],
                     limits: Any) -> list[list[ScoredRollout]]:
        scored: list[list[ScoredRollout | None]] = [[None] * len(g) for g in groups]

        async def one(i: int, k: int, r: Rollout, spec: Any) -> None:
            domain = self.domains[r.domain]
            async with limits.hold(domain.resource):
                t0 = time.monotonic()
                verdict = await domain.verify(spec, r.completion)
            scored[i][k] = scored_from_verdict(r, verdict, verifier_id="sync-loop",
                                               verify_s=time.monotonic() - t0, attempts=1)

        async with trio.open_nursery() as nursery:
            for i, (group, (_, spec)) in enumerate(zip(groups, tasks, strict=True)):
                for k, r in enumerate(group):
                    nursery.start_soon(one, i, k, r, spec)
        return [[s for s in g if s is not None] for g in scored]

    def train(self, batch: list[list[ScoredRollout]]) -> tuple[int, float]:
        """One GRPO step and its checkpoint; returns (samples, busy seconds)."""
        samples, _ = prepare_samples(batch, self.learner_cfg.advantage_norm)
        figures = self.trainer.train_step(samples, self.version)
        t0 = time.monotonic()
        self.version += 1
        self.checkpoint_path = ckpt.save_model_checkpoint(
            ckpt.version_dir(self.root, self.version), model=self.trainer.model,
            tokenizer_src=self.sft, version=self.version, step=self.version)
        ckpt.prune_checkpoints(self.root, 2, (self.version,))
        return len(samples), figures["compute_s"] + time.monotonic() - t0

    # -- the loop -----------------------------------------------------------------------

    async def run(self, limits: Any, *, window_s: float,
                  warmup_timeout_s: float) -> dict[str, float]:
        deadline = time.time() + warmup_timeout_s
        t_first: float | None = None
        trained = generated = steps = stale = 0
        busy = 0.0
        usable: list[list[ScoredRollout]] = []
        window_groups: list[tuple[str, list[float]]] = []
        phases = PhaseClock()
        cpu = CpuMeter()
        while t_first is None or time.time() < t_first + window_s:
            if t_first is None and time.time() > deadline:
                raise SystemExit(f"sync: no policy version within {warmup_timeout_s} s")
            tasks = self.draw_tasks(self.s.groups_per_batch - len(usable))
            with phases.timing("generate"):
                generation = await self.generate(tasks)
            with phases.timing("verify"):
                groups = await self.verify(generation, tasks, limits)
            for g in groups:
                rewards = [s.reward for s in g]
                informative = group_has_signal(rewards)
                name, tier = g[0].rollout.domain, g[0].rollout.tier
                self.signal[name] = updated_signal_rate(self.signal[name], informative)
                self.curricula[name].record(tier, sum(rewards) / max(1, len(rewards)))
                if group_has_signal(rewards, [sample_is_valid(s) for s in g]):
                    usable.append(g)
                if t_first is not None:
                    window_groups.append((name, rewards))
            if t_first is not None:
                generated += sum(len(g) for g in groups)
            if len(usable) < self.s.groups_per_batch:
                continue
            batch, extra = usable[: self.s.groups_per_batch], usable[self.s.groups_per_batch:]
            usable = []
            with phases.timing("train"):
                n, step_busy = await trio.to_thread.run_sync(self.train, batch)
            with phases.timing("load_weights"):
                await self.client.update_weights_from_disk(str(self.checkpoint_path),
                                                           weight_version=str(self.version))
            if t_first is None:
                t_first = time.time()
                phases.reset()
                cpu.start()
                continue
            if time.time() <= t_first + window_s:
                trained, busy, steps, stale = trained + n, busy + step_busy, steps + 1, \
                    stale + len(extra)
        return {
            "samples_per_s": trained / window_s,
            "generated_per_s": generated / window_s,
            "steps": float(steps),
            "learner_idle": max(0.0, 1.0 - busy / window_s),
            "stale_groups_dropped": float(stale),
            "cpu_busy": cpu.busy_share(),
            **phases.shares(),
            **signal_shares(window_groups),
        }
