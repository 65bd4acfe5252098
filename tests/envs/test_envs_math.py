"""The math domain: generated tiers, JSONL sets, and answers that must not be gamed."""

import json
import random

import pytest
import trio
from reinforge.envs.domains.math import MathDomain
from reinforge.envs.tasksets import TaskFileError


def verify(domain, task, completion):
    return trio.run(domain.verify, task, completion)


@pytest.mark.parametrize("tier", range(5))
def test_reference_completions_score_one_on_every_tier(tier):
    d = MathDomain()
    rng = random.Random(tier)
    for _ in range(20):
        task = d.sample_task(rng, tier)
        v = verify(d, task, task.reference)
        assert (v.reward, v.outcome) == (1.0, "pass"), (task.prompt, task.reference, v)


@pytest.mark.parametrize("tier", [1, 2, 3])
def test_worked_steps_are_true_and_each_does_one_operation_ending_at_the_answer(tier):
    from fractions import Fraction

    d = MathDomain()
    rng = random.Random(100 + tier)
    for _ in range(50):
        task = d.sample_task(rng, tier)
        *steps, final = task.reference.splitlines()
        assert len(steps) >= 2, task.reference  # a demonstration shows how, not only what
        for step in steps:
            left, right = step.split(" = ")
            a, op, b = left.split(" ")  # one operation per line: small enough to learn
            assert op in "+-*"
            assert Fraction(eval(left)) == Fraction(right), step
        assert steps[-1].split(" = ")[1] == final.removeprefix("#### ")


def test_generation_is_seeded():
    d = MathDomain()
    assert d.sample_task(random.Random(7), 3) == d.sample_task(random.Random(7), 3)
    assert d.sample_task(random.Random(7), 3) != d.sample_task(random.Random(8), 3)


def test_tier_zero_is_a_short_one_digit_addition():
    task = MathDomain().sample_task(random.Random(1), 0)
    a, b = task.spec["question"].removeprefix("Compute ").rstrip(".").split(" + ")
    assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9
    assert len(task.prompt.split()) < 15 and len(task.reference.split()) <= 2


def test_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="tiers 0..4"):
        MathDomain().sample_task(random.Random(0), 5)


def _task(answer="3/4"):
    return MathDomain().task_from_row({"question": "q?", "answer": answer}, where="f:1")


@pytest.mark.parametrize("completion", ["#### 0.75", r"\boxed{\frac{3}{4}}", "#### 3/4", "0.75"])
def test_equivalent_answers_pass(completion):
    assert verify(MathDomain(), _task(), completion).reward == 1.0


@pytest.mark.parametrize(
    "completion, why",
    [
        ("#### 0.76", "near miss"),
        ("#### 0.75 #### 0.5", "hedging between two answers"),
        (r"\boxed{0.75} \boxed{1/2}", "hedging with boxes"),
        ("the answer is 0.75 or 0.5 or 3/4", "unmarked list of numbers"),
        ("3/4 is wrong, #### 1", "marked wrong answer after the right number"),
        ("", "empty"),
        ("#### ", "empty marker"),
    ],
)
def test_bad_and_gaming_answers_score_zero(completion, why):
    v = verify(MathDomain(), _task(), completion)
    assert (v.reward, v.outcome) == (0.0, "fail"), why


def test_gsm8k_and_math_rows_load_as_they_are(tmp_path):
    path = tmp_path / "set.jsonl"
    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
        {"problem": "Half of 3?", "solution": r"It is $\boxed{\frac{3}{2}}$.", "level": "1"},
        {"question": "Pi to 2 places?", "answer": 3.14, "rel_tol": 0.001, "tier": 2},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n# a comment\n")
    d = MathDomain()
    tasks = d.load_tasks(path)
    assert [t.spec["answer"] for t in tasks] == ["7", r"\frac{3}{2}", "3.14"]
    assert tasks[2].tier == 2 and all(t.source == "jsonl" for t in tasks)
    assert verify(d, tasks[0], "#### 7").reward == 1.0
    assert verify(d, tasks[1], "#### 1.5").reward == 1.0
    assert verify(d, tasks[2], "#### 3.1416").reward == 1.0
    assert verify(d, tasks[2], "#### 3.2").reward == 0.0


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"answer": "3"}', "needs a non-empty `question`"),
        ('{"question": "q"}', "needs `answer`"),
        ('{"question": "q", "answer": "3", "tier": "hard"}', "tier"),
    ],
)
def test_malformed_lines_are_refused_with_their_line_number(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "ok?", "answer": "1"}\n' + line + "\n")
    with pytest.raises(TaskFileError, match=f"bad.jsonl:2: .*{message}"):
        MathDomain().load_tasks(path)
