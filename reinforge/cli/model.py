"""`reinforge model init`: write the tiny Qwen2-architecture CPU policy and its tokenizer."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    model = subparsers.add_parser("model", help="model utilities (init the tiny CPU policy)")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION")
    init = model_sub.add_parser(
        "init", help="write a tiny Qwen2-architecture policy + tokenizer (HF format)"
    )
    init.add_argument(
        "--out", default="models/tiny", help="output directory (default: models/tiny)"
    )
    init.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    init.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    init.add_argument("--intermediate", type=int, default=704, help="MLP size (default 704)")
    init.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    init.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    init.add_argument(
        "--vocab", type=int, default=4096, help="BPE vocabulary size at most (default 4096)"
    )
    init.add_argument(
        "--seed", type=int, default=0, help="seed for tokenizer corpus and weights (default 0)"
    )
    init.set_defaults(func=cmd_model_init)
    model.set_defaults(func=lambda args: (model.print_help(), 2)[1])


def cmd_model_init(args: argparse.Namespace) -> int:
    from reinforge.engine.tiny import TinyModelSpec, init_tiny_model

    from reinforge.cli import UserError

    try:
        spec = TinyModelSpec(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            seed=args.seed,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    out = init_tiny_model(args.out, spec)
    print(f"wrote a tiny qwen2 policy to {out}")
    return 0
