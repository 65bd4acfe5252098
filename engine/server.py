"""The HTTP front of the embedded rollout server: SGLang's API subset
(the routes `build_app` lists), with SGLang's paths, field names and defaults.

Starlette app on hypercorn (asyncio). The engine runs on its own thread (`Engine.run_forever`);
handlers submit groups and await per-sequence updates, which the engine thread hands to the
event loop with `call_soon_threadsafe`. Nothing here computes: the event loop never blocks on
the model (weight loading runs in a worker thread).

Errors: a body that breaks the API contract (engine/api.py: bad JSON, unknown
`sampling_params` key, wrong type, bad value) gets 400 `{"error": "<message>"}`, the message
ending with the field's path; a semantic error (prompt too long, does not fit the KV cache)
gets 400 `{"error": {"message": ...}}` -- SGLang's two shapes. /update_weights_from_disk
answers every failure in its own shape, `{"success": false, "message": ...}`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
import uuid
from typing import Any

import msgspec
from reinforge.core.atomic import write_atomic
from reinforge.engine.api import (
    AbortRequest,
    GenerateRequest,
    PauseRequest,
    SamplingParamsJSON,
    UpdateWeightsRequest,
    decode,
)
from reinforge.engine.engine import (
    Engine,
    EngineConfig,
    Group,
    Sequence,
    SeqUpdate,
    default_torch_threads,
    make_generator,
)
from reinforge.engine.sampling import SamplingParams
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

VERSION = "reinforge-engine 0.1 (sglang api subset)"


class ServerState:
    """What the handlers share: the engine, its thread, the tokenizer, identity and timing."""

    def __init__(
        self, engine: Engine, tokenizer: Any, model_path: str, served_model_name: str | None = None
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.started_at = time.time()
        self.thread = threading.Thread(target=engine.run_forever, name="engine", daemon=True)
        self.paused = asyncio.Event()
        self.paused.set()  # set = not paused

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.engine.stop()
        self.thread.join(timeout=10)


SERVER_KEEP_ALIVE_S = 75.0
"""How long an idle client connection stays open: longer than any client keeps one idle
(`rollout.client.CLIENT_KEEP_ALIVE_S`), so a client never sends on a connection the server
is closing (which reads as "Server disconnected without sending a response")."""


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def contract_error(message: str) -> JSONResponse:
    """A 400 in the shape SGLang gives a request its contract refuses (the reward server's
    too)."""
    return JSONResponse({"error": message}, status_code=400)


def _weights_failed(message: str) -> JSONResponse:
    return JSONResponse(
        {"success": False, "message": message, "num_paused_requests": 0}, status_code=400
    )


# ----------------------------------------------------------------------------- /generate


def _stop_checker(tokenizer: Any, params: SamplingParams):
    if not params.stop:
        return None
    skip = params.skip_special_tokens
    # Every token decodes to at least one byte, so a stop string of b bytes completed by the
    # newest token lies within the last b + 1 tokens (one more for a split UTF-8 character).
    tail = max(len(s.encode()) for s in params.stop) + 2

    def check(output_ids: list[int]) -> str | None:
        text = tokenizer.decode(output_ids[-tail:], skip_special_tokens=skip)
        for s in params.stop:
            if s in text:
                return s
        return None

    return check


def output_text(tokenizer: Any, update: SeqUpdate, params: SamplingParams) -> str:
    """Decoded completion, trimmed of the matched stop token or string (SGLang's rule)."""
    ids = update.output_ids
    matched = (update.finish_reason or {}).get("matched")
    if isinstance(matched, int) and not params.no_stop_trim and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(matched, str) and not params.no_stop_trim:
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


class GenerateJob:
    """One /generate call: its sequences, their latest updates, and the response builder."""

    def __init__(self, state: ServerState, req: GenerateRequest) -> None:
        """Raises ValueError for a prompt that is empty or does not fit the engine."""
        self.state = state
        self.created = time.perf_counter()
        prompts = req.prompts(state.tokenizer)
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty (0 tokens)")
        b = len(prompts)
        params = req.per_prompt(req.sampling_params)
        self.n = n = req.n
        self.batched = req.batched or n > 1
        self.return_logprob = req.per_prompt(req.return_logprob)
        starts = req.per_prompt(req.logprob_start_len)
        self.return_text_in_logprobs = req.return_text_in_logprobs
        self.stream = req.stream
        if req.rid is None:
            rids = [uuid.uuid4().hex for _ in range(b)]
        elif isinstance(req.rid, str):
            rids = [req.rid] if b == 1 else [f"{req.rid}_{i}" for i in range(b)]
        else:
            rids = req.rid
        engine = state.engine
        self.params: list[SamplingParams] = []
        self.groups: list[Group] = []
        self.queue: asyncio.Queue[SeqUpdate] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(update: SeqUpdate) -> None:
            loop.call_soon_threadsafe(self.queue.put_nowait, update)

        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if len(prompt) >= engine.context_length:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; "
                    f"the context length is {engine.context_length}"
                )
            room = engine.context_length - len(prompt)
            if p.max_new_tokens > room:
                p = msgspec.structs.replace(
                    p, max_new_tokens=room, min_new_tokens=min(p.min_new_tokens, room)
                )
            need = engine.max_blocks_for(len(prompt), p)
            if need > engine.pool.num_blocks:
                raise ValueError(
                    f"prompt {i} ({len(prompt)} tokens) with n={p.n} "
                    f"and max_new_tokens={p.max_new_tokens} "
                    f"needs {need} KV blocks; the cache has {engine.pool.num_blocks}"
                )
            seqs = []
            for j in range(n):
                self.params.append(p)
                seqs.append(
                    Sequence(
                        rid=rids[i] if n == 1 else uuid.uuid4().hex,
                        index=i * n + j,
                        prompt_ids=list(prompt),
                        params=p,
                        sink=sink,
                        stream=self.stream,
                        logprob_start_len=starts[i],
                        generator=make_generator(p.sampling_seed, j),
                        stop_check=_stop_checker(state.tokenizer, p),
                    )
                )
            self.groups.append(Group(prompt_ids=list(prompt), seqs=seqs))
        self.latest: list[SeqUpdate | None] = [None] * (b * n)

    def submit(self) -> None:
        for g in self.groups:
            self.state.engine.submit(g)

    def abort(self) -> None:
        """Abort this call's unfinished sequences (by exact rid: never a neighbour's)."""
        for g in self.groups:
            for s in g.seqs:
                last = self.latest[s.index]
                if last is None or last.finish_reason is None:
                    self.state.engine.abort(s.rid, exact=True)

    def item(self, update: SeqUpdate) -> dict[str, Any]:
        tok = self.state.tokenizer
        p = self.params[update.index]
        meta: dict[str, Any] = {
            "id": update.rid,
            "finish_reason": update.finish_reason,
            "weight_version": update.weight_version or self.state.engine.weight_version,
            "completion_tokens": len(update.output_ids),
            "e2e_latency": time.perf_counter() - self.created,
        }
        if update.admitted:
            meta["prompt_tokens"] = update.prompt_tokens
            meta["cached_tokens"] = update.cached_tokens
        if self.return_logprob[update.index // self.n]:
            with_text = self.return_text_in_logprobs

            def entries(lps, ids):
                return [[lp, t, tok.decode([t]) if with_text else None] for lp, t in zip(lps, ids)]

            meta["output_token_logprobs"] = entries(update.output_logprobs, update.output_ids)
            prompt = self.groups[update.index // self.n].prompt_ids
            skip = len(prompt) - len(update.input_logprobs)
            meta["input_token_logprobs"] = entries(update.input_logprobs, prompt[skip:])
        return {
            "text": output_text(tok, update, p),
            "output_ids": list(update.output_ids),
            "meta_info": meta,
        }

    async def finals(self) -> list[dict[str, Any]]:
        pending = len(self.latest)
        while pending:
            u = await self.queue.get()
            if u.finish_reason is not None and (
                self.latest[u.index] is None or self.latest[u.index].finish_reason is None
            ):
                pending -= 1
            self.latest[u.index] = u
        return [self.item(u) for u in self.latest]  # type: ignore[arg-type]

    async def chunks(self):
        pending = len(self.latest)
        while pending:
            u = await self.queue.get()
            if u.finish_reason is not None:
                pending -= 1
            self.latest[u.index] = u
            chunk = self.item(u)
            if self.batched:
                chunk["index"] = u.index
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"


# ----------------------------------------------------------------------------- handlers


async def generate(request: Request) -> Response:
    state: ServerState = request.app.state.server
    try:
        req = decode(await request.body(), GenerateRequest)
    except msgspec.DecodeError as exc:
        return contract_error(str(exc))
    await state.paused.wait()
    try:
        job = GenerateJob(state, req)
    except ValueError as exc:
        return _error(str(exc))
    job.submit()
    if job.stream:

        async def body_iter():
            try:
                async for chunk in job.chunks():
                    yield chunk
            finally:
                job.abort()  # no-op for finished sequences; stops abandoned ones

        return StreamingResponse(body_iter(), media_type="text/event-stream")
    try:
        items = await job.finals()
    except asyncio.CancelledError:
        job.abort()
        raise
    for item in items:  # an abort with an HTTP status (engine failure) is an HTTP error
        reason = item["meta_info"]["finish_reason"] or {}
        status = reason.get("status_code")
        if reason.get("type") == "abort" and isinstance(status, int) and status >= 400:
            return _error(reason.get("message", "request aborted"), status)
    return JSONResponse(items if job.batched else items[0])


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def health_generate(request: Request) -> Response:
    state: ServerState = request.app.state.server
    job = GenerateJob(
        state,
        GenerateRequest(
            input_ids=[0], sampling_params=SamplingParamsJSON(max_new_tokens=1, temperature=0.0)
        ),
    )
    job.submit()
    try:
        await asyncio.wait_for(job.finals(), timeout=20.0)
    except TimeoutError:
        job.abort()
        return Response(status_code=503)
    return Response(status_code=200)


def _model_info(state: ServerState) -> dict[str, Any]:
    c = state.engine.model.config
    return {
        "model_path": state.model_path,
        "served_model_name": state.served_model_name,
        "tokenizer_path": state.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.engine.weight_version,
        "load_format": "safetensors",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": c.model_type,
        "architectures": list(c.architectures),
    }


async def model_info(request: Request) -> Response:
    return JSONResponse(_model_info(request.app.state.server))


async def weight_version(request: Request) -> Response:
    return JSONResponse({"weight_version": request.app.state.server.engine.weight_version})


async def server_info(request: Request) -> Response:
    state: ServerState = request.app.state.server
    e = state.engine
    stats = e.statistics()
    ec = e.config
    return JSONResponse(
        {
            "model_path": state.model_path,
            "served_model_name": state.served_model_name,
            "tokenizer_path": state.model_path,
            "tp_size": 1,
            "dp_size": 1,
            "kv_cache_dtype": e.pool.kind,
            "kv_kernel_backend": e.pool.ops.name,
            "page_size": ec.block_size,
            "context_length": e.context_length,
            "max_running_requests": ec.max_running_requests,
            "max_total_num_tokens": stats.max_total_num_tokens,
            "kv_bytes_per_token": stats.kv.bytes_per_token,
            "weight_dtype": e.model.weights.weight_format,
            "weight_kernel_path": e.model.linear.path,
            "layer_ops_path": e.model.ops.path,
            "weight_version": e.weight_version,
            "disable_radix_cache": not ec.prefix_cache,
            "chunked_prefill_size": ec.chunked_prefill_size,
            "speculative_algorithm": "NGRAM" if ec.speculative_num_draft_tokens else None,
            "speculative_num_draft_tokens": ec.speculative_num_draft_tokens,
            "device": "cpu",
            "version": VERSION,
            "startup_time": state.started_at,
            "internal_states": [
                {
                    "num_running_reqs": stats.num_running_reqs,
                    "num_waiting_reqs": stats.num_waiting_reqs,
                    "steps": stats.steps,
                    "generated_tokens": stats.generated_tokens,
                    "prefix_cache_pages": stats.prefix_cache_pages,
                    "spec_verify_steps": stats.spec_verify_steps,
                    "spec_draft_tokens": stats.spec_draft_tokens,
                    "spec_accepted_tokens": stats.spec_accepted_tokens,
                }
            ],
        }
    )


async def loads(request: Request) -> Response:
    state: ServerState = request.app.state.server
    s = state.engine.statistics()
    return JSONResponse(
        {
            "timestamp": time.time(),
            "version": VERSION,
            "accelerator": "cpu",
            "num_accelerators": 0,
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": s.num_running_reqs,
                    "num_waiting_reqs": s.num_waiting_reqs,
                    "num_used_tokens": s.num_used_tokens,
                    "num_total_tokens": s.max_total_num_tokens,
                    "max_total_num_tokens": s.max_total_num_tokens,
                    "max_running_requests": state.engine.config.max_running_requests,
                    "token_usage": s.num_used_tokens / max(1, s.max_total_num_tokens),
                    "cache_hit_rate": s.cached_tokens / max(1, s.prompt_tokens + s.cached_tokens),
                }
            ],
        }
    )


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": state.served_model_name,
                    "object": "model",
                    "created": int(state.started_at),
                    "owned_by": "sglang",
                    "root": state.model_path,
                    "parent": None,
                    "max_model_len": state.engine.context_length,
                }
            ],
        }
    )


