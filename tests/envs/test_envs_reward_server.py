"""A reward model behind SGLang's `/classify` (`reinforge serve --is-embedding`): its scores
are the model's forward pass, sequences waiting together share a pass, the rm domain
rewards through it as through the folder, and a model's held-out score statistics put its
scores on one scale."""

from __future__ import annotations

import asyncio
import math
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
import trio
from reinforge.engine.reward_server import ScoreBatcher
from reinforge.envs.domains.reward_model import RewardModelDomain, standardised
from reinforge.rl import checkpoint as ckpt
from reinforge.rl.reward_model import encode, load_scorer, scores

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A reward model (an untrained head on the tiny policy) saved as `rm train` saves one,
    its held-out score statistics in the manifest."""
    from reinforge.rl.reward_model import load_reward_model

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("rm") / "rm"
    ckpt.save_model_checkpoint(out, model=load_reward_model(tiny_model_dir),
                               tokenizer_src=tiny_model_dir, version=0,
                               extra={"summary": {"score_mean": 0.25, "score_std": 2.0}})
    return out


def forward(rm_dir, prompt, answers):
    tok, model, pad = load_scorer(rm_dir)
    with torch.no_grad():
        return tok, [float(x) for x in scores(model.eval(), [encode(tok, prompt, a)
                                                             for a in answers], pad)]


def test_a_list_is_scored_in_one_pass_and_each_score_is_the_models(rm_dir, serve_model):
    answers = ["a red kite", "no", "the old blue boat near the quiet garden"]
    tok, want = forward(rm_dir, "Describe a thing.", answers)
    with serve_model(rm_dir, "--is-embedding") as url:
        ids = [encode(tok, "Describe a thing.", a) for a in answers]
        got = httpx.post(f"{url}/classify", json={"input_ids": ids}, timeout=60).json()
        info = httpx.get(f"{url}/get_server_info").json()
        one = httpx.post(f"{url}/classify", json={"input_ids": ids[1]}, timeout=60).json()
        model_info = httpx.get(f"{url}/get_model_info").json()
    assert [g["embedding"][0] for g in got] == pytest.approx(want, abs=1e-5)
    assert [g["meta_info"]["prompt_tokens"] for g in got] == [len(i) for i in ids]
    assert (info["forward_passes"], info["sequences_scored"], info["largest_batch"]) == (1, 3, 3)
    assert one["embedding"][0] == pytest.approx(want[1], abs=1e-5)  # one sequence: one object
    assert model_info["is_generation"] is False and model_info["tokenizer_path"] == str(rm_dir)


OUT_OF_CONTRACT = [
    ({"text": "x", "input_ids": [1]}, "give exactly one of `text` and `input_ids`"),
    ({"text": []}, "nothing to score: the list is empty"),
    ({"input_ids": []}, "sequence 0 is empty"),
    ({"input_ids": [[1, 2], 3]}, "not a mix"),
    ({"input_ids": [[1, 2], []]}, "sequence 1 is empty"),
    ({"input_ids": [1, 10**9]}, "sequence 0 has a token id outside the vocabulary"),
    ({"input_ids": "12"}, "Expected `array | null`, got `str` - at `$.input_ids`"),
]


def test_a_request_out_of_contract_is_a_400_that_says_why(rm_dir, serve_model):
    with serve_model(rm_dir, "--is-embedding") as url:
        got = [httpx.post(f"{url}/classify", json=body, timeout=60) for body, _ in OUT_OF_CONTRACT]
        still = httpx.post(f"{url}/classify", json={"text": "a red kite"}, timeout=60)
    for r, (_, error) in zip(got, OUT_OF_CONTRACT, strict=True):
        assert r.status_code == 400 and error in r.json()["error"], (r.status_code, r.text)
    assert still.status_code == 200 and isinstance(still.json()["embedding"][0], float)


def test_sequences_waiting_together_share_forward_passes(rm_dir):
    """Ten sequences queued before the scoring thread starts: passes of four, four, two."""
    tok, model, pad = load_scorer(rm_dir)
    batcher = ScoreBatcher(model.eval(), pad, max_batch=4)
    seqs = [encode(tok, "Describe a thing.", "word " * k) for k in range(1, 11)]

    async def main():
        pending = asyncio.ensure_future(batcher.score(seqs))
        await asyncio.sleep(0)  # every sequence is queued; then the thread starts
        batcher.start()
        return await pending

    got = asyncio.run(main())
    batcher.close()
    with torch.no_grad():
        want = [float(scores(model, [s], pad)[0]) for s in seqs]
    assert got == pytest.approx(want, abs=1e-5)
    assert (batcher.passes, batcher.largest_batch, batcher.sequences) == (3, 4, 10)


def test_the_domain_rewards_through_the_server_as_through_the_folder(rm_dir, serve_model):
    """Standardised by the model's held-out statistics (mean 0.25, std 2) either way."""
    folder = RewardModelDomain(model_path=str(rm_dir))
    task = folder.sample_task(random.Random(5), 0)
    answers = [task.reference, "no"]
    _, raw = forward(rm_dir, task.prompt, answers)
    with serve_model(rm_dir, "--is-embedding") as url:
        served = RewardModelDomain(model_path=url)

        async def both():
            return ([await folder.verify(task, a) for a in answers],
                    [await served.verify(task, a) for a in answers])

        by_folder, by_server = trio.run(both)
        again = trio.run(served.verify, task, answers[0])  # a new trio run: a new client
    for f, s, r in zip(by_folder, by_server, raw, strict=True):
        z = (r - 0.25) / 2.0
        assert f.reward == pytest.approx(1 / (1 + math.exp(-z)), abs=1e-6)
        assert s.reward == pytest.approx(f.reward, abs=1e-5)
        assert s.outcome == f.outcome and s.checks[1] == f.checks[1]  # the gold check
    assert again.reward == pytest.approx(by_server[0].reward, abs=1e-6)


def test_a_dead_reward_model_server_is_infra_error_not_zero():
    from reinforge.core.ports import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    domain = RewardModelDomain(model_path=url)
    task = domain.sample_task(random.Random(1), 0)
    v = trio.run(domain.verify, task, task.reference)
    assert v.outcome == "infra_error" and v.reward == 0.0
    assert v.reason.startswith(f"reward model {url}: RewardModelUnavailable: {url} ")


def test_standardised_scores_put_models_trained_apart_on_one_scale():
    assert standardised(3.0, (1.0, 0.5)) == 4.0
    assert standardised(3.0, None) == 3.0  # a model without statistics: its raw score


def test_serving_a_reward_model_needs_is_embedding_and_a_policy_refuses_it(rm_dir,
                                                                            tiny_model_dir):
    def serve(*args):
        return subprocess.run([sys.executable, "-P", "-m", "reinforge", "serve", *args],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)

    rm = serve("--model", str(rm_dir), "--port", "0")
    assert rm.returncode == 2 and "is a reward model: serve it with --is-embedding" in rm.stderr
    policy = serve("--model", str(tiny_model_dir), "--port", "0", "--is-embedding")
    assert policy.returncode == 2 and "is not a reward model" in policy.stderr
