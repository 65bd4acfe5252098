"""The monitor: an actor that only observes a run and writes down what it sees.

Inputs (core subscriptions, at most once — the monitor never holds work back):
  * `rl.<run>.scored.*`      ScoredRollout: samples, rewards, outcomes, tiers, tokens;
  * `rl.<run>.weights`       WeightsPublished / Rollback: the policy version;
  * `rl.<run>.decision.*`    GroupDecision: what the learner did with each group (which
                             tasks it trained on, which it dropped and why);
  * `rl.<run>.stats.*`       TrainStats, EvalStats (and whatever else decodes; the rest
                             is counted and skipped, never dead-lettered);
  * `ctl.<run>.heartbeat.*`  Heartbeat: per-process CPU, memory, figures, waits;
  * `rl.<run>.review.*`      ReviewMark: a person's mark on a rollout (`reinforge ui`).
Every `snapshot_interval_s` it also reads the run stream's consumers (messages pending
and in flight per durable consumer = the queue depths).

Outputs, under `<run_dir>/metrics/`: `metrics.jsonl` (records of kind start, scored,
decision, weights, rollback, train, eval, review, snapshot), TensorBoard scalars in `tb/`,
the newest `snapshot.json`; and `GET /metrics` (Prometheus text) and `GET /snapshot.json` on an HTTP
port written to `<run_dir>/monitor.json`.

`MonitorState` is the bookkeeping without I/O (fed messages and clock readings, tested
alone); `render_rich(snapshot)` / `render_line(snapshot)` turn a `Snapshot` into the live
terminal view (rich renderable, or one plain line when stdout is not a TTY).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import trio

from reinforge.metrics import writers as mx
from reinforge.rl.scoring import mean_or_none
from reinforge.core import paths, subjects
from reinforge.core.actor import Actor, Input
from reinforge.core.messages import (
    TRAIN_FIGURE_FIELDS,
    EvalStats,
    GroupDecision,
    Heartbeat,
    MessageError,
    Outcome,
    ReviewMark,
    Rollback,
    ScoredRollout,
    TrainStats,
    WeightsPublished,
    decode,
)


class MonitorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    port: int = 0
    """Port of the HTTP endpoint (/metrics, /snapshot.json); 0 = a free port, -1 = none."""
    host: str = "127.0.0.1"
    """Address the HTTP endpoint listens on."""
    snapshot_interval_s: float = 5.0
    """How often a snapshot is taken (JSONL, TensorBoard, snapshot.json, queue depths)."""
    window_s: float = 60.0
    """Rates, recent reward/pass rate, staleness and tier mix are over this sliding window."""
    log_rollouts: bool = True
    """Write one JSONL record per scored rollout and per learner decision on a group (the
    report's reward curves and the demo's trained tiers need them)."""
    tensorboard: bool = True
    """Write TensorBoard event files under metrics/tb/."""
    target_version: int = 0
    """The policy version the run aims for (for the ETA); 0 = no ETA."""
    process_timeout_s: float = 30.0
    """A process whose last heartbeat is older than this is left out of snapshots."""
    run_dir: str = ""
    """Where the run keeps its files; "" = core.paths.run_dir(run)."""
    max_domain_series: int = 20
    """Per-domain series in /metrics and TensorBoard for at most this many domains (those
    with the most samples); the rest are summed (counters) or sample-weighted (gauges)
    into one `domain="_other"` series, so a hundred domains do not explode cardinality."""

    def __post_init__(self) -> None:
        if not -1 <= self.port <= 65535:
            raise ValueError(f"MonitorConfig.port must be -1..65535, got {self.port}")
        if self.snapshot_interval_s <= 0:
            raise ValueError(
                f"MonitorConfig.snapshot_interval_s must be > 0, got {self.snapshot_interval_s}"
            )
        if self.window_s <= 0:
            raise ValueError(f"MonitorConfig.window_s must be > 0, got {self.window_s}")
        if self.target_version < 0:
            raise ValueError(
                f"MonitorConfig.target_version must be >= 0, got {self.target_version}"
            )
        if self.max_domain_series < 1:
            raise ValueError(f"MonitorConfig.max_domain_series must be >= 1, got "
                             f"{self.max_domain_series}")


# ----------------------------------------------------------------------------- snapshot


class DomainSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    domain: str
    samples: int
    """Scored rollouts since the monitor started (infra errors included)."""
    infra_errors: int
    tokens: int
    """Generated tokens (len(output_ids)) since start."""
    samples_per_s: float
    """Over the window."""
    reward_mean: float | None
    """Mean reward over the window, infra errors left out (None: nothing in the window)."""
    pass_rate: float | None
    """Fraction of PASS among the window's non-infra outcomes."""
    tier_mean: float | None
    tier_mix: dict[str, float] = {}
    """Share of the window's samples per tier (keys are tier numbers as strings)."""
    eval_version: int | None = None
    eval_pass_at_1: float | None = None
    eval_pass_at_k: float | None = None
    eval_first_version: int | None = None
    eval_first_pass_at_1: float | None = None


class ProcessSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    actor_id: str
    actor_type: str
    host: str
    pid: int
    cpu_percent: float
    rss_bytes: int
    state: str
    waiting_on: str = ""
    seen_s_ago: float = 0.0
    figures: dict[str, float] = {}


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    run: str
    t: float
    """Wall clock of the snapshot (s since epoch)."""
    elapsed_s: float
    policy_version: int
    rollbacks: int
    samples_total: int
    samples_per_s: float
    tokens_per_s: float
    staleness_mean: float | None
    """Policy version at scoring minus the rollout's version, mean over the window."""
    staleness_max: int | None
    train_step: int | None
    train_loss: float | None
    train_figures: dict[str, float] = {}
    eta_s: float | None = None
    target_version: int = 0
    domains: list[DomainSnapshot] = []
    queues: dict[str, float] = {}
    processes: list[ProcessSnapshot] = []


# ----------------------------------------------------------------------------- state


class _Recent(msgspec.Struct, frozen=True):
    t: float
    domain: str
    tier: int
    reward: float
    outcome: Outcome
    tokens: int
    staleness: int


_QUEUE_FIGURE = re.compile(r"queue|pending|backlog|in_flight|held|depth", re.IGNORECASE)


class MonitorState:
    """What the monitor knows, fed message by message; each `on_*` returns its JSONL record."""

    def __init__(self, run: str, *, window_s: float = 60.0, target_version: int = 0,
                 process_timeout_s: float = 30.0, started_at: float | None = None) -> None:
        self.run = run
        self.window_s = window_s
        self.target_version = target_version
        self.process_timeout_s = process_timeout_s
        self.started_at = time.time() if started_at is None else started_at
        self.policy_version = 0
        self.rollbacks = 0
        self._first_version: tuple[float, int] | None = None  # (t, version) for the ETA
        self._last_version_t = 0.0
        self._recent: collections.deque[_Recent] = collections.deque()
        self.samples: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.tokens: collections.Counter[str] = collections.Counter()
        self.train: TrainStats | None = None
        self._train_seen: set[tuple[int, int, int]] = set()
        self.eval_first: dict[str, EvalStats] = {}
        self.eval_last: dict[str, EvalStats] = {}
        self._eval_seen: set[tuple[int, int, str]] = set()
        self.heartbeats: dict[str, tuple[float, Heartbeat]] = {}
        self.queues: dict[str, float] = {}
        self.unknown_stats = 0

    # -- messages ---------------------------------------------------------------------

    def on_scored(self, s: ScoredRollout, now: float) -> dict[str, Any]:
        r = s.rollout
        staleness = max(self.policy_version - r.policy_version, 0)
        tokens = len(r.output_ids)
        self.samples[r.domain] += 1
        self.outcomes[(r.domain, s.outcome.value)] += 1
        self.tokens[r.domain] += tokens
        self._recent.append(_Recent(now, r.domain, r.tier, s.reward, s.outcome, tokens, staleness))
        self._trim(now)
        return {
            "t": now, "kind": "scored", "domain": r.domain, "tier": r.tier,
            "version": r.policy_version, "reward": s.reward, "outcome": s.outcome.value,
            "tokens": tokens, "staleness": staleness, "task_id": r.task_id,
            "purpose": r.purpose,
        }

    def on_decision(self, msg: GroupDecision, now: float) -> dict[str, Any]:
        return {"t": now, "kind": "decision", "domain": msg.domain, "task_id": msg.task_id,
                "fate": msg.fate.value, "version": msg.version}

    def on_weights(self, msg: WeightsPublished | Rollback, now: float) -> dict[str, Any]:
        if isinstance(msg, Rollback):
            self.rollbacks += 1
            self.policy_version = msg.to_version
            return {"t": now, "kind": "rollback", "to_version": msg.to_version,
                    "reason": msg.reason}
        if self._first_version is None:
            self._first_version = (now, msg.version)
        self.policy_version = max(self.policy_version, msg.version)
        self._last_version_t = now
        return {"t": now, "kind": "weights", "version": msg.version, "step": msg.step}

    def on_stats(self, msg: Any, now: float) -> dict[str, Any] | None:
        """TrainStats and EvalStats are recorded once each (they may come on two subjects).
        A version (and step) number comes back after a rollback: its epoch tells them apart,
        and the newest epoch's is the latest."""
        if isinstance(msg, TrainStats):
            key = (msg.epoch, msg.version, msg.step)
            if key in self._train_seen:
                return None
            self._train_seen.add(key)
            if self.train is None or key >= (self.train.epoch, self.train.version,
                                             self.train.step):
                self.train = msg
            return {"t": now, "kind": "train", "epoch": msg.epoch, "version": msg.version,
                    "step": msg.step, "loss": msg.loss, "figures": train_figures(msg)}
        if isinstance(msg, EvalStats):
            key = (msg.epoch, msg.version, msg.domain)
            if key in self._eval_seen:
                return None
            self._eval_seen.add(key)
            first = self.eval_first.get(msg.domain)
            if first is None or (msg.epoch, msg.version) < (first.epoch, first.version):
                self.eval_first[msg.domain] = msg
            last = self.eval_last.get(msg.domain)
            if last is None or (msg.epoch, msg.version) >= (last.epoch, last.version):
                self.eval_last[msg.domain] = msg
            return {"t": now, "kind": "eval", "epoch": msg.epoch, "version": msg.version,
                    "domain": msg.domain,
                    "pass_at_1": msg.pass_at_1, "pass_at_k": msg.pass_at_k, "k": msg.k,
                    "n_tasks": msg.n_tasks, "figures": dict(msg.figures)}
        self.unknown_stats += 1
        return None

    def on_heartbeat(self, hb: Heartbeat, now: float) -> None:
        self.heartbeats[hb.actor_id] = (now, hb)

    def on_review(self, mark: ReviewMark, now: float) -> dict[str, Any]:
        return {"t": now, "kind": "review", "domain": mark.domain, "mark": mark.kind.value,
                "rollout_id": mark.rollout_id, "version": mark.policy_version,
                "recorded_reward": mark.recorded_reward,
                "corrected_reward": mark.corrected_reward}

    def set_consumer_queues(self, depths: dict[str, float]) -> None:
        """Pending / in-flight counts of the run stream's durable consumers."""
        self.queues = dict(depths)

    # -- views ------------------------------------------------------------------------

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._recent and self._recent[0].t < horizon:
            self._recent.popleft()

    def snapshot(self, now: float) -> Snapshot:
        self._trim(now)
        span = min(self.window_s, max(now - self.started_at, 1e-9))
        recent = list(self._recent)
        domains = sorted(set(self.samples) | set(self.eval_last))
        stale = [x.staleness for x in recent]
        train = self.train
        return Snapshot(
            run=self.run,
            t=now,
            elapsed_s=now - self.started_at,
            policy_version=self.policy_version,
            rollbacks=self.rollbacks,
            samples_total=sum(self.samples.values()),
            samples_per_s=len(recent) / span,
            tokens_per_s=sum(x.tokens for x in recent) / span,
            staleness_mean=mean_or_none(stale),
            staleness_max=max(stale) if stale else None,
            train_step=train.step if train else None,
            train_loss=train.loss if train else None,
            train_figures=train_figures(train) if train else {},
            eta_s=self._eta(now),
            target_version=self.target_version,
            domains=[self._domain(d, [x for x in recent if x.domain == d], span)
                     for d in domains],
            queues={**self._figure_queues(now), **self.queues},
            processes=self._processes(now),
        )

    def _domain(self, domain: str, recent: list[_Recent], span: float) -> DomainSnapshot:
        scored = [x for x in recent if x.outcome is not Outcome.INFRA_ERROR]
        tiers = collections.Counter(x.tier for x in recent)
        first, last = self.eval_first.get(domain), self.eval_last.get(domain)
        return DomainSnapshot(
            domain=domain,
            samples=self.samples[domain],
            infra_errors=self.outcomes[(domain, Outcome.INFRA_ERROR.value)],
            tokens=self.tokens[domain],
            samples_per_s=len(recent) / span,
            reward_mean=mean_or_none([x.reward for x in scored]),
            pass_rate=mean_or_none([1.0 if x.outcome is Outcome.PASS else 0.0 for x in scored]),
            tier_mean=mean_or_none([float(x.tier) for x in recent]),
            tier_mix={str(t): n / len(recent) for t, n in sorted(tiers.items())},
            eval_version=last.version if last else None,
            eval_pass_at_1=last.pass_at_1 if last else None,
            eval_pass_at_k=last.pass_at_k if last else None,
            eval_first_version=first.version if first else None,
            eval_first_pass_at_1=first.pass_at_1 if first else None,
        )

    def _live(self, now: float) -> list[tuple[float, Heartbeat]]:
        return [(seen, hb) for seen, hb in self.heartbeats.values()
                if now - seen <= self.process_timeout_s]

    def _processes(self, now: float) -> list[ProcessSnapshot]:
        return [
            ProcessSnapshot(
                actor_id=hb.actor_id, actor_type=hb.actor_type, host=hb.host, pid=hb.pid,
                cpu_percent=hb.process.cpu_percent, rss_bytes=hb.process.rss_bytes,
                state=hb.state, waiting_on=hb.waiting_on, seen_s_ago=now - seen,
                figures=dict(hb.figures),
            )
            for seen, hb in sorted(self._live(now), key=lambda p: (p[1].actor_type,
                                                                    p[1].actor_id))
        ]

    def _figure_queues(self, now: float) -> dict[str, float]:
        """Queue-like heartbeat figures (queue/pending/in_flight/...), summed per actor type."""
        out: dict[str, float] = collections.defaultdict(float)
        for _, hb in self._live(now):
            for key, value in hb.figures.items():
                if _QUEUE_FIGURE.search(key):
                    out[f"{hb.actor_type}.{key}"] += value
        return dict(sorted(out.items()))

    def _eta(self, now: float) -> float | None:
        if not self.target_version or self._first_version is None:
            return None
        t0, v0 = self._first_version
        done = self.policy_version - v0
        if self.policy_version >= self.target_version:
            return 0.0
        if done <= 0 or self._last_version_t <= t0:
            return None
        per_version_s = (self._last_version_t - t0) / done
        return max((self.target_version - self.policy_version) * per_version_s
                   - (now - self._last_version_t), 0.0)


