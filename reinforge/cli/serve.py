"""`reinforge serve`: the embedded SGLang-compatible rollout server (CPU)."""

from __future__ import annotations

import argparse
from typing import Any

from reinforge.engine.kernel_choice import BACKENDS


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve", help="the embedded SGLang-compatible rollout server (CPU)"
    )
    serve.add_argument("--model", required=True, help="Hugging Face-format model directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000, help="TCP port (0 = any free port)")
    serve.add_argument("--port-file", help="write the bound port to this file once listening")
    serve.add_argument(
        "--kv-cache-dtype",
        default="int8",
        choices=["int8", "int4", "auto", "float32", "bfloat16"],
        help="KV cache format (auto = int8)",
    )
    serve.add_argument(
        "--weight-dtype",
        default="float32",
        choices=["float32", "bfloat16", "int8", "lossless"],
        help="how the projections' weights are served: float32 (exactly the checkpoint), "
        "bfloat16 or int8 weight-only (half or a quarter of the bytes each decode step "
        "reads; their logprob error is the learner's to correct), or lossless: a GGUF "
        "import's Q4_1/Q8_0 blocks kept as they are, every other matrix float32",
    )
    serve.add_argument(
        "--kernel-backend",
        default="auto",
        choices=BACKENDS,
        help="paged-KV ops, packed-weight products, RMSNorm and RoPE: TVM-compiled, torch, "
             "or auto (TVM where it compiles)",
    )
    serve.add_argument(
        "--max-total-tokens", type=int, default=65536, help="KV cache capacity in tokens"
    )
    serve.add_argument("--max-running-requests", type=int, default=256)
    serve.add_argument("--context-length", type=int, default=None)
    serve.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    serve.add_argument("--weight-version", default="default")
    serve.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=1024,
        help="prompt tokens prefilled per engine step at most, so running requests keep "
        "decoding while a long prompt is prefilled (-1: whole prompts)",
    )
    serve.add_argument(
        "--speculative-algorithm",
        choices=["NGRAM"],
        default=None,
        help="speculative decoding: NGRAM drafts tokens by prompt lookup (the sequence's own "
        "earlier n-grams) and verifies them in one pass; same outputs (greedy), distribution "
        "(sampling) and logprobs",
    )
    serve.add_argument(
        "--speculative-num-draft-tokens", type=int, default=4,
        help="draft tokens per sequence and step (with --speculative-algorithm)",
    )
    serve.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="prefill every prompt whole instead of reusing the cached KV pages of earlier "
        "requests that share its prefix",
    )
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument(
        "--is-embedding", action="store_true",
        help="serve a reward model (`reinforge rm train`'s, or any Hugging Face "
        "...ForSequenceClassification with one label) on SGLang's POST /classify, as "
        "`sglang.launch_server --is-embedding` does")
    serve.add_argument("--max-batch", type=int, default=32,
                       help="with --is-embedding: sequences per forward pass at most (32)")
    serve.set_defaults(func=cmd_serve)


def is_reward_model(model_dir: str) -> bool:
    """Whether a Hugging Face folder holds a sequence classifier (a reward model)."""
    import json
    from pathlib import Path

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return any(str(a).endswith("ForSequenceClassification")
               for a in config.get("architectures") or [])


def cmd_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from reinforge.engine.engine import EngineConfig
    from reinforge.engine.server import serve

    from reinforge.cli import UserError

    if not (Path(args.model) / "config.json").is_file():
        raise UserError(
            f"--model {args.model}: no config.json there (run `reinforge model init --out DIR`)"
        )
    try:
        reward_model = is_reward_model(args.model)
    except ValueError as exc:
        raise UserError(f"--model {args.model}: its config.json does not parse: {exc}") from None
    if reward_model and not args.is_embedding:
        raise UserError(f"--model {args.model} is a reward model: serve it with --is-embedding")
    if args.is_embedding and not reward_model:
        raise UserError(f"--is-embedding: {args.model} is not a reward model (no "
                        "...ForSequenceClassification in its config.json's architectures)")
    if args.is_embedding:
        from reinforge.engine.reward_server import serve_reward_model

        if args.max_batch < 1:
            raise UserError(f"--max-batch must be >= 1, got {args.max_batch}")
        serve_reward_model(args.model, host=args.host, port=args.port,
                           port_file=args.port_file, max_batch=args.max_batch)
        return 0
    try:
        config = EngineConfig(
            kv_cache_dtype="int8" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
            kernel_backend=args.kernel_backend,
            block_size=args.page_size,
            max_total_tokens=args.max_total_tokens,
            max_running_requests=args.max_running_requests,
            context_length=args.context_length,
            weight_version=args.weight_version,
            chunked_prefill_size=args.chunked_prefill_size,
            speculative_num_draft_tokens=(
                args.speculative_num_draft_tokens if args.speculative_algorithm else 0
            ),
            prefix_cache=not args.disable_radix_cache,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    serve(
        args.model,
        host=args.host,
        port=args.port,
        engine_config=config,
        port_file=args.port_file,
        served_model_name=args.served_model_name,
        weight_dtype=args.weight_dtype,
    )
    return 0
