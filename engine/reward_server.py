"""A reward model behind SGLang's reward API: `reinforge serve --model RM_DIR --is-embedding`
answers `POST /classify` as `python -m sglang.launch_server --is-embedding` does for a reward
model, so a verifier scores against either the same way (`envs/domains/reward_model.py`).

`/classify` takes `{"text": str | [str]}` or `{"input_ids": [int] | [[int]]}` and answers,
per sequence, `{"embedding": [score], "meta_info": {"id", "prompt_tokens"}}` (a list for a
list). Also `/health`, `/get_model_info` (`is_generation: false`, the tokenizer's path) and
`/get_server_info` (what was scored, in how many forward passes).

Batching: one thread runs the model. Sequences that arrive while a forward pass runs wait
and go into the next one together (at most `max_batch`, right-padded to the longest), so
concurrent verifiers share passes without anyone waiting on a timer.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from reinforge.engine.server import contract_error, health  # the API's shapes, one place


class ClassifyRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    """One sequence (ints) or several (lists of ints), not a mix."""
    rid: str | None = None


@dataclass
class _Waiting:
    ids: list[int]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class ScoreBatcher:
    """Scores sequences with the reward model on a thread of its own, in batches of what
    is waiting when the previous pass ends."""

    def __init__(self, model: Any, pad: int, *, max_batch: int = 32) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.pad, self.max_batch = model, pad, max_batch
        self.waiting: queue.Queue[_Waiting | None] = queue.Queue()
        self.passes = 0
        self.sequences = 0
        self.largest_batch = 0
        self.thread = threading.Thread(target=self._run, name="reward-model", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.waiting.put(None)
        self.thread.join(timeout=10)

    async def score(self, batch: list[list[int]]) -> list[float]:
        loop = asyncio.get_running_loop()
        futures = []
        for ids in batch:
            fut = loop.create_future()
            self.waiting.put(_Waiting(ids, loop, fut))
            futures.append(fut)
        return list(await asyncio.gather(*futures))

    def _run(self) -> None:
        import torch

        from reinforge.rl.reward_model import scores

        while True:
            first = self.waiting.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    more = self.waiting.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self.waiting.put(None)  # stop after this pass
                    break
                batch.append(more)
            try:
                with torch.no_grad():
                    got = scores(self.model, [w.ids for w in batch], self.pad).tolist()
            except Exception as exc:  # the model failed: every waiter hears it
                for w in batch:
                    w.loop.call_soon_threadsafe(_fail, w.future, exc)
                continue
            self.passes += 1
            self.sequences += len(batch)
            self.largest_batch = max(self.largest_batch, len(batch))
            for w, value in zip(batch, got):
                w.loop.call_soon_threadsafe(_resolve, w.future, float(value))


def _resolve(fut: asyncio.Future, value: float) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future, exc: Exception) -> None:
    if not fut.done():
        fut.set_exception(exc)


class RewardServerState:
    def __init__(self, batcher: ScoreBatcher, tokenizer: Any, model_path: str,
                 context_length: int) -> None:
        self.batcher, self.tokenizer, self.model_path = batcher, tokenizer, model_path
        self.context_length = context_length
        self.started_at = time.time()


async def classify(request: Request) -> Response:
    state: RewardServerState = request.app.state.server
    try:
        req = msgspec.json.decode(await request.body(), type=ClassifyRequest)
    except msgspec.DecodeError as exc:  # ValidationError included
        return contract_error(str(exc))
    if (req.text is None) == (req.input_ids is None):
        return contract_error("give exactly one of `text` and `input_ids`")
    if req.text is not None:
        batched = isinstance(req.text, list)
        texts = req.text if batched else [req.text]
        seqs = [state.tokenizer.encode(t) for t in texts]
    else:
        batched = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        if any(isinstance(x, list) != batched for x in req.input_ids):
            return contract_error("`input_ids` is one sequence of ints or a list of them, "
                                   "not a mix")
        seqs = req.input_ids if batched else [req.input_ids]
    if not seqs:
        return contract_error("nothing to score: the list is empty")
    for k, ids in enumerate(seqs):
        if not ids:
            return contract_error(f"sequence {k} is empty")
        if len(ids) > state.context_length:
            return contract_error(f"sequence {k} has {len(ids)} tokens, more than the "
                                   f"model's context length {state.context_length}")
        if min(ids) < 0 or max(ids) >= state.batcher.model.config.vocab_size:
            return contract_error(f"sequence {k} has a token id outside the vocabulary")
    try:
        got = await state.batcher.score([list(s) for s in seqs])
    except Exception as exc:
        return JSONResponse({"error": {"message": f"reward model failed: {exc!r}"}},
                            status_code=500)
    rid = req.rid or uuid.uuid4().hex
    items = [{"embedding": [score], "meta_info": {"id": f"{rid}-{k}" if batched else rid,
                                                  "prompt_tokens": len(ids)}}
             for k, (score, ids) in enumerate(zip(got, seqs))]
    return JSONResponse(items if batched else items[0])


async def model_info(request: Request) -> Response:
    state: RewardServerState = request.app.state.server
    c = state.batcher.model.config
    return JSONResponse({"model_path": state.model_path, "tokenizer_path": state.model_path,
                         "is_generation": False, "model_type": c.model_type,
                         "architectures": list(c.architectures or [])})


async def server_info(request: Request) -> Response:
    state: RewardServerState = request.app.state.server
    b = state.batcher
    return JSONResponse({"version": "reinforge reward server (sglang /classify)",
                         "max_batch": b.max_batch, "forward_passes": b.passes,
                         "sequences_scored": b.sequences, "largest_batch": b.largest_batch,
                         "uptime_s": time.time() - state.started_at})


def build_app(state: RewardServerState) -> Starlette:
    app = Starlette(routes=[
        Route("/classify", classify, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
    ])
    app.state.server = state
    return app


def serve_reward_model(model_dir: str, *, host: str = "127.0.0.1", port: int = 30000,
                       port_file: str | None = None, max_batch: int = 32) -> None:
    """Load the reward model and serve `/classify` until interrupted."""
    import torch

    from reinforge.engine.engine import default_torch_threads
    from reinforge.engine.server import serve_http
    from reinforge.rl.reward_model import load_scorer

    torch.set_num_threads(default_torch_threads())
    tok, model, pad = load_scorer(model_dir)
    batcher = ScoreBatcher(model.eval(), pad, max_batch=max_batch)
    state = RewardServerState(batcher, tok, str(model_dir),
                              int(getattr(model.config, "max_position_embeddings", 4096)))
    serve_http(build_app(state), host=host, port=port, port_file=port_file,
               banner=f"reinforge serve: reward model on http://{host}:{{port}}/classify "
                      f"(batches of up to {max_batch})",
               start=batcher.start, close=batcher.close)