def train_figures(msg: TrainStats) -> dict[str, float]:
    """A step's figures with its typed ones (logprob mismatch, TIS) that it reports, so the
    JSONL, TensorBoard, /metrics and the snapshot show them like any other."""
    typed = {f: getattr(msg, f) for f in TRAIN_FIGURE_FIELDS}
    return {**msg.figures, **{f: float(v) for f, v in typed.items() if v is not None}}


# ----------------------------------------------------------------------------- outputs


OTHER_DOMAINS = "_other"


def series_domains(samples: Mapping[str, int], cap: int) -> set[str]:
    """The domains that keep series of their own: the `cap` with the most samples (ties by
    name); the others go into `OTHER_DOMAINS`."""
    return set(sorted(samples, key=lambda d: (-samples[d], d))[:cap])


def _weighted(values: list[tuple[float | None, int]]) -> float | None:
    known = [(v, w) for v, w in values if v is not None and w > 0]
    total = sum(w for _, w in known)
    return sum(v * w for v, w in known) / total if total else None


def capped_domains(domains: list[DomainSnapshot], cap: int) -> list[DomainSnapshot]:
    """`domains` with all but the `cap` busiest folded into one `_other` entry (samples and
    tokens summed; window figures weighted by samples; no evaluation figures)."""
    keep = series_domains({d.domain: d.samples for d in domains}, cap)
    rest = [d for d in domains if d.domain not in keep]
    if not rest:
        return list(domains)
    mix: dict[str, float] = collections.defaultdict(float)
    weight = sum(d.samples for d in rest) or 1
    for d in rest:
        for tier, share in d.tier_mix.items():
            mix[tier] += share * d.samples / weight
    other = DomainSnapshot(
        domain=OTHER_DOMAINS, samples=sum(d.samples for d in rest),
        infra_errors=sum(d.infra_errors for d in rest), tokens=sum(d.tokens for d in rest),
        samples_per_s=sum(d.samples_per_s for d in rest),
        reward_mean=_weighted([(d.reward_mean, d.samples) for d in rest]),
        pass_rate=_weighted([(d.pass_rate, d.samples) for d in rest]),
        tier_mean=_weighted([(d.tier_mean, d.samples) for d in rest]), tier_mix=dict(mix))
    return [d for d in domains if d.domain in keep] + [other]


