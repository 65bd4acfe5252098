"""The docqa domain: generated statements, per-field scoring, anti-gaming, JSONL sets."""

import json
import random

import msgspec
import pytest
import trio
from reinforge.envs.domains.docqa import DocQADomain, DocQASpec, token_f1
from reinforge.envs.tasksets import TaskFileError


def verify(task, completion):
    return trio.run(DocQADomain().verify, task, completion)


@pytest.mark.parametrize("tier", range(4))
def test_reference_completions_score_one_on_every_tier(tier):
    d = DocQADomain()
    rng = random.Random(100 + tier)
    for _ in range(15):
        task = d.sample_task(rng, tier)
        v = verify(task, task.reference)
        assert (v.reward, v.outcome) == (1.0, "pass"), (task.prompt[-300:], task.reference, v)


def test_tier_zero_is_one_small_table_and_a_direct_lookup():
    task = DocQADomain().sample_task(random.Random(3), 0)
    spec = msgspec.convert(task.spec, DocQASpec)
    assert spec.document.count("Table:") == 1 and len(spec.fields) == 1
    assert spec.fields[0].answer.replace(",", "") in spec.document.replace(",", "")
    assert len(task.prompt.split()) < 60


def test_generated_numbers_are_consistent_across_sections():
    # Tier 3: the lookup and the ratio come from different pages of an 8-page report.
    task = DocQADomain().sample_task(random.Random(5), 3)
    spec = msgspec.convert(task.spec, DocQASpec)
    assert spec.document.count("--- Page") == 8 and len(spec.fields) == 3
    assert len(spec.document.split()) > 600


def _two_fields():
    row = {
        "document": "Revenue 2023 was 530. Top region: Europe.",
        "question": "q",
        "fields": {"revenue_2023": 530, "top_region": "Europe"},
    }
    return DocQADomain().task_from_row(row, where="f:1")


def test_each_field_is_scored_on_its_own():
    task = _two_fields()
    assert verify(task, "revenue_2023: 530\ntop_region: Europe").reward == 1.0
    half = verify(task, "revenue_2023: 530\ntop_region: Asia")
    assert half.reward == 0.5 and half.outcome == "fail"
    assert [c.passed for c in half.checks] == [True, False]


@pytest.mark.parametrize("value", ["530", "$530", "530.0", "530 thousand", "530 USD"])
def test_equivalent_numbers_pass(value):
    assert verify(_two_fields(), f"revenue_2023: {value}\ntop_region: the Europe.").reward == 1.0


@pytest.mark.parametrize(
    "completion, why",
    [
        ("revenue_2023: 530 or 412\ntop_region: Europe or Asia", "several values on one line"),
        (
            "revenue_2023: 530\nrevenue_2023: 412\ntop_region: Europe\ntop_region: Asia",
            "a field answered twice differently",
        ),
        ("Revenue 2023 was 530. Top region: Europe.", "pasting the document"),
        ("revenue_2023: 531\ntop_region: Europe, Asia", "near miss and a list"),
        ("", "empty"),
    ],
)
def test_gaming_completions_score_zero(completion, why):
    assert verify(_two_fields(), completion).reward == 0.0, why


def test_single_field_accepts_the_marked_answer_but_not_hedging():
    task = DocQADomain().sample_task(random.Random(1), 0)
    good = task.spec["fields"][0]["answer"]
    assert verify(task, f"#### {good}").reward == 1.0
    assert verify(task, f"answer: {good}").reward == 1.0
    assert verify(task, f"#### {good} #### {int(good) + 1}").reward == 0.0
    assert verify(task, f"#### {int(good) + 1}").reward == 0.0


def test_token_f1_rewards_overlap_and_punishes_stuffing():
    assert token_f1("The cash flow improved", "cash flow improved") == 1.0
    assert 0 < token_f1("cash flow", "cash flow improved") < 1
    stuffed = "cash flow improved " + " ".join(f"w{i}" for i in range(30))
    assert token_f1(stuffed, "cash flow improved") < 0.2


def test_f1_fields_from_jsonl(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(
        json.dumps(
            {"document": "d", "question": "why?", "match": "f1", "answer": "higher steel prices"}
        )
        + "\n"
    )
    (task,) = DocQADomain().load_tasks(path)
    assert verify(task, "#### higher steel prices").reward == 1.0
    assert 0 < verify(task, "#### steel prices").reward < 1


@pytest.mark.parametrize(
    "row, message",
    [
        ({"question": "q", "answer": 1}, "document"),
        ({"document": "d", "question": "q"}, "exactly one of `answer` or `fields`"),
        ({"document": "d", "question": "q", "fields": {"bad name": 1}}, "must be an identifier"),
        ({"document": "d", "question": "q", "answer": 1, "match": "fuzzy"}, "match"),
    ],
)
def test_malformed_rows_are_refused_with_their_line_number(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n" + json.dumps(row) + "\n")
    with pytest.raises(TaskFileError, match=f"bad.jsonl:2: .*{message}"):
        DocQADomain().load_tasks(path)
