"""Chunked prefill: a long prompt is prefilled over several steps within a per-step token
budget while running sequences keep decoding, with the outputs of a whole prefill."""

from __future__ import annotations

import msgspec
import pytest
import torch
from engine_helpers import GREEDY, Collector, make_engine, submit
from reinforge.engine.engine import EngineConfig
from reinforge.engine.loader import load_model, load_weights

LONG = [(7 * i) % 900 + 20 for i in range(300)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def test_a_prompt_prefilled_in_chunks_generates_what_a_whole_prefill_does(model):
    outs = {}
    for chunk in (-1, 64, 37):
        engine, sink = make_engine(model, chunked_prefill_size=chunk), Collector()
        submit(engine, sink, "x", LONG, msgspec.structs.replace(GREEDY, n=2))
        engine.run_until_idle()
        outs[chunk] = [sink.finals[f"x-{j}"] for j in range(2)]
        assert engine.pool.num_free == engine.pool.num_blocks
    for chunk in (64, 37):
        for got, want in zip(outs[chunk], outs[-1]):
            assert got.output_ids == want.output_ids
            assert torch.allclose(torch.tensor(got.output_logprobs),
                                  torch.tensor(want.output_logprobs), atol=1e-4)


def test_running_sequences_decode_a_token_every_step_while_a_long_prompt_is_prefilled(model):
    engine, sink = make_engine(model, chunked_prefill_size=64), Collector()
    submit(engine, sink, "short", [1, 2, 3], msgspec.structs.replace(GREEDY, max_new_tokens=40),
           stream=True)
    engine.step()
    submit(engine, sink, "long", LONG, stream=True)
    short_tokens, prefilled = [], []
    while "long" not in {u.rid for u in sink.updates if u.output_ids}:
        before = engine.statistics().prompt_tokens
        engine.step()
        prefilled.append(engine.statistics().prompt_tokens - before)
        short_tokens.append(len(next(u for u in reversed(sink.updates)
                                     if u.rid == "short").output_ids))
    assert prefilled == [64, 64, 64, 64, 44]  # 300 tokens within a 64-token budget per step
    assert short_tokens == list(range(short_tokens[0], short_tokens[0] + 5))  # one per step
    engine.run_until_idle()


def test_the_step_budget_is_shared_by_the_prompts_being_prefilled_oldest_first(model):
    engine, sink = make_engine(model, chunked_prefill_size=64), Collector()
    submit(engine, sink, "a", LONG[:100])
    submit(engine, sink, "b", LONG[100:200])
    prefilled = []
    for _ in range(4):
        before = engine.statistics().prompt_tokens
        engine.step()
        prefilled.append(engine.statistics().prompt_tokens - before)
    assert prefilled == [64, 64, 64, 8]
    engine.run_until_idle()
    for rid, prompt in (("a", LONG[:100]), ("b", LONG[100:200])):
        alone, s = make_engine(model, chunked_prefill_size=-1), Collector()
        submit(alone, s, rid, prompt)
        alone.run_until_idle()
        assert sink.finals[rid].output_ids == s.finals[rid].output_ids


def test_aborting_the_first_sample_mid_prefill_leaves_the_others_whole(model):
    engine, sink = make_engine(model, chunked_prefill_size=32), Collector()
    submit(engine, sink, "g", LONG, msgspec.structs.replace(GREEDY, n=3))
    engine.step()
    engine.abort("g-0", exact=True)
    engine.run_until_idle()
    assert sink.finals["g-0"].finish_reason["type"] == "abort"
    whole, s = make_engine(model, chunked_prefill_size=-1), Collector()
    submit(whole, s, "w", LONG)
    whole.run_until_idle()
    assert [sink.finals[f"g-{j}"].output_ids for j in (1, 2)] == [s.finals["w"].output_ids] * 2
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_request_for_its_prompt_logprobs_is_prefilled_whole_in_one_step(model):
    engine, sink = make_engine(model, chunked_prefill_size=16), Collector()
    submit(engine, sink, "lp", LONG, logprob_start_len=0, stream=True)
    engine.step()
    assert len(sink.updates[-1].input_logprobs) == len(LONG) and sink.updates[-1].output_ids


def test_a_weight_swap_waits_for_a_prompt_being_prefilled(model, tiny_model_dir):
    engine, sink = make_engine(model, chunked_prefill_size=64), Collector()
    submit(engine, sink, "x", LONG, msgspec.structs.replace(GREEDY, max_new_tokens=2))
    engine.step()
    fut = engine.swap_weights(load_weights(tiny_model_dir, model.config), "v2")
    engine.step()
    assert not fut.done()  # still prefilling: its tokens must all come from one version
    engine.run_until_idle()
    assert fut.result(timeout=5) == "v2" and sink.finals["x"].weight_version == "default"


def test_a_chunk_budget_of_zero_is_refused():
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        EngineConfig(chunked_prefill_size=0)


def test_a_step_failing_as_a_prompt_leaves_prefill_still_finishes_its_samples(
        model, monkeypatch):
    import threading

    import reinforge.engine.engine as engine_module

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    engine, sink = make_engine(model, chunked_prefill_size=64), Collector()
    submit(engine, sink, "x", LONG, msgspec.structs.replace(GREEDY, n=2), logprob_start_len=0)
    monkeypatch.setattr(engine_module, "token_logprobs", broken)  # its prompt logprobs fail
    thread = threading.Thread(target=engine.run_forever)
    thread.start()
    try:
        for _ in range(200):
            if len(sink.finals) == 2:
                break
            threading.Event().wait(0.05)
    finally:
        engine.stop()
        thread.join(timeout=10)
    assert {rid: u.finish_reason["status_code"] for rid, u in sink.finals.items()} == \
        {"x-0": 500, "x-1": 500}
    assert engine.pool.num_free == engine.pool.num_blocks
