"""The evaluator actor: held-out pass@1 / pass@k per domain for each new policy version, and
the regression guard that rolls a bad version back.

    learner --WeightsPublished(version, path)--> evaluator --EvalStats--> stats.evaluator (core)
                                                     |                    stats.eval (durable)
                                                     +--Rollback(to_version, path)--> weights

* Held-out sets: `evalsets.build_heldout` (the scheduler excludes the same tasks from
  training). At start the evaluator runs the n-gram contamination check against the
  training files and every training task already stored in the run's stream, and refuses
  to start (ContaminationError) when they overlap.
* Scoring: `samples` completions per task (n in one /generate request); pass@1 is the mean
  correctness over all samples, pass@k the unbiased estimator (Chen et al. 2021); the
  per-run pass rates (run j = the j-th sample of every task) and their spread are the
  multi-run stability figures. Samples whose verification hit an infrastructure fault are
  masked, never counted as failures. `answer_mode_share` is how often the most common
  final answer was given, and `answer_prior` scores the constant answer (each tier's most
  common reference) on the same tasks: a policy collapsed onto the answer prior shows as
  a share near 1 and a pass@1 no better than the constant's.
* Regression guard: a version with a domain below its `thresholds` entry, or whose pass@1
  fell against that domain's baseline (its scores at the last good version that evaluated
  it) by more than `drop_margin` with a one-sided exact test on the shared tasks'
  samples, stratified by task (`scoring.drop_test`), at p < `drop_alpha` (a test on
  counts, not a threshold on noisy pass rates), triggers a
  `Rollback` to the last good version (msg_id f"rollback:{to}:{bad}"); it is said loudly on
  stderr. Without a good version to go back to, it says so and publishes nothing. Given
  `start_scores` (an evaluation of the starting model), a domain not yet scored at a good
  version is judged against the start, and every domain against the start as well as its
  baseline: a slow slide, no step of it significant, still adds up to a fall from the
  start. At start the evaluator says which domains its test cannot flag at all: too few
  tasks and samples to reach `drop_alpha`. With `falls_before_rollback` > 1 a fall must be
  found that many checks in a row (the domain is checked at every version meanwhile, and
  the version is not a good one): a fall the next check no longer finds costs nothing.
* Over-optimisation: in a domain whose verdicts carry a `gold` check (a rule its learned
  reward only approximates), a version whose mean reward rose while its gold pass rate fell
  against the domain's gold peak (the good version with the best gold so far; the same sign
  test, at p < `gold_alpha`) is rolled back to that peak: the policy learnt to please the
  reward model, not the rule. Against the peak, not the last good version: over-optimising
  is a slow slide, each step too small to be significant against the one before it.
  `reward_mean` and `gold_pass_rate` are in each EvalStats' figures, so the report shows
  proxy against gold.
* Many domains: `domains_per_version` evaluates that many per version, in two fixed
  rotations: the domains that can fall (unscored, or passing something at their baseline
  or at the start) take most of the slots, those that passed nothing (they cannot fall) a
  `zero_share` of them. Each domain is seen within ceil(n / slots) evaluated versions of
  its group; a hundred procedural families mostly start at zero, and the guard's samples go
  where a fall can happen. A domain a rollback was for is evaluated at every version
  after it (`watched`): what fell once can fall again before its turn comes round.
* Paired draws: every evaluation samples task t with the seed `task_seed(sampling_seed, t)`
  (the server draws sample j from its own generator, seeded that plus j, by inverse CDF), so
  two checkpoints evaluated with one seed meet the same random numbers (common random
  numbers). Where the policy did not change, their samples are the same; where it changed a
  little, most still are. Once a sample's tokens part, the rest of it draws apart: after a
  run's training most of the sampling noise is back (`bench/eval_noise.py --versus`).
* Generation: the evaluator's own rollout server (`server_url`, or one it starts on the
  first version it sees), loaded with each version through /update_weights_from_disk.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec
import trio
from reinforge.rl.evalsets import (
    ContaminationChecker,
    HeldOutConfig,
    build_heldout,
    exact_only_ids,
    modal_references,
    require_clean,
)
from reinforge.rl.episodes import domain_tools, run_episode
from reinforge.rl.prompts import task_prompt_ids
from reinforge.rl.scoring import (
    DomainScore,
    answer_signature,
    drop_test,
    mean_or_none,
    paired_delta,
    score_domain,
    smallest_drop_p,
)
from reinforge.core import paths, policy_version, subjects
from reinforge.core.policy_version import PolicyVersion
from reinforge.core.actor import Actor, Input
from reinforge.core.atomic import write_json_atomic
from reinforge.core.weights import (
    FetchStats,
    WeightsUnavailable,
    fetched_weights_dir,
    local_weights,
)
from reinforge.core.messages import (
    EvalStats,
    KeepVersions,
    Rollback,
    Task,
    WeightsPublished,
    decode,
)
from reinforge.engine.tokenizer import load_tokenizer
from reinforge.envs.domain import TaskSpec, gold_of
from reinforge.envs.tools import episode_counts, policy_turns


class EvaluatorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    domains: list[str] = msgspec.field(default_factory=lambda: ["math"])
    """Domains to evaluate, by name or glob (`gym-*`)."""
    k: int = 4
    """pass@k's k."""
    samples: int = 0
    """Completions per task (0: k); must be >= k."""
    domain_samples: dict[str, int] = {}
    """Completions per task of these domains instead of `samples` (each >= k): more where a
    fall must be seen on few tasks. Their baselines in `start_scores` should be counted
    the same way: the test on the counts weighs every sample of both sides."""
    heldout: HeldOutConfig = HeldOutConfig()
    """The held-out sets; `[run]` (the scheduler never trains on them)."""
    score_per_tier: int = 0
    """Score at most this many of each tier's held-out tasks, the first ones after
    `skip_per_tier` (0: all the rest): a cheaper guard on a subset of the run's held-out
    sets."""
    skip_per_tier: int = 0
    """Leave each tier's first this many held-out tasks unscored: those a final evaluation
    reports, so that the guard's choices (what to roll back) are made on other tasks than
    the figures the run is judged by (a validation slice apart from the test slice). A
    tier holding fewer than `heldout.tasks_per_tier` (a small bank) splits what it holds
    in the same proportions (`first_per_tier`)."""
    thresholds: dict[str, float] = {}
    """Minimum pass@1 per domain; below it, the version is rolled back."""
    drop_alpha: float = 0.01
    """A fall of pass@1 against the domain's baseline counts when the exact test on the
    shared held-out tasks' samples (`scoring.drop_test`) gives p below this (0: no such
    guard). Too few tasks and samples cannot reach it: the evaluator says so at start."""
    drop_margin: float = 0.05
    """... and the mean fall is larger than this."""
    reward_model: str | list[str] = ""
    """A reward model directory, or an ensemble's: rm-synthetic is scored with it (as the
    verifier's `reward_model`)."""
    reward_model_spread_penalty: float = 1.0
    gold_alpha: float = 0.05
    """Domains with a gold check: a version whose reward rose while its gold pass rate fell
    against the baseline (sign test p below this, a fall larger than `drop_margin`) is
    rolled back (0: no such guard)."""
    max_rollbacks_per_domain: int = 2
    """Rollbacks a domain's falls may cause (0: no limit). A fall the training reaches again
    from the version rolled back to is what this training does: rolling back once more only
    repeats it (one suite run went back to v75 six times for one fall, and made nothing
    after v113). Past the limit the domain's fall is said and the version kept."""
    falls_before_rollback: int = 1
    """Checks in a row that must find a domain's fall before it causes a rollback; one that
    finds a fall and not yet this many keeps the version from being the last good one and
    checks the domain again at the next evaluated version. A policy whose answers collapsed
    to one per family flips them back and forth while it trains: in one 86-family run a
    fall (count_bits, 4 tasks worse, p = 0.04) caused two rollbacks and was a gain of
    0.156 by the end."""
    domains_per_version: int = 0
    """Domains evaluated per version, in rotation (0: every domain every time)."""
    zero_share: float = 0.2
    """Of `domains_per_version`, the share (at least one, never all) kept for the domains
    that passed nothing at their baseline nor at the start: they cannot fall, so the rest
    goes to those that can. Slots a group cannot fill go to the other (0: the zero domains
    are seen only then)."""
    every_versions: int = 1
    """Evaluate versions that are multiples of this."""
    server_url: str = ""
    """A rollout server for the evaluator alone; "" = start one on the first version."""
    model_path: str = ""
    """The run's starting model: the evaluator's server starts from it and each version is
    then loaded into it, so no version can be pruned while the server starts ("" = start
    from the first version scored)."""
    server_args: list[str] = []
    server_start_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    max_new_tokens: int = 128
    eval_temperature: float = 1.0
    """The evaluator's own sampling temperature (not the run's: greedy evaluation is 0)."""
    sampling_seed: int | None = 0
    """Each task's samples are drawn with `task_seed(sampling_seed, task_id)`, as `reinforge
    eval --sampling-seed` draws them, so versions and the start compare on the same draws
    (None: the server's shared RNG, fresh draws every time). SGLang honours a seed only under
    `--enable-deterministic-inference`, and there gives one sample n times: on SGLang leave
    that flag off (the seed is then ignored) or set None."""
    top_p: float = 1.0
    chat_template: bool = True
    """Wrap prompts in the tokenizer's chat template, as the sampler does."""
    concurrency: int = 4
    """Tasks being generated and verified at once."""
    train_files: dict[str, str] = {}
    """domain -> training JSONL, checked for overlap with the held-out sets."""
    check_issued_tasks: bool = True
    """Also check the training tasks already stored in the run's stream."""
    contamination_n: int = 13
    contamination_min_overlap: float = 0.5
    sandbox_pool_size: int = 2
    ack_wait_s: float = 3600.0
    """How long one version's evaluation may take before the message is redelivered."""
    state_file: str = ""
    """Default: <run_dir>/evaluator_state.json."""
    start_scores: str = ""
    """A `reinforge eval --json` of `model_path` on these held-out sets (the demo's evaluation
    before training): each domain's baseline until the evaluator has scored it at a good
    version, so its first evaluation is judged against the start ("" = none: a domain's
    first evaluation has nothing to fall from)."""

    def __post_init__(self) -> None:
        n = self.samples or self.k
        if self.k < 1 or n < self.k:
            raise ValueError(f"EvaluatorConfig: need 1 <= k <= samples, got k={self.k}, "
                             f"samples={n}")
        if few := {d: c for d, c in self.domain_samples.items() if c < self.k}:
            raise ValueError(f"EvaluatorConfig.domain_samples: need each >= k={self.k}, "
                             f"got {few}")
        if self.every_versions < 1 or self.concurrency < 1 or self.skip_per_tier < 0 or \
                self.max_rollbacks_per_domain < 0 or self.falls_before_rollback < 1:
            raise ValueError("EvaluatorConfig: every_versions, concurrency and "
                             "falls_before_rollback must be >= 1, skip_per_tier and "
                             "max_rollbacks_per_domain >= 0")
        if not (0.0 <= self.drop_alpha < 1.0 and 0.0 <= self.gold_alpha < 1.0) or \
                self.drop_margin < 0 or self.domains_per_version < 0 or \
                not 0.0 <= self.zero_share <= 1.0:
            raise ValueError("EvaluatorConfig: need 0 <= drop_alpha < 1, 0 <= gold_alpha < 1, "
                             "drop_margin >= 0, domains_per_version >= 0 and "
                             "0 <= zero_share <= 1")
        if self.reward_model_spread_penalty < 0:
            raise ValueError("EvaluatorConfig.reward_model_spread_penalty must be >= 0, got "
                             f"{self.reward_model_spread_penalty}")

    def samples_for(self, domain: str) -> int:
        """Completions per task of `domain`: its `domain_samples`, else `samples` (0: k)."""
        return self.domain_samples.get(domain, self.samples or self.k)


