"""The rm-synthetic domain: its reward is the reward model's forward pass through a
sigmoid, the hidden rule is reported but never rewarded, and a reward model that is not
configured, missing or broken is infra_error, never a 0."""

import math
import random

import torch
import trio
from reinforge.envs.domains.reward_model import RewardModelDomain
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
