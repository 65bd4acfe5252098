"""A sampler-style client (httpx) against a real `reinforge serve` process on a free port."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(server_url: str):
    """A client of a real `reinforge serve` (tests/conftest.py's `server_url`)."""
    with httpx.Client(base_url=server_url, timeout=60) as client:
        yield client


def check_item(item: dict, *, logprobs: bool = False) -> None:
    assert set(item) >= {"text", "output_ids", "meta_info"}
    meta = item["meta_info"]
    assert set(meta) >= {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "weight_version",
        "e2e_latency",
    }
    assert meta["completion_tokens"] == len(item["output_ids"])
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    if logprobs:
        lps = meta["output_token_logprobs"]
        assert len(lps) == len(item["output_ids"])
        assert all(lp <= 0 and tok == tid for (lp, tok, _), tid in zip(lps, item["output_ids"]))


@pytest.mark.smoke
def test_generate_single_text_with_logprobs(server):
    r = server.post(
        "/generate",
        json={
            "text": "Question: What is 2 + 3?\nAnswer:",
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        },
    )
    assert r.status_code == 200
    item = r.json()
    check_item(item, logprobs=True)
    assert (
        item["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
        or item["output_ids"][-1] == 2
    )


def test_generate_batch_of_input_ids_with_n_is_ordered_prompt_major(server):
    params = {
        "max_new_tokens": 6,
        "temperature": 1.0,
        "n": 3,
        "sampling_seed": 7,
        "ignore_eos": True,
    }
    body = {"input_ids": [[5, 6, 7] * 7, [9, 10] * 3], "sampling_params": params}
    r = server.post("/generate", json=body)
    assert r.status_code == 200
    items = r.json()
    assert len(items) == 6
    for k, item in enumerate(items):
        check_item(item)
        assert item["meta_info"]["prompt_tokens"] == (21 if k < 3 else 6)
    assert items[1]["meta_info"]["cached_tokens"] == 16  # one shared 16-token page
    again = server.post("/generate", json=body).json()
    # seeded: the same tokens, though the first prompt's page now comes from the prefix cache
    assert [i["output_ids"] for i in again] == [i["output_ids"] for i in items]
    assert again[0]["meta_info"]["cached_tokens"] == 16


def test_generate_stops_on_stop_token_ids_and_stop_strings(server):
    greedy = server.post(
        "/generate",
        json={
            "input_ids": [3, 4, 5],
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
        },
    ).json()
    ids = greedy["output_ids"]
    r = server.post(
        "/generate",
        json={
            "input_ids": [3, 4, 5],
            "sampling_params": {
                "max_new_tokens": 10,
                "temperature": 0,
                "stop_token_ids": [ids[2]],
                "ignore_eos": True,
            },
        },
    ).json()
    assert r["output_ids"] == ids[: ids.index(ids[2]) + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}
    # A stop string that surely occurs mid-generation: the greedy text's second word (the
    # first may hold half a UTF-8 character), so stopping on it cuts the output short.
    text = greedy["text"]
    words = text.split()
    assert len(words) >= 3, text
    stop = words[1]
    r = server.post(
        "/generate",
        json={
            "input_ids": [3, 4, 5],
            "sampling_params": {
                "max_new_tokens": 10,
                "temperature": 0,
                "stop": [stop],
                "ignore_eos": True,
            },
        },
    ).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # SGLang's rule: the text ends just before the stop string, which is not returned.
    assert r["text"] == text[: text.index(stop)]
    n = len(r["output_ids"])
    assert n < len(ids) and r["output_ids"] == ids[:n]


def test_streaming_sends_cumulative_chunks_then_done(server):
    chunks = []
    with server.stream(
        "POST",
        "/generate",
        json={
            "text": ["a", "b"],
            "stream": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
        },
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    for index in (0, 1):
        mine = [e for e in events if e["index"] == index]
        assert [len(e["output_ids"]) for e in mine] == [1, 2, 3, 4]
        assert mine[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        assert all(e["meta_info"]["finish_reason"] is None for e in mine[:-1])


def sp(**params) -> dict:
    return {"text": "hi", "sampling_params": params}


@pytest.mark.parametrize(
    "body, message",
    [
        # a wrong type, in sampling_params or at the top
        (sp(temperature="hot"), "Expected `float`, got `str` - at `$.sampling_params.temperature`"),
        (
            sp(max_new_tokens=1.5),
            "Expected `int`, got `float` - at `$.sampling_params.max_new_tokens`",
        ),
        ({"text": "hi", "stream": "yes"}, "Expected `bool`, got `str` - at `$.stream`"),
        ({"input_ids": [1, "2"]}, "Expected `int | array`, got `str` - at `$.input_ids[1]`"),
        # a value out of bounds, also in one item of a batch or of a list
        (sp(top_p=0), "Expected `float` > 0.0 - at `$.sampling_params.top_p`"),
        (sp(temperature=-1), "Expected `float` >= 0.0 - at `$.sampling_params.temperature`"),
        (
            {"text": ["a", "b"], "sampling_params": [{}, {"n": 0}]},
            "Expected `int` >= 1 - at `$.sampling_params[1].n`",
        ),
        (sp(stop=["###", ""]), "Expected `str` of length >= 1 - at `$.sampling_params.stop[1]`"),
        ({"text": []}, "Expected `array` of length >= 1 - at `$.text`"),
        # a rule across values
        (sp(top_k=0), "top_k must be -1 (all) or >= 1 - at `$.sampling_params`"),
        (
            sp(min_new_tokens=5, max_new_tokens=2),
            "min_new_tokens must be in [0, max_new_tokens] - at `$.sampling_params`",
        ),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid has 1 entries for a batch of 2"),
        ({"input_ids": [1, [2]]}, "input_ids must be a list of integers or a list of such lists"),
        ({"rid": "x"}, "either text or input_ids must be provided"),
        # an unknown sampling_params key (SGLang's strict contract), or one not supported here
        (sp(max_tokens=4), "Object contains unknown field `max_tokens` - at `$.sampling_params`"),
        (
            sp(seed=1),
            "unknown field `seed`: use `sampling_seed` (SGLang's name) - at `$.sampling_params`",
        ),
        (
            sp(repetition_penalty=1.2),
            (
                "repetition_penalty is not supported by the embedded server (only 1.0)"
                " - at `$.sampling_params`"
            ),
        ),
        # not an object
        (["hi"], "Expected `object`, got `array`"),
    ],
)
def test_bad_generate_bodies_are_a_400_naming_the_field_path(server, body, message):
    r = server.post("/generate", json=body)
    assert (r.status_code, r.json()) == (400, {"error": message})


def test_bad_bodies_of_the_other_endpoints_are_400s_naming_the_field_path(server):
    r = server.post("/abort_request", json={"rid": 5})
    assert (r.status_code, r.json()) == (400, {"error": "Expected `str`, got `int` - at `$.rid`"})
    r = server.post("/pause_generation", json={"mode": 1})
    assert (r.status_code, r.json()) == (400, {"error": "Expected `str`, got `int` - at `$.mode`"})
    r = server.post("/update_weights_from_disk", json={"model_path": "", "weight_version": "v9"})
    assert r.status_code == 400 and r.json() == {
        "success": False,
        "message": "Expected `str` of length >= 1 - at `$.model_path`",
        "num_paused_requests": 0,
    }
    r = server.post("/update_weights_from_disk", json={"weight_version": "v9"})
    assert r.json()["message"] == "Object missing required field `model_path`"


def test_null_means_the_default_and_unknown_top_level_keys_are_ignored(server):
    # What a client that serializes SGLang's request classes sends.
    body = {
        "input_ids": [3, 4, 5],
        "text": None,
        "rid": None,
        "return_logprob": None,
        "lora_path": None,
        "sampling_params": {"max_new_tokens": 2, "temperature": None, "logit_bias": None},
    }
    r = server.post("/generate", json=body)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= 2


def test_too_long_or_empty_prompts_and_empty_or_malformed_bodies_are_400s(server):
    r = server.post("/generate", json={"input_ids": [1] * 5000})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    r = server.post("/generate", json={"input_ids": []})
    assert (r.status_code, r.json()) == (
        400,
        {"error": {"message": "prompt 0 is empty (0 tokens)"}},
    )
    assert server.post("/generate", json={}).status_code == 400
    r = server.post("/generate", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"].startswith("JSON is malformed")


def test_info_health_and_cache_endpoints(server):
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate").status_code == 200
    info = server.get("/get_model_info").json()
    assert info["is_generation"] and info["model_type"] == "qwen2" and "weight_version" in info
    sinfo = server.get("/get_server_info").json()
    assert sinfo["kv_cache_dtype"] == "int8" and sinfo["max_total_num_tokens"] == 8192
    assert server.get("/v1/models").json()["data"][0]["id"] == info["served_model_name"]
    assert server.get("/v1/loads").json()["loads"][0]["num_running_reqs"] >= 0
    body = {"input_ids": [11, 12, 13] * 8, "sampling_params": {"max_new_tokens": 2}}
    server.post("/generate", json=body)

    def cache_pages() -> int:
        return server.get("/get_server_info").json()["internal_states"][0]["prefix_cache_pages"]

    assert cache_pages() >= 1 and not sinfo["disable_radix_cache"]
    assert server.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 16
    r = server.post("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed")
    assert cache_pages() == 0  # really flushed: the same prompt is prefilled whole again
    assert server.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0


def test_abort_request_returns_partial_output_with_abort_reason(server):
    import threading

    result = {}

    def long_request():
        result["r"] = server.post(
            "/generate",
            json={
                "text": "x",
                "rid": "abort-me-1",
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
            },
        )

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.0)
    busy = server.post("/flush_cache")
    assert busy.status_code == 400  # SGLang refuses to flush while requests run
    assert server.post("/abort_request", json={"rid": "abort-me"}).status_code == 200
    t.join(timeout=60)
    item = result["r"].json()
    assert result["r"].status_code == 200
    assert item["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(item["output_ids"]) < 1500


def test_update_weights_from_disk_swaps_weights_and_version(server, tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    body = {
        "input_ids": [3, 4, 5],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    }
    before = server.post("/generate", json=body).json()
    other = tmp_path / "v2"  # the learner's next checkpoint: same architecture, new weights
    other.mkdir()
    for f in tiny_model_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    state = load_file(str(other / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    save_file(state, str(other / "model.safetensors"), metadata={"format": "pt"})
    r = server.post(
        "/update_weights_from_disk", json={"model_path": str(other), "weight_version": "v2"}
    )
    assert (
        r.status_code == 200
        and r.json()["success"] is True
        and r.json()["num_paused_requests"] == 0
    )
    assert server.get("/get_model_info").json()["weight_version"] == "v2"
    after = server.post("/generate", json=body).json()
    assert after["meta_info"]["weight_version"] == "v2"
    assert after["output_ids"] != before["output_ids"]
    r = server.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
    assert r.status_code == 400 and r.json()["success"] is False
    r = server.post(
        "/update_weights_from_disk",
        json={"model_path": str(tiny_model_dir), "weight_version": "v3"},
    )
    assert (
        r.json()["success"]
        and server.post("/generate", json=body).json()["output_ids"] == before["output_ids"]
    )


def test_a_client_that_drops_a_stream_stops_its_generation(server):
    def generated() -> int:
        return server.get("/get_server_info").json()["internal_states"][0]["generated_tokens"]

    before = generated()
    with server.stream(
        "POST",
        "/generate",
        json={
            "text": "x",
            "stream": True,
            "rid": "dropped-stream",
            "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True},
        },
    ) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        load = server.get("/v1/loads").json()["loads"][0]
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
            break
        time.sleep(0.2)
    assert load["num_running_reqs"] == 0
    assert generated() - before < 1900  # aborted, not run to the end


def test_the_serve_flags_for_speculative_decoding_chunked_prefill_and_no_prefix_cache(
        server, serve_tiny):
    body = {"input_ids": [5, 6, 7, 8] * 12,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    flags = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "3",
             "--chunked-prefill-size", "32", "--disable-radix-cache"]
    with serve_tiny(*flags) as url, httpx.Client(base_url=url, timeout=60) as other:
        got = [other.post("/generate", json=body).json() for _ in range(2)]
        info = other.get("/get_server_info").json()
    assert (info["speculative_algorithm"], info["speculative_num_draft_tokens"],
            info["chunked_prefill_size"], info["disable_radix_cache"]) == ("NGRAM", 3, 32, True)
    assert info["internal_states"][0]["spec_draft_tokens"] > 0
    assert got[1]["meta_info"]["cached_tokens"] == 0  # no prefix cache
    # the same greedy tokens as the default server (int8 cache both)
    default = server.post("/generate", json=body).json()["output_ids"]
    assert [g["output_ids"] for g in got] == [default, default]


def test_a_server_with_int8_weights_says_so_generates_and_keeps_the_format_across_updates(
        serve_tiny, tiny_model_dir):
    body = {"input_ids": [3, 4, 5, 6], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    with serve_tiny("--weight-dtype", "int8") as url, \
            httpx.Client(base_url=url, timeout=60) as other:
        info = other.get("/get_server_info").json()
        first = other.post("/generate", json=body).json()
        r = other.post("/update_weights_from_disk",
                       json={"model_path": str(tiny_model_dir), "weight_version": "v1"})
        again = other.post("/generate", json=body).json()
        after = other.get("/get_server_info").json()
    assert (info["weight_dtype"], info["weight_kernel_path"]) == ("int8", "tvm-gemv")
    assert len(first["output_ids"]) == 6
    assert all(lp <= 0 for lp, _, _ in first["meta_info"]["output_token_logprobs"])
    assert r.json()["success"] and after["weight_dtype"] == "int8"
    assert after["layer_ops_path"] == "tvm-layer"  # norms and rotations ran as TVM kernels
    assert again["output_ids"] == first["output_ids"]  # the same weights, packed the same way


def test_a_server_process_given_no_log_path_removes_its_scratch_folder_when_stopped(
        tiny_model_dir):
    import trio
    from reinforge.rollout.client import RolloutClient
    from reinforge.rollout.server import ServerProcess, ServerSpec

    server = ServerProcess(ServerSpec(model_path=str(tiny_model_dir)))
    scratch = server.log_path.parent

    async def served_model() -> str:
        async with RolloutClient(await server.wait_url(120.0), timeout_s=30) as client:
            return str((await client.model_info())["model_path"])

    server.start()
    try:
        assert trio.run(served_model) == str(tiny_model_dir)
        assert server.log_path.is_file() and scratch.is_dir()
    finally:
        server.stop()
    assert not scratch.exists()
