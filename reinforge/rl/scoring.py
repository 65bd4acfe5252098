"""Scoring evaluations: pass@k, a domain's scores from per-sample verdicts, and how pass@1
moved between two evaluations of the same held-out tasks (with its confidence interval).

Pure functions on plain data: the evaluator actor, `reinforge eval` and the demo's
before/after comparison all score with these.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import msgspec


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021, eq. 1):
    1 - C(n-c, k) / C(n, k), computed as a stable product. Needs k <= n."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


class DomainScore(msgspec.Struct, frozen=True, kw_only=True):
    domain: str
    n_tasks: int
    """Tasks with at least one verified sample."""
    samples: int
    k: int
    pass_at_1: float
    pass_at_k: float
    run_pass_rates: list[float]
    """Pass rate of run j (the j-th sample of every task): multi-run stability."""
    run_std: float
    infra_errors: int
    """Samples masked because verification failed for infrastructure reasons."""
    rejected_tasks: int = 0
    """Tasks the rollout server refused (e.g. prompt longer than the context): all failed."""
    task_pass_at_1: dict[str, float] = {}
    """Pass@1 of each task with a verified sample, by task id: what a paired comparison of
    two checkpoints on the same held-out set needs (`paired_change`)."""
    task_counts: dict[str, tuple[int, int]] = {}
    """(passed, verified) samples of each task with a verified sample, by task id: what the
    drop test on counts needs (`drop_test`)."""
    answer_mode_share: float = 0.0
    """Share of the samples whose final answer (`answer_signature`) is the most common one:
    near 1.0, the policy gives one answer whatever the task asks, having collapsed onto the
    answer prior (`actors.evaluator.answer_prior` scores that constant answer)."""
    turns_mean: float = 0.0
    """Tool domains: the policy's turns per episode."""
    tool_call_error_rate: float = 0.0
    """Tool domains: malformed tool calls among all tool calls (well-formed or not)."""
    reward_mean: float = 0.0
    """Mean over tasks of their verified samples' mean reward: for a domain rewarded by a
    learned model, the proxy the policy is trained on."""
    task_reward: dict[str, float] = {}
    gold_pass_rate: float | None = None
    """Domains whose verdicts carry a `gold` check (a rule the reward only approximates,
    never rewarded): the mean over tasks of the share of samples that pass it."""
    task_gold: dict[str, float] = {}

    def figures(self) -> dict[str, float]:
        gold = {} if self.gold_pass_rate is None else {"gold_pass_rate": self.gold_pass_rate}
        return {
            "reward_mean": self.reward_mean,
            **gold,
            "n_samples": float(self.samples),
            "run_std": self.run_std,
            "run_min": min(self.run_pass_rates, default=0.0),
            "run_max": max(self.run_pass_rates, default=0.0),
            "infra_errors": float(self.infra_errors),
            "rejected_tasks": float(self.rejected_tasks),
            "answer_mode_share": self.answer_mode_share,
            "turns_mean": self.turns_mean,
            "tool_call_error_rate": self.tool_call_error_rate,
        }


COLLAPSED_MODE_SHARE = 0.8
"""A policy whose most common final answer is at least this share of its answers on a
domain's held-out tasks gives one answer whatever the task: it has collapsed onto the answer
prior (the demo names such domains; the report's frontier places them apart)."""


def answer_signature(completion: str) -> str:
    """A completion's last non-empty line, its whitespace collapsed: where every domain's
    format puts the final answer (`#### 7`, `<answer>7</answer>`), so two completions with
    the same signature gave the same answer."""
    lines = [line for line in completion.splitlines() if line.strip()]
    return " ".join(lines[-1].split()) if lines else ""


def mode_share(values: Sequence[str]) -> float:
    """The share of the most common value (0.0 for none). Worked example: (a, a, b) -> 2/3."""
    if not values:
        return 0.0
    return max(Counter(values).values()) / len(values)


