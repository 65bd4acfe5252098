"""Calibrating a judge model against labels: the figures (pure), the built-in labelled set,
and the whole path against a real `reinforge serve` (the tiny policy: its P(YES) must be
the model's own, from a forward pass here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trio
from reinforge.envs.domains.judge import RubricItem, RuleItemJudge, SGLangJudgeClient, judge_prompt
from reinforge.envs.domains.judge_calibration import (
    calibration_figures,
    load_labels,
    p_yes_of,
    synthetic_labels,
)
from reinforge.envs.tasksets import TaskFileError

ROOT = Path(__file__).resolve().parents[2]


def test_agreement_and_calibration_figures_of_a_small_set_by_hand():
    # parsed: (yes, yes) (yes, no) (no, no); the second item's reply did not parse
    f = calibration_figures(labels=[True, True, False, False],
                            decisions=[True, None, True, False], p_yes=[0.9, 0.6, 0.7, 0.2])
    assert f["confusion"] == {"tp": 1, "fp": 1, "tn": 1, "fn": 0, "unparsed": 1}
    assert f["parsed"] == 0.75 and f["accuracy"] == pytest.approx(2 / 3)
    assert f["cohen_kappa"] == pytest.approx(0.4)  # chance agreement 4/9
    assert (f["precision"], f["recall"]) == (0.5, 1.0)
    assert f["brier"] == pytest.approx(0.175)
    assert f["auroc"] == pytest.approx(0.75)  # 0.6 < 0.7: one of four pairs misordered
    assert f["ece"] == pytest.approx(0.35)  # one item per bin: mean |p - label|
    assert f["accuracy_at_p_half"] == 0.75
    assert [(r["bin"], r["n"]) for r in f["reliability"]] == [
        ([0.2, 0.3], 1), ([0.6, 0.7], 1), ([0.7, 0.8], 1), ([0.9, 1.0], 1)]


def test_a_judge_that_never_parses_has_no_agreement_figures_but_still_a_calibration():
    f = calibration_figures([True, False], [None, None], [0.5, 0.5])
    assert (f["accuracy"], f["cohen_kappa"], f["judge_yes"]) == (None, None, None)
    assert f["auroc"] == 0.5 and f["brier"] == 0.25


def test_p_yes_normalises_over_yes_and_no():
    assert p_yes_of({"YES": -1.0, "NO": -1.0}) == 0.5
    assert p_yes_of({"YES": -800.0, "NO": -801.0}) == pytest.approx(1 / (1 + torch.e ** -1))


def test_the_built_in_labelled_set_is_balanced_seeded_and_agrees_with_the_rule():
    items = synthetic_labels(60, seed=3)
    assert len(items) == 60 and sum(i.label for i in items) == 30
    assert items == synthetic_labels(60, seed=3) and items != synthetic_labels(60, seed=4)

    async def rule(item):
        from reinforge.envs.domains.judge_calibration import _built_in_tasks

        (rubric_item,) = [r for t in _built_in_tasks() for r in t.rubric
                          if t.instruction == item.instruction and r.criterion == item.criterion]
        return (await RuleItemJudge().judge_item(instruction=item.instruction,
                                                 answer=item.answer, item=rubric_item)).passed

    assert [trio.run(rule, i) for i in items] == [i.label for i in items]
    with pytest.raises(ValueError, match="has 1690 items, asked for 5000"):
        synthetic_labels(5000)


def test_a_bad_labelled_row_names_its_line(tmp_path):
    path = tmp_path / "labels.jsonl"
    path.write_text('{"instruction": "i", "answer": "a", "criterion": "c", "label": true}\n'
                    '{"instruction": "i", "answer": "a", "criterion": "c", "label": "maybe"}\n')
    with pytest.raises(TaskFileError, match=r"labels.jsonl:2: Expected `bool`, got `str` - at "
                                            r"`\$.label`"):
        load_labels(path)


def test_the_judges_p_yes_is_the_served_models_own(server_url, tiny_model_dir):
    """log P(YES | question) from the server's input logprobs is a forward pass of the
    model here, on the same template ids, to the error of the server's int8 KV cache (its
    default: 1e-3 relative), and P(YES) to 0.005."""
    from transformers import AutoModelForCausalLM

    from reinforge.rl.prompts import task_prompt_ids

    client = SGLangJudgeClient(url=server_url, chat_template=True)
    prompt = judge_prompt("Name one fruit.", "Mars.", RubricItem(criterion="names a fruit"),
                          "00000000abcd")
    got = trio.run(client.answer_logprobs, prompt, ("YES", "NO"))
    tok = client.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = task_prompt_ids(tok, prompt)
    want = {}
    for answer in ("YES", "NO"):
        tail = tok.encode(answer, add_special_tokens=False)
        with torch.inference_mode():
            lp = torch.log_softmax(hf(torch.tensor([ids + tail])).logits[0], -1)
        want[answer] = sum(lp[len(ids) - 1 + k, t].item() for k, t in enumerate(tail))
        assert got[answer] == pytest.approx(want[answer], rel=1e-3)
    assert p_yes_of(got) == pytest.approx(p_yes_of(want), abs=0.005)


def test_reinforge_judge_calibrate_against_a_real_server_prints_its_figures(server_url):
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "reinforge", "judge", "calibrate", "--url", server_url,
         "--synthetic", "8", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["items"] == 8 and out["labelled_yes"] == 0.5 and out["labels"] == "synthetic"
    assert sum(r["n"] for r in out["reliability"]) == 8
    assert len(out["items_asked"]) == 8 and all(0 < i["p_yes"] < 1 for i in out["items_asked"])
    # the tiny policy never answers YES or NO: no agreement, said so
    assert out["parsed"] == 0.0 and out["accuracy"] is None
    assert "agreement: accuracy n/a" in proc.stderr and "8/8 items asked" in proc.stderr


def test_reinforge_judge_calibrate_refuses_a_missing_labels_file(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "reinforge", "judge", "calibrate", "--url",
         "http://127.0.0.1:9", "--labels", str(tmp_path / "none.jsonl")],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "none.jsonl: no such file" in proc.stderr
