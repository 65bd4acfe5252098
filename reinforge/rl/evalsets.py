"""Held-out evaluation sets per domain, and the contamination check that keeps them held out.

A held-out set is either generated (a seed of its own, `tasks_per_tier` tasks per tier, no
duplicates, never every prompt of a tier: see `build_heldout`) or read from a JSONL file per
domain; the problems of review sets join it. Both the scheduler and the evaluator build it
from the same `HeldOutConfig`: the evaluator scores on it, the scheduler never issues a
training task whose prompt fingerprint is in it (disjoint by construction for generated
domains, where a tier may have only ~100 distinct tasks).

The contamination check compares prompts by word n-grams (GPT-3's test, 13-grams, on
lower-cased word/punctuation tokens):
  * n-grams found in at least `boilerplate_frac` of all prompts (and in at least
    `boilerplate_min_prompts` of them) are template text ("End with '#### <answer>'") and
    are ignored;
  * an eval prompt is contaminated when its normalised text equals a training prompt's, or
    when at least `min_overlap` of its remaining n-grams occur in training prompts. A
    prompt shorter than n tokens counts as one n-gram (the whole prompt). A templated
    domain's prompts (`envs/domain.py`) count only when copied exactly: their n-grams are
    all found across its other tasks.
The evaluator refuses to start on a contaminated set (`ContaminationError`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from reinforge.core import paths
from reinforge.core.atomic import write_atomic
from reinforge.envs.domain import TaskSpec, templated_prompts

_TOKEN_RE = re.compile(r"\w+|[^\w\s]+")

HELDOUT_RULES = 1
"""Part of a kept held-out set's key, with its domain's `generator_version`: raised when
`generate_heldout` draws or keeps tasks by another rule (how many draws, when a small bank
keeps half), so no set made by an old rule is read back."""


class HeldOutConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which tasks are held out for evaluation (the scheduler and evaluator must agree)."""

    seed: int = 20240917
    """Seed of the held-out generator (training tasks use other seeds)."""
    tasks_per_tier: int = 4
    """Generated held-out tasks per tier of each domain (0: none)."""
    files: dict[str, str] = {}
    """domain -> JSONL file of held-out tasks, used instead of generating them."""
    tiers: list[int] = []
    """Only these tiers (empty: every tier of the domain)."""
    review_sets: list[str] = []
    """Review sets (`reinforge log reviews`): the problems people reviewed join the held-out
    set of their domain (those of a domain or tier not evaluated are left out)."""

    def __post_init__(self) -> None:
        if self.tasks_per_tier < 0:
            raise ValueError(
                f"HeldOutConfig.tasks_per_tier must be >= 0, got {self.tasks_per_tier}"
            )


def tokens(text: str) -> list[str]:
    """Lower-cased word and punctuation tokens."""
    return _TOKEN_RE.findall(text.lower())


def fingerprint(prompt: str) -> str:
    """A stable identity of a prompt, blind to case and whitespace."""
    return hashlib.sha1(" ".join(tokens(prompt)).encode()).hexdigest()[:20]


def unseen_mass(drawn: Counter[str]) -> float:
    """Good-Turing's estimate of the share of a generator's draws that would give a prompt
    not yet drawn: prompts drawn once over all draws. Below 0.5, what was drawn is most of
    what the generator gives, a small bank even when it reached the count asked."""
    return sum(n == 1 for n in drawn.values()) / max(1, sum(drawn.values()))


