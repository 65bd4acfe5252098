"""The scheduler's decisions as pure logic: tiers, pass rates, domain mixing, flow control.

Nothing here touches the bus or the clock; the scheduler actor feeds outcomes in and asks
what to issue next. Every rule is written in its docstring and tested on hand-made data
(tests/rl/test_rl_curriculum.py).

The signal rule (GRPO): a group of G samples teaches only when its rewards differ. If a
task passes with probability p, the chance that a group carries signal is
`1 - p**G - (1-p)**G` (`informative_probability`), largest at p = 0.5. The curriculum
therefore keeps each domain at the tier whose recent pass rate is in the informative band,
explores the neighbouring tiers in proportion to their predicted signal, and, for recurring
tasks, picks the task by its own posterior: all decided BEFORE sampling, instead of
generating groups and throwing away the all-pass and all-fail ones afterwards (DAPO's
dynamic sampling).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence

import msgspec


def informative_probability(p: float, group_size: int) -> float:
    """P(a group of `group_size` Bernoulli(p) samples is neither all-pass nor all-fail)."""
    if group_size < 2:
        return 0.0
    p = min(1.0, max(0.0, p))
    return 1.0 - p**group_size - (1.0 - p) ** group_size


MIN_REWARD_SPREAD = 0.05
"""Rewards closer than this are equal to the signal rule. A scorer's crumbs of credit for a
wrong answer (0.01 for a well-formed one, 1e-3 for being near) would otherwise make a group
of failures look informative, and a std-normalised advantage blows their difference up to
the size of a pass against a fail: the budget and the gradient would go to noise."""


def group_has_signal(rewards: Sequence[float], valid: Sequence[bool] | None = None,
                     min_spread: float = MIN_REWARD_SPREAD) -> bool:
    """A group carries learning signal when its valid samples' rewards differ by at least
    `min_spread` (else its GRPO advantages are zero, or noise scaled up). `valid` (default:
    all) leaves out samples that cannot be trained on: a learner skips a group without
    signal and counts it."""
    if valid is not None:
        rewards = [r for r, ok in zip(rewards, valid, strict=True) if ok]
    spread = max(rewards) - min(rewards) if len(rewards) >= 2 else 0.0
    return spread > 0 and spread >= min_spread


def group_straddles_pass(passes: int, samples: int) -> bool:
    """A group of `samples` scored samples, `passes` of which passed, holds a pass and a
    non-pass: its domain sits on the frontier that pass@1 measures. The mix goes by the
    rate of these, not of `group_has_signal`: a family that gives partial credit makes
    nearly every group differ in reward without ever passing (in one 86-family run two
    such families took 36 % of the trained groups, and neither passed once)."""
    return 0 < passes < samples


# ----------------------------------------------------------------------------- curriculum


class CurriculumConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How tiers move and how a tier is chosen for the next task."""

    start_tier: int = 0
    """The tier a new domain starts at (clipped to the domain's tiers)."""
    promote_above: float = 0.8
    """Move the domain up a tier when its current tier's recent pass rate is above this."""
    demote_below: float = 0.2
    """Move it down a tier when the recent pass rate is below this."""
    window_groups: int = 8
    """Groups remembered per (domain, tier): the rates are over this sliding window."""
    min_groups: int = 4
    """Groups at the level since the last move before the domain may move again."""
    explore: float = 0.1
    """Probability of issuing a task at a neighbour tier (the nearest open one below or
    above the level) instead."""
    prior_pass_rate: float = 0.5
    """Predicted pass rate of a tier nothing is known about, with no observed neighbour."""
    tier_step: float = 0.3
    """Prior guess of how much the pass rate drops per tier harder (for unseen tiers)."""
    prior_groups: float = 1.0
    """Weight of the prior in a tier's predicted rate (pseudo-groups of shrinkage)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.demote_below < self.promote_above <= 1.0:
            raise ValueError(
                "CurriculumConfig: need 0 <= demote_below < promote_above <= 1, got "
                f"{self.demote_below} and {self.promote_above}"
            )
        if self.window_groups < 1 or not 1 <= self.min_groups <= self.window_groups:
            raise ValueError(
                "CurriculumConfig: need 1 <= min_groups <= window_groups, got "
                f"min_groups={self.min_groups}, window_groups={self.window_groups}"
            )
        if not 0.0 <= self.explore <= 1.0:
            raise ValueError(f"CurriculumConfig.explore must be in [0, 1], got {self.explore}")


class DomainCurriculumState(msgspec.Struct, kw_only=True):
    """What a domain's curriculum remembers (persisted with the scheduler's state)."""

    n_tiers: int
    level: int = 0
    windows: dict[int, list[float]] = {}
    """Recent group pass rates per tier, oldest first (at most window_groups)."""
    groups_since_move: int = 0
    moves: int = 0
    issued_by_tier: dict[int, int] = {}


class DomainCurriculum:
    """One domain's difficulty level, kept where its groups carry signal.

    Rules:
      * record(tier, rate): append the group's pass rate to that tier's window. Only groups
        at the level count towards a move.
      * adapt: once `min_groups` groups at the level were recorded since the last move,
        promote (level+1) if the level's window mean is above `promote_above`, demote
        (level-1) if below `demote_below`. The level thus stays where the pass rate is in
        [demote_below, promote_above], i.e. where `informative_probability` is high (at
        G=8 and the defaults, >= 0.83), so groups are aimed at the signal before sampling.
      * choose_tier: the level; with probability `explore` a neighbour (the nearest open
        tier below or above) instead, weighted by `informative_probability(predicted, G) +
        0.05`, so the rates of the tiers around the level stay known.
      * predicted(tier): the window mean shrunk towards a prior (`prior_groups`
        pseudo-groups); the prior extrapolates from the nearest other observed tier by
        `tier_step` per tier, else it is `prior_pass_rate`.
      * close(tier): a tier with no task to give (every draw held out for evaluation, or a
        task file without that tier) leaves the ladder: moves and exploration step over
        it, and a level on it moves to the open neighbour predicted to carry more signal.
        A level stuck on such a tier would issue nothing at the level and never move.
        Closed tiers are not saved: a restart finds them again on its first draw.
    """

    def __init__(self, config: CurriculumConfig, state: DomainCurriculumState) -> None:
        self.config = config
        self.state = state
        self.closed: set[int] = set()

    @classmethod
    def new(cls, config: CurriculumConfig, n_tiers: int,
            measured: Sequence[float] = ()) -> DomainCurriculum:
        """A domain's curriculum at `config.start_tier`; or, given the pass rates `measured`
        on its tiers 0, 1, ... (e.g. by a held-out evaluation of the starting policy), at
        the easiest of them at or below `promote_above` (where the promotion rule would
        stop; past the last measured tier if all are above), with each measured tier's
        window starting with its rate as one group."""
        if n_tiers < 1:
            raise ValueError(f"a domain needs at least one tier, got {n_tiers}")
        if len(measured) > n_tiers or not all(0.0 <= r <= 1.0 for r in measured):
            raise ValueError(f"measured pass rates must be in [0, 1], one per tier (at most "
                             f"{n_tiers}), got {list(measured)}")
        level = config.start_tier
        if measured:
            level = next((t for t, r in enumerate(measured) if r <= config.promote_above),
                         len(measured))
        state = DomainCurriculumState(n_tiers=n_tiers, level=min(max(level, 0), n_tiers - 1),
                                      windows={t: [r] for t, r in enumerate(measured)})
        return cls(config, state)

    @property
    def level(self) -> int:
        return self.state.level

    def band(self) -> list[int]:
        """The level and its open neighbours."""
        lv = self.state.level
        return [t for t in (self._next_open(lv, -1), lv, self._next_open(lv, 1)) if t is not None]

    def _next_open(self, tier: int, step: int) -> int | None:
        t = tier + step
        while 0 <= t < self.state.n_tiers:
            if t not in self.closed:
                return t
            t += step
        return None

    def close(self, tier: int) -> bool:
        """Leave `tier` out of the ladder (see the class docstring); False when no open
        tier is left, so the domain has nothing to give."""
        self.closed.add(tier)
        st = self.state
        if st.level in self.closed:
            # Nearer the middle of the band is more signal (informative_probability is
            # symmetric about 0.5); a tie goes up.
            options = [t for t in (self._next_open(st.level, 1), self._next_open(st.level, -1))
                       if t is not None]
            if not options:
                return False
            st.level = min(options, key=lambda t: abs(self.predicted(t) - 0.5))
            st.groups_since_move = 0
        return True

    def window(self, tier: int) -> list[float]:
        return self.state.windows.get(tier, [])

    def observed_rate(self, tier: int) -> float | None:
        w = self.window(tier)
        return sum(w) / len(w) if w else None

    def predicted(self, tier: int) -> float:
        """The tier's window mean, shrunk towards a prior drawn from the other tiers."""
        w = self.window(tier)
        m = self.config.prior_groups
        return (sum(w) + m * self._prior(tier)) / (len(w) + m)

    def _prior(self, tier: int) -> float:
        """Extrapolate from the nearest other observed tier (`tier_step` per tier harder)."""
        cfg = self.config
        others = [t for t in range(self.state.n_tiers) if t != tier and self.window(t)]
        if not others:
            return cfg.prior_pass_rate
        near = min(others, key=lambda t: (abs(t - tier), t))
        guess = self.observed_rate(near) - cfg.tier_step * (tier - near)  # type: ignore[operator]
        return min(0.98, max(0.02, guess))

    def choose_tier(self, rng: random.Random, group_size: int) -> int:
        tier = self.state.level
        neighbours = [t for t in self.band() if t != tier]
        if neighbours and rng.random() < self.config.explore:
            weights = [informative_probability(self.predicted(t), group_size) + 0.05
                       for t in neighbours]
            tier = rng.choices(neighbours, weights=weights, k=1)[0]
        return tier

    def issued(self, tier: int) -> None:
        """Count a task issued at `tier` (its own tier, which `tier_mix` reports)."""
        self.state.issued_by_tier[tier] = self.state.issued_by_tier.get(tier, 0) + 1

    def record(self, tier: int, pass_rate: float) -> int:
        """Add one group's pass rate; return the move made (+1, -1 or 0)."""
        if not 0 <= tier < self.state.n_tiers:
            raise ValueError(f"tier {tier} outside 0..{self.state.n_tiers - 1}")
        w = self.state.windows.setdefault(tier, [])
        w.append(min(1.0, max(0.0, pass_rate)))
        del w[: max(0, len(w) - self.config.window_groups)]
        if tier != self.state.level:
            return 0
        self.state.groups_since_move += 1
        return self._adapt()

    def _adapt(self) -> int:
        cfg, st = self.config, self.state
        if st.groups_since_move < cfg.min_groups:
            return 0
        w = self.window(st.level)
        rate = sum(w) / len(w)
        move = 0
        if rate > cfg.promote_above:
            move = 1
        elif rate < cfg.demote_below:
            move = -1
        to = self._next_open(st.level, move) if move else None
        if to is None:
            return 0
        st.level = to
        st.groups_since_move = 0
        st.moves += 1
        return move

    def tier_mix(self) -> dict[int, float]:
        """Fraction of issued tasks per tier so far."""
        total = sum(self.state.issued_by_tier.values())
        return {t: n / total for t, n in sorted(self.state.issued_by_tier.items())} if total else {}


