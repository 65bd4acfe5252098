"""The learner actor: scored rollouts in, GRPO updates, checkpointed weight versions out.

Dataflow: durable `rl.<run>.scored.*` (manual ack) -> `GroupBuffer` (by task_id until
`group_size` samples arrived) -> batches of `groups_per_batch` groups with signal ->
`Trainer.train_step` (in a worker thread) -> atomic checkpoint `v<version>` (weights,
optimizer, step, rng, ledger) -> `WeightsPublished` on `rl.<run>.weights` -> ack of the
batch's deliveries -> `TrainStats` on `rl.<run>.stats.learner`.

Invariants:
  * A delivery is acked only after the checkpoint that records it in the ledger committed,
    or, for groups that are dropped (too stale) or skipped (no signal), once the decision is
    made; such groups join the ledger saved with the next checkpoint. Re-deciding them after
    a crash gives the same outcome, so nothing is ever trained on twice.
  * On restart the learner loads the newest complete checkpoint; a redelivered rollout
    already in the ledger is acked and skipped.
  * Version N is the policy after N optimizer steps since the first checkpointless start;
    every published version has a committed checkpoint.
  * Samples with outcome `infra_error` count toward a group's completion but are masked.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio
from reinforge.actors import checkpoint as ckpt
from reinforge.actors.grpo import (
    AdvantageNorm,
    domain_reward_scales,
    group_advantages,
    group_has_signal,
    is_too_stale,
    staleness,
)
from reinforge.core import paths, subjects
from reinforge.core.actor import Actor, Input, Ticket, ack_all
from reinforge.core.messages import Outcome, ScoredRollout, TrainStats, WeightsPublished


class LearnerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str = ""
    """Hugging Face-format directory of the initial policy (used when no checkpoint exists)."""
    checkpoint_dir: str = ""
    """Where versions are written; default `<run_dir>/checkpoints`."""
    reference_model: str = ""
    """Frozen reference for the KL term; default: `model`. Loaded only when kl_coef > 0."""
    domains: str = "*"
    """Subject token of the scored rollouts to learn from (`*` = every domain)."""
    groups_per_batch: int = 4
    """Complete groups (with signal) per optimizer step = per published version."""
    group_size: int = 0
    """Samples per group; 0 takes each rollout's own `group_size`."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass (gradients are accumulated over a batch)."""
    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    clip_low: float = 0.2
    """PPO clip: the ratio is clamped to [1 - clip_low, 1 + clip_high]."""
    clip_high: float = 0.2
    kl_coef: float = 0.0
    """Weight of the k3 KL to the frozen reference (0: no reference model is loaded)."""
    temperature: float = 1.0
    """The samplers' temperature: logprobs are log_softmax(logits / T) (use 1.0 for greedy)."""
    advantage_norm: AdvantageNorm = AdvantageNorm.DOMAIN_STD
    """group_std (DeepSeekMath), domain_std (per-domain batch std), none (Dr. GRPO)."""
    max_staleness: int = 4
    """Groups generated more than this many versions ago are dropped (and counted)."""
    keep_last: int = 3
    """Complete checkpoints kept on disk (the newest one is never deleted)."""
    torch_threads: int = 2
    ack_wait_s: float = 120.0
    """JetStream ack wait for held deliveries; a keep-alive renews it every third of it."""
    max_deliver: int = 50
    """Deliveries of one rollout before the server gives up on it (crash loops)."""
    max_pending_samples: int = 256
    """Unacked rollouts held at most (the consumer's max_ack_pending)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("groups_per_batch", "micro_batch_size", "keep_last", "torch_threads",
                     "max_deliver", "max_pending_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"learner config: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("group_size", "max_staleness", "kl_coef", "weight_decay", "max_grad_norm",
                     "clip_low", "clip_high"):
            if getattr(self, name) < 0:
                raise ValueError(f"learner config: {name} must be >= 0, got {getattr(self, name)}")
        if self.learning_rate <= 0 or self.temperature <= 0 or self.ack_wait_s <= 0:
            raise ValueError("learner config: learning_rate, temperature and ack_wait_s must be > 0")
        if self.group_size and self.groups_per_batch * self.group_size > self.max_pending_samples:
            raise ValueError(
                f"learner config: a batch of {self.groups_per_batch} x {self.group_size} samples "
                f"exceeds max_pending_samples={self.max_pending_samples}: it could never fill"
            )


# ----------------------------------------------------------------------------- grouping


@dataclass
class Group:
    """The samples of one task, keyed by sample_index, and every delivery that brought them."""

    task_id: str
    domain: str
    group_size: int
    samples: dict[int, ScoredRollout] = field(default_factory=dict)
    tickets: list[Any] = field(default_factory=list)
    rollout_ids: dict[str, int] = field(default_factory=dict)
    """Every rollout id seen for this group (duplicates of other attempts too) -> version."""

    @property
    def complete(self) -> bool:
        return len(self.samples) >= self.group_size

    def ordered(self) -> list[ScoredRollout]:
        return [self.samples[i] for i in sorted(self.samples)]


def sample_is_valid(s: ScoredRollout) -> bool:
    """Trainable: not an infra error, with token ids and one behaviour logprob per token."""
    r = s.rollout
    return (
        s.outcome != Outcome.INFRA_ERROR
        and bool(r.prompt_ids)
        and bool(r.output_ids)
        and len(r.logprobs) == len(r.output_ids)
        and math.isfinite(s.reward)
    )


class GroupBuffer:
    """Scored rollouts grouped by task until complete; no I/O, no awaits."""

    def __init__(self, *, group_size: int = 0, ledger: dict[str, int] | None = None) -> None:
        self.group_size = group_size
        self.ledger: dict[str, int] = dict(ledger or {})
        """Consumed rollout_id -> policy_version (saved in every checkpoint)."""
        self.pending: dict[str, Group] = {}
        self.ready: collections.deque[Group] = collections.deque()
        self.counts: collections.Counter[str] = collections.Counter()

    def add(self, scored: ScoredRollout, ticket: Any) -> str:
        """File one delivery; returns "consumed" (ack it now), "duplicate", "added" or
        "completed" (its group just became ready)."""
        r = scored.rollout
        if r.rollout_id in self.ledger:
            self.counts["duplicates_skipped"] += 1
            return "consumed"
        group = self.pending.get(r.task_id)
        if group is None:
            size = self.group_size or max(1, r.group_size)
            group = self.pending[r.task_id] = Group(task_id=r.task_id, domain=r.domain,
                                                    group_size=size)
        group.tickets.append(ticket)
        if r.sample_index in group.samples or r.rollout_id in group.rollout_ids:
            group.rollout_ids.setdefault(r.rollout_id, r.policy_version)
            self.counts["duplicates_held"] += 1
            return "duplicate"
        group.samples[r.sample_index] = scored
        group.rollout_ids[r.rollout_id] = r.policy_version
        if group.complete:
            del self.pending[r.task_id]
            self.ready.append(group)
            return "completed"
        return "added"

    def consume(self, group: Group) -> None:
        self.ledger.update(group.rollout_ids)

    def held_tickets(self) -> list[Any]:
        out = [t for g in self.pending.values() for t in g.tickets]
        out += [t for g in self.ready for t in g.tickets]
        return out

    def statistics(self) -> dict[str, float]:
        return {
            "pending_groups": float(len(self.pending)),
            "ready_groups": float(len(self.ready)),
            "ledger_size": float(len(self.ledger)),
            **{k: float(v) for k, v in self.counts.items()},
        }


class TrainSample(msgspec.Struct, frozen=True, kw_only=True):
    """One sequence to train on, with its advantage."""

    rollout_id: str
    domain: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    advantage: float
    reward: float
    policy_version: int


def prepare_samples(
    groups: list[list[ScoredRollout]], norm: AdvantageNorm
) -> tuple[list[TrainSample], dict[str, float]]:
    """Advantages for the valid samples of groups (each with signal); returns the samples to
    train on and figures (mean reward per domain, advantage stats, masked count)."""
    import torch

    flat = [s for g in groups for s in g]
    valid = [sample_is_valid(s) for s in flat]
    scales = domain_reward_scales(
        [s.reward for s in flat], valid, [s.rollout.domain for s in flat]
    )
    out: list[TrainSample] = []
    for group in groups:
        ok = [sample_is_valid(s) for s in group]
        rewards = torch.tensor([s.reward for s in group], dtype=torch.float64)
        adv = group_advantages(
            rewards, torch.tensor(ok), norm=norm, scale=scales.get(group[0].rollout.domain, 0.0)
        )
        for s, a, good in zip(group, adv.tolist(), ok, strict=True):
            if good:
                r = s.rollout
                out.append(TrainSample(
                    rollout_id=r.rollout_id, domain=r.domain, prompt_ids=list(r.prompt_ids),
                    output_ids=list(r.output_ids), logprobs=list(r.logprobs), advantage=a,
                    reward=s.reward, policy_version=r.policy_version,
                ))
    figures: dict[str, float] = {"masked_samples": float(len(flat) - sum(valid))}
    by_domain: dict[str, list[float]] = collections.defaultdict(list)
    for s, good in zip(flat, valid, strict=True):
        if good:
            by_domain[s.rollout.domain].append(s.reward)
    for domain, rs in sorted(by_domain.items()):
        figures[f"reward_mean/{domain}"] = sum(rs) / len(rs)
    advs = [s.advantage for s in out]
    if advs:
        mean = sum(advs) / len(advs)
        figures["adv_mean"] = mean
        figures["adv_std"] = (sum((a - mean) ** 2 for a in advs) / len(advs)) ** 0.5
        figures["adv_abs_max"] = max(abs(a) for a in advs)
    return out, figures


# ----------------------------------------------------------------------------- the actor


class Learner(Actor):
    actor_type = "learner"
    Config = LearnerConfig

    def __init__(self, ctx: Any, config: LearnerConfig) -> None:
        super().__init__(ctx, config)
        self.root = Path(config.checkpoint_dir or paths.run_dir(ctx.run) / "checkpoints")
        self.trainer: Any = None
        self.buffer = GroupBuffer(group_size=config.group_size)
        self.version = 0
        self.step = 0
        self.counters: collections.Counter[str] = collections.Counter()
        self._ready = trio.Event()
        self._in_flight: list[Group] = []

    def inputs(self) -> list[Input]:
        cfg: LearnerConfig = self.config
        return [Input(
            subject=subjects.scored(self.ctx.run, cfg.domains), handler=self.on_scored,
            accepts=(ScoredRollout,), manual_ack=True, concurrency=8,
            batch=max(1, cfg.max_pending_samples // 2), ack_wait_s=cfg.ack_wait_s,
            max_deliver=cfg.max_deliver,
        )]

    def capabilities(self) -> list[str]:
        return [f"learner for domains {self.config.domains}"]

    async def setup(self) -> None:
        from reinforge.actors.trainer import Trainer

        cfg: LearnerConfig = self.config
        await trio.to_thread.run_sync(ckpt.remove_temp_dirs, self.root)
        latest = ckpt.latest_checkpoint(self.root)
        if latest is None:
            if not cfg.model or not (Path(cfg.model) / "config.json").is_file():
                raise ValueError(
                    f"learner: no checkpoint in {self.root} and model={cfg.model!r} has no "
                    "config.json (set model=DIR, e.g. from `reinforge model init`)"
                )
            source, state = Path(cfg.model), None
        else:
            self.version, source = latest
            state = await trio.to_thread.run_sync(ckpt.load_trainer_state, source)
            self.step = int(state["step"])
            self.buffer.ledger = dict(state["ledger"])
            self.counters.update({k: int(v) for k, v in state.get("counters", {}).items()})
        self.tokenizer_src = source
        self.trainer = await trio.to_thread.run_sync(
            lambda: Trainer(cfg, source, state, reference_dir=cfg.reference_model or cfg.model)
        )
        if latest is not None:  # a crash may have cut off the announcement: say it again
            await self._publish_weights(self.version, source)

    def figures(self) -> dict[str, float]:
        return {"version": float(self.version), "step": float(self.step),
                **self.buffer.statistics(), **{k: float(v) for k, v in self.counters.items()}}

    async def on_scored(self, msg: ScoredRollout, ticket: Ticket) -> None:
        if msg.rollout.purpose != "train":
            self.counters["ignored_eval"] += 1
            await ticket.ack()
            return
        status = self.buffer.add(msg, ticket)
        if status == "consumed":
            await ticket.ack()
        elif status == "completed":
            self._ready.set()

    async def main(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_alive)
            while True:
                t0 = time.monotonic()
                batch = await self._next_batch()
                wait_s = time.monotonic() - t0
                with trio.CancelScope(shield=True):  # a batch is applied whole or not at all
                    await self._train_and_commit(batch, wait_s)

    async def _next_batch(self) -> list[Group]:
        """Wait for `groups_per_batch` usable groups; drop stale ones and skip silent ones."""
        cfg: LearnerConfig = self.config
        usable: list[Group] = []
        with self.ctx.waiting(f"{cfg.groups_per_batch} complete groups of scored rollouts"):
            while len(usable) < cfg.groups_per_batch:
                if not self.buffer.ready:
                    await self._ready.wait()
                    self._ready = trio.Event()
                    continue
                group = self.buffer.ready.popleft()
                samples = group.ordered()
                versions = [s.rollout.policy_version for s in samples]
                if is_too_stale(self.version, versions, cfg.max_staleness):
                    self.counters["dropped_stale_groups"] += 1
                    self.counters["dropped_stale_samples"] += len(samples)
                elif not group_has_signal([s.reward for s in samples],
                                          [sample_is_valid(s) for s in samples]):
                    self.counters["skipped_no_signal_groups"] += 1
                else:
                    usable.append(group)
                    continue
                self.buffer.consume(group)  # decided for good: in the next checkpoint's ledger
                await ack_all(group.tickets)
        return usable

    async def _train_and_commit(self, batch: list[Group], wait_s: float) -> None:
        cfg: LearnerConfig = self.config
        self._in_flight = batch
        samples, figures = prepare_samples([g.ordered() for g in batch], cfg.advantage_norm)
        stale = [staleness(self.version, s.policy_version) for s in samples]
        with self.ctx.waiting("GRPO step (compute)"):
            step_figures = await trio.to_thread.run_sync(self.trainer.train_step, samples,
                                                         self.version)
        for g in batch:
            self.buffer.consume(g)
        version, self.step = self.version + 1, self.step + 1
        state = self.trainer.state_dict(step=self.step, ledger=self.buffer.ledger,
                                        counters=dict(self.counters))
        t0 = time.monotonic()
        with self.ctx.waiting("checkpoint write", deadline_s=300):
            path = await trio.to_thread.run_sync(lambda: ckpt.save_model_checkpoint(
                ckpt.version_dir(self.root, version), model=self.trainer.model,
                tokenizer_src=self.tokenizer_src, version=version, step=self.step,
                trainer_state=state))
        self.version = version
        await self._publish_weights(version, path)
        await ack_all([t for g in batch for t in g.tickets])
        await trio.to_thread.run_sync(ckpt.prune_checkpoints, self.root, cfg.keep_last, (version,))
        figures.update(step_figures)
        figures.update({
            "wait_s": wait_s, "checkpoint_s": time.monotonic() - t0,
            "staleness_mean": sum(stale) / max(1, len(stale)),
            "staleness_max": float(max(stale, default=0)), "groups": float(len(batch)),
            **self.buffer.statistics(), **{k: float(v) for k, v in self.counters.items()},
        })
        self._in_flight = []
        await self.ctx.publish(subjects.stats(self.ctx.run, "learner"), TrainStats(
            version=version, step=self.step, loss=figures.get("loss", 0.0), figures=figures))

    async def _publish_weights(self, version: int, path: Path) -> None:
        await self.ctx.publish_durable(
            subjects.weights(self.ctx.run),
            WeightsPublished(version=version, path=str(path), step=self.step),
            msg_id=f"weights:{version}",
        )

    async def _keep_alive(self) -> None:
        """Tell the server that held deliveries are still being worked on."""
        while True:
            await trio.sleep(self.config.ack_wait_s / 3)
            held = self.buffer.held_tickets() + [t for g in self._in_flight for t in g.tickets]
            for ticket in held:
                await ticket.in_progress()

    async def teardown(self) -> None:
        """Hand back what was held but not committed, for the next learner to take at once."""
        for ticket in self.buffer.held_tickets():
            await ticket.nak()