def build_heldout(
    registry: Any, domains: Iterable[str], config: HeldOutConfig, *,
    cache: Path | None = None,
) -> dict[str, list[TaskSpec]]:
    """The held-out tasks of each domain: from its file, else generated with the held-out seed.

    A generated tier whose draws (20 per wanted task) gave fewer distinct prompts than wanted,
    or repeated so often that most of its bank was drawn (`unseen_mass`), has a small bank,
    such as a procedural family's easiest level: half of what they found is held out, the
    rest left to training, which could otherwise never reach the tier. (No extra draws to
    size a bank: some generators take minutes on a rare item.)

    A domain that names what its draws depend on (`generator_version`) keeps its generated
    set in `cache` (default `<home>/cache/heldout`): the scheduler, the evaluator and every
    evaluation of a run build the same set, and a procedural family's can take seconds."""
    out: dict[str, list[TaskSpec]] = {}
    for name in domains:
        domain = registry.get(name)
        if name in config.files:
            tasks = domain.load_tasks(config.files[name])
            if config.tiers:
                tasks = [t for t in tasks if t.tier in config.tiers]
            out[name] = tasks
            continue
        tiers = config.tiers or list(range(len(domain.tiers)))
        for tier in tiers:
            if not 0 <= tier < len(domain.tiers):
                raise ValueError(
                    f"held-out tier {tier} is not a tier of domain {name!r} "
                    f"(0..{len(domain.tiers) - 1})"
                )
        version = getattr(domain, "generator_version", None)
        if version is None:
            out[name] = generate_heldout(name, domain, tiers, config)
            continue
        key = json.dumps([HELDOUT_RULES, name, tiers, config.tasks_per_tier, config.seed,
                          version, TaskSpec.__struct_fields__])
        kept = (cache or paths.home() / "cache" / "heldout") / (
            f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json")
        try:
            out[name] = msgspec.json.decode(kept.read_bytes(), type=list[TaskSpec])
        except (OSError, msgspec.DecodeError):  # not made yet, or cut short: made again
            out[name] = generate_heldout(name, domain, tiers, config)
            with contextlib.suppress(OSError):  # a cache that cannot be written is no error
                write_atomic(kept, msgspec.json.encode(out[name]))
    for path in config.review_sets:
        for task in reviewed_tasks(path):
            held = out.get(task.domain)
            if held is None or (config.tiers and task.tier not in config.tiers):
                continue
            if fingerprint(task.prompt) not in {fingerprint(t.prompt) for t in held}:
                held.append(task)
    return out


def generate_heldout(name: str, domain: Any, tiers: Sequence[int],
                     config: HeldOutConfig) -> list[TaskSpec]:
    """The generated held-out tasks on `tiers` of `domain`, registered as `name` (see
    `build_heldout`)."""
    tasks: list[TaskSpec] = []
    seen: set[str] = set()
    for tier in tiers:
        rng = random.Random(f"heldout:{name}:{tier}:{config.seed}")
        cap = domain.tiers[tier].max_heldout
        want = min(config.tasks_per_tier, cap) if cap else config.tasks_per_tier
        held: list[TaskSpec] = []
        drawn: Counter[str] = Counter()
        for _ in range(want * 20):
            if len(held) >= want:
                break
            task = domain.sample_task(rng, tier)
            fp = fingerprint(task.prompt)
            drawn[fp] += 1
            if fp in seen:
                continue
            seen.add(fp)
            held.append(msgspec.structs.replace(task, task_id=f"heldout-{task.task_id}"))
        # the whole bank, or most of it (a tier's own cap is its author's sizing)
        if len(held) < want or (not cap and unseen_mass(drawn) < 0.5):
            del held[len(held) // 2 :]
        tasks += held
    return tasks


def reviewed_tasks(path: str) -> list[TaskSpec]:
    """The tasks of a review set, one per row (TaskFileError names a row without one)."""
    from reinforge.envs.tasksets import load_jsonl

    def task_of(row: Mapping[str, Any], where: str) -> TaskSpec:
        if not isinstance(row.get("task"), dict):
            raise ValueError("no `task` in this row: not a review set from `reinforge log "
                             "reviews` (or one exported before reviews carried their task)")
        try:
            task = msgspec.convert(row["task"], TaskSpec)
        except msgspec.ValidationError as exc:
            raise ValueError(f"task: {exc}") from None
        return msgspec.structs.replace(task, task_id=f"reviewed-{task.task_id}",
                                       source="jsonl")

    return load_jsonl(path, task_of)


def modal_references(domain: Any, tiers: Iterable[int], *, draws: int = 64,
                     seed: int = 0) -> dict[int, str]:
    """The most common reference completion of each tier among `draws` tasks drawn as the
    scheduler draws training tasks: the answer a policy that ignores its prompt would learn
    to give. A tier whose tasks carry no reference is left out."""
    out: dict[int, str] = {}
    for tier in tiers:
        rng = random.Random(f"prior:{domain.name}:{tier}:{seed}")
        refs = Counter(ref for ref in (domain.sample_task(rng, tier).reference
                                       for _ in range(draws)) if ref)
        if refs:
            out[tier] = refs.most_common(1)[0][0]
    return out


def heldout_fingerprints(sets: Mapping[str, Sequence[TaskSpec]]) -> dict[str, set[str]]:
    return {d: {fingerprint(t.prompt) for t in tasks} for d, tasks in sets.items()}


def exact_only_ids(sets: Mapping[str, Sequence[TaskSpec]], domains: Mapping[str, Any],
                   heldout: HeldOutConfig) -> list[str]:
    """The held-out ids checked for an exact copy only: a templated domain's generated
    prompts share their template with every training prompt, so n-gram overlap means nothing
    there. A held-out set read from `heldout.files` (people's own prompts) keeps the n-gram
    test."""
    return [t.task_id for d, tasks in sets.items()
            if templated_prompts(domains[d]) and d not in heldout.files for t in tasks]


# ----------------------------------------------------------------------------- contamination


class Overlap(msgspec.Struct, frozen=True, kw_only=True):
    eval_id: str
    train_id: str
    """A training prompt that shares n-grams with it (the first one found)."""
    overlap: float
    """Fraction of the eval prompt's (non-template) n-grams found in training prompts."""
    exact: bool
    example: str
    """One shared n-gram, as text."""


class ContaminationReport(msgspec.Struct, frozen=True, kw_only=True):
    n_eval: int
    n_train: int
    n: int
    min_overlap: float
    boilerplate_ngrams: int
    overlaps: list[Overlap] = []

    @property
    def clean(self) -> bool:
        return not self.overlaps

    def summary(self, limit: int = 5) -> str:
        if self.clean:
            return (
                f"no contamination: {self.n_eval} eval prompts vs {self.n_train} training "
                f"prompts ({self.n}-grams, threshold {self.min_overlap:.0%})"
            )
        lines = [
            f"{len(self.overlaps)} of {self.n_eval} eval prompts overlap training prompts "
            f"({self.n}-grams, threshold {self.min_overlap:.0%}):"
        ]
        for o in self.overlaps[:limit]:
            kind = "identical to" if o.exact else f"{o.overlap:.0%} of its {self.n}-grams in"
            lines.append(f"  eval {o.eval_id}: {kind} train {o.train_id} (e.g. {o.example!r})")
        if len(self.overlaps) > limit:
            lines.append(f"  ... and {len(self.overlaps) - limit} more")
        return "\n".join(lines)


class ContaminationError(RuntimeError):
    """Held-out prompts overlap training prompts: evaluation on them would be meaningless."""


def _ngrams(toks: list[str], n: int) -> set[tuple[str, ...]]:
    if len(toks) < n:
        return {tuple(toks)} if toks else set()
    return {tuple(toks[i : i + n]) for i in range(len(toks) - n + 1)}


class ContaminationChecker:
    """The check, fed one training prompt at a time: memory grows with the eval set only.

    Only eval n-grams matter, so only they are counted (document frequency over all
    prompts, for the template filter) and looked up in each training prompt as it passes.
    """

    def __init__(
        self,
        evals: Sequence[tuple[str, str]],
        *,
        n: int = 13,
        min_overlap: float = 0.5,
        exact_only: Iterable[str] = (),
        boilerplate_frac: float = 0.1,
        boilerplate_min_prompts: int = 4,
    ) -> None:
        """`exact_only`: eval ids checked for an exact copy only (a templated domain's)."""
        if n < 1:
            raise ValueError(f"n-gram size must be >= 1, got {n}")
        if not 0.0 < min_overlap <= 1.0:
            raise ValueError(f"min_overlap must be in (0, 1], got {min_overlap}")
        self.n = n
        self.min_overlap = min_overlap
        self.exact_only = set(exact_only)
        self.boilerplate_frac = boilerplate_frac
        self.boilerplate_min_prompts = boilerplate_min_prompts
        self.evals = [(eid, tokens(p)) for eid, p in evals]
        self.eval_grams = [_ngrams(t, n) for _, t in self.evals]
        self.df: Counter[tuple[str, ...]] = Counter()
        for grams in self.eval_grams:
            self.df.update(grams)
        self.owner: dict[tuple[str, ...], str] = {}
        self.exact = {" ".join(t): "" for _, t in self.evals if t}
        self.n_train = 0

    def add_train(self, train_id: str, prompt: str) -> None:
        toks = tokens(prompt)
        self.n_train += 1
        key = " ".join(toks)
        if key in self.exact and not self.exact[key]:
            self.exact[key] = train_id
        n = self.n
        if len(toks) < n:
            found = {tuple(toks)} & self.df.keys()
        else:
            df = self.df
            found = {g for i in range(len(toks) - n + 1) if (g := tuple(toks[i : i + n])) in df}
        for g in found:
            self.df[g] += 1
            self.owner.setdefault(g, train_id)

    def report(self) -> ContaminationReport:
        total = len(self.evals) + self.n_train
        cut = max(self.boilerplate_min_prompts, self.boilerplate_frac * total)
        boiler = {g for g, c in self.df.items() if c >= cut}
        overlaps = []
        for (eid, toks), grams in zip(self.evals, self.eval_grams, strict=True):
            key = " ".join(toks)
            if self.exact.get(key):
                overlaps.append(Overlap(eval_id=eid, train_id=self.exact[key], overlap=1.0,
                                        exact=True, example=" ".join(toks[: self.n])))
                continue
            if eid in self.exact_only:
                continue
            content = grams - boiler
            shared = [g for g in content if g in self.owner]
            if not shared:
                continue
            frac = len(shared) / len(content)
            if frac >= self.min_overlap:
                first = min(shared)
                overlaps.append(Overlap(eval_id=eid, train_id=self.owner[first], overlap=frac,
                                        exact=False, example=" ".join(first)))
        return ContaminationReport(
            n_eval=len(self.evals), n_train=self.n_train, n=self.n,
            min_overlap=self.min_overlap, boilerplate_ngrams=len(boiler), overlaps=overlaps,
        )


def check_contamination(
    train: Iterable[tuple[str, str]],
    evals: Sequence[tuple[str, str]],
    **options: Any,
) -> ContaminationReport:
    """Which eval prompts overlap the training prompts. Both are `(id, prompt)` pairs;
    `options` are ContaminationChecker's (n, min_overlap, boilerplate_frac, ...)."""
    checker = ContaminationChecker(evals, **options)
    for train_id, prompt in train:
        checker.add_train(train_id, prompt)
    return checker.report()


def require_clean(report: ContaminationReport) -> None:
    """Raise ContaminationError (with the overlaps) unless the report is clean."""
    if not report.clean:
        raise ContaminationError(
            "refusing to evaluate on a contaminated held-out set: " + report.summary()
            + "\n(remove these prompts from the training files or the held-out set)"
        )