# ----------------------------------------------------------------------------- recurring tasks


class TaskRecord(msgspec.Struct, kw_only=True, array_like=True):
    passes: float = 0.0
    fails: float = 0.0


def pick_recurring_task(
    candidates: list[str],
    records: Mapping[str, TaskRecord],
    rng: random.Random,
    group_size: int,
    *,
    floor: float = 0.05,
) -> str:
    """Pick a recurring task where the signal is: weight each candidate by
    `informative_probability` of its Beta(1 + passes, 1 + fails) posterior mean, plus
    `floor` so mastered and hopeless tasks still come back now and then (forgetting checks)."""
    if not candidates:
        raise ValueError("pick_recurring_task: no candidate tasks")
    weights = []
    for tid in candidates:
        r = records.get(tid) or TaskRecord()
        mean = (1.0 + r.passes) / (2.0 + r.passes + r.fails)
        weights.append(informative_probability(mean, group_size) + floor)
    return rng.choices(candidates, weights=weights, k=1)[0]


# ----------------------------------------------------------------------------- mixing


def mix_probabilities(
    weights: Mapping[str, float],
    *,
    eligible: set[str] | None = None,
    floors: Mapping[str, float] | None = None,
    boosts: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Sampling probability of each eligible domain.

    p_d = w_d * boost_d (a factor per domain: the scheduler's is its regression boost times
    its floored signal rate), normalised over eligible domains with w_d > 0; then each critical
    domain d with a floor f_d (replay of critical domains) gets max(p_d, f_d) and the
    others are scaled down to make room. Floors of ineligible domains are ignored.
    """
    eligible = set(weights) if eligible is None else set(eligible) & set(weights)
    floors = {d: f for d, f in (floors or {}).items() if d in eligible and f > 0}
    boosts = boosts or {}
    raw = {d: max(0.0, weights[d]) * boosts.get(d, 1.0) for d in eligible}
    raw = {d: v for d, v in raw.items() if v > 0 or d in floors}
    if not raw:
        return {}
    if sum(floors.values()) > 1.0 + 1e-9:
        raise ValueError(f"replay floors add up to more than 1: {dict(floors)}")
    pinned: set[str] = set()  # water-filling: domains held at their floor
    while True:
        room = 1.0 - sum(floors[d] for d in pinned)
        free = {d: v for d, v in raw.items() if d not in pinned}
        free_total = sum(free.values())
        p = {d: floors[d] for d in pinned}
        p.update({d: (v / free_total * room if free_total > 0 else 0.0) for d, v in free.items()})
        under = {d for d in floors if d not in pinned and p[d] < floors[d]}
        if not under:
            break
        pinned |= under
    total = sum(p.values())
    return {d: v / total for d, v in p.items()} if total > 0 else {}


class DomainDraw:
    """Draws a domain by fixed probabilities: names sorted and cumulative weights made once,
    so each draw is one bisection (a scheduler plans a batch from one of these, not one
    sort of every domain per task). The same rng gives the same domain as
    `rng.choices(sorted names, weights)`."""

    def __init__(self, probabilities: Mapping[str, float]) -> None:
        if not probabilities:
            raise ValueError("draw_domain: no eligible domain")
        self.names = sorted(probabilities)
        self.cum_weights = list(itertools.accumulate(probabilities[d] for d in self.names))

    def __call__(self, rng: random.Random) -> str:
        return rng.choices(self.names, cum_weights=self.cum_weights, k=1)[0]


def draw_domain(probabilities: Mapping[str, float], rng: random.Random) -> str:
    return DomainDraw(probabilities)(rng)


# ----------------------------------------------------------------------------- flow control


def issue_budget(
    *,
    in_flight: int,
    max_in_flight: int,
    groups_per_version: int,
    max_staleness: int,
    queued: float,
    expected_in_flight: float | None = None,
    signal_rate: float = 1.0,
) -> int:
    """How many new tasks may be issued now.

    The learner turns about `groups_per_version` groups into one new policy version. A group
    issued now must be trained on within `max_staleness` versions, so at most
    `groups_per_version * (max_staleness + 1)` groups the learner will train on may be ahead
    of it: those expected from the tasks in flight plus `queued`, those complete and not yet
    trained (the learner's decisions say which). A group without signal (all rewards equal)
    never reaches the learner, so a task counts by its chance of carrying signal:
    `expected_in_flight` (default: every task counts 1) and `signal_rate` for a new task. At
    8 % signal, counting every task as 1 would keep 6 tasks in flight for a learner that
    wants 2 groups: half a group of signal ahead of it. The budget is never more than
    `max_in_flight - in_flight`.
    """
    if not 0.0 < signal_rate <= 1.0:
        raise ValueError(f"issue_budget: signal_rate must be in (0, 1], got {signal_rate}")
    expected = float(in_flight) if expected_in_flight is None else expected_in_flight
    room = groups_per_version * (max_staleness + 1) - queued - expected
    by_learner = math.ceil(room / signal_rate - 1e-9) if room > 0 else 0
    return max(0, min(max_in_flight - in_flight, by_learner))


def floored_signal_rate(rate: float, floor: float) -> float:
    return min(1.0, max(floor, rate))


def new_task_signal_rate(probs: Mapping[str, float], rates: Mapping[str, float], *,
                         floor: float) -> float:
    """The chance that a task drawn by the mix `probs` carries signal: each domain's rate,
    floored at `floor` (a domain that never shows signal still counts), capped at 1."""
    rate = sum(p * floored_signal_rate(rates[d], floor) for d, p in probs.items())
    return min(1.0, rate) or 1.0


SIGNAL_PRIOR_GROUPS = 2.0
"""How many groups a domain's prior signal rate weighs as. The old rule, a moving average
from 0.5 that moved 5 % a group, needed about 30 groups to learn a hopeless domain was one:
in an 86-domain suite that was most of a run's samples (3,170 groups)."""


def prior_signal_rate(start_pass_rates: Sequence[float], level: int, group_size: int,
                      samples: Sequence[int] = ()) -> float:
    """A domain's rate of groups with signal before any is judged: `informative_probability`
    of the starting policy's pass rate at its curriculum's level, if measured, else 0.5.
    With `samples` (how many samples measured each rate) a rate is read as its Jeffreys
    estimate, (passes + 1/2) / (samples + 1): no pass in 4 samples (a short demo's
    evaluation) leaves a pass rate of 0.1 likely, no pass in 32 one of 0.015. A family
    that scores wrong answers a little shows signal at a pass rate of 0 too, and its first
    informative groups lift the rate at once (`updated_signal_rate`)."""
    if not 0 <= level < len(start_pass_rates):
        return 0.5
    rate = start_pass_rates[level]
    if level < len(samples) and samples[level] > 0:
        rate = (rate * samples[level] + 0.5) / (samples[level] + 1)
    return informative_probability(rate, group_size)


def updated_signal_rate(rate: float, informative: bool, *, judged: int | None = None,
                        prior_groups: float = SIGNAL_PRIOR_GROUPS,
                        weight: float = 0.05) -> float:
    """A domain's rate of groups with signal after one more verdict. With `judged`, the
    verdicts before this one: the posterior mean of `prior_groups` pseudo-groups at the
    prior rate and every verdict so far, until that would weigh a new verdict less than
    `weight`; from then on, as without `judged`, a moving average (recent groups weigh more:
    the curriculum moves the tiers under it)."""
    step = weight if judged is None else max(weight, 1.0 / (prior_groups + judged + 1))
    return rate + step * ((1.0 if informative else 0.0) - rate)


class RunningStats(msgspec.Struct, kw_only=True, array_like=True):
    """Count, mean and M2 of a stream (Welford): per-domain reward normalisation inputs."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        delta = x - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count > 1 else 0.0
