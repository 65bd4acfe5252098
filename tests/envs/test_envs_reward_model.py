"""The rm-synthetic domain: its reward is the reward model's forward pass through a
sigmoid (an ensemble's: mean minus the spread of its models' passes), the hidden rule is
reported but never rewarded, and a reward model that is not configured, missing or broken is
infra_error, never a 0."""

import math
import random

import torch
import trio
import pytest
from reinforge.envs.domains.reward_model import RewardModelDomain, ensemble_score
from reinforge.rl.reward_model import encode, load_reward_model, scores


def test_the_reward_is_the_models_forward_pass_and_the_gold_rule_is_only_reported(
        tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    rm_dir = tmp_path / "rm"
    torch.manual_seed(0)
    model = load_reward_model(tiny_model_dir)
    model.save_pretrained(str(rm_dir))
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.save_pretrained(str(rm_dir))
    domain = RewardModelDomain(model_path=str(rm_dir))
    task = domain.sample_task(random.Random(0), 0)
    answers = [task.reference, "no"]

    async def main():
        return [await domain.verify(task, a) for a in answers]

    verdicts = trio.run(main)
    model.eval()
    model.config.pad_token_id = tok.pad_token_id
    with torch.no_grad():
        want = [float(scores(model, [encode(tok, task.prompt, a)], tok.pad_token_id)[0])
                for a in answers]
    for v, w in zip(verdicts, want, strict=True):
        assert math.isclose(v.reward, 1 / (1 + math.exp(-w)), rel_tol=1e-5)
        assert float(v.checks[0].detail) == round(w, 4)
    assert [c.passed for v in verdicts for c in v.checks if c.name == "gold"] == [True, False]


def test_a_reward_model_not_configured_missing_or_broken_is_infra_error(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    task = RewardModelDomain().sample_task(random.Random(1), 0)

    async def main():
        return [await RewardModelDomain(model_path=p).verify(task, task.reference)
                for p in ("", str(tmp_path / "missing"), str(broken))]

    verdicts = trio.run(main)
    assert [v.outcome for v in verdicts] == ["infra_error"] * 3
    assert all(v.reward == 0.0 for v in verdicts)
    assert "no reward model configured" in verdicts[0].reason


def test_an_ensemble_rewards_the_mean_of_its_models_less_their_spread(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    dirs, models = [], []
    for seed in (1, 2):  # two heads initialised apart: two models that disagree
        torch.manual_seed(seed)
        model = load_reward_model(tiny_model_dir)
        model.save_pretrained(str(tmp_path / f"rm{seed}"))
        tok.save_pretrained(str(tmp_path / f"rm{seed}"))
        dirs.append(str(tmp_path / f"rm{seed}"))
        models.append(model.eval())
    domain = RewardModelDomain(model_path=dirs, spread_penalty=0.5)
    task = domain.sample_task(random.Random(3), 0)
    verdict = trio.run(domain.verify, task, task.reference)
    with torch.no_grad():
        each = [float(scores(mdl, [encode(tok, task.prompt, task.reference)],
                             tok.pad_token_id)[0]) for mdl in models]
    mean, std = sum(each) / 2, abs(each[0] - each[1]) / 2
    assert each[0] != pytest.approx(each[1], abs=1e-3)
    assert verdict.reward == pytest.approx(1 / (1 + math.exp(-(mean - 0.5 * std))), rel=1e-5)
    assert "mean - 0.5 x std of" in verdict.checks[0].detail
    assert ensemble_score([1.0, 3.0], 1.0) == 1.0 and ensemble_score([2.0], 3.0) == 2.0
    with pytest.raises(ValueError, match="spread_penalty"):
        RewardModelDomain(model_path=dirs, spread_penalty=-1)
