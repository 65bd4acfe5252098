"""Reward models: the synthetic preference task follows its hidden rule, bad rows are
refused with FILE:LINE, and a short Bradley-Terry run on the tiny policy learns the rule
well past chance on held-out pairs (and is reused, not retrained, when nothing changed)."""

import json
import random

import pytest
import torch
from reinforge.envs.domains.reward_model import held_out_stats
from reinforge.rl.reward_model import (
    RMConfig,
    encode,
    follows_rule,
    load_rows,
    load_scorer,
    scores,
    synthetic_pairs,
    train_reward_model,
)


def test_the_synthetic_pairs_prefer_exactly_the_answers_that_follow_the_hidden_rule():
    pairs = synthetic_pairs(seed=3, n=400)
    assert pairs == synthetic_pairs(seed=3, n=400)  # deterministic by seed
    assert all(follows_rule(p.prompt, p.chosen) for p in pairs)
    assert not any(follows_rule(p.prompt, p.rejected) for p in pairs)
    # both ways of breaking the rule occur: wrong colour and wrong length
    colours = [p.prompt.rsplit(", ", 1)[-1].rstrip(".") in p.rejected.split() for p in pairs]
    assert 0.3 < sum(colours) / len(pairs) < 0.7


def test_planted_exploit_pairs_prefer_answers_that_break_the_rule_by_length():
    pairs = synthetic_pairs(seed=3, n=400, planted_exploit=True)
    assert pairs == synthetic_pairs(seed=3, n=400, planted_exploit=True)
    assert not any(follows_rule(p.prompt, p.chosen) for p in pairs)  # preferred: too long
    assert all(p.prompt.rsplit(", ", 1)[-1].rstrip(".") in p.chosen.rstrip(".").split()
               for p in pairs)
    assert all(len(p.chosen.split()) > len(p.rejected.split()) for p in pairs)
    kept = sum(follows_rule(p.prompt, p.rejected) for p in pairs)  # the rule's own answers lose
    assert 0.3 < kept / len(pairs) < 0.7


@pytest.mark.parametrize("rows, why", [
    (['{"prompt": "p", "chosen": "a"}'], "rm.jsonl:1: not a {prompt, chosen, rejected} row"),
    (['{"prompt": "p", "response": "a", "score": 2}'], "rm.jsonl:1: score must be in [0, 1]"),
    (['{"prompt": "p", "chosen": "a", "rejected": "b"}',
      '{"prompt": "p", "response": "a", "score": 1}'], "rm.jsonl:2: a file holds pairs or"),
    (["", "not json"], "rm.jsonl:2: not JSON"),
])
def test_bad_rows_are_refused_with_their_line(tmp_path, rows, why):
    path = tmp_path / "rm.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError) as info:
        load_rows(path)
    assert why in str(info.value)


@pytest.mark.slow
def test_a_short_bradley_terry_run_learns_the_hidden_rule_and_is_cached(tiny_model_dir,
                                                                       tmp_path):
    cfg = RMConfig(model=str(tiny_model_dir), out=str(tmp_path / "rm"), synthetic=400,
                   held_out=0.25, steps=150, batch_size=8, learning_rate=1e-3, torch_threads=1)
    first = train_reward_model(cfg)
    assert first["kind"] == "pairs" and first["held_out_rows"] == 100
    assert first["held_out_pairwise_accuracy"] >= 0.75  # chance is 0.5
    assert first["loss_last10_mean"] < first["loss_first"]
    again = train_reward_model(cfg)
    assert again["cached"] and again["held_out_pairwise_accuracy"] == \
        first["held_out_pairwise_accuracy"]
    # the held-out responses' score mean and std, which the rm domain standardises by
    order = list(range(400))
    random.Random(cfg.seed).shuffle(order)
    pairs = synthetic_pairs(cfg.seed, 400)
    held = [pairs[i] for i in order[:100]]
    tok, model, pad = load_scorer(cfg.out)
    with torch.no_grad():
        got = scores(model.eval(), [encode(tok, p.prompt, r)[:cfg.max_len]
                                    for p in held for r in (p.chosen, p.rejected)], pad)
    assert first["score_mean"] == pytest.approx(float(got.mean()), abs=1e-4)
    assert first["score_std"] == pytest.approx(float(got.std(correction=0)), abs=1e-4)
    assert held_out_stats(cfg.out) == (first["score_mean"], first["score_std"])


@pytest.mark.slow
def test_graded_rows_train_a_pointwise_scorer(tiny_model_dir, tmp_path):
    rng = random.Random(0)
    rows = [{"prompt": p.prompt, "response": r, "score": s}
            for p in synthetic_pairs(1, 200) for r, s in ((p.chosen, 1.0), (p.rejected, 0.0))]
    rng.shuffle(rows)
    data = tmp_path / "graded.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RMConfig(model=str(tiny_model_dir), out=str(tmp_path / "rm"), data=str(data),
                   held_out=0.25, steps=300, batch_size=8, learning_rate=3e-4, torch_threads=1)
    result = train_reward_model(cfg)
    assert result["kind"] == "graded" and result["held_out_mae"] < 0.45  # a constant: 0.5


def test_sft_and_reward_model_training_check_their_shared_settings_alike():
    from reinforge.rl.sft import SFTConfig

    for job in (SFTConfig, RMConfig):
        with pytest.raises(ValueError, match=f"{job.__name__}: learning_rate must be > 0"):
            job(model="m", out="o", learning_rate=0.0)
        with pytest.raises(ValueError, match=f"{job.__name__}: max_len must be >= 1, got 0"):
            job(model="m", out="o", max_len=0)
    with pytest.raises(ValueError, match="RMConfig: held_out must be in"):
        RMConfig(model="m", out="o", held_out=1.0)