# ----------------------------------------------------------------------------- scoring


def first_per_tier(sets: Mapping[str, Sequence[TaskSpec]], n: int, skip: int = 0,
                   held: int = 0) -> dict[str, list[TaskSpec]]:
    """Each domain's first `n` tasks of every tier after its first `skip`, in order (n = 0:
    all the rest). `held`: the tasks a tier the run held out; a tier holding fewer (a small
    bank) gives each slice its share of what it holds, rounded up and at least 2 for the
    first slice (a change on one task has no interval), so a guard scoring the tasks after
    the reported ones still has some: n_queens held 10 of 32, 5 reported and 5 guarded."""
    counts = {d: Counter(t.tier for t in tasks) for d, tasks in sets.items()}
    out: dict[str, list[TaskSpec]] = {}
    for domain, tasks in sets.items():
        seen: dict[int, int] = {}
        out[domain] = []
        for task in tasks:
            i = seen[task.tier] = seen.get(task.tier, 0) + 1
            cut = share_of(counts[domain][task.tier], held)
            if cut(skip) < i and (not n or i <= cut(skip + n)):
                out[domain].append(task)
    return out


def share_of(m: int, held: int) -> Callable[[int], int]:
    """Where the `b` first of `held` tasks end in a tier holding `m` (`first_per_tier`)."""
    if m >= held:
        return lambda b: b
    return lambda b: 0 if b <= 0 else min(m, max(2, -(-b * m // held)))


class VersionGone(Exception):
    """The checkpoint of a version to evaluate was deleted before the evaluator got to it."""


class CompletionSource(Protocol):
    async def complete(self, task: TaskSpec, n: int, domain: Any) -> list[str]:
        """`n` completions of `task`; for a multi-turn `domain`, `n` episodes' transcripts."""
        ...


async def evaluate_sets(
    sets: Mapping[str, Sequence[TaskSpec]],
    domains: Mapping[str, Any],
    source: CompletionSource,
    *,
    samples: int,
    k: int,
    concurrency: int = 4,
    samples_by_domain: Mapping[str, int] | None = None,
) -> dict[str, DomainScore]:
    """Generate `samples` completions per task (a domain in `samples_by_domain`: its own
    count), verify each with its domain, score.

    A task the server refuses (4xx: e.g. its prompt is longer than the model's context)
    counts as its samples' failures and is reported in `rejected_tasks`."""
    from reinforge.rollout.client import RolloutRequestError
    from reinforge.core.bus import collapse_single_exception

    limiter = trio.CapacityLimiter(concurrency)
    results: dict[str, list[list[bool | None]]] = {d: [[] for _ in ts] for d, ts in sets.items()}
    rewards: dict[str, list[list[float]]] = {d: [[] for _ in ts] for d, ts in sets.items()}
    golds: dict[str, list[list[bool]]] = {d: [[] for _ in ts] for d, ts in sets.items()}
    answers: dict[str, list[str]] = {d: [] for d in sets}
    rejected: dict[str, int] = dict.fromkeys(sets, 0)
    episodes: dict[str, list[tuple[int, int, int]]] = {d: [] for d in sets}

    async def one(name: str, i: int, task: TaskSpec) -> None:
        n = (samples_by_domain or {}).get(name, samples)
        async with limiter:
            try:
                completions = await source.complete(task, n, domains[name])
            except RolloutRequestError:
                rejected[name] += 1
                results[name][i] = [False] * n
                return
            tools = domain_tools(domains[name])
            if tools:
                episodes[name] += [episode_counts(text, tools) for text in completions]
            row: list[bool | None] = []
            for text in completions:
                verdict = await domains[name].verify(task, text)
                row.append(None if verdict.outcome == "infra_error" else verdict.outcome == "pass")
                if verdict.outcome != "infra_error":
                    rewards[name][i].append(verdict.reward)
                    if (gold := gold_of(verdict)) is not None:
                        golds[name][i].append(gold)
                    said = policy_turns(text)[-1:] if tools else [text]  # a final turn
                    answers[name].append(answer_signature(said[0] if said else ""))
            results[name][i] = row

    with collapse_single_exception():
        async with trio.open_nursery() as nursery:
            for name, tasks in sets.items():
                for i, task in enumerate(tasks):
                    nursery.start_soon(one, name, i, task)
    return {name: with_episode_figures(
                score_domain(name, rows, k, rejected_tasks=rejected[name],
                             task_ids=[t.task_id for t in sets[name]], answers=answers[name],
                             rewards=rewards[name], golds=golds[name]),
                episodes[name])
            for name, rows in results.items()}


def with_episode_figures(score: DomainScore, counts: list[tuple[int, int, int]]) -> DomainScore:
    """The score with its tool episodes' turns per episode and malformed-call rate."""
    if not counts:
        return score
    calls = sum(c + e for _, c, e in counts)
    return msgspec.structs.replace(
        score, turns_mean=sum(t for t, _, _ in counts) / len(counts),
        tool_call_error_rate=sum(e for _, _, e in counts) / calls if calls else 0.0)


async def answer_prior(
    sets: Mapping[str, Sequence[TaskSpec]], domains: Mapping[str, Any], *, draws: int = 64,
) -> dict[str, dict[str, float]]:
    """Each held-out task's pass with a constant answer, by domain: the most common reference
    of the task's tier (`evalsets.modal_references`), whatever the task asks. What a policy
    collapsed onto the answer prior scores, so a gain that does not beat it is no skill.
    Domains that verify in a sandbox are left out (one program for every task would cost
    a sandbox run per task to learn that it fails)."""
    out: dict[str, dict[str, float]] = {}
    for name, tasks in sets.items():
        domain = domains[name]
        if domain.resource == "sandbox":
            continue
        modal = modal_references(domain, sorted({t.tier for t in tasks}), draws=draws)
        scores: dict[str, float] = {}
        for task in tasks:
            if task.tier in modal:
                verdict = await domain.verify(task, modal[task.tier])
                scores[task.task_id] = 1.0 if verdict.outcome == "pass" else 0.0
        if scores:
            out[name] = scores
    return out


# ----------------------------------------------------------------------------- the guard


class GoodVersion(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    path: str


class StartScore(msgspec.Struct, kw_only=True):
    task_pass_at_1: dict[str, float]
    task_counts: dict[str, tuple[int, int]] = {}


class StartScores(msgspec.Struct, kw_only=True):
    """What `start_baselines` reads of a `reinforge eval --json` result."""

    domains: dict[str, StartScore]


class Baseline(msgspec.Struct, frozen=True, kw_only=True):
    """A domain's per-task pass@1 (and mean reward and gold pass rate) at a good version
    that evaluated it: the last one, or (a gold peak) the one with the best gold."""

    version: int
    task_pass_at_1: dict[str, float]
    task_counts: dict[str, tuple[int, int]] = {}
    """(passed, verified) samples per task ({} in a state file written before they were
    kept: the drop test then falls back to the sign test)."""
    task_reward: dict[str, float] = {}
    task_gold: dict[str, float] = {}
    path: str = ""

    @classmethod
    def of(cls, version: int, score: DomainScore, path: str = "") -> Baseline:
        return cls(version=version, task_pass_at_1=score.task_pass_at_1,
                   task_counts=score.task_counts, task_reward=score.task_reward,
                   task_gold=score.task_gold, path=path)

    def gold(self) -> float:
        return mean_or_none(self.task_gold.values()) or 0.0


def regression_rollback(
    version: int,
    scores: Mapping[str, DomainScore],
    thresholds: Mapping[str, float],
    last_good: GoodVersion | None,
    *,
    baselines: Mapping[str, Baseline] | None = None,
    starts: Mapping[str, Baseline] | None = None,
    drop_alpha: float = 0.0,
    drop_margin: float = 0.0,
    gold_peaks: Mapping[str, Baseline] | None = None,
    gold_alpha: float = 0.0,
    epoch: int = 0,
    spent: Collection[str] = (),
) -> tuple[list[str], Rollback | None]:
    """(domains that regressed, the Rollback to publish or None). A domain regresses when
    it is below its threshold, or (with `drop_alpha` > 0) its pass@1 fell against its
    baseline, or its start (`starts`: a slow slide, no step of it significant, still adds up
    to a fall from the start), by more than `drop_margin` with the test on the counts
    (`drop_test`) at p < `drop_alpha`, or (with `gold_alpha` > 0, in a domain with a gold
    peak) its mean reward rose while its gold pass rate fell against the peak by more than
    `drop_margin`, sign test on the tasks p < `gold_alpha`: over-optimised, and the
    rollback goes back to the peak if it is older than the last good version.

    A domain without verified tasks is not judged. No rollback without a good version older
    than this one, nor for domains `spent` alone (those past `max_rollbacks_per_domain`)."""
    why: dict[str, str] = {}
    for d, s in scores.items():
        if s.n_tasks == 0:
            continue
        if d in thresholds and s.pass_at_1 < thresholds[d]:
            why[d] = f"{d} pass@1 {s.pass_at_1:.3f} < {thresholds[d]:.3f}"
        for base in ((baselines or {}).get(d), (starts or {}).get(d)):
            if not drop_alpha or base is None or base.version >= version or d in why:
                continue
            t = drop_test(base.task_pass_at_1, s.task_pass_at_1, base.task_counts,
                          s.task_counts)
            if t.p_value < drop_alpha and t.delta < -drop_margin:
                why[d] = (f"{d} pass@1 fell {-t.delta:.3f} since v{base.version} on "
                          f"{t.n_tasks} tasks ({t.worse} worse, {t.better} better; test on "
                          f"the counts p={t.p_value:.2g})")
        peak = (gold_peaks or {}).get(d)
        if gold_alpha and peak is not None and peak.version < version and d not in why:
            g = drop_test(peak.task_gold, s.task_gold)
            proxy = paired_delta(peak.task_reward, s.task_reward)
            if g.p_value < gold_alpha and g.delta < -drop_margin and proxy > 0:
                why[d] = (f"{d} over-optimised: its reward rose {proxy:+.3f} while its gold "
                          f"pass rate fell {-g.delta:.3f} since its gold peak v{peak.version} "
                          f"on {g.n_tasks} tasks ({g.worse} worse, {g.better} better; sign "
                          f"test p={g.p_value:.2g})")
                if last_good is not None and peak.path and peak.version < last_good.version:
                    last_good = GoodVersion(version=peak.version, path=peak.path)
    flagged = sorted(why)
    if set(flagged) <= set(spent) or last_good is None or last_good.version >= version:
        return flagged, None
    return flagged, Rollback(
        to_version=last_good.version, path=last_good.path,
        reason=f"version {version} regressed: {', '.join(why[d] for d in flagged)}",
        from_epoch=epoch,
    )


def falls_waiting(seen: Mapping[str, int], scores: Mapping[str, DomainScore],
                  fell: Collection[str], spent: Collection[str],
                  needed: int) -> tuple[list[str], dict[str, int]]:
    """(the domains whose fall waits for more checks before a rollback, the checks in a row
    that found each fall so far). A domain scored on verified tasks without a fall starts
    its count again (one without any was not judged); one that fell waits while this check
    and those before it number fewer than `needed` (a spent domain never causes a rollback
    anyway)."""
    checked = {d for d, s in scores.items() if s.n_tasks}
    counts = {d: n for d, n in seen.items() if d not in checked or d in fell}
    waiting = [d for d in fell if d not in spent and counts.get(d, 0) + 1 < needed]
    for d in waiting:
        counts[d] = counts.get(d, 0) + 1
    return waiting, counts


def spent_domains(rollbacks_for: Mapping[str, int], limit: int) -> set[str]:
    """The domains whose falls may cause no more rollbacks: `limit` of them already (0: no
    limit)."""
    return {d for d, n in rollbacks_for.items() if limit and n >= limit}


def epoch_tag(msg: WeightsPublished) -> str:
    """What tells apart the messages about two versions of one number (the learner reuses
    the numbers past a rollback): "" in the first epoch, so ids stay as they were."""
    return f":e{msg.epoch}" if msg.epoch else ""


def gold_peaks_after(peaks: Mapping[str, Baseline], good: WeightsPublished,
                     scores: Mapping[str, DomainScore]) -> dict[str, Baseline]:
    """The gold peaks once `good` (a version that passed the guard) scored `scores`: a
    domain's peak moves to it when its gold pass rate is at least the peak's."""
    out = dict(peaks)
    for d, s in scores.items():
        if s.gold_pass_rate is not None and (d not in out or s.gold_pass_rate >= out[d].gold()):
            out[d] = Baseline.of(good.version, s, good.path)
    return out


def start_baselines(path: Path, sets: Mapping[str, Sequence[TaskSpec]]) -> dict[str, Baseline]:
    """Version-0 baselines from a `reinforge eval --json` of the starting model: each domain's
    per-task pass@1 and counts on the tasks the evaluator scores (`sets`)."""
    try:
        evaluation = msgspec.json.decode(path.read_bytes(), type=StartScores)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"EvaluatorConfig.start_scores {path}: not a `reinforge eval --json` "
                         f"result ({exc})") from None
    out = {}
    for d, tasks in sets.items():
        if (score := evaluation.domains.get(d)) is None:
            continue
        ids = {t.task_id for t in tasks} & set(score.task_pass_at_1)
        if ids:
            out[d] = Baseline(version=0,
                              task_pass_at_1={t: score.task_pass_at_1[t] for t in ids},
                              task_counts={t: score.task_counts[t] for t in ids
                                           if t in score.task_counts})
    return out


def drop_guard_blind(sets: Mapping[str, Sequence[TaskSpec]], cfg: EvaluatorConfig) -> str:
    """What to say when the drop test cannot reach `drop_alpha` on some domains' scored
    tasks and samples (`scoring.smallest_drop_p`), "" when it can on all of them."""
    if not cfg.drop_alpha:
        return ""
    blind = sorted(d for d, tasks in sets.items()
                   if smallest_drop_p(len(tasks), cfg.samples_for(d)) >= cfg.drop_alpha)
    if not blind:
        return ""
    fewest = min(blind, key=lambda d: (len(sets[d]), cfg.samples_for(d)))
    n_tasks, n_samples = len(sets[fewest]), cfg.samples_for(fewest)
    return (f"the drop guard cannot flag {', '.join(blind)}: on {n_tasks} task(s) of "
            f"{n_samples} sample(s) its test gives p >= "
            f"{smallest_drop_p(n_tasks, n_samples):.2g}, never below drop_alpha "
            f"{cfg.drop_alpha:g}, however far pass@1 falls; score more tasks "
            "(score_per_tier) or samples")


def rotation(names: Sequence[str], start: int, per_version: int) -> list[str]:
    """The `per_version` domains after `start` in a fixed order, wrapping (0: all)."""
    if not per_version or per_version >= len(names):
        return list(names)
    return [names[(start + i) % len(names)] for i in range(per_version)]


def at_stake(names: Sequence[str], baselines: Mapping[str, Baseline],
             starts: Mapping[str, Baseline] | None = None) -> tuple[list[str], list[str]]:
    """(the domains that can fall: not scored yet, or passing some sample at their baseline
    or at the start (`starts`: a fall from it is a fall too); those that passed nothing at
    either), each in `names`' order."""
    def passed(scores: Mapping[str, Baseline], d: str) -> bool:
        return d in scores and any(scores[d].task_pass_at_1.values())

    starts = starts or {}
    stake = [d for d in names if (d not in baselines and d not in starts)
             or passed(baselines, d) or passed(starts, d)]
    return stake, [d for d in names if d not in stake]


def guard_picks(names: Sequence[str], baselines: Mapping[str, Baseline],
                positions: tuple[int, int], per_version: int, zero_share: float,
                starts: Mapping[str, Baseline] | None = None) -> tuple[list[str], list[str]]:
    """This version's (domains that can fall, domains at zero: `at_stake`), two rotations
    from `positions`. The zero domains get `zero_share` of `per_version` (at least one while
    there are any, never all while some domain can fall); each group's unfilled slots go to
    the other. Every domain that can fall is seen within ceil(n_stake / its slots) evaluated
    versions, every zero domain within ceil(n_zero / its slots) (0 domains_per_version:
    every domain, every version)."""
    stake, zero = at_stake(names, baselines, starts)
    if not per_version or per_version >= len(names):
        return stake, zero
    n_zero = min(len(zero), max(1, round(per_version * zero_share))) if zero_share else 0
    if stake:  # never every slot while some domain can fall
        n_zero = min(n_zero, per_version - 1)
    n_zero = max(n_zero, per_version - len(stake))  # what the domains at stake leave over
    return (rotation(stake, positions[0], per_version - n_zero) if per_version > n_zero else [],
            rotation(zero, positions[1], n_zero) if n_zero else [])


def with_watched(picks: Sequence[str], watched: Sequence[str]) -> list[str]:
    """This version's domains: the rotations' picks, then every watched domain (one a
    rollback was for) not among them. A domain that fell once can fall again after the
    rollback, sooner than its turn in the rotation comes round."""
    return [*picks, *(d for d in watched if d not in picks)]


class EvaluatorState(msgspec.Struct, kw_only=True):
    last_good: GoodVersion | None = None
    baselines: dict[str, Baseline] = {}
    """Per domain, its scores at the last good version that evaluated it."""
    gold_peaks: dict[str, Baseline] = {}
    """Per domain with a gold check, its scores at the good version with the best gold."""
    rotation_start: int = 0
    """Where the next version's rotation of the domains that can fall begins."""
    zero_rotation_start: int = 0
    """... and of the domains that passed nothing at their baseline."""
    evaluated: list[str] = []
    """f"{version}:{path}" of every version scored; a Rollback forgets those past its
    to_version, whose numbers (and paths) the learner reuses for new checkpoints."""
    rolled_back: list[int] = []
    watched: list[str] = []
    """The domains rollbacks were for: evaluated at every version after (`with_watched`)."""
    rollbacks_for: dict[str, int] = {}
    """Per domain, the rollbacks its falls were among the reasons for."""
    falls_seen: dict[str, int] = {}
    """Per domain, the checks in a row that found its fall and did not roll back for it
    yet (`falls_before_rollback`): evaluated at every version until one does not."""


def load_evaluator_state(path: Path) -> EvaluatorState:
    if not path.exists():
        return EvaluatorState()
    try:
        return msgspec.json.decode(path.read_bytes(), type=EvaluatorState)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"evaluator state {path} is unreadable: {exc} (move it away to "
                         "start afresh)") from None


def loud(text: str) -> None:
    bar = "!" * 72
    print(f"{bar}\nevaluator: {text}\n{bar}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- generation


def task_seed(seed: int, task_id: str) -> int:
    """The sampling seed of `task_id`'s samples under evaluation seed `seed`: the same for
    every checkpoint, different across tasks, below 2**31 with room for the sample index the
    server adds."""
    digest = hashlib.blake2b(f"{seed}:{task_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") >> 2


class ServerSource:
    """Completions from a rollout server (SGLang API), prompts as the sampler builds them;
    with a `seed`, each task's samples (each episode's turns) drawn with a seed of their own
    (`task_seed`), the same whichever checkpoint the server holds."""

    def __init__(self, client: Any, tokenizer: Any, *, max_new_tokens: int, temperature: float,
                 top_p: float = 1.0, chat_template: bool = True, seed: int | None = None) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.params = {"max_new_tokens": max_new_tokens, "temperature": temperature,
                       "top_p": top_p}
        self.chat_template = chat_template
        self.seed = seed

    def seeded(self, key: str) -> dict[str, int]:
        return {} if self.seed is None else {"sampling_seed": task_seed(self.seed, key)}

    def prompt_ids(self, prompt: str, tools: Sequence[Any] = ()) -> list[int]:
        return task_prompt_ids(self.tokenizer, prompt, chat_template=self.chat_template,
                               tools=tools)

    async def complete(self, task: TaskSpec, n: int, domain: Any) -> list[str]:
        ids = self.prompt_ids(task.prompt, domain_tools(domain))
        if not getattr(domain, "multi_turn", False):
            samples = await self.client.generate(
                input_ids=ids, sampling_params={**self.params, "n": n,
                                                **self.seeded(task.task_id)})
            return [s.text for s in samples]
        out = [""] * n

        async def play(i: int) -> None:  # an episode, as the sampler runs it
            turn = functools.partial(self._turn, len(ids), f"{task.task_id}#{i}")
            trace = await run_episode(domain, task, ids, tokenizer=self.tokenizer,
                                      generate=turn,
                                      version_of=lambda v: 0, chat_template=self.chat_template)
            out[i] = trace.completion

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(play, i)
        return out

    async def _turn(self, n_prompt: int, episode: str, ids: list[int], stop: list[str]) -> Any:
        from reinforge.rollout.client import RolloutRequestError

        try:  # a turn's seed: its episode's and where the transcript stands
            (s,) = await self.client.generate(
                input_ids=ids, sampling_params={**self.params, "n": 1, "stop": stop,
                                                **self.seeded(f"{episode}@{len(ids)}")})
        except RolloutRequestError:
            if len(ids) == n_prompt:
                raise  # the task's own prompt is refused: counted as rejected
            return None  # the transcript outgrew the context: the episode ends there
        return s


# ----------------------------------------------------------------------------- the actor


class Evaluator(Actor):
    actor_type = "evaluator"
    Config = EvaluatorConfig

    async def setup(self) -> None:
        from reinforge.envs.domain import DomainRegistry

        cfg: EvaluatorConfig = self.config
        self.registry = DomainRegistry.default()
        if cfg.reward_model:
            from reinforge.envs.domains.reward_model import attach_reward_model

            attach_reward_model(self.registry, cfg.reward_model, cfg.reward_model_spread_penalty)
        self.domain_names = self.registry.resolve(cfg.domains, where="EvaluatorConfig.domains")
        self.domains = {d: self.registry.get(d) for d in self.domain_names}
        self.sets = first_per_tier(build_heldout(self.registry, self.domain_names, cfg.heldout),
                                   cfg.score_per_tier, cfg.skip_per_tier,
                                   cfg.heldout.tasks_per_tier)
        checker = ContaminationChecker(
            [(t.task_id, t.prompt) for ts in self.sets.values() for t in ts],
            n=cfg.contamination_n, min_overlap=cfg.contamination_min_overlap,
            exact_only=exact_only_ids(self.sets, self.domains, cfg.heldout),
        )
        if blind := drop_guard_blind(self.sets, cfg):
            loud(blind)
        self.start = start_baselines(Path(cfg.start_scores), self.sets) \
            if cfg.start_scores else {}
        await self._feed_training_prompts(checker)
        report = checker.report()
        require_clean(report)  # refuses to start
        print(f"evaluator: {report.summary()}", file=sys.stderr, flush=True)
        run_dir = paths.run_dir(self.ctx.run)
        self.state_path = (
            Path(cfg.state_file) if cfg.state_file else run_dir / "evaluator_state.json"
        )
        self.state = load_evaluator_state(self.state_path)
        self.serving = trio.Lock()  # one start or load of the eval server at a time
        self.server: Any = None
        self.client: Any = None
        self.tokenizer: Any = None
        self.served_version: int | None = None
        self.fetched = fetched_weights_dir("eval")
        self.fetch_stats = FetchStats()
        self.last_scores: dict[str, DomainScore] = {}
        self.skipped_versions = 0
        self.policy = PolicyVersion()
        """The current policy by the weights messages (`core/policy_version.py`)."""

    async def _feed_training_prompts(self, checker: ContaminationChecker) -> None:
        """The training files, then every training task already stored in the run's stream."""
        cfg: EvaluatorConfig = self.config
        for name, path in cfg.train_files.items():
            for t in self.registry.get(name).load_tasks(path):
                checker.add_train(f"{path}:{t.task_id}", t.prompt)
        if cfg.check_issued_tasks:
            with self.ctx.waiting("reading issued training tasks from the stream", deadline_s=300):
                async for d in self.ctx.bus.read_stream(
                    self.ctx.stream, filter_subject=subjects.task(self.ctx.run, "*")
                ):
                    msg = decode(d.data)
                    if isinstance(msg, Task) and msg.purpose == "train" and msg.attempt == 1:
                        checker.add_train(msg.task_id, msg.prompt)

    def inputs(self) -> list[Input]:
        cfg: EvaluatorConfig = self.config
        return [Input(subject=subjects.weights(self.ctx.run), handler=self.on_weights,
                      accepts=(WeightsPublished, Rollback), ack_wait_s=cfg.ack_wait_s,
                      max_deliver=3)]

    def capabilities(self) -> list[str]:
        return [f"evaluator for domains {','.join(self.domain_names)}"]

    def figures(self) -> dict[str, float]:
        out: dict[str, float] = {"evaluated_versions": float(len(self.state.evaluated)),
                                 "skipped_versions": float(self.skipped_versions),
                                 "rollbacks": float(len(self.state.rolled_back)),
                                 **self.fetch_stats.figures()}
        if self.state.last_good is not None:
            out["last_good_version"] = float(self.state.last_good.version)
        for d, s in self.last_scores.items():
            out[f"{d}.pass_at_1"] = s.pass_at_1
            out[f"{d}.pass_at_k"] = s.pass_at_k
        return out

    async def main(self) -> None:
        """Start the eval server from the starting model right away (when it is known), and
        hold a sandbox pool while any evaluated domain verifies in one."""
        cfg: EvaluatorConfig = self.config
        async with trio.open_nursery() as nursery:
            if cfg.model_path and not cfg.server_url:
                nursery.start_soon(self._warm_up)
            await self._hold_sandbox()

    async def _warm_up(self) -> None:
        try:
            async with self.serving:
                await self._ensure_server(self.config.model_path, None)
        except Exception as exc:  # noqa: BLE001 - the first version to score tries again
            print(f"evaluator: the eval server did not start ({exc}); the first version to "
                  "score starts it", file=sys.stderr, flush=True)

    async def _hold_sandbox(self) -> None:
        needs = [d for d, dom in self.domains.items() if dom.resource == "sandbox"]
        if not needs:
            return
        from reinforge.envs.sandbox.owned import hold_sandbox_runner

        def use(runner: Any, why: str) -> None:
            if runner is None:
                loud(f"no sandbox ({why}): {', '.join(needs)} samples will be infra errors")
                return
            for d in needs:
                self.domains[d] = self.domains[d].with_runner(runner)

        await hold_sandbox_runner(self.config.sandbox_pool_size, use, lambda: 0)

    async def teardown(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.server is not None:
            await trio.to_thread.run_sync(self.server.stop)
        shutil.rmtree(self.fetched, ignore_errors=True)

    async def on_weights(self, msg: WeightsPublished | Rollback) -> None:
        cfg: EvaluatorConfig = self.config
        policy = policy_version.after(self.policy, msg)
        self.policy = policy or self.policy
        if isinstance(msg, WeightsPublished) and policy is None:
            # announced before a rollback the learner has since applied (or older than what
            # was scored): judging it would roll the learner back from a good lineage
            self.skipped_versions += 1
            return
        if isinstance(msg, Rollback):
            # the learner reuses the numbers (and paths) past to_version: score them afresh
            self.state.evaluated = [k for k in self.state.evaluated
                                    if int(k.split(":", 1)[0]) <= msg.to_version]
            self.state.baselines = {d: b for d, b in self.state.baselines.items()
                                    if b.version <= msg.to_version}
            self.state.gold_peaks = {d: b for d, b in self.state.gold_peaks.items()
                                     if b.version <= msg.to_version}
            if self.state.last_good is not None and \
                    self.state.last_good.version > msg.to_version:  # back to a gold peak
                self.state.last_good = GoodVersion(version=msg.to_version, path=msg.path)
            write_json_atomic(self.state_path, self.state)
            return
        key = f"{msg.version}:{msg.path}"
        if key in self.state.evaluated or msg.version % cfg.every_versions:
            return
        try:
            source = await self.source_for(msg)
        except VersionGone as exc:  # pruned before its turn came: a later one will do
            self.skipped_versions += 1
            print(f"evaluator: {exc}", file=sys.stderr, flush=True)
            return
        stake, zero = guard_picks(sorted(self.sets), self.state.baselines,
                                  (self.state.rotation_start, self.state.zero_rotation_start),
                                  cfg.domains_per_version, cfg.zero_share, self.start)
        sets = {d: self.sets[d] for d in with_watched(
            stake + zero, [*self.state.watched, *self.state.falls_seen])
                if d in self.sets}
        with self.ctx.waiting(f"evaluating version {msg.version}", deadline_s=cfg.ack_wait_s):
            t0 = time.monotonic()
            scores = await evaluate_sets(sets, self.domains, source,
                                         samples=cfg.samples or cfg.k, k=cfg.k,
                                         concurrency=cfg.concurrency,
                                         samples_by_domain=cfg.domain_samples)
        self.last_scores = scores
        await self.publish_scores(msg, scores, time.monotonic() - t0)
        await self.guard(msg, scores)
        await self.keep_rollback_targets(msg.version)
        self.state.rotation_start += len(stake)
        self.state.zero_rotation_start += len(zero)
        self.state.evaluated.append(key)
        write_json_atomic(self.state_path, self.state)

    async def publish_scores(
        self, msg: WeightsPublished, scores: dict[str, DomainScore], took_s: float
    ) -> None:
        cfg: EvaluatorConfig = self.config
        version = msg.version
        for d, s in scores.items():
            stats = EvalStats(version=version, epoch=msg.epoch, domain=d, pass_at_1=s.pass_at_1,
                              pass_at_k=s.pass_at_k, k=s.k, n_tasks=s.n_tasks,
                              figures={**s.figures(), "eval_s": took_s,
                                       **({"threshold": cfg.thresholds[d]}
                                          if d in cfg.thresholds else {})})
            await self.ctx.publish(subjects.stats(self.ctx.run, "evaluator"), stats)
            await self.ctx.publish_durable(subjects.stats(self.ctx.run, "eval"), stats,
                                           msg_id=f"eval:{version}:{d}{epoch_tag(msg)}")
            print(f"evaluator: v{version} {d}: pass@1 {s.pass_at_1:.3f} pass@{s.k} "
                  f"{s.pass_at_k:.3f} over {s.n_tasks} tasks x {s.samples}", file=sys.stderr,
                  flush=True)

    async def guard(self, msg: WeightsPublished, scores: dict[str, DomainScore]) -> None:
        cfg: EvaluatorConfig = self.config
        spent = spent_domains(self.state.rollbacks_for, cfg.max_rollbacks_per_domain)
        below, rollback = regression_rollback(
            msg.version, scores, cfg.thresholds, self.state.last_good,
            baselines=self.state.baselines, starts=self.start, drop_alpha=cfg.drop_alpha,
            drop_margin=cfg.drop_margin, gold_peaks=self.state.gold_peaks,
            gold_alpha=cfg.gold_alpha, epoch=msg.epoch, spent=spent)
        waiting, self.state.falls_seen = falls_waiting(
            self.state.falls_seen, scores, below, spent, cfg.falls_before_rollback)
        if waiting and set(below) <= spent | set(waiting):
            loud(f"{rollback.reason if rollback else f'version {msg.version} regressed'}; "
                 f"no rollback yet: it waits for {cfg.falls_before_rollback} checks in a row "
                 f"to find the fall in {', '.join(waiting)}")
            return  # not a good version, nor rolled back: checked again at the next
        if set(below) <= spent:  # no fall, or only in domains past their rollbacks
            if below:
                loud(f"version {msg.version} fell again in {', '.join(below)}, which "
                     f"{cfg.max_rollbacks_per_domain} rollbacks each did not stop: kept (the "
                     "training reaches this fall from the version it goes back to)")
            self.state.last_good = GoodVersion(version=msg.version, path=msg.path)
            for d, s in scores.items():
                if s.n_tasks:
                    self.state.baselines[d] = Baseline.of(msg.version, s)
            self.state.gold_peaks = gold_peaks_after(self.state.gold_peaks, msg, scores)
            return
        if rollback is None:
            loud(f"version {msg.version} regressed in {', '.join(below)}, and there "
                 "is no earlier good version to roll back to")
            return
        loud(f"REGRESSION: {rollback.reason}; rolling back to version {rollback.to_version} "
             f"({rollback.path})")
        await self.ctx.publish_durable(subjects.weights(self.ctx.run), rollback,
                                       msg_id=f"rollback:{rollback.to_version}:{msg.version}"
                                              f"{epoch_tag(msg)}")
        self.state.rolled_back.append(msg.version)
        self.state.watched = with_watched(self.state.watched, below)
        for d in below:
            self.state.rollbacks_for[d] = self.state.rollbacks_for.get(d, 0) + 1
        self.state.falls_seen = {}  # the falls seen were the rolled-back policy's

    async def keep_rollback_targets(self, version: int) -> None:
        """Tell the learner which checkpoints a rollback may return to (KeepVersions): the
        last good version and the gold peaks, which may be older than its own retention."""
        targets = sorted({b.version for b in self.state.gold_peaks.values()}
                         | ({self.state.last_good.version} if self.state.last_good else set()))
        if targets:
            await self.ctx.publish_durable(
                subjects.keep(self.ctx.run),
                KeepVersions(versions=targets, reason="the evaluator's rollback targets"),
                msg_id=f"keep:{version}:{','.join(map(str, targets))}")

    async def source_for(self, msg: WeightsPublished) -> CompletionSource:
        """A completion source serving `msg.version`: starts the eval server on first use,
        then loads the version into it. A version pruned before or while it loads (a slow
        server start lets the learner move on by many versions) raises VersionGone."""
        cfg: EvaluatorConfig = self.config
        gone = VersionGone(f"v{msg.version} skipped: {msg.path} is gone (set the learner's "
                           "keep_every to the evaluator's every_versions)")
        if msg.store and not Path(msg.path).is_dir():  # not this host's disk: fetch it
            try:
                local = await local_weights(self.ctx.bus, msg.path, msg.store, msg.version,
                                            self.fetched, self.fetch_stats)
            except WeightsUnavailable as exc:
                raise gone from exc
            msg = msgspec.structs.replace(msg, path=local)
        if not Path(msg.path).is_dir():
            raise gone
        try:
            await self._serve(msg)
        except Exception as exc:
            if Path(msg.path).is_dir():
                raise
            raise gone from exc
        return ServerSource(self.client, self.tokenizer, max_new_tokens=cfg.max_new_tokens,
                            temperature=cfg.eval_temperature, top_p=cfg.top_p,
                            chat_template=cfg.chat_template, seed=cfg.sampling_seed)

    async def _serve(self, msg: WeightsPublished) -> None:
        cfg: EvaluatorConfig = self.config
        async with self.serving:
            if cfg.model_path:
                await self._ensure_server(cfg.model_path, None)
            else:
                await self._ensure_server(msg.path, msg.version)
            if self.served_version != msg.version:
                self.served_version = None  # a failed load leaves no version known served
                with self.ctx.waiting(f"loading version {msg.version}", deadline_s=600):
                    await self.client.update_weights_from_disk(
                        msg.path, weight_version=str(msg.version))
                self.served_version = msg.version

    async def _ensure_server(self, model_path: str, version: int | None) -> None:
        """The tokenizer (every version of a run shares it) and a client of the eval server,
        starting the server from `model_path` (serving `version`) unless it runs."""
        from reinforge.rollout.client import RolloutClient

        cfg: EvaluatorConfig = self.config
        if self.tokenizer is None:
            self.tokenizer = await trio.to_thread.run_sync(load_tokenizer, model_path)
        if self.client is None:
            url = cfg.server_url or await self._start_server(model_path, version)
            self.client = RolloutClient(url, timeout_s=cfg.request_timeout_s)

    async def _start_server(self, model_path: str, version: int | None) -> str:
        """Start the evaluator's own rollout server from `model_path`; returns its URL."""
        from reinforge.rollout.server import ServerProcess, ServerSpec

        cfg: EvaluatorConfig = self.config
        spec = ServerSpec(model_path=model_path, initial_version=version or 0,
                          server_args=list(cfg.server_args))
        server = ServerProcess(spec, paths.actor_server_log(self.ctx.run, self.ctx.actor_id))
        server.start()
        try:
            with self.ctx.waiting("eval rollout server start",
                                  deadline_s=cfg.server_start_timeout_s):
                url = await server.wait_url(cfg.server_start_timeout_s)
        except BaseException:
            with trio.CancelScope(shield=True):  # no server outlives a failed start
                await trio.to_thread.run_sync(server.stop)
            raise
        self.server, self.served_version = server, version
        return url

