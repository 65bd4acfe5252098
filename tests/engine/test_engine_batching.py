"""Continuous batching, prefix sharing, admission control, aborts and weight swaps in the engine."""

from __future__ import annotations

import msgspec
import pytest
import torch
from engine_helpers import GREEDY, Collector, make_engine, submit
from reinforge.engine.loader import load_model, load_weights
from reinforge.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def alone(model, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    engine, sink = make_engine(model), Collector()
    submit(engine, sink, "x", prompt, params)
    engine.run_until_idle()
    return sink.finals["x"].output_ids


PROMPTS = [[5, 6, 7, 8] * 5, [100, 200, 300], [42] * 37, list(range(10, 60))]


def test_requests_join_and_leave_the_running_batch_without_changing_their_outputs(model):
    engine, sink = make_engine(model), Collector()
    short = msgspec.structs.replace(GREEDY, max_new_tokens=3)
    submit(engine, sink, "a", PROMPTS[0])
    submit(engine, sink, "b", PROMPTS[1], short)
    running = []
    for _ in range(2):
        engine.step()
        running.append(engine.statistics().num_running_reqs)
    submit(engine, sink, "c", PROMPTS[2])  # joins while a is mid-generation
    submit(engine, sink, "d", PROMPTS[3], short)
    while not engine.is_idle():
        engine.step()
        running.append(engine.statistics().num_running_reqs)
    assert running[0] == 2 and max(running) == 3 and running[-1] == 0  # b left, c and d joined
    assert len(sink.finals["b"].output_ids) == 3
    for rid, prompt, params in [
        ("a", PROMPTS[0], GREEDY),
        ("b", PROMPTS[1], short),
        ("c", PROMPTS[2], GREEDY),
        ("d", PROMPTS[3], short),
    ]:
        assert sink.finals[rid].output_ids == alone(model, prompt, params), rid
    assert engine.pool.num_free == engine.pool.num_blocks


def test_the_n_samples_of_a_prompt_share_its_full_prompt_pages(model):
    engine, sink = make_engine(model, block_size=16), Collector()
    prompt = PROMPTS[2]  # 37 tokens: 2 full pages shared, the tail page copied
    submit(engine, sink, "g", prompt, msgspec.structs.replace(GREEDY, n=4))
    engine.step()
    per_seq = -(-(37 + 12) // 16)  # 4 pages each without sharing
    assert engine.pool.num_blocks - engine.pool.num_free == 2 + 4 * (per_seq - 2)
    engine.run_until_idle()
    outs = [sink.finals[f"g-{j}"] for j in range(4)]
    expect = alone(model, prompt)
    assert all(u.output_ids == expect for u in outs)  # the copied tail page is right for each
    assert [u.cached_tokens for u in outs] == [0, 32, 32, 32]
    assert engine.pool.num_free == engine.pool.num_blocks


def test_seeded_samples_repeat_and_differ_between_samples(model):
    params = SamplingParams(
        max_new_tokens=10, temperature=1.0, n=3, sampling_seed=11, ignore_eos=True
    )
    runs = []
    for _ in range(2):
        engine, sink = make_engine(model), Collector()
        submit(engine, sink, "s", PROMPTS[1], params)
        engine.run_until_idle()
        runs.append([sink.finals[f"s-{j}"].output_ids for j in range(3)])
    assert runs[0] == runs[1]
    assert len({tuple(o) for o in runs[0]}) == 3


def test_a_full_cache_queues_requests_instead_of_failing(model):
    engine, sink = make_engine(model, max_total_tokens=16 * 10, block_size=16), Collector()
    params = msgspec.structs.replace(GREEDY, max_new_tokens=30)  # 20 + 30 tokens: 4 pages each
    for i in range(6):
        submit(engine, sink, f"q{i}", PROMPTS[0], params)
    most = 0
    while not engine.is_idle():
        engine.step()
        most = max(most, engine.statistics().num_running_reqs)
    assert most == 2  # 10 pages hold two requests at a time
    assert len(sink.finals) == 6 and all(len(u.output_ids) == 30 for u in sink.finals.values())
    assert engine.pool.num_free == engine.pool.num_blocks


def test_abort_returns_partial_output_and_drops_queued_requests(model):
    engine, sink = make_engine(model, max_running_requests=1), Collector()
    long = msgspec.structs.replace(GREEDY, max_new_tokens=100)
    submit(engine, sink, "run-1", PROMPTS[0], long)
    submit(engine, sink, "wait-1", PROMPTS[1], long)
    for _ in range(3):
        engine.step()
    engine.abort("run")
    engine.abort("wait-1")
    engine.run_until_idle()
    ran, queued = sink.finals["run-1"], sink.finals["wait-1"]
    assert ran.finish_reason["type"] == "abort" and 0 < len(ran.output_ids) < 100
    assert queued.finish_reason["message"] == "Abort in waiting queue" and not queued.admitted
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_weight_swap_waits_for_the_running_batch_and_keeps_queued_requests(model, tiny_model_dir):
    new = load_weights(tiny_model_dir, model.config)
    new.layers[0].down_proj.mul_(-1.0)
    engine, sink = make_engine(model, max_running_requests=1), Collector()
    long = msgspec.structs.replace(GREEDY, max_new_tokens=20)
    submit(engine, sink, "old", PROMPTS[0], long)
    engine.step()
    fut = engine.swap_weights(new, "v2")
    submit(engine, sink, "new", PROMPTS[0], long)
    engine.run_until_idle()
    assert fut.result(timeout=0) == "v2"
    old_out, new_out = sink.finals["old"], sink.finals["new"]
    assert old_out.weight_version == "default" and new_out.weight_version == "v2"
    assert old_out.finish_reason["type"] == "length" and new_out.finish_reason["type"] == "length"
    old_weights = engine.model.weights
    engine.model.weights = load_weights(tiny_model_dir, model.config)
    assert old_out.output_ids == alone(engine.model, PROMPTS[0], long)
    engine.model.weights = old_weights
    assert new_out.output_ids == alone(engine.model, PROMPTS[0], long)
    model.weights = load_weights(tiny_model_dir, model.config)  # restore the shared fixture


def test_prompt_logprobs_and_max_new_tokens_zero_score_the_prompt(model, hf_tiny):
    hf, _ = hf_tiny
    engine, sink = make_engine(model), Collector()
    prompt = PROMPTS[3]
    submit(engine, sink, "score", prompt, SamplingParams(max_new_tokens=0), logprob_start_len=0)
    engine.run_until_idle()
    u = sink.finals["score"]
    assert u.output_ids == [] and u.finish_reason == {"type": "length", "length": 0}
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1)
    want = lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).flatten()
    assert u.input_logprobs[0] is None
    assert (torch.tensor(u.input_logprobs[1:]) - want).abs().max().item() < 1e-4


