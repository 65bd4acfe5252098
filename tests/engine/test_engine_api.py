"""The request bodies (engine/api.py): what they accept, and as what. The 400s for bad bodies
are tested against the real server, in test_engine_server.py."""

from __future__ import annotations

from reinforge.engine.api import (
    AbortRequest,
    GenerateRequest,
    PauseRequest,
    UpdateWeightsRequest,
    decode,
)
from reinforge.engine.sampling import TOP_K_ALL


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_sampling_params_take_sglang_spellings_and_null_means_default():
    req = decode(
        b'{"text": "hi", "sampling_params": {"max_new_tokens": null, "top_k": -1,'
        b' "stop": "###", "temperature": 0, "repetition_penalty": 1.0, "seed": null,'
        b' "logit_bias": {"5": 2.0}, "stream_interval": 4}}',
        GenerateRequest,
    )
    p = req.sampling_params
    assert not isinstance(p, list)
    assert (p.max_new_tokens, p.top_k, p.stop, p.greedy) == (128, TOP_K_ALL, ("###",), True)
    assert isinstance(p.temperature, float)


def test_a_request_is_one_prompt_or_a_batch_with_per_prompt_values():
    one = decode(b'{"input_ids": [1, 2], "rid": "a"}', GenerateRequest)
    assert (one.batched, one.size, one.prompts(None)) == (False, 1, [[1, 2]])
    batch = decode(
        b'{"input_ids": [[1], [2, 3]], "return_logprob": [true, false],'
        b' "logprob_start_len": 0, "sampling_params": [{"top_p": 0.5}, {}]}',
        GenerateRequest,
    )
    assert (batch.batched, batch.size, batch.n) == (True, 2, 1)
    assert [p.top_p for p in batch.per_prompt(batch.sampling_params)] == [0.5, 1.0]
    assert batch.per_prompt(batch.return_logprob) == [True, False]
    assert batch.per_prompt(batch.logprob_start_len) == [0, 0]
    texts = decode(b'{"text": ["ab", "c"], "input_ids": null}', GenerateRequest)
    assert texts.prompts(CharTokenizer()) == [[97, 98], [99]]
    both = decode(b'{"text": "ab", "input_ids": [7]}', GenerateRequest)
    assert both.prompts(CharTokenizer()) == [[7]]  # input_ids wins
    empty = decode(b'{"input_ids": []}', GenerateRequest)
    assert empty.prompts(None) == [[]]  # refused by the server as a semantic error


def test_keys_outside_sampling_params_are_ignored_and_empty_bodies_are_defaults():
    req = decode(
        b'{"text": "a", "lora_path": null, "return_hidden_states": false}', GenerateRequest
    )
    assert req.text == "a" and req.rid is None and req.stream is False
    weights = decode(b'{"model_path": "/m", "flush_cache": true}', UpdateWeightsRequest)
    assert weights == UpdateWeightsRequest(model_path="/m")
    assert decode(b"", AbortRequest) == AbortRequest(rid="", abort_all=False)
    assert decode(b"{}", PauseRequest).mode == "abort"


def test_the_client_drops_an_idle_connection_before_any_server_would_close_it():
    # At httpx's default 5 s the client kept idle connections exactly as long as uvicorn and
    # hypercorn do, and a request could go out on one the server was closing.
    from reinforge.engine.server import SERVER_KEEP_ALIVE_S
    from reinforge.rollout.client import CLIENT_KEEP_ALIVE_S, RolloutClient

    pool = RolloutClient("http://127.0.0.1:1")._http._transport._pool
    assert pool._keepalive_expiry == CLIENT_KEEP_ALIVE_S < 5.0 < SERVER_KEEP_ALIVE_S
