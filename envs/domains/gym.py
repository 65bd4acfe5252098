"""Procedural task families from `reasoning-gym` as domains: one per dataset, `gym-<dataset>`.

reasoning-gym (Apache-2.0, pure Python) generates tasks in about a hundred families
(arithmetic, algebra, logic, graphs, games, induction, ...) and scores answers with each
family's own scorer. Here each of its datasets is a domain:

- **Tiers** are the dataset's own curriculum: tier k is the configuration at the
  curriculum's global level k, for k below the most levels any of its attributes has
  (at most `MAX_TIERS`). A dataset without a curriculum has one tier, its defaults.
- **A task** is one item, drawn by a seed from the caller's rng: the spec keeps the dataset,
  the tier and the seed, so the verifier regenerates the same item (and the metadata its
  scorer reads) without shipping it.
- **The answer** goes in `<answer>...</answer>` (reasoning-gym's convention; the last such
  tag counts). The dataset's scorer turns it into the reward, a float in [0, 1] (some
  families give partial credit); a completion without the tag scores 0. A scorer that
  raises on an answer is an `error` verdict with the exception named, never a silent 0.
  Scorers run in a worker process with a time and memory limit (`gym_scorer.py`): some
  evaluate the answer with sympy, and an answer can make that compute for minutes.
- **The reference** (for SFT demonstrations) is the item's own answer when its scorer gives
  it 1; families whose items have many valid answers and no canonical one give none.

The domain name is a subject token (`core/subjects.py`): hence `gym-<dataset>`, not a path.
Importing reasoning-gym takes seconds, so the registry lists these names only when asked
(`DomainRegistry.names(families=True)`, or a name with the `gym-` prefix: "every domain"
stays the singular ones).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import trio
from reinforge.envs.domains.gym_scorer import worker
from reinforge.envs.domain import Check, TaskSpec, Tier, Verdict, check_tier
from reinforge.envs.tasksets import decode_row, load_jsonl

PREFIX = "gym-"
MAX_TIERS = 5
SEED_TRIES = 8
ITEMS_KEPT = 16
"""Items each domain keeps made (`GymDomain.item`): a few groups' worth."""
ANSWER_HINT = "Give your final answer inside <answer></answer> tags."
LEFT_OUT = {
    "composite": "it mixes the other datasets: each is a domain of its own here",
    "game_of_life_halting": "its scorer passes any non-empty answer (it compares "
                            "bool(answer) with bool('True'/'False'), both True)",
    **dict.fromkeys(
        ("isomorphic_strings", "polynomial_multiplication", "ransom_note", "word_ladder"),
        "its item depends on the process's string-hash seed (set order): the verifier, "
        "another process, would score a different item than the policy saw"),
}
"""Datasets that are not domains, and why. A scorer that a wrong answer passes would teach
the policy to game it, and an item not reproducible from its seed in another process would
be scored against the wrong answer (tests/envs/test_envs_gym.py checks both on every one)."""


TIER_CAPS = {
    "number_sequence": (3, "from its level 3 on, rules that square a term again and again make "
                           "integers of millions of digits: one item ran for over a minute"),
}
"""Datasets whose higher levels are not tiers here (the level they stop at, and why): making
one item must take milliseconds, since the scheduler and the verifier make them in-line."""


class GymSpec(msgspec.Struct, frozen=True, kw_only=True):
    dataset: str
    tier: int
    """Its configuration is the curriculum's at this level (rebuilt where it is needed: some
    configurations hold enums that a message would flatten)."""
    seed: int


class GymRow(msgspec.Struct, kw_only=True):
    """One line of a JSONL file of gym tasks: a dataset item by its seed (extra keys ignored)."""

    seed: int
    tier: int = 0
    task_id: str | None = None


def quiet() -> contextlib.AbstractContextManager:
    """Some generators print (bf's compiler prints a dot per pass): their chatter must not
    reach our stdout, where `reinforge eval --json` writes its one JSON line."""
    return contextlib.redirect_stdout(io.StringIO())


@functools.cache
def _gym() -> Any:
    import reasoning_gym
    import reasoning_gym.utils  # noqa: F401 - extract_answer

    return reasoning_gym


def dataset_names() -> list[str]:
    """Every reasoning-gym dataset that is a domain here (imports reasoning-gym)."""
    from reasoning_gym import factory

    return sorted(set(factory.DATASETS) - set(LEFT_OUT))


def gym_domains() -> dict[str, GymDomain]:
    """The family for `DomainRegistry.add_family`: domain name -> domain."""
    return {PREFIX + name: GymDomain(name) for name in dataset_names()}


def tier_configs(dataset: str) -> list[dict[str, Any]]:
    """One configuration per tier, from the dataset's curriculum (or its defaults). A level
    whose configuration the dataset itself rejects is left out (a few curricula start below
    their dataset's own minimum); with none left, the defaults are the one tier."""
    from reasoning_gym import factory

    if dataset not in factory.CURRICULA:
        return [{}]
    curriculum = factory.create_curriculum(dataset)
    levels = max((len(a.levels) for a in curriculum.attributes.values()), default=1)
    out = []
    cap = TIER_CAPS.get(dataset, (MAX_TIERS, ""))[0]
    for level in range(min(levels, MAX_TIERS, cap)):
        curriculum.set_global_level(level)
        cfg = curriculum.generate_configuration()  # shallow: nested configs stay objects
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                  if f.name not in ("seed", "size")}
        try:  # validates the configuration; items are made on demand, not here
            with quiet():
                _gym().create_dataset(dataset, seed=0, size=1, **fields)
        except Exception:  # noqa: BLE001 - the dataset refuses its own curriculum's level
            continue
        out.append(fields)
    return out or [{}]


