"""Held-out sets: a reviewed problem joins its domain's set once, only for the domains and
tiers evaluated, and a file that is not a review set is refused by its line; a domain that
names its generator's version keeps its generated set on disk and draws it once."""

from __future__ import annotations

import json
import random

import pytest

from reinforge.envs.domain import DomainRegistry, TaskSpec, Tier
from reinforge.envs.tasksets import TaskFileError
from reinforge.rl.evalsets import HeldOutConfig, build_heldout


def review_row(task_id: str, tier: int, question: str, answer: str, domain: str = "math"):
    return {"prompt": question, "response": "#### 1", "score": 0.0, "domain": domain,
            "task": {"task_id": task_id, "domain": domain, "tier": tier, "prompt": question,
                     "spec": {"question": question, "answer": answer}}}


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_reviewed_problems_join_the_sets_of_evaluated_domains_and_tiers_once(tmp_path):
    rows = [review_row("math-a@3", 0, "Compute 1 + 1.", "2"),
            review_row("math-a@9", 0, "compute  1 + 1.", "2"),  # the same problem again
            review_row("math-b@4", 2, "Compute 9 * 9.", "81"),  # a tier not evaluated
            review_row("docqa-c@1", 0, "Which year?", "2020", domain="docqa")]
    config = HeldOutConfig(tasks_per_tier=0, tiers=[0],
                           review_sets=[write_rows(tmp_path / "r.jsonl", rows)])
    sets = build_heldout(DomainRegistry.default(), ["math"], config)
    assert [(t.task_id, t.prompt, t.spec["answer"]) for t in sets["math"]] == [
        ("reviewed-math-a@3", "Compute 1 + 1.", "2")]
    assert list(sets) == ["math"]


def test_a_file_that_is_not_a_review_set_is_refused_naming_its_line(tmp_path):
    rows = [review_row("math-a", 0, "Compute 1 + 1.", "2"), {"prompt": "p", "response": "r"}]
    config = HeldOutConfig(tasks_per_tier=0, review_sets=[write_rows(tmp_path / "r.jsonl", rows)])
    with pytest.raises(TaskFileError, match=r"r\.jsonl:2: no `task` in this row"):
        build_heldout(DomainRegistry.default(), ["math"], config)


class CountingFakeDomain:
    """A fake generator (unit test of the cache above it): it counts its draws."""

    def __init__(self, name: str, generator_version: str | None) -> None:
        self.name = name
        self.tiers = tuple(Tier(level=k, name=f"t{k}", description="") for k in (0, 1))
        self.draws = 0
        if generator_version is not None:
            self.generator_version = generator_version

    def sample_task(self, rng: random.Random, tier: int) -> TaskSpec:
        self.draws += 1
        n = rng.randrange(10**9)
        return TaskSpec(task_id=f"{self.name}-{n}", domain=self.name, tier=tier,
                        prompt=f"tier {tier} question {n}", spec={"n": n})


def test_a_versioned_generators_held_out_set_is_drawn_once_and_read_back_the_same(tmp_path):
    registry = DomainRegistry()
    config = HeldOutConfig(tasks_per_tier=3)
    first = CountingFakeDomain("fam", "v1")
    registry.attach(first)
    made = build_heldout(registry, ["fam"], config, cache=tmp_path)["fam"]
    assert first.draws == 6 and len(made) == 6
    # a new process (a new domain object), the same version: read back, nothing drawn
    again = CountingFakeDomain("fam", "v1")
    registry.attach(again, name="fam")
    assert build_heldout(registry, ["fam"], config, cache=tmp_path)["fam"] == made
    assert again.draws == 0
    # another version, or other tiers, or a file cut short: drawn again
    for domain, cfg in ((CountingFakeDomain("fam", "v2"), config),
                        (CountingFakeDomain("fam", "v1"), HeldOutConfig(tasks_per_tier=3,
                                                                        tiers=[1]))):
        registry.attach(domain, name="fam")
        build_heldout(registry, ["fam"], cfg, cache=tmp_path)
        assert domain.draws == 3 * len(cfg.tiers or [0, 1])
    kept = sorted(tmp_path.iterdir())
    assert len(kept) == 3 and all(p.name.startswith("fam-") for p in kept)
    for path in kept:
        path.write_bytes(path.read_bytes()[:40])
    cut = CountingFakeDomain("fam", "v1")
    registry.attach(cut, name="fam")
    assert build_heldout(registry, ["fam"], config, cache=tmp_path)["fam"] == made
    assert cut.draws == 6
    # the generator draws what it drew without a cache
    plain = CountingFakeDomain("fam", None)
    registry.attach(plain, name="fam")
    assert build_heldout(registry, ["fam"], config, cache=tmp_path / "none")["fam"] == made
    assert plain.draws == 6 and not (tmp_path / "none").exists()  # unversioned: not kept


def test_a_held_out_set_kept_under_older_rules_is_drawn_again(tmp_path, monkeypatch):
    """The key held the generator's version but not the rules that draw from it: a change
    to how a small bank is split would have read back sets split the old way."""
    from reinforge.rl import evalsets

    registry = DomainRegistry()
    config = HeldOutConfig(tasks_per_tier=3)
    registry.attach(CountingFakeDomain("fam", "v1"))
    build_heldout(registry, ["fam"], config, cache=tmp_path)
    monkeypatch.setattr(evalsets, "HELDOUT_RULES", evalsets.HELDOUT_RULES + 1)
    later = CountingFakeDomain("fam", "v1")
    registry.attach(later, name="fam")
    build_heldout(registry, ["fam"], config, cache=tmp_path)
    assert later.draws == 6 and len(list(tmp_path.iterdir())) == 2
