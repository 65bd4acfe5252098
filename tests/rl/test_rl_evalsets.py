"""Review sets in held-out sets: a reviewed problem joins its domain's set once, only for the
domains and tiers evaluated, and a file that is not a review set is refused by its line."""

from __future__ import annotations

import json

import pytest

from reinforge.envs.domain import DomainRegistry
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