async def flush_cache(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if not state.engine.is_idle():
        return PlainTextResponse(
            "Cache not flushed: requests are running or waiting.\n", status_code=400
        )
    await asyncio.wrap_future(state.engine.flush_cache())
    return PlainTextResponse(
        "Cache flushed.\nPlease check backend logs for more details. "
        "(When there are running or waiting requests, the operation will not be performed.)\n"
    )


async def abort_request(request: Request) -> Response:
    state: ServerState = request.app.state.server
    try:
        req = decode(await request.body(), AbortRequest)
    except msgspec.DecodeError as exc:
        return contract_error(str(exc))
    state.engine.abort(req.rid, req.abort_all)
    return Response(status_code=200)


async def update_weights_from_disk(request: Request) -> Response:
    state: ServerState = request.app.state.server
    try:
        req = decode(await request.body(), UpdateWeightsRequest)
    except msgspec.DecodeError as exc:
        return _weights_failed(str(exc))
    path = req.model_path
    from reinforge.engine.loader import load_config, load_weights

    engine = state.engine
    try:
        new_config = await asyncio.to_thread(load_config, path)
        old = engine.model.config
        if (
            new_config.hidden_size,
            new_config.num_layers,
            new_config.vocab_size,
            new_config.num_kv_heads,
        ) != (old.hidden_size, old.num_layers, old.vocab_size, old.num_kv_heads):
            raise ValueError(f"{path} has a different architecture from the served model")
        weights = await asyncio.to_thread(load_weights, path, old,
                                          engine.model.weights.weight_format)
    except (OSError, ValueError, KeyError) as exc:
        return _weights_failed(f"Failed to update weights: {exc}")
    fut = engine.swap_weights(
        weights, req.weight_version or engine.weight_version, req.abort_all_requests
    )
    try:
        await asyncio.wrap_future(fut)
    except RuntimeError as exc:
        return _weights_failed(str(exc))
    state.model_path = path
    state.served_model_name = path
    return JSONResponse(
        {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
    )


async def pause_generation(request: Request) -> Response:
    state: ServerState = request.app.state.server
    try:
        req = decode(await request.body(), PauseRequest)
    except msgspec.DecodeError as exc:
        return contract_error(str(exc))
    if req.mode != "abort":
        return _error(
            f"pause_generation mode {req.mode!r} is not supported by the embedded server "
            "(only 'abort')"
        )
    state.paused.clear()
    state.engine.abort("", abort_all=True)
    return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: Request) -> Response:
    request.app.state.server.paused.set()
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


def build_app(state: ServerState) -> Starlette:
    routes = [
        Route("/generate", generate, methods=["POST", "PUT"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_weight_version", weight_version, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/loads", loads, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/pause_generation", pause_generation, methods=["POST"]),
        Route("/continue_generation", continue_generation, methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.server = state
    return app


def serve(
    model_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    engine_config: EngineConfig = EngineConfig(),
    port_file: str | None = None,
    served_model_name: str | None = None,
    weight_dtype: str = "float32",
) -> None:
    """Load the model (its projections in `weight_dtype`), start the engine thread, serve
    HTTP until interrupted."""
    import torch
    from reinforge.engine.loader import load_model
    from reinforge.engine.tokenizer import load_tokenizer

    torch.set_num_threads(default_torch_threads())
    model = load_model(model_dir, weight_dtype, kernel_backend=engine_config.kernel_backend)
    tokenizer = load_tokenizer(model_dir)
    eos = set(model.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    engine = Engine(model, engine_config, eos_token_ids=tuple(sorted(eos)))
    state = ServerState(engine, tokenizer, str(model_dir), served_model_name)
    serve_http(
        build_app(state), host=host, port=port, port_file=port_file,
        banner=f"reinforge serve: listening on http://{host}:{{port}} (kv {engine.pool.kind} "
               f"via {engine.pool.ops.name}, weights {model.weights.weight_format})",
        start=state.start, close=state.close)


def serve_http(app: Any, *, host: str, port: int, port_file: str | None, banner: str,
               start: Any = lambda: None, close: Any = lambda: None) -> None:
    """Serve `app` on hypercorn until interrupted: bind first (port 0: any free one), print
    `banner` (its `{port}` filled in), write the port to `port_file`, call `start` before
    serving and `close` after."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    bound = sock.getsockname()[1]

    async def main() -> None:
        start()
        config = Config()
        config.bind = [f"fd://{sock.fileno()}"]
        config.accesslog = None
        config.errorlog = "-"
        config.graceful_timeout = 1.0
        config.keep_alive_timeout = SERVER_KEEP_ALIVE_S
        print(banner.format(port=bound), flush=True)
        if port_file:  # whoever waits for it reads the whole number or nothing
            write_atomic(port_file, str(bound).encode())
        try:
            await hypercorn_serve(app, config)
        finally:
            close()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        try:
            sock.close()
        except OSError:  # hypercorn already closed the fd it served on
            pass
        sys.stdout.flush()