class GymDomain:
    """One reasoning-gym dataset as a domain; see the module docstring."""

    resource = "cpu"
    multi_turn = False

    def __init__(self, dataset: str) -> None:
        self.dataset = dataset
        self.name = PREFIX + dataset
        self.description = f"reasoning-gym's {dataset} tasks, scored by its own scorer"

    @functools.cached_property
    def _configs(self) -> list[dict[str, Any]]:
        return tier_configs(self.dataset)

    @functools.cached_property
    def generator_version(self) -> str:
        """What the task a seed draws depends on: reasoning-gym's version, the tiers'
        configurations and this adapter's code (its prompt and reference). Sets of drawn
        tasks kept on disk (held-out sets) are kept under it."""
        from importlib.metadata import version

        adapter = hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:16]
        configs = json.dumps(self._configs, sort_keys=True, default=repr)
        return f"reasoning-gym {version('reasoning-gym')} adapter {adapter} tiers {configs}"

    @property
    def tiers(self) -> tuple[Tier, ...]:  # type: ignore[override]
        return tuple(Tier(level=k, name=f"level-{k}",
                          description=f"the {self.dataset} curriculum at global level {k}")
                     for k in range(len(self._configs)))

    def item(self, spec: GymSpec) -> tuple[Any, dict[str, Any]]:
        """(the dataset, the item) a spec names; the same item every time. The last few are
        kept: a group's samples verify against one task, and some datasets read a word list
        of 150,000 lines each time one is made (group_anagrams, figlet_font: 0.2 s)."""
        check_tier(self, spec.tier)
        return self._made(spec.dataset, spec.seed, spec.tier)

    @functools.lru_cache(maxsize=ITEMS_KEPT)  # on the method: a domain lives as its process
    def _made(self, dataset: str, seed: int, tier: int) -> tuple[Any, dict[str, Any]]:
        with quiet():
            ds = _gym().create_dataset(dataset, seed=seed, size=1, **self._configs[tier])
            return ds, ds[0]

    def _task(self, tier: int, seed: int, task_id: str,
              source: str = "generated") -> TaskSpec:
        spec = GymSpec(dataset=self.dataset, tier=tier, seed=seed)
        ds, entry = self.item(spec)
        answer = entry.get("answer")
        reference = None
        if answer is not None and _scores_one(ds, str(answer), entry):
            reference = f"<answer>{answer}</answer>"
        return TaskSpec(task_id=task_id, domain=self.name, tier=tier,
                        prompt=f"{entry['question']}\n\n{ANSWER_HINT}",
                        spec=msgspec.to_builtins(spec), reference=reference, source=source)

    def sample_task(self, rng: random.Random, tier: int) -> TaskSpec:
        """An item by a fresh seed; a seed the generator fails on is skipped (a few
        generators have corner cases), up to `SEED_TRIES` times."""
        check_tier(self, tier)
        for attempt in range(SEED_TRIES):
            seed = rng.getrandbits(31)  # numpy-seeded generators take seed + index < 2**32
            try:
                return self._task(tier, seed, f"{self.name}-t{tier}-{seed:08x}")
            except Exception as exc:  # noqa: BLE001 - reasoning-gym's own failure
                if attempt == SEED_TRIES - 1:
                    raise RuntimeError(f"{self.name} tier {tier}: {SEED_TRIES} seeds in a row "
                                       f"failed to generate; last: {exc!r}") from exc
        raise AssertionError("unreachable")

    def task_from_row(self, row: Mapping[str, Any], *, where: str) -> TaskSpec:
        r = decode_row(row, GymRow, where=where)
        check_tier(self, r.tier)
        return self._task(r.tier, r.seed, r.task_id or f"{self.name}-t{r.tier}-{r.seed:08x}",
                          source="jsonl")

    def load_tasks(self, path: str | Path) -> list[TaskSpec]:
        return load_jsonl(path, lambda row, where: self.task_from_row(row, where=where))

    def prompt(self, task: TaskSpec) -> str:
        return task.prompt

    async def verify(self, task: TaskSpec, completion: str) -> Verdict:
        spec = msgspec.convert(task.spec, GymSpec)
        answer = _gym().utils.extract_answer(completion, tag_name="answer")
        if answer is None:
            return Verdict(reward=0.0, outcome="fail", reason="no <answer>...</answer> tag",
                           checks=[Check(name="answer_tag", passed=False)])
        check_tier(self, spec.tier)
        try:  # in the scorer's worker: a model-written answer can make it compute for minutes
            score = await trio.to_thread.run_sync(
                worker().score, spec.dataset, spec.tier, spec.seed, answer)
        except Exception as exc:  # noqa: BLE001 - the scorer broke on this answer: say so
            return Verdict(reward=0.0, outcome="error", reason=str(exc)[:300])
        passed = score >= 1.0
        return Verdict(reward=score, outcome="pass" if passed else "fail",
                       reason=f"{self.dataset} scorer: {score:g}",
                       checks=[Check(name="score", passed=passed)])


def score_answer(ds: Any, answer: str, entry: dict[str, Any]) -> float:
    """The dataset's scorer on `answer`, checked to be a reward in [0, 1]."""
    with quiet():
        score = float(ds.score_answer(answer, entry))
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"a score outside [0, 1]: {score}")
    return score


def _scores_one(ds: Any, answer: str, entry: dict[str, Any]) -> bool:
    try:
        return score_answer(ds, answer, entry) == 1.0
    except Exception:  # noqa: BLE001 - a reference its own scorer rejects is no reference
        return False
