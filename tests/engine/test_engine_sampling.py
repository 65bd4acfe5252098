"""Sampling parameters (SGLang's names and checks) and the sampling maths, by hand."""

from __future__ import annotations

import math
import re

import pytest
import torch
from reinforge.engine.sampling import (
    TOP_K_ALL,
    SamplingParams,
    sample_tokens,
    token_logprobs,
    truncation_mask,
)


def test_defaults_and_normalisation_match_sglang():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.n) == (128, 1.0, 1.0, TOP_K_ALL, 1)
    assert SamplingParams(top_k=-1).top_k == TOP_K_ALL
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="###").stop == ("###",)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top_k": 0}, "top_k must be -1 (all) or >= 1"),
        (
            {"min_new_tokens": 5, "max_new_tokens": 2},
            "min_new_tokens must be in [0, max_new_tokens]",
        ),
    ],
)
def test_rules_the_bounds_cannot_express_hold_for_every_instance(kwargs, message):
    # The bounds themselves are checked on decoding: tests/engine/test_engine_server.py.
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_logprobs_are_temperature_scaled_and_greedy_uses_temperature_one():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    lp = token_logprobs(logits, torch.tensor([0.5, 0.0]))
    z = math.exp(4) + math.exp(2) + 1
    assert lp[0, 0].item() == pytest.approx(4 - math.log(z), abs=1e-6)
    assert lp[1, 0].item() == pytest.approx(2 - math.log(math.exp(2) + math.exp(1) + 1), abs=1e-6)


def test_truncation_keeps_top_k_then_top_p_then_min_p():
    lp = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    one = lambda k=TOP_K_ALL, p=1.0, m=0.0: truncation_mask(  # noqa: E731
        lp, torch.tensor([k]), torch.tensor([p]), torch.tensor([m])
    )[0].tolist()
    assert one() == [True] * 4
    assert one(k=2) == [True, True, False, False]
    assert one(p=0.7) == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 crosses: kept
    assert one(p=0.5) == [True, False, False, False]
    assert one(m=0.2) == [True, True, True, False]  # keeps p >= 0.2 * 0.5
    assert one(k=3, p=0.95) == [True, True, True, False]


def test_sampling_follows_the_distribution_and_never_picks_a_truncated_token():
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    rows = 20000
    lp = probs.log().expand(rows, -1).contiguous()
    greedy = torch.zeros(rows, dtype=torch.bool)
    got = sample_tokens(lp, greedy, None, [None] * rows)
    freq = torch.bincount(got, minlength=4).float() / rows
    assert (freq - probs).abs().max().item() < 0.015
    keep = torch.tensor([[True, False, True, False]]).expand(rows, -1)
    got = sample_tokens(lp, greedy, keep, [None] * rows)
    assert set(got.tolist()) == {0, 2}


def test_greedy_rows_take_the_argmax_and_seeded_rows_repeat():
    lp = torch.log_softmax(torch.randn(6, 50), dim=-1)
    greedy = torch.tensor([True, False, True, False, False, False])

    def gens():
        out = []
        for seed in (None, 1, None, 2, 1, 3):
            g = None if seed is None else torch.Generator().manual_seed(seed)
            out.append(g)
        return out

    a = sample_tokens(lp, greedy, None, gens())
    b = sample_tokens(lp, greedy, None, gens())
    assert a[0] == lp[0].argmax() and a[2] == lp[2].argmax()
    assert a[[1, 3, 4, 5]].tolist() == b[[1, 3, 4, 5]].tolist()


def test_sampling_params_are_frozen():
    with pytest.raises(AttributeError):
        SamplingParams().n = 3  # type: ignore[misc]
