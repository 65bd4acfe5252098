"""The scheduler actor: what to sample next, how much, and what happened to it.

Dataflow:
    scheduler --Task (durable, rl.<run>.task.<domain>)--> samplers --> verifiers
        ^-- ScoredRollout (core view of rl.<run>.scored.*): group completion, rewards
        ^-- GroupDecision (durable rl.<run>.decision.*): the learner's word on each group
        ^-- WeightsPublished / Rollback (rl.<run>.weights): the policy version
        ^-- TrainStats / EvalStats (rl.<run>.stats.*): learner demand, eval thresholds
        ^-- Announce (ctl.<run>.announce): the domains verifiers serve (available, not scheduled)

Decisions (pure, in `reinforge.rl.curriculum`): the domain by mixing weights x regression
boosts x its recent rate of groups that hold a pass and a non-pass (`pass_signal_rate`,
floored at `signal_share_floor`, so a mastered or hopeless domain is still probed), with
replay floors for critical domains; the tier where the predicted group pass rate gives the
most learning signal (a tier with no training task stepped over); for recurring (file)
tasks, the task itself. Flow control:
in-flight tasks stay within `issue_budget` (learner demand x max staleness, each task counted
by its domain's recent rate of groups with signal) and per-domain quotas.

One owner for a group's fate: the learner. A group the scheduler saw complete waits for the
learner's `GroupDecision`: until then it counts by its domain's signal rate, once ACCEPTED
as one group, and a final decision (trained, or dropped with its reason) takes it out of the
count and closes its lease. The signal rate itself is the learner's verdicts' average,
from a prior set by the start's measured pass rate, read with its sample count (a domain
the start never passes in many samples is probed at the floor from its first task, not
after 30 hopeless groups; 0 of 4 is not hopeless). The scheduler never
judges signal or staleness, so the two cannot disagree; a decision is acked only once the
state that holds it is saved.

Leases: a task whose group is not complete within `lease_s` is reissued with attempt+1
(priority over new tasks), up to `max_attempts`; JetStream already redelivers a task whose
sampler died before acking it, the lease covers the rest (lost groups, dead-lettered
rollouts). A rollback ends at once the leases of tasks that ask for a version past it.
State (tiers, rates, leases, counters) is saved atomically to
`<run_dir>/scheduler_state.json` and reloaded at start.

Clocks: leases, stalls and saving run on trio's clock (`trio.current_time()`), so tests move
them with a fake clock. Its zero means nothing to another process: the state file carries the
wall-clock offset it was saved with, and a restart moves the saved times onto its own clock,
so a lease keeps its wall-clock deadline (work went on while the scheduler was down).

Figures (heartbeats, `reinforge status`): per domain the tier, the tier mix, the groups,
the informative groups, the **wasted tokens** (tokens of groups the learner found without
GRPO signal), the reward mean/std, the learner's decisions by fate.

Mixing weights change while running through `<run_dir>/scheduler_mix.json`
(`{"weights": {...}, "replay_floors": {...}, "max_in_flight_per_domain": {...}}`),
re-read whenever it changes; its weights, like the config's `domains`, may name globs
(`DomainRegistry.resolve_weights`), and replace the config's weight of a domain both give.

Only a user widens the mix: the config's `domains`, or a weight in the mix file (the way to
start training on a domain whose verifier was attached at runtime). A verifier announcing a
domain makes it *available* (figure `available.<domain>`), never scheduled: the default
verifier announces every registered domain, and a math-only run must stay math-only.
"""

from __future__ import annotations

import math
import random
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import trio
from reinforge.rl.curriculum import (
    CurriculumConfig,
    DomainCurriculum,
    DomainDraw,
    DomainCurriculumState,
    RunningStats,
    TaskRecord,
    floored_signal_rate,
    group_straddles_pass,
    issue_budget,
    mix_probabilities,
    new_task_signal_rate,
    pick_recurring_task,
    prior_signal_rate,
    updated_signal_rate,
)
from reinforge.rl.evalsets import HeldOutConfig, build_heldout, fingerprint
from reinforge.core import paths, policy_version, subjects
from reinforge.core.policy_version import PolicyVersion
from reinforge.core.atomic import write_json_atomic
from reinforge.core.cluster import RUN_DEFAULTS
from reinforge.core.actor import Actor, Input, Ticket, ack_all
from reinforge.core.messages import (
    Announce,
    EvalStats,
    Fate,
    GroupDecision,
    Outcome,
    Rollback,
    ScoredRollout,
    Task,
    WeightsPublished,
    decode,
    split_rollout_id,
)