def tensorboard_scalars(snap: Snapshot, max_domains: int = 20) -> dict[str, float]:
    """The snapshot's figures as TensorBoard tags (None values left out)."""
    out: dict[str, float | None] = {
        "throughput/samples_per_s": snap.samples_per_s,
        "throughput/tokens_per_s": snap.tokens_per_s,
        "policy/version": float(snap.policy_version),
        "policy/staleness_mean": snap.staleness_mean,
        "policy/rollbacks": float(snap.rollbacks),
    }
    for d in capped_domains(snap.domains, max_domains):
        out[f"reward/{d.domain}"] = d.reward_mean
        out[f"pass_rate/{d.domain}"] = d.pass_rate
        out[f"tier_mean/{d.domain}"] = d.tier_mean
    for name, value in snap.queues.items():
        out[f"queue/{name}"] = value
    for p in snap.processes:
        out[f"process_cpu_percent/{p.actor_id}"] = p.cpu_percent
        out[f"process_rss_mib/{p.actor_id}"] = p.rss_bytes / 2**20
    return {k: v for k, v in out.items() if v is not None}


def prometheus_samples(state: MonitorState, snap: Snapshot,
                       max_domains: int = 20) -> list[mx.Sample]:
    """Everything `/metrics` shows: counters from the state, gauges from the snapshot;
    per-domain series for the `max_domains` busiest domains, the rest as `_other`."""
    run = {"run": snap.run}
    keep = series_domains(dict(state.samples), max_domains)

    def label(domain: str) -> str:
        return domain if domain in keep else OTHER_DOMAINS

    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
    for (domain, outcome), n in state.outcomes.items():
        outcomes[(label(domain), outcome)] += n
    tokens: collections.Counter[str] = collections.Counter()
    for domain, n in state.tokens.items():
        tokens[label(domain)] += n
    S = mx.Sample
    out = [
        S(name="reinforge_policy_version", value=snap.policy_version, labels=run,
          help="Newest policy version published (or rolled back to)."),
        S(name="reinforge_rollbacks_total", value=snap.rollbacks, labels=run, kind="counter",
          help="Rollbacks seen."),
        S(name="reinforge_samples_per_second", value=snap.samples_per_s, labels=run,
          help="Scored rollouts per second over the monitor's window."),
        S(name="reinforge_tokens_per_second", value=snap.tokens_per_s, labels=run,
          help="Generated tokens per second over the monitor's window."),
    ]
    if snap.staleness_mean is not None:
        out.append(S(name="reinforge_staleness_versions", value=snap.staleness_mean, labels=run,
                     help="Mean policy lag of scored rollouts over the window, in versions."))
    if snap.eta_s is not None:
        out.append(S(name="reinforge_eta_seconds", value=snap.eta_s, labels=run,
                     help="Estimated time to the target policy version."))
    for (domain, outcome), n in sorted(outcomes.items()):
        out.append(S(name="reinforge_scored_total", value=n, kind="counter",
                     labels={**run, "domain": domain, "outcome": outcome},
                     help="Scored rollouts by domain and outcome."))
    for domain, n in sorted(tokens.items()):
        out.append(S(name="reinforge_tokens_total", value=n, kind="counter",
                     labels={**run, "domain": domain}, help="Generated tokens by domain."))
    for d in capped_domains(snap.domains, max_domains):
        labels = {**run, "domain": d.domain}
        for name, value, text in (
            ("reinforge_reward_mean", d.reward_mean, "Mean reward over the window."),
            ("reinforge_pass_rate", d.pass_rate, "PASS share over the window."),
            ("reinforge_tier_mean", d.tier_mean, "Mean difficulty tier over the window."),
            ("reinforge_eval_pass_at_1", d.eval_pass_at_1, "Latest evaluation pass@1."),
            ("reinforge_eval_pass_at_k", d.eval_pass_at_k, "Latest evaluation pass@k."),
        ):
            if value is not None:
                out.append(S(name=name, value=value, labels=labels, help=text))
        for tier, share in d.tier_mix.items():
            out.append(S(name="reinforge_tier_share", value=share,
                         labels={**labels, "tier": tier},
                         help="Share of the window's samples per tier."))
    if snap.train_step is not None:
        out.append(S(name="reinforge_train_step", value=snap.train_step, labels=run,
                     help="Newest learner step."))
        out.append(S(name="reinforge_train_loss", value=snap.train_loss or 0.0, labels=run,
                     help="Loss of the newest learner step."))
        for name, value in sorted(snap.train_figures.items()):
            out.append(S(name="reinforge_train_figure", value=value,
                         labels={**run, "figure": name},
                         help="Figures of the newest learner step."))
    for name, value in snap.queues.items():
        out.append(S(name="reinforge_queue_depth", value=value, labels={**run, "queue": name},
                     help="Messages waiting or in flight per queue."))
    for p in snap.processes:
        labels = {**run, "actor_id": p.actor_id, "actor_type": p.actor_type}
        out.append(S(name="reinforge_process_cpu_percent", value=p.cpu_percent, labels=labels,
                     help="Process CPU (100 = one core) from the newest heartbeat."))
        out.append(S(name="reinforge_process_rss_bytes", value=p.rss_bytes, labels=labels,
                     help="Process resident memory from the newest heartbeat."))
        for name, value in sorted(p.figures.items()):
            out.append(S(name="reinforge_actor_figure", value=value,
                         labels={**labels, "figure": name},
                         help="An actor's own figures from its heartbeat."))
    return out