def score_domain(
    domain: str, correct: Sequence[Sequence[bool | None]], k: int, *, rejected_tasks: int = 0,
    task_ids: Sequence[str] = (), answers: Sequence[str] = (),
    rewards: Sequence[Sequence[float]] = (), golds: Sequence[Sequence[bool]] = (),
) -> DomainScore:
    """Scores from per-task, per-sample correctness (None = masked infrastructure fault).

    Per task with n verified samples, c correct: pass@1 = c/n and pass@k = the unbiased
    estimator with k' = min(k, n); the domain's figures are the means over tasks. With
    `task_ids` (one per row), each task's pass@1 is kept too; with `answers` (the verified
    samples' `answer_signature`s), how often the most common answer was given. `rewards`
    and `golds` (per row: the verified samples' rewards, and their `gold` checks where the
    domain has one) give the proxy and gold figures, per task too.
    """
    if task_ids and len(task_ids) != len(correct):
        raise ValueError(f"{len(task_ids)} task ids for {len(correct)} tasks")
    for name, rows in (("rewards", rewards), ("golds", golds)):
        if rows and len(rows) != len(correct):
            raise ValueError(f"{len(rows)} rows of {name} for {len(correct)} tasks")
    ids = list(task_ids) or [str(i) for i in range(len(correct))]
    task_reward = {ids[i]: sum(r) / len(r) for i, r in enumerate(rewards) if r}
    task_gold = {ids[i]: sum(g) / len(g) for i, g in enumerate(golds) if g}
    p1, pk, infra = [], [], 0
    per_task: dict[str, float] = {}
    counts: dict[str, tuple[int, int]] = {}
    samples = max((len(row) for row in correct), default=0)
    runs: list[list[bool]] = [[] for _ in range(samples)]
    for i, row in enumerate(correct):
        valid = [c for c in row if c is not None]
        infra += len(row) - len(valid)
        for j, c in enumerate(row):
            if c is not None:
                runs[j].append(c)
        if not valid:
            continue
        n, c = len(valid), sum(valid)
        p1.append(c / n)
        if task_ids:
            per_task[task_ids[i]] = c / n
            counts[task_ids[i]] = (c, n)
        pk.append(pass_at_k(n, c, min(k, n)))
    rates = [sum(r) / len(r) for r in runs if r]
    return DomainScore(
        domain=domain, n_tasks=len(p1), samples=samples, k=k,
        pass_at_1=sum(p1) / len(p1) if p1 else 0.0,
        pass_at_k=sum(pk) / len(pk) if pk else 0.0,
        run_pass_rates=rates,
        run_std=statistics.pstdev(rates) if len(rates) > 1 else 0.0,
        infra_errors=infra,
        rejected_tasks=rejected_tasks,
        task_pass_at_1=per_task,
        task_counts=counts,
        answer_mode_share=mode_share(answers),
        reward_mean=mean_or_none(task_reward.values()) or 0.0,
        task_reward=task_reward if task_ids else {},
        gold_pass_rate=mean_or_none(task_gold.values()),
        task_gold=task_gold if task_ids else {},
    )


def mean_or_none(values: Iterable[float]) -> float | None:
    """The mean, or None for no values (a figure the data does not have)."""
    values = list(values)
    return sum(values) / len(values) if values else None


class Change(msgspec.Struct, frozen=True, kw_only=True):
    """How pass@1 moved between two evaluations of the same held-out tasks."""

    delta: float
    """Mean over the tasks both evaluations scored of (after - before)."""
    ci95: tuple[float, float]
    """95 % confidence interval of `delta` (normal approximation of the paired mean)."""
    n_tasks: int


def paired_change(before: Mapping[str, float], after: Mapping[str, float]) -> Change:
    """The change of pass@1 on the tasks both sides scored, paired by task: a task's
    difficulty cancels out, so the interval is much tighter than comparing two means.

    Worked example: before {a: 0, b: .5, c: 1}, after {a: .5, b: .5, c: 1}: differences
    (.5, 0, 0), delta 1/6, sample std .289, standard error .167, ci95 = 1/6 ± 1.96 x .167."""
    common = sorted(set(before) & set(after))
    diffs = [after[t] - before[t] for t in common]
    n = len(diffs)
    if n == 0:
        return Change(delta=0.0, ci95=(0.0, 0.0), n_tasks=0)
    delta = sum(diffs) / n
    # one task gives no sample sd: take the largest a difference in [-1, 1] can have, 1
    half = 1.96 * (statistics.stdev(diffs) / math.sqrt(n) if n > 1 else 1.0)
    return Change(delta=delta, ci95=(delta - half, delta + half), n_tasks=n)


def change_beyond_prior(before: Mapping[str, float], after: Mapping[str, float],
                        prior: Mapping[str, float]) -> Change:
    """The paired change against the better of two baseline policies on these tasks: the
    policy at its start (`before`) or the constant answer (`prior`: each task's pass, 0 or
    1, with its tier's most common reference), whichever scores higher. A policy that only
    learned to give the constant answer gains nothing against it.
    Worked example: before {a: .25, b: .25} (.25), prior {a: 1, b: 0} (.5), after {a: 1,
    b: 0}: the prior is the baseline, change 0 (against `before` alone it would be +.25)."""
    common = set(before) & set(after)
    constant = {t: prior.get(t, 0.0) for t in common}
    if sum(constant.values()) > sum(before[t] for t in common):
        return paired_change(constant, after)
    return paired_change(before, after)


def mean_change(changes: Sequence[Change], weights: Sequence[float] | None = None) -> Change:
    """The (weighted) mean of changes on disjoint held-out sets (domains, or the tiers of
    one domain), with its interval: their variances add, se = sqrt(sum (w_i se_i)^2) with
    the weights summing to 1 (default: equal, se = sqrt(sum se_i^2) / D)."""
    if weights is None:
        weights = [1.0] * len(changes)
    if len(weights) != len(changes) or any(w < 0 for w in weights):
        raise ValueError(f"mean_change: need one weight >= 0 per change, got {list(weights)} "
                         f"for {len(changes)} changes")
    total = sum(weights)
    if not changes or total == 0:
        return Change(delta=0.0, ci95=(0.0, 0.0), n_tasks=0)
    w = [x / total for x in weights]
    delta = sum(wi * c.delta for wi, c in zip(w, changes))
    se = math.sqrt(sum((wi * (c.ci95[1] - c.ci95[0]) / (2 * 1.96)) ** 2
                       for wi, c in zip(w, changes)))
    return Change(delta=delta, ci95=(delta - 1.96 * se, delta + 1.96 * se),
                  n_tasks=sum(c.n_tasks for c in changes))