def test_eos_and_stop_token_ids_end_a_sequence_including_the_token(model):
    first = alone(model, PROMPTS[1])
    engine, sink = make_engine(model), Collector()
    submit(
        engine,
        sink,
        "e",
        PROMPTS[1],
        msgspec.structs.replace(GREEDY, ignore_eos=False, stop_token_ids=(first[4],)),
    )
    engine.run_until_idle()
    u = sink.finals["e"]
    assert u.output_ids == first[: first.index(first[4]) + 1]
    assert u.finish_reason == {"type": "stop", "matched": first[4]}


@pytest.mark.parametrize("kind", ["int8", "int4", "bfloat16"])
def test_quantized_caches_serve_the_same_requests_with_small_logprob_error(model, kind):
    engine, sink = make_engine(model, kv_cache_dtype=kind), Collector()
    ref, ref_sink = make_engine(model), Collector()
    for e, s in ((engine, sink), (ref, ref_sink)):
        submit(e, s, "k", PROMPTS[3], msgspec.structs.replace(GREEDY, max_new_tokens=6),
               logprob_start_len=0)
        e.run_until_idle()
    got, want = sink.finals["k"], ref_sink.finals["k"]
    assert len(got.output_ids) == 6
    assert engine.pool.bytes_per_token() < ref.pool.bytes_per_token()
    # the prompt attends over its KV as stored (quantized): its 49 logprobs, teacher-forced
    errs = [abs(a - b) for a, b in zip(got.input_logprobs[1:], want.input_logprobs[1:])]
    assert len(errs) == 49
    assert sum(errs) / len(errs) < {"int8": 0.08, "int4": 0.6, "bfloat16": 0.02}[kind]


def test_the_tvm_and_torch_kv_ops_give_the_engine_the_same_outputs(model):
    outs = []
    for backend in ("tvm", "torch"):
        engine, sink = (
            make_engine(model, kv_cache_dtype="int8", kernel_backend=backend),
            Collector(),
        )
        submit(engine, sink, "t", PROMPTS[3], msgspec.structs.replace(GREEDY, max_new_tokens=10))
        engine.run_until_idle()
        outs.append(sink.finals["t"])
        assert engine.pool.ops.name.startswith(backend)
    assert outs[0].output_ids == outs[1].output_ids
    err = max(abs(a - b) for a, b in zip(outs[0].output_logprobs, outs[1].output_logprobs))
    assert err < 1e-3


def test_a_failing_step_aborts_every_request_instead_of_hanging(model):
    engine, sink = make_engine(model), Collector()
    submit(engine, sink, "a", PROMPTS[0])
    engine.step()
    submit(engine, sink, "b", PROMPTS[1])
    real = engine.model.decode

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    engine.model.decode = broken
    try:
        import threading

        t = threading.Thread(target=engine.run_forever)
        t.start()
        for _ in range(200):
            if len(sink.finals) == 2:
                break
            threading.Event().wait(0.05)
        engine.stop()
        t.join(timeout=10)
    finally:
        engine.model.decode = real
    assert {u.finish_reason["status_code"] for u in sink.finals.values()} == {500}
    assert "boom" in sink.finals["a"].finish_reason["message"]
    assert engine.pool.num_free == engine.pool.num_blocks