STATE_SCHEMA = 1
_VERIFIES_RE = re.compile(r"\bverifier for domains? ([\w,\- ]+)$")


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    domains: dict[str, float] = msgspec.field(default_factory=lambda: {"math": 1.0})
    """Starting pool: domain or glob -> mixing weight (relative); a glob (`gym-*`) gives
    each domain it matches its weight, a domain named too keeps its own. Only these and the
    mix file's domains are scheduled; a domain a verifier announces is only available."""
    domain_specs: list[str] = []
    """Extra domains to register, as `NAME=module:Class`."""
    replay_floors: dict[str, float] = {}
    """Critical domains: minimum share of issued tasks (forgetting guard)."""
    min_pass_at_1: dict[str, float] = {}
    """Per-domain evaluation thresholds; a domain below its threshold gets its weight
    multiplied by `regression_boost` until it recovers."""
    regression_boost: float = 3.0
    group_size: int = RUN_DEFAULTS.group_size
    """Samples per task (G); `[run]`."""
    max_in_flight: int = 64
    """Hard cap on outstanding tasks (leases)."""
    max_in_flight_per_domain: dict[str, int] = {}
    """Per-domain quotas on outstanding tasks."""
    groups_per_version: int = RUN_DEFAULTS.groups_per_version
    """Groups with signal the learner trains per policy version; `[run]`."""
    max_staleness: int = RUN_DEFAULTS.max_staleness
    """Versions a group may lag the policy; bounds how far issuance runs ahead; `[run]`."""
    min_signal_rate: float = 0.05
    """Floor on a domain's estimated rate of groups with signal, which the issue budget
    divides by: a domain whose groups never carry signal still counts (it cannot fill the
    pipeline on its own); `max_in_flight` is the hard cap."""
    signal_share_floor: float = 0.1
    """The mix follows the signal: a domain's weight is multiplied by its recent rate of
    groups that hold a pass and a non-pass (`group_straddles_pass`), floored at this. A
    domain whose groups are all pass or all fail (mastered, or out of reach; partial credit
    does not count) keeps this fraction of the share it would get if every group taught,
    so it is probed again as the policy changes. 1 turns this off: the weights alone."""
    lease_s: float = 300.0
    """A task whose group is neither complete nor decided after this is reissued
    (attempt + 1)."""
    max_attempts: int = 3
    """Attempts per task before it is abandoned (counted)."""
    tick_s: float = 0.5
    """Planning period (the loop also wakes when a group completes)."""
    seed: int = 0
    task_files: dict[str, str] = {}
    """domain -> JSONL file of recurring tasks (instead of the domain's generator)."""
    curriculum: CurriculumConfig = CurriculumConfig()
    start_pass_rates: dict[str, list[float]] = {}
    """domain -> the starting policy's pass rate on its tiers 0, 1, ... (e.g. from a
    held-out evaluation): a domain new to the run starts at the easiest tier it has not
    solved yet (`DomainCurriculum.new`), not at `curriculum.start_tier`."""
    start_samples: dict[str, list[int]] = {}
    """domain -> how many samples measured each of its `start_pass_rates` (default: the
    rates are exact). A domain's first signal rate reads a rate measured on few samples as
    uncertain (`prior_signal_rate`): 0 of 4 is not a hopeless domain."""
    heldout: HeldOutConfig = HeldOutConfig()
    """Tasks held out for evaluation: never issued for training; `[run]` (the evaluator
    scores the same)."""
    state_file: str = ""
    """Default: <run_dir>/scheduler_state.json."""
    mix_file: str = ""
    """Default: <run_dir>/scheduler_mix.json."""
    persist_every_s: float = 1.0

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.max_in_flight < 1 or self.max_attempts < 1:
            raise ValueError(
                "SchedulerConfig: group_size, max_in_flight and max_attempts must be >= 1"
            )
        if self.lease_s <= 0 or self.tick_s <= 0:
            raise ValueError("SchedulerConfig: lease_s and tick_s must be > 0")
        for name in ("min_signal_rate", "signal_share_floor"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"SchedulerConfig.{name} must be in (0, 1], got "
                                 f"{getattr(self, name)}")
        if any(w < 0 for w in self.domains.values()):
            raise ValueError(f"SchedulerConfig.domains: weights must be >= 0, got {self.domains}")
        bad = {d: r for d, r in self.start_pass_rates.items() if not all(0 <= x <= 1 for x in r)}
        if bad:
            raise ValueError(f"SchedulerConfig.start_pass_rates: rates must be in [0, 1], got "
                             f"{bad}")
        bad_n = {d: n for d, n in self.start_samples.items() if not all(x >= 0 for x in n)}
        if bad_n:
            raise ValueError(f"SchedulerConfig.start_samples: counts must be >= 0, got {bad_n}")
        if sum(self.replay_floors.values()) > 1.0:
            raise ValueError(f"SchedulerConfig.replay_floors add up to more than 1: "
                             f"{self.replay_floors}")


