"""Speculative decoding by prompt lookup: drafts from the sequence's own n-grams, verified in
one pass; greedy outputs, the sampling distribution and the logprobs are those of plain
decoding."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch
from engine_helpers import GREEDY, Collector, make_engine, submit
from reinforge.engine.loader import load_model
from reinforge.engine.model import Model
from reinforge.engine.sampling import SamplingParams, token_logprobs, truncation_mask
from reinforge.engine.speculative import NgramIndex, accept

PROMPT = [5, 6, 7, 8] * 10


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def echo_model(model):
    """The tiny policy with every attention and MLP output zeroed: each next-token
    distribution depends on the current token alone, so outputs repeat and drafts are
    accepted (the verification path's every branch runs, through the real forward)."""
    layers = [dataclasses.replace(layer, o_proj=torch.zeros_like(layer.o_proj),
                                  down_proj=torch.zeros_like(layer.down_proj))
              for layer in model.weights.layers]
    return Model(model.config, dataclasses.replace(model.weights, layers=layers), model.rope)


def generate(model, prompt, params, **config):
    engine, sink = make_engine(model, **config), Collector()
    submit(engine, sink, "x", prompt, params)
    engine.run_until_idle()
    assert engine.pool.num_free == engine.pool.num_blocks
    return sink.finals["x"], engine.statistics()


def test_the_ngram_index_drafts_what_followed_the_latest_earlier_occurrence_of_the_tail():
    index = NgramIndex([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2], max_n=3)
    assert index.draft(3) == [3, 4, 5]  # "1 2" last seen before the tail at positions 4-5
    index.extend([3])
    assert index.draft(2) == [4, 5]  # the 3-gram "1 2 3" beats the 1-gram "3"
    assert NgramIndex([1, 2, 3], max_n=3).draft(4) == []  # the tail is not its own match
    assert NgramIndex([7, 8, 7, 8], max_n=2).draft(5) == [7, 8, 7, 8, 7]  # a short period


@pytest.mark.parametrize("which", ["model", "echo_model"])
def test_greedy_speculative_decoding_emits_exactly_the_tokens_and_logprobs_of_plain_decoding(
        which, request):
    m = request.getfixturevalue(which)
    params = msgspec.structs.replace(GREEDY, max_new_tokens=48)
    plain, _ = generate(m, PROMPT, params)
    spec, stats = generate(m, PROMPT, params, speculative_num_draft_tokens=4)
    assert spec.output_ids == plain.output_ids
    assert torch.allclose(torch.tensor(spec.output_logprobs), torch.tensor(plain.output_logprobs),
                          atol=1e-5)
    assert stats.spec_draft_tokens > 0


def test_on_repetitive_outputs_most_drafts_are_accepted_and_steps_are_saved(echo_model):
    params = msgspec.structs.replace(GREEDY, max_new_tokens=48)
    _, plain = generate(echo_model, PROMPT, params)
    _, spec = generate(echo_model, PROMPT, params, speculative_num_draft_tokens=4)
    assert spec.spec_accepted_tokens >= 0.8 * spec.spec_draft_tokens
    assert spec.steps < plain.steps / 2


def test_sampled_tokens_carry_the_logprobs_teacher_forced_scoring_gives(echo_model):
    params = SamplingParams(max_new_tokens=40, temperature=1.0, top_p=0.9, ignore_eos=True,
                            sampling_seed=3)
    got, stats = generate(echo_model, PROMPT, params, speculative_num_draft_tokens=4)
    assert len(got.output_ids) == 40 and stats.spec_accepted_tokens > 0
    engine, sink = make_engine(echo_model), Collector()
    scored = PROMPT + got.output_ids
    submit(engine, sink, "s", scored, SamplingParams(max_new_tokens=0, temperature=1.0),
           logprob_start_len=len(PROMPT))
    engine.run_until_idle()
    assert torch.allclose(torch.tensor(sink.finals["s"].input_logprobs),
                          torch.tensor(got.output_logprobs), atol=1e-4)


def test_verification_keeps_the_policys_sampling_distribution_exactly():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]] * 2)
    lp = token_logprobs(logits, 1.0)
    keep = truncation_mask(lp, torch.tensor([3, 3]), torch.tensor([1.0, 1.0]),
                           torch.tensor([0.0, 0.0]))  # top-3
    want = lp[0].exp() * keep[0]
    want = want / want.sum()
    trials, counts = 40_000, torch.zeros(5)
    for d in (1, 3):  # a likely draft, and one the truncation forbids
        counts.zero_()
        for _ in range(trials):
            counts[accept([d], lp, keep, greedy=False, generator=None)[0][0]] += 1
        assert (counts / trials - want).abs().max() < 0.01, (d, counts / trials, want)


def test_drafts_stop_at_max_new_tokens_and_a_stop_token_inside_a_draft_ends_the_output(
        echo_model):
    plain, _ = generate(echo_model, PROMPT, msgspec.structs.replace(GREEDY, max_new_tokens=48))
    for n in (1, 5, 7):
        got, _ = generate(echo_model, PROMPT, msgspec.structs.replace(GREEDY, max_new_tokens=n),
                          speculative_num_draft_tokens=4)
        assert got.output_ids == plain.output_ids[:n]
    stop = plain.output_ids[9]
    first = plain.output_ids.index(stop)
    got, _ = generate(echo_model, PROMPT,
                      msgspec.structs.replace(GREEDY, max_new_tokens=48, stop_token_ids=(stop,)),
                      speculative_num_draft_tokens=4)
    assert got.output_ids == plain.output_ids[: first + 1]
    assert got.finish_reason == {"type": "stop", "matched": stop}