class DropTest(msgspec.Struct, frozen=True, kw_only=True):
    """Whether pass@1 fell on the held-out tasks two evaluations share: a test on counts."""

    delta: float
    """Mean over the shared tasks of (after - before)."""
    worse: int
    better: int
    """Tasks whose pass@1 fell / rose (ties carry no evidence either way)."""
    p_value: float
    """One-sided: the stratified exact test on the samples' counts when both sides have
    them (`fewer_passes_p`), else the exact sign test on the tasks."""
    n_tasks: int


def paired_delta(before: Mapping[str, float], after: Mapping[str, float]) -> float:
    """Mean over the tasks both have of (after - before); 0.0 when they share none."""
    common = set(before) & set(after)
    return sum(after[t] - before[t] for t in common) / len(common) if common else 0.0


def drop_test(before: Mapping[str, float], after: Mapping[str, float],
              before_counts: Mapping[str, tuple[int, int]] | None = None,
              after_counts: Mapping[str, tuple[int, int]] | None = None) -> DropTest:
    """Whether pass@1 fell, paired by task (a task's difficulty cancels out). With each
    task's (passed, verified) samples on both sides, the p-value is `fewer_passes_p`'s;
    without, the sign test on the tasks, which can say no less than 0.5 ** n_tasks: on 4
    tasks it never reaches 0.01, however far pass@1 fell.
    Worked example (sign test): 9 tasks worse, 1 better, p = (C(10,9) + C(10,10)) / 2**10 =
    0.0107."""
    common = sorted(set(before) & set(after))
    worse = sum(after[t] < before[t] for t in common)
    better = sum(after[t] > before[t] for t in common)
    counted = [t for t in common if t in (before_counts or {}) and t in (after_counts or {})]
    if counted and len(counted) == len(common):
        p = fewer_passes_p([(before_counts[t], after_counts[t]) for t in counted])
    else:
        n = worse + better
        p = sum(math.comb(n, i) for i in range(worse, n + 1)) / 2**n if n else 1.0
    return DropTest(delta=paired_delta(before, after), worse=worse, better=better, p_value=p,
                    n_tasks=len(common))


def fewer_passes_p(tasks: Sequence[tuple[tuple[int, int], tuple[int, int]]]) -> float:
    """One-sided p-value that the second evaluation passes fewer samples than the first,
    from each task's ((passed, verified) before, (passed, verified) after): the exact test
    stratified by task (the exact form of Cochran-Mantel-Haenszel). With no change, a task's
    passes are spread over its before and after samples at random, so its after-passes
    follow a hypergeometric law given its total; p = P(the after-passes summed over tasks
    <= those seen), the laws convolved. It uses every sample, so a few tasks of several
    samples each can show a fall that a sign test on the tasks cannot.
    Worked example: two tasks, each 2 of 2 before and 0 of 2 after: each has total 2 in 4
    samples, P(0 of them after) = C(2,2) / C(4,2) = 1/6; p = 1/36 = 0.028 (the sign test on
    the two tasks: 0.25)."""
    law = [1.0]  # P(after-passes so far = s)
    seen = 0
    for (cb, nb), (ca, na) in tasks:
        if not (0 <= cb <= nb and 0 <= ca <= na):
            raise ValueError(f"fewer_passes_p: need 0 <= passed <= verified, got "
                             f"{(cb, nb)} and {(ca, na)}")
        total, n = cb + ca, nb + na
        lo, hi = max(0, total - nb), min(total, na)
        task = [math.comb(total, x) * math.comb(n - total, na - x) / math.comb(n, na)
                if lo <= x <= hi else 0.0 for x in range(hi + 1)]
        law = [sum(law[s - x] * task[x] for x in range(len(task)) if 0 <= s - x < len(law))
               for s in range(len(law) + len(task) - 1)]
        seen += ca
    return min(1.0, sum(law[:seen + 1]))


def smallest_drop_p(n_tasks: int, samples: int) -> float:
    """The least p-value `fewer_passes_p` can give on `n_tasks` tasks of `samples` samples
    a side: every sample passed before and none after. At or above a guard's alpha, that
    guard cannot flag a fall, however large. Worked example: 1 task of 2 samples:
    1 / C(4, 2) = 1/6; 4 such tasks: (1/6)**4 = 0.00077."""
    if n_tasks < 1 or samples < 1:
        return 1.0
    return math.comb(2 * samples, samples) ** -n_tasks