class MixOverride(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The runtime-adjustable part of the mix (the mix file)."""

    weights: dict[str, float] = {}
    replay_floors: dict[str, float] = {}
    max_in_flight_per_domain: dict[str, int] = {}


# ----------------------------------------------------------------------------- state


class Lease(msgspec.Struct, kw_only=True):
    task: Task
    base_id: str
    """The underlying task (recurring tasks are issued under fresh task ids)."""
    issued_at: float
    deadline: float
    """Both on the scheduler's clock (see `SchedulerState.clock_offset_s`)."""


class GroupTally(msgspec.Struct, kw_only=True):
    domain: str
    tier: int
    group_size: int
    rewards: dict[int, float] = {}
    """sample_index -> reward, for samples the candidate is responsible for."""
    infra: list[int] = []
    """sample indices whose verification failed for infrastructure reasons (no signal)."""
    tokens: int = 0
    first_seen: float = 0.0
    """On the scheduler's clock (see `SchedulerState.clock_offset_s`)."""
    oldest_version: int = -1
    """The oldest policy version among its samples (-1: none yet)."""
    passes: int = 0
    """Samples that passed (outcome pass, whatever their reward)."""


class AwaitingDecision(msgspec.Struct, kw_only=True):
    """A group the scheduler saw complete (or the learner accepted) with no final word yet."""

    domain: str
    accepted: bool = False
    """The learner put it in the batch of its next update: it counts as one whole group."""


class DomainCounters(msgspec.Struct, kw_only=True):
    issued: int = 0
    reissued: int = 0
    abandoned: int = 0
    groups: int = 0
    informative_groups: int = 0
    signal_rate: float = 0.5
    """The learner's verdicts "this group carries signal" (stale ones included: staleness
    is the budget's doing, not the domain's), averaged from a prior (`updated_signal_rate`):
    the start's pass rate's where the config measured one, else 0.5."""
    signal_judged: int = 0
    """Verdicts in `signal_rate`: the prior weighs less as they come."""
    pass_signal_rate: float = 0.5
    """Of its complete groups, the rate that hold a pass and a non-pass
    (`group_straddles_pass`), from the same prior: the mix's measure of the frontier.
    Below `signal_rate` where partial credit makes rewards differ without a pass."""
    pass_judged: int = 0
    """Groups in `pass_signal_rate`."""
    late_groups: int = 0
    stale_groups: int = 0
    """Groups the learner dropped as too stale."""
    decided: dict[str, int] = {}
    """Final decisions by fate (trained, stale, no_signal, rolled_back, incomplete)."""
    tokens: int = 0
    wasted_tokens: int = 0
    infra_samples: int = 0
    heldout_skips: int = 0
    rewards: RunningStats = msgspec.field(default_factory=RunningStats)


class SchedulerState(msgspec.Struct, kw_only=True):
    schema: int = STATE_SCHEMA
    issued: int = 0
    """Issue sequence number: names tasks and seeds their draws."""
    version: int = 0
    """The current policy version: `policy.version`, read where tasks are issued."""
    policy: PolicyVersion = PolicyVersion()
    """How the version was reached (`core/policy_version.py`: rollbacks, epochs)."""
    available: list[str] = []
    """Domains some verifier announced (sorted): trainable if the mix names them."""
    attached: dict[str, float] = {}
    """Domains an announcement added to the mix in states written before announcements
    stopped doing so; read once at start (see `_forget_announced_joins`), never filled."""
    curricula: dict[str, DomainCurriculumState] = {}
    task_records: dict[str, dict[str, TaskRecord]] = {}
    leases: dict[str, Lease] = {}
    tallies: dict[str, GroupTally] = {}
    recent_done: list[str] = []
    """Keys of recently completed groups (duplicates after them are ignored)."""
    awaiting: dict[str, AwaitingDecision] = {}
    """task_id -> a group waiting for the learner's final decision."""
    recent_decided: list[str] = []
    """Task ids the learner decided for good, newest last (repeats after them are ignored)."""
    counters: dict[str, DomainCounters] = {}
    eval_pass_at_1: dict[str, float] = {}
    rollbacks: int = 0
    abandoned: list[str] = []
    """Task ids given up after max_attempts (the newest 4096): the record an accounting
    check (bench/chaos.py) reads as their reason for never reaching the learner."""
    clock_offset_s: float = 0.0
    """Wall-clock time minus the scheduler's clock when this was saved: what turns the lease
    and tally times into wall-clock times. States saved before there was one hold wall-clock
    times already: 0."""


def wall_clock_offset() -> float:
    """Wall-clock time minus trio's clock, now: the one place the scheduler reads the wall
    clock, because only wall-clock time means the same to the process that saved a state
    and the one that loads it."""
    return time.time() - trio.current_time()


def move_onto_clock(state: SchedulerState, offset: float) -> None:
    """Shift a loaded state's times onto the clock whose wall-clock offset is `offset`;
    their wall-clock values stay, so the time the scheduler was down counts against them."""
    shift = state.clock_offset_s - offset
    for lease in state.leases.values():
        lease.issued_at += shift
        lease.deadline += shift
    for tally in state.tallies.values():
        tally.first_seen += shift
    state.clock_offset_s = offset


def save_state(path: Path, state: SchedulerState) -> None:
    write_json_atomic(path, state)


def load_state(path: Path) -> SchedulerState | None:
    if not path.exists():
        return None
    try:
        state = msgspec.json.decode(path.read_bytes(), type=SchedulerState)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"scheduler state {path} is unreadable: {exc} (move it away to "
                         "start afresh)") from None
    if state.schema != STATE_SCHEMA:
        raise ValueError(f"scheduler state {path} has schema {state.schema}, "
                         f"this scheduler reads {STATE_SCHEMA}")
    return state