# ----------------------------------------------------------------------------- the actor


class Monitor(Actor):
    actor_type = "monitor"
    Config = MonitorConfig

    def __init__(self, ctx: Any, config: MonitorConfig) -> None:
        super().__init__(ctx, config)
        self.state = MonitorState(ctx.run, window_s=config.window_s,
                                  target_version=config.target_version,
                                  process_timeout_s=config.process_timeout_s)
        self.dir = Path(config.run_dir) if config.run_dir else paths.run_dir(ctx.run)
        self.jsonl: mx.JsonlWriter | None = None
        self.tb: mx.TensorBoardWriter | None = None
        self.port = 0
        self._last: Snapshot | None = None

    def inputs(self) -> list[Input]:
        run = self.ctx.run
        return [
            Input(subject=subjects.scored(run, "*"), handler=self.on_scored,
                  accepts=(ScoredRollout,), durable=False),
            Input(subject=subjects.weights(run), handler=self.on_weights,
                  accepts=(WeightsPublished, Rollback), durable=False),
            Input(subject=subjects.decision(run), handler=self.on_decision,
                  accepts=(GroupDecision,), durable=False),
            Input(subject=subjects.heartbeat(run), handler=self.on_heartbeat,
                  accepts=(Heartbeat,), durable=False),
            Input(subject=subjects.review(run, "*"), handler=self.on_review,
                  accepts=(ReviewMark,), durable=False),
        ]

    def capabilities(self) -> list[str]:
        return [f"monitor: metrics in {self.dir / 'metrics'}, /metrics on port {self.port}"]

    def figures(self) -> dict[str, float]:
        return {
            "metrics_lines": float(self.jsonl.lines_written if self.jsonl else 0),
            "unknown_stats": float(self.state.unknown_stats),
        }

    async def setup(self) -> None:
        metrics_dir = self.dir / "metrics"
        self.jsonl = mx.JsonlWriter(metrics_dir / "metrics.jsonl")
        if self.config.tensorboard:
            self.tb = await trio.to_thread.run_sync(mx.TensorBoardWriter, metrics_dir / "tb")
        now = time.time()
        self.jsonl.write({"t": now, "kind": "start", "run": self.ctx.run,
                          "actor_id": self.ctx.actor_id,
                          "config": msgspec.to_builtins(self.config)})
        # The newest weights already published: the policy version before we joined.
        with self.ctx.waiting("the newest weights message", deadline_s=30):
            last = await self.ctx.bus.last_message(self.ctx.stream, subjects.weights(self.ctx.run))
        if last is not None:
            try:
                msg = decode(last.data)
            except MessageError:
                msg = None
            if isinstance(msg, (WeightsPublished, Rollback)):
                self._write(self.state.on_weights(msg, now))

    async def main(self) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self._stats_loop)  # subscribed before monitor.json appears
            if self.config.port >= 0:
                self.port = await nursery.start(functools.partial(
                    mx.serve_http, self._pages(), host=self.config.host, port=self.config.port))
                mx.write_json_file(self.dir / "monitor.json", {
                    "host": self.config.host, "port": self.port, "pid": os.getpid(),
                    "actor_id": self.ctx.actor_id,
                    "url": f"http://{self.config.host}:{self.port}/metrics",
                })
            while True:
                await self._take_snapshot()
                await trio.sleep(self.config.snapshot_interval_s)

    async def teardown(self) -> None:
        if self.jsonl is not None:
            await self._take_snapshot(poll_queues=False)
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()

    # -- handlers ---------------------------------------------------------------------

    async def on_scored(self, msg: ScoredRollout) -> None:
        record = self.state.on_scored(msg, time.time())
        if self.config.log_rollouts:
            self._write(record)

    async def on_weights(self, msg: WeightsPublished | Rollback) -> None:
        self._write(self.state.on_weights(msg, time.time()))

    async def on_decision(self, msg: GroupDecision) -> None:
        if self.config.log_rollouts:
            self._write(self.state.on_decision(msg, time.time()))

    async def on_heartbeat(self, msg: Heartbeat) -> None:
        self.state.on_heartbeat(msg, time.time())

    async def on_review(self, msg: ReviewMark) -> None:
        self._write(self.state.on_review(msg, time.time()))

    async def _stats_loop(self, task_status: trio.TaskStatus[None]) -> None:
        """stats.* by hand: a stats struct this build does not know is skipped, not DLQ'd."""
        async with self.ctx.bus.subscribe(subjects.stats(self.ctx.run)) as sub:
            task_status.started()
            async for batch in sub:
                for raw in batch:
                    try:
                        msg = decode(raw.data)
                    except MessageError:
                        self.state.unknown_stats += 1
                        continue
                    record = self.state.on_stats(msg, time.time())
                    if record is not None:
                        self._write(record)
                        self._tb_stats(record)
                self.ctx.counts["msgs_in"] += len(batch)

    def _write(self, record: dict[str, Any]) -> None:
        if self.jsonl is not None:
            self.jsonl.write(record)

    def _tb_stats(self, record: dict[str, Any]) -> None:
        if self.tb is None:
            return
        if record["kind"] == "train":
            values = {"train/loss": record["loss"],
                      **{f"train/{k}": v for k, v in record["figures"].items()}}
            self.tb.scalars(values, step=record["step"], walltime=record["t"])
        elif record["kind"] == "eval":
            d = record["domain"]
            self.tb.scalars({f"eval/pass_at_1/{d}": record["pass_at_1"],
                             f"eval/pass_at_k/{d}": record["pass_at_k"]},
                            step=record["version"], walltime=record["t"])

    # -- snapshots ----------------------------------------------------------------------

    async def _take_snapshot(self, poll_queues: bool = True) -> None:
        if poll_queues:
            self.state.set_consumer_queues(await self._consumer_queues())
        snap = self.state.snapshot(time.time())
        self._last = snap
        record = msgspec.to_builtins(snap)
        self._write({**record, "kind": "snapshot"})
        mx.write_json_file(self.dir / "metrics" / "snapshot.json", record)
        if self.tb is not None:
            self.tb.scalars(tensorboard_scalars(snap, self.config.max_domain_series),
                            step=int(snap.elapsed_s), walltime=snap.t)
            self.tb.flush()

    async def _consumer_queues(self) -> dict[str, float]:
        """Pending and in-flight messages of each durable consumer of the run's stream."""
        bus = self.ctx.bus
        try:
            with self.ctx.waiting("consumer info from the bus", deadline_s=30), \
                    trio.move_on_after(10):
                # Bus has no public consumer listing yet; nats-py's manager call, on its loop.
                infos = await bus.aio(bus._js.consumers_info)(self.ctx.stream)  # noqa: SLF001
                out: dict[str, float] = {}
                for info in infos:
                    out[f"{info.name}.pending"] = float(info.num_pending or 0)
                    out[f"{info.name}.in_flight"] = float(info.num_ack_pending or 0)
                return dict(sorted(out.items()))
        except Exception:  # noqa: BLE001 - queue depths are optional figures
            self.ctx.counts["queue_poll_errors"] += 1
        return dict(self.state.queues)

    def current(self) -> Snapshot:
        return self._last if self._last is not None else self.state.snapshot(time.time())

    def _pages(self) -> dict[str, mx.Route]:
        def metrics_page() -> tuple[str, bytes]:
            snap = self.state.snapshot(time.time())
            text = mx.prometheus_text(prometheus_samples(self.state, snap,
                                                         self.config.max_domain_series))
            return mx.PROMETHEUS_CONTENT_TYPE, text.encode()

        def snapshot_page() -> tuple[str, bytes]:
            snap = self.state.snapshot(time.time())
            return "application/json", msgspec.json.encode(snap)

        return {"/metrics": metrics_page, "/snapshot.json": snapshot_page}


