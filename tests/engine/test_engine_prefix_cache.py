"""The prefix cache across requests: reuse of earlier requests' KV pages, exactness against
prefilling whole, LRU eviction under memory pressure, flushes on a weight swap and on request."""

from __future__ import annotations

import msgspec
import pytest
import torch
from engine_helpers import GREEDY, Collector, make_engine, submit
from reinforge.engine.kvpool import KVPool
from reinforge.engine.loader import load_model, load_weights
from reinforge.engine.prefix_cache import PrefixCache

PROMPT = list(range(100, 137))  # 37 tokens: 2 full 16-token pages, then a tail


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def run(engine, prompt, rid="r", params=GREEDY, **kw):
    sink = Collector()
    submit(engine, sink, rid, prompt, params, **kw)
    engine.run_until_idle()
    if params.n == 1:
        return sink.finals[rid]
    return [sink.finals[f"{rid}-{j}"] for j in range(params.n)]


def owners(engine) -> list[int]:
    return [engine.pool.refcount(b) for b in range(engine.pool.num_blocks)]


def test_a_resent_prompt_reuses_its_full_pages_and_generates_exactly_what_a_whole_prefill_does(
        model):
    cold = make_engine(model)  # float32 cache, no prefix cache
    want = run(cold, PROMPT)
    engine = make_engine(model, prefix_cache=True)
    first, again = run(engine, PROMPT), run(engine, PROMPT)
    assert (first.cached_tokens, again.cached_tokens) == (0, 32)
    for got in (first, again):
        assert got.output_ids == want.output_ids
        assert torch.allclose(torch.tensor(got.output_logprobs),
                              torch.tensor(want.output_logprobs), atol=1e-5)
    assert engine.statistics().cached_tokens == 32
    # idle: every page still held is the cache's alone
    held = [r for r in owners(engine) if r]
    assert set(held) == {1} and len(held) == engine.prefix_cache.num_pages


def test_the_next_turn_of_an_episode_reuses_the_pages_of_the_last_prompt_and_its_output(model):
    params = msgspec.structs.replace(GREEDY, max_new_tokens=30)
    engine = make_engine(model, prefix_cache=True)
    first = PROMPT + [7, 8, 9]  # 40 tokens
    turn1 = run(engine, first, params=params)
    history = first + turn1.output_ids + [5, 6, 7, 8, 9]  # 75 tokens
    turn2 = run(engine, history, rid="t2", params=params)
    # 40 + 30 tokens, the last output token's KV never written: 69 -> 4 full pages
    assert turn2.cached_tokens == 64
    assert turn2.output_ids == run(make_engine(model), history, params=params).output_ids


def test_the_samples_of_a_group_start_from_the_cached_prefix_of_an_earlier_request(model):
    engine = make_engine(model, prefix_cache=True)
    run(engine, PROMPT)
    group = run(engine, PROMPT, rid="g", params=msgspec.structs.replace(GREEDY, n=4))
    want = run(make_engine(model), PROMPT).output_ids
    assert [u.cached_tokens for u in group] == [32, 32, 32, 32]
    assert all(u.output_ids == want for u in group)


def test_a_request_for_its_prompt_logprobs_prefills_the_whole_prompt(model):
    engine = make_engine(model, prefix_cache=True)
    run(engine, PROMPT)
    scored = run(engine, PROMPT, rid="lp", logprob_start_len=0)
    assert scored.cached_tokens == 0 and len(scored.input_logprobs) == len(PROMPT)


def test_under_memory_pressure_the_least_recently_used_pages_go_first(model):
    # 12 pages; each request holds 4 (37 + 12 tokens) while it runs and leaves 3 cached
    engine = make_engine(model, prefix_cache=True, max_total_tokens=16 * 12)
    prompts = [[p] * 37 for p in range(1, 8)]
    for i, p in enumerate(prompts):
        assert run(engine, p, rid=f"p{i}").cached_tokens == 0
        assert engine.pool.num_free + engine.prefix_cache.num_pages == engine.pool.num_blocks
    # 7 prompts x 3 pages did not all fit: the oldest were evicted, the newest kept
    assert run(engine, prompts[-1], rid="new").cached_tokens == 32
    assert run(engine, prompts[0], rid="old").cached_tokens == 0


def test_eviction_never_takes_a_page_a_running_sequence_holds(model):
    pool = KVPool(model.config, kind="float32", num_blocks=6, block_size=4, backend="torch")
    cache = PrefixCache(pool)
    a, b = pool.allocate(2), pool.allocate(2)
    cache.insert([1] * 8, a, 2)
    cache.insert([2] * 8, b, 2)
    pool.release(a)  # a's request finished: only the cache holds its pages
    assert cache.evict(4) == 2  # b's pages are still in use by their request
    assert cache.match([2] * 8, 2) == b and cache.match([1] * 8, 2) == []
    assert pool.num_free == 4


def test_a_weight_swap_flushes_the_cache(model, tiny_model_dir):
    engine = make_engine(model, prefix_cache=True)
    run(engine, PROMPT)
    assert engine.prefix_cache.num_pages == 3  # 37 + 12 tokens, 48 of them written
    fut = engine.swap_weights(load_weights(tiny_model_dir, model.config), "v2")
    engine.step()
    assert fut.result(timeout=5) == "v2" and engine.prefix_cache.num_pages == 0
    assert engine.pool.num_free == engine.pool.num_blocks
    assert run(engine, PROMPT, rid="after").cached_tokens == 0


def test_flush_cache_drops_every_page_once_nothing_runs(model):
    engine = make_engine(model, prefix_cache=True)
    run(engine, PROMPT)
    run(engine, [9] * 40, rid="b")
    fut = engine.flush_cache()
    engine.run_until_idle()
    assert fut.result(timeout=5) == 3 + 3
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_long_history_resent_is_prefilled_from_the_end_of_its_cached_prefix(model):
    long = [(7 * i) % 900 + 20 for i in range(300)]
    engine = make_engine(model, prefix_cache=True, chunked_prefill_size=64)
    first = run(engine, long)
    history = long + first.output_ids + [5, 6]  # 314 tokens
    before = engine.statistics().prompt_tokens
    again = run(engine, history, rid="again")
    # 300 + 12 tokens, the last one's KV unwritten: 19 full pages reused, 10 tokens prefilled
    assert again.cached_tokens == 304
    assert engine.statistics().prompt_tokens - before == 10
    assert again.output_ids == run(make_engine(model, chunked_prefill_size=-1), history).output_ids