def verified_domains(capabilities: list[str]) -> list[str]:
    """The domains named by capabilities like "verifier for domain sql" (or "domains a,b")."""
    out = []
    for cap in capabilities:
        m = _VERIFIES_RE.search(cap)
        out += [n for n in m.group(1).replace(" ", ",").split(",") if n] if m else []
    return out


def group_key(task_id: str, attempt: int) -> str:
    return f"{task_id}#{attempt}"


def say(text: str) -> None:
    print(f"scheduler: {text}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the actor


class Scheduler(Actor):
    actor_type = "scheduler"
    Config = SchedulerConfig

    # -- start-up ---------------------------------------------------------------------

    async def setup(self) -> None:
        from reinforge.envs.domain import DomainRegistry

        cfg: SchedulerConfig = self.config
        run_dir = paths.run_dir(self.ctx.run)
        self.state_path = (
            Path(cfg.state_file) if cfg.state_file else run_dir / "scheduler_state.json"
        )
        self.mix_path = Path(cfg.mix_file) if cfg.mix_file else run_dir / "scheduler_mix.json"
        self.registry = DomainRegistry.default(cfg.domain_specs)
        self.domain_weights = self.registry.resolve_weights(
            cfg.domains, where="SchedulerConfig.domains")
        self.state = load_state(self.state_path) or SchedulerState()
        move_onto_clock(self.state, wall_clock_offset())
        self.mix = MixOverride()
        self._mix_mtime = -1.0
        self.curricula: dict[str, DomainCurriculum] = {}
        self.heldout: dict[str, set[str]] = {}
        self.file_tasks: dict[str, dict[str, Any]] = {}
        self._forget_announced_joins()
        for name in self.domain_weights:
            self._join(name)
        self._dirty = True
        self._last_persist = -math.inf  # never saved: the first save is due at once
        self._unsaved_decisions: list[Ticket] = []
        self._wakeup = trio.Event()
        latest = await self.ctx.bus.last_message(self.ctx.stream, subjects.weights(self.ctx.run))
        if latest is not None:
            await self.on_weights(decode(latest.data))

    def _forget_announced_joins(self) -> None:
        """A state saved when announcements widened the mix lists the domains they added:
        they become available only, and the change is said, not silent."""
        st = self.state
        if not st.attached:
            return
        names = sorted(set(st.attached) - set(self.domain_weights))
        st.available = sorted({*st.available, *st.attached})
        st.attached = {}
        if names:
            say(f"domains {', '.join(names)} joined the mix by an announcement in the saved "
                "state; announcements no longer schedule a domain: they are only available "
                f"unless the config's `domains` or the mix file {self.mix_path} weights them")

    def _join(self, name: str) -> None:
        """Add a domain to the pool (its curriculum, held-out fingerprints, task file)."""
        if name in self.curricula:
            return
        cfg: SchedulerConfig = self.config
        domain = self.registry.get(name)
        st = self.state.curricula.get(name)
        self.curricula[name] = (
            DomainCurriculum(cfg.curriculum, st) if st is not None
            else DomainCurriculum.new(cfg.curriculum, len(domain.tiers),
                                      cfg.start_pass_rates.get(name, ())[:len(domain.tiers)])
        )
        self.state.curricula[name] = self.curricula[name].state
        if name not in self.state.counters:
            prior = prior_signal_rate(
                cfg.start_pass_rates.get(name, ()), self.curricula[name].level,
                cfg.group_size, cfg.start_samples.get(name, ()))
            self.state.counters[name] = DomainCounters(signal_rate=prior,
                                                       pass_signal_rate=prior)
        held = build_heldout(self.registry, [name], cfg.heldout)[name]
        self.heldout[name] = {fingerprint(t.prompt) for t in held}
        if name in cfg.task_files:
            tasks = [t for t in domain.load_tasks(cfg.task_files[name])
                     if fingerprint(t.prompt) not in self.heldout[name]]
            if not tasks:
                raise ValueError(f"task file {cfg.task_files[name]} for domain {name!r} has no "
                                 "task outside the held-out set")
            self.file_tasks[name] = {t.task_id: t for t in tasks}
            for tier in set(range(len(domain.tiers))) - {t.tier for t in tasks}:
                self.curricula[name].close(tier)

    # -- inputs -----------------------------------------------------------------------

    def inputs(self) -> list[Input]:
        run = self.ctx.run
        return [
            Input(subject=subjects.scored(run, "*"), handler=self.on_scored,
                  accepts=(ScoredRollout,), durable=False),
            Input(subject=subjects.decision(run, "*"), handler=self.on_decision,
                  accepts=(GroupDecision,), manual_ack=True, ack_wait_s=60.0),
            Input(subject=subjects.weights(run), handler=self.on_weights,
                  accepts=(WeightsPublished, Rollback), durable=False),
            Input(subject=subjects.stats(run, "*"), handler=self.on_stats, durable=False),
            Input(subject=subjects.announce(run), handler=self.on_announce,
                  accepts=(Announce,), durable=False),
        ]

    def capabilities(self) -> list[str]:
        return [f"scheduler for domains {','.join(sorted(self.curricula))}"]

    async def on_scored(self, msg: ScoredRollout) -> None:
        r = msg.rollout
        if r.purpose != "train":
            return
        task_id, index, attempt = split_rollout_id(r.rollout_id)
        key = group_key(task_id, attempt)
        if key in self.state.recent_done:
            return  # a redelivered sample of a group already counted
        tally = self.state.tallies.get(key)
        if tally is None:
            tally = self.state.tallies[key] = GroupTally(
                domain=r.domain, tier=r.tier, group_size=r.group_size,
                first_seen=trio.current_time(),
            )
        if index in tally.rewards or index in tally.infra:
            return
        if msg.outcome == Outcome.INFRA_ERROR:
            tally.infra.append(index)
        else:
            tally.rewards[index] = msg.reward
            tally.passes += msg.outcome == Outcome.PASS
        tally.tokens += len(r.output_ids)
        if tally.oldest_version < 0 or r.policy_version < tally.oldest_version:
            tally.oldest_version = r.policy_version
        self._dirty = True
        if len(tally.rewards) + len(tally.infra) >= tally.group_size:
            self._complete(task_id, key, tally)

    def _complete(self, task_id: str, key: str, tally: GroupTally) -> None:
        st = self.state
        del st.tallies[key]
        st.recent_done.append(key)
        del st.recent_done[:-4096]
        c = st.counters.setdefault(tally.domain, DomainCounters())
        rewards = [tally.rewards[i] for i in sorted(tally.rewards)]
        c.groups += 1
        c.tokens += tally.tokens
        c.infra_samples += len(tally.infra)
        for x in rewards:
            c.rewards.add(x)
        if rewards:
            c.pass_signal_rate = updated_signal_rate(
                c.pass_signal_rate, group_straddles_pass(tally.passes, len(rewards)),
                judged=c.pass_judged)
            c.pass_judged += 1
        lease = st.leases.pop(task_id, None)
        if lease is None:
            c.late_groups += 1  # a group of an attempt already superseded, or not ours
        elif task_id not in st.recent_decided:
            st.awaiting.setdefault(task_id, AwaitingDecision(domain=tally.domain))
        if rewards and tally.domain in self.curricula:
            curriculum = self.curricula[tally.domain]
            if 0 <= tally.tier < curriculum.state.n_tiers:
                # passes, not mean reward: partial credit (coin_flip's 0.64 at a pass rate of
                # 0.09) took a family up three tiers it could not pass
                move = curriculum.record(tally.tier, tally.passes / len(rewards))
                if move:
                    say(f"domain {tally.domain} moves {'up' if move > 0 else 'down'} to tier "
                        f"{curriculum.level}")
            if lease is not None and tally.domain in self.file_tasks:
                rec = st.task_records.setdefault(tally.domain, {}).setdefault(
                    lease.base_id, TaskRecord())
                rec.passes += sum(rewards)
                rec.fails += len(rewards) - sum(rewards)
        self._wakeup.set()

    async def on_decision(self, msg: GroupDecision, ticket: Ticket) -> None:
        """The learner's word on a group; see the module's "one owner for a group's fate".
        The ticket is acked once a saved state holds this decision (`_save_then_ack`)."""
        st = self.state
        self._unsaved_decisions.append(ticket)
        self._dirty = True
        if msg.task_id in st.recent_decided:
            return  # a final decision sent again
        c = st.counters.setdefault(msg.domain, DomainCounters())
        waiting = st.awaiting.get(msg.task_id)
        judged_before = waiting is not None and waiting.accepted
        if msg.signal is not None and not judged_before and msg.fate != Fate.INCOMPLETE:
            c.signal_rate = updated_signal_rate(c.signal_rate, msg.signal,
                                                judged=c.signal_judged)
            c.signal_judged += 1
            if msg.signal:
                c.informative_groups += 1
            else:
                c.wasted_tokens += msg.tokens
        # Decided before this scheduler saw it complete (its core view lost a sample, or it
        # was down): no reissue, since the learner skips a task it has decided.
        st.leases.pop(msg.task_id, None)
        if msg.fate == Fate.ACCEPTED:
            st.awaiting[msg.task_id] = AwaitingDecision(domain=msg.domain, accepted=True)
        else:
            st.awaiting.pop(msg.task_id, None)
            st.recent_decided.append(msg.task_id)
            del st.recent_decided[:-4096]
            c.decided[msg.fate.value] = c.decided.get(msg.fate.value, 0) + 1
            if msg.fate == Fate.STALE:
                c.stale_groups += 1
        self._wakeup.set()

    async def on_weights(self, msg: WeightsPublished | Rollback) -> None:
        policy = policy_version.after(self.state.policy, msg)
        if policy is None:  # an older announcement (maybe of a version since rolled back)
            return
        self.state.policy, self.state.version = policy, policy.version
        if isinstance(msg, Rollback):
            self.state.rollbacks += 1
            say(f"rollback to version {msg.to_version}: {msg.reason}")
            # A task in flight that asks for a version past the rollback cannot be served
            # until the learner gets there again, which it cannot without groups: its lease
            # runs out now, and it goes out again asking for what exists.
            now = trio.current_time()
            for lease in self.state.leases.values():
                if lease.task.min_version > msg.to_version:
                    lease.deadline = min(lease.deadline, now)
        self._dirty = True
        self._wakeup.set()

    async def on_stats(self, msg: Any) -> None:
        if isinstance(msg, EvalStats):
            self.state.eval_pass_at_1[msg.domain] = msg.pass_at_1
            self._dirty = True

    async def on_announce(self, msg: Announce) -> None:
        """A verifier's domains become available; only the config or the mix file schedules
        a domain (a default verifier announces all of them)."""
        if msg.event != "joined":
            return
        for name in verified_domains(msg.capabilities):
            if name in self.state.available or name not in self.registry:
                continue
            self.state.available = sorted([*self.state.available, name])
            self._dirty = True
            if name not in self.curricula:
                say(f"domain {name} is available ({msg.actor_id} verifies it) but not in the "
                    f"mix: give it a weight in {self.mix_path} to train on it")

    # -- the loop ---------------------------------------------------------------------

    async def main(self) -> None:
        while True:
            self._reload_mix()
            now = trio.current_time()
            tasks = [*self._expired_leases(now), *self._plan(now)]
            if tasks:
                # Write-ahead: the leases (and the issue counter that names tasks) are on
                # disk before any task is out, so a restarted scheduler never reuses an id
                # (the server's duplicate window would swallow the new task).
                self._dirty = True
                self._persist_if_due(force=True)
            await self.ctx.publish_durable_many(
                [(subjects.task(self.ctx.run, t.domain), t, f"task:{t.task_id}:{t.attempt}")
                 for t in tasks])
            await self._save_then_ack()
            with trio.move_on_after(self.config.tick_s):
                with self.ctx.waiting("group outcomes or the next tick"):
                    await self._wakeup.wait()
            self._wakeup = trio.Event()

    async def teardown(self) -> None:
        self._persist_if_due(force=True)
        await ack_all(self._unsaved_decisions)

    async def _save_then_ack(self) -> None:
        """Save when due; decisions are acked only once a saved state holds them (one
        crashed between would be redelivered and ignored as a repeat, never lost)."""
        self._persist_if_due()
        if self._unsaved_decisions and not self._dirty:
            tickets, self._unsaved_decisions = self._unsaved_decisions, []
            await ack_all(tickets)

    # -- decisions --------------------------------------------------------------------

    def weights(self) -> dict[str, float]:
        w = {**self.domain_weights, **self.mix.weights}
        return {d: v for d, v in w.items() if d in self.curricula}

    def probabilities(self, eligible: set[str]) -> dict[str, float]:
        cfg: SchedulerConfig = self.config
        boosts = {d: floored_signal_rate(self._pass_signal_rate(d), cfg.signal_share_floor)
                  for d in eligible}
        for d, p in self.state.eval_pass_at_1.items():
            if d in boosts and d in cfg.min_pass_at_1 and p < cfg.min_pass_at_1[d]:
                boosts[d] *= cfg.regression_boost
        floors = {**cfg.replay_floors, **self.mix.replay_floors}
        return mix_probabilities(self.weights(), eligible=eligible, floors=floors, boosts=boosts)

    def _in_flight_by_domain(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lease in self.state.leases.values():
            out[lease.task.domain] = out.get(lease.task.domain, 0) + 1
        return out

    def _raw_signal_rate(self, domain: str) -> float:
        c = self.state.counters.get(domain)
        return c.signal_rate if c is not None else DomainCounters().signal_rate

    def _pass_signal_rate(self, domain: str) -> float:
        c = self.state.counters.get(domain)
        return c.pass_signal_rate if c is not None else DomainCounters().pass_signal_rate

    def signal_rate(self, domain: str) -> float:
        return floored_signal_rate(self._raw_signal_rate(domain), self.config.min_signal_rate)

    def queued_groups(self) -> float:
        """Groups with signal expected from those complete but not yet finally decided: an
        accepted one counts whole, one not yet judged by its domain's signal rate."""
        return sum(1.0 if w.accepted else self.signal_rate(w.domain)
                   for w in self.state.awaiting.values())

    def budget(self, probs: dict[str, float] | None = None) -> int:
        """How many new tasks to issue now. `probs`: the mix over every domain, when the
        caller has computed it already."""
        cfg: SchedulerConfig = self.config
        st = self.state
        if probs is None:
            probs = self.probabilities(set(self.curricula))
        new_task_rate = new_task_signal_rate(
            probs, {d: self._raw_signal_rate(d) for d in probs}, floor=cfg.min_signal_rate)
        return issue_budget(
            in_flight=len(st.leases),
            max_in_flight=cfg.max_in_flight,
            groups_per_version=cfg.groups_per_version,
            max_staleness=cfg.max_staleness,
            queued=self.queued_groups(),
            expected_in_flight=sum(self.signal_rate(lease.task.domain)
                                   for lease in st.leases.values()),
            signal_rate=new_task_rate,
        )

    def _plan(self, now: float) -> Iterator[Task]:
        """New tasks within the budget, domain by the mix, tier by the curriculum; their
        leases start at `now`. The mix's draw is built once per batch and again only when
        a domain drops out (its quota filled, or no task to give), so a batch costs O(D)
        once, not per task."""
        quotas = {**self.config.max_in_flight_per_domain, **self.mix.max_in_flight_per_domain}
        by_domain = self._in_flight_by_domain()
        eligible = {d for d in self.curricula
                    if d not in quotas or by_domain.get(d, 0) < quotas[d]}
        everyone = self.probabilities(set(self.curricula))
        draw: DomainDraw | None = None
        for _ in range(self.budget(everyone)):
            if draw is None:
                # The budget's mix serves the first draw when no domain is left out.
                probs = everyone if len(eligible) == len(self.curricula) else \
                    self.probabilities(eligible)
                if not probs:
                    return
                draw = DomainDraw(probs)
            rng = random.Random(f"{self.config.seed}:{self.state.issued}")
            domain = draw(rng)
            task = self._new_task(domain, rng, now)
            if task is not None:
                by_domain[domain] = by_domain.get(domain, 0) + 1
            if task is None or (domain in quotas and by_domain[domain] >= quotas[domain]):
                eligible.discard(domain)
                draw = None
            if task is not None:
                yield task

    def _new_task(self, name: str, rng: random.Random, now: float) -> Task | None:
        cfg: SchedulerConfig = self.config
        curriculum = self.curricula[name]
        if curriculum.level in curriculum.closed:
            return None  # every tier closed, said when the last one closed
        while True:
            tier = curriculum.choose_tier(rng, cfg.group_size)
            spec = self._draw_spec(name, tier, rng)
            if spec is not None:
                break
            if not curriculum.close(tier):
                say(f"domain {name}: no tier has a task outside the held-out set; "
                    "it issues nothing")
                return None
            say(f"domain {name}: tier {tier} has no task outside the held-out set; its "
                f"curriculum steps over it (level {curriculum.level})")
        curriculum.issued(spec.tier)
        st = self.state
        task = Task(
            task_id=f"{spec.task_id}@{st.issued}",
            domain=name,
            tier=spec.tier,
            prompt=self.registry.get(name).prompt(spec),
            spec=spec.spec,
            group_size=cfg.group_size,
            attempt=1,
            min_version=max(0, st.version - cfg.max_staleness),
            purpose="train",
            epoch=st.policy.epoch,
        )
        st.issued += 1
        st.leases[task.task_id] = Lease(task=task, base_id=spec.task_id, issued_at=now,
                                        deadline=now + cfg.lease_s)
        st.counters[name].issued += 1
        self._dirty = True
        return task

    def _draw_spec(self, name: str, tier: int, rng: random.Random) -> Any:
        """A training task at (or, for task files, nearest to) `tier`, never a held-out one."""
        cfg: SchedulerConfig = self.config
        if name in self.file_tasks:
            pool = self.file_tasks[name]
            tiers = sorted({t.tier for t in pool.values()}, key=lambda t: (abs(t - tier), t))
            ids = sorted(tid for tid, t in pool.items() if t.tier == tiers[0])
            records = self.state.task_records.get(name, {})
            return pool[pick_recurring_task(ids, records, rng, cfg.group_size)]
        domain = self.registry.get(name)
        for _ in range(64):
            spec = domain.sample_task(rng, tier)
            if fingerprint(spec.prompt) not in self.heldout[name]:
                return spec
            self.state.counters[name].heldout_skips += 1
        return None  # 64 draws all held out: the tier has (almost surely) nothing else

    def _expired_leases(self, now: float) -> list[Task]:
        """Reissue (attempt + 1) the tasks whose lease ran out; abandon after max_attempts."""
        cfg: SchedulerConfig = self.config
        st = self.state
        out = []
        for task_id, lease in list(st.leases.items()):
            if lease.deadline > now:
                continue
            c = st.counters.setdefault(lease.task.domain, DomainCounters())
            if lease.task.attempt >= cfg.max_attempts:
                del st.leases[task_id]
                c.abandoned += 1
                st.abandoned.append(task_id)
                del st.abandoned[:-4096]
                say(f"task {task_id} abandoned after {lease.task.attempt} attempts")
                continue
            task = msgspec.structs.replace(
                lease.task, attempt=lease.task.attempt + 1,
                min_version=max(0, st.version - cfg.max_staleness), epoch=st.policy.epoch,
            )
            lease.task, lease.deadline = task, now + cfg.lease_s
            c.reissued += 1
            out.append(task)
        horizon = now - cfg.lease_s * (cfg.max_attempts + 1)
        for key in [k for k, t in st.tallies.items() if t.first_seen < horizon]:
            del st.tallies[key]  # a partial group nobody will finish
        if out:
            self._dirty = True
        return out

    # -- runtime adjustment and persistence ---------------------------------------------

    def _reload_mix(self) -> None:
        try:
            mtime = self.mix_path.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime == self._mix_mtime:
            return
        self._mix_mtime = mtime
        try:
            mix = msgspec.json.decode(self.mix_path.read_bytes(), type=MixOverride)
            mix = msgspec.structs.replace(
                mix, weights=self.registry.resolve_weights(mix.weights))
            for name in mix.weights:
                if name not in self.curricula:
                    self._join(name)
        except (msgspec.ValidationError, msgspec.DecodeError, KeyError, ValueError) as exc:
            say(f"ignoring mix file {self.mix_path}: {exc}")
            return
        self.mix = mix
        say(f"mix from {self.mix_path}: {msgspec.json.encode(mix).decode()}")

    def _persist_if_due(self, force: bool = False) -> None:
        now = trio.current_time()
        if self._dirty and (force or now - self._last_persist >= self.config.persist_every_s):
            self.state.clock_offset_s = wall_clock_offset()
            save_state(self.state_path, self.state)
            self._dirty = False
            self._last_persist = now

    # -- figures ----------------------------------------------------------------------

    def figures(self) -> dict[str, float]:
        st = self.state
        out: dict[str, float] = {
            "policy_version": float(st.version),
            "in_flight": float(len(st.leases)),
            "issue_budget": float(self.budget()),
            "queued_groups": self.queued_groups(),
            "awaiting_decision": float(len(st.awaiting)),
            "rollbacks": float(st.rollbacks),
        }
        for d in st.available:
            out[f"available.{d}"] = 1.0
        probs = self.probabilities(set(self.curricula))
        for d, cur in self.curricula.items():
            c = st.counters.get(d, DomainCounters())
            out[f"{d}.tier"] = float(cur.level)
            out[f"{d}.mix"] = probs.get(d, 0.0)
            for tier, frac in cur.tier_mix().items():
                out[f"{d}.tier_mix.{tier}"] = frac
            out[f"{d}.groups"] = float(c.groups)
            out[f"{d}.informative_groups"] = float(c.informative_groups)
            out[f"{d}.signal_rate"] = self.signal_rate(d)
            out[f"{d}.pass_signal_rate"] = c.pass_signal_rate
            out[f"{d}.wasted_tokens"] = float(c.wasted_tokens)
            out[f"{d}.wasted_token_frac"] = c.wasted_tokens / c.tokens if c.tokens else 0.0
            out[f"{d}.reward_mean"] = c.rewards.mean
            out[f"{d}.reward_std"] = c.rewards.std
            out[f"{d}.reward_count"] = float(c.rewards.count)
            out[f"{d}.reissued"] = float(c.reissued)
            out[f"{d}.abandoned"] = float(c.abandoned)
            for fate, n in c.decided.items():
                out[f"{d}.decided.{fate}"] = float(n)
        return out