# ----------------------------------------------------------------------------- reading back


def read_snapshot(run_dir: Path) -> Snapshot | None:
    """The newest snapshot a monitor wrote in `<run_dir>/metrics/snapshot.json`, or None."""
    path = Path(run_dir) / "metrics" / "snapshot.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=Snapshot)
    except FileNotFoundError:
        return None


def read_endpoint(run_dir: Path) -> dict[str, Any] | None:
    """The monitor's `monitor.json` (host, port, url), or None when no monitor wrote one."""
    try:
        return json.loads((Path(run_dir) / "monitor.json").read_text())
    except FileNotFoundError:
        return None


# ----------------------------------------------------------------------------- rendering


def _f(value: float | None, fmt: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _tiers(mix: dict[str, float]) -> str:
    return " ".join(f"t{t}:{share:.0%}" for t, share in mix.items()) or "-"


def _mismatch_text(figures: dict[str, float]) -> str:
    """Rollout vs learner logprob gap (nats) and the TIS weights, in one short phrase."""
    text = (f"|dlogp| mean {figures['logp_mismatch_mean_nats']:.3f} "
            f"max {figures.get('logp_mismatch_max_nats', 0.0):.3f} nats, "
            f"{figures.get('logp_mismatch_share_over', 0.0):.1%} "
            f"> {figures.get('logp_mismatch_threshold_nats', 0.0):g}")
    if "tis_weight_mean" in figures:
        text += (f"; TIS w {figures['tis_weight_mean']:.3f} "
                 f"capped {figures.get('tis_capped_share', 0.0):.1%}")
    return text


def render_line(snap: Snapshot) -> str:
    """One plain line for logs and non-TTY output."""
    parts = [
        f"[{snap.run} {_duration(snap.elapsed_s)}]",
        f"v{snap.policy_version}",
        f"{snap.samples_per_s:.2f} samples/s",
        f"{snap.samples_total} scored",
        f"stale {_f(snap.staleness_mean)}",
    ]
    if snap.train_step is not None:
        parts.append(f"step {snap.train_step} loss {_f(snap.train_loss, '.4f')}")
        if "logp_mismatch_mean_nats" in snap.train_figures:
            parts.append(_mismatch_text(snap.train_figures))
    for d in snap.domains:
        evals = f" eval@1 {d.eval_pass_at_1:.2f}" if d.eval_pass_at_1 is not None else ""
        parts.append(
            f"{d.domain}: r {_f(d.reward_mean)} pass {_f(d.pass_rate)} "
            f"tier {_f(d.tier_mean, '.1f')} [{_tiers(d.tier_mix)}]{evals}"
        )
    if snap.queues:
        busiest = sorted(snap.queues.items(), key=lambda kv: -kv[1])[:3]
        parts.append("queues " + " ".join(f"{k}={v:g}" for k, v in busiest))
    if snap.rollbacks:
        parts.append(f"rollbacks {snap.rollbacks}")
    if snap.target_version:
        parts.append(f"ETA {_duration(snap.eta_s)}")
    return " | ".join(parts)


def render_rich(snap: Snapshot) -> Any:
    """A rich renderable of the snapshot: headline, domains, queues, processes."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text.assemble(
        (f"run {snap.run}", "bold"), f"  {_duration(snap.elapsed_s)}   ",
        ("policy ", "dim"), (f"v{snap.policy_version}", "bold cyan"),
        ("   throughput ", "dim"), f"{snap.samples_per_s:.2f} samples/s "
        f"({snap.tokens_per_s:.0f} tok/s)",
        ("   staleness ", "dim"), f"{_f(snap.staleness_mean)} (max {snap.staleness_max or 0})",
        ("   ETA ", "dim"),
        _duration(snap.eta_s) if snap.target_version else "no target",
    )
    lines: list[Any] = [head]
    if snap.train_step is not None:
        figs = "  ".join(f"{k} {v:.3g}" for k, v in sorted(snap.train_figures.items())[:8])
        lines.append(Text(f"learner step {snap.train_step}  loss {_f(snap.train_loss, '.4f')}"
                          f"  {figs}", style="dim"))
        if "logp_mismatch_mean_nats" in snap.train_figures:
            lines.append(Text(_mismatch_text(snap.train_figures), style="dim"))
    if snap.rollbacks:
        lines.append(Text(f"rollbacks: {snap.rollbacks}", style="bold red"))

    domains = Table(title="domains", expand=False, title_justify="left")
    for col in ("domain", "samples", "samples/s", "reward", "pass rate", "tier", "tier mix",
                "eval pass@1 (first→last)", "infra err"):
        domains.add_column(col, justify="left" if col in ("domain", "tier mix") else "right")
    for d in snap.domains:
        evals = "-"
        if d.eval_pass_at_1 is not None:
            evals = f"{_f(d.eval_first_pass_at_1)}→{d.eval_pass_at_1:.2f} (v{d.eval_version})"
        domains.add_row(d.domain, str(d.samples), f"{d.samples_per_s:.2f}", _f(d.reward_mean),
                        _f(d.pass_rate), _f(d.tier_mean, ".1f"), _tiers(d.tier_mix), evals,
                        str(d.infra_errors))
    lines.append(domains if snap.domains else Text("no scored samples yet", style="dim"))

    if snap.queues:
        queues = Table(title="queues", title_justify="left")
        queues.add_column("queue")
        queues.add_column("depth", justify="right")
        for name, depth in snap.queues.items():
            queues.add_row(name, f"{depth:g}")
        lines.append(queues)

    if snap.processes:
        procs = Table(title="processes", title_justify="left")
        for col in ("actor", "type", "cpu %", "rss MiB", "state", "waiting on"):
            procs.add_column(col, justify="right" if col in ("cpu %", "rss MiB") else "left")
        for p in snap.processes:
            procs.add_row(p.actor_id, p.actor_type, f"{p.cpu_percent:.0f}",
                          f"{p.rss_bytes / 2**20:.0f}", p.state, p.waiting_on or "")
        lines.append(procs)
    return Group(*lines)
