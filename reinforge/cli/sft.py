"""`reinforge sft`: supervised fine-tuning from demonstrations into a Hugging Face checkpoint."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add this package's sub-commands to the `reinforge` parser."""
    sft = subparsers.add_parser(
        "sft", help="supervised fine-tuning from demonstrations into an HF checkpoint"
    )
    sft.add_argument("--model", required=True, help="Hugging Face-format model directory")
    sft.add_argument("--out", required=True, help="output directory (reused if inputs match)")
    sft.add_argument("--domains", default="math",
                     help="comma-separated domains or globs (gym-*) whose references are the "
                          "demos (default math)")
    sft.add_argument("--tiers", default="0", help="comma-separated tiers (default 0)")
    sft.add_argument("--jsonl", default="", help="JSONL of {prompt, response} rows instead")
    sft.add_argument("--examples", type=int, default=256, help="demos from the domains")
    sft.add_argument("--steps", type=int, default=200)
    sft.add_argument("--batch-size", type=int, default=16)
    sft.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    sft.add_argument("--max-len", type=int, default=512, help="longest example in tokens")
    sft.add_argument("--seed", type=int, default=0)
    sft.add_argument("--threads", type=int, default=2, help="torch threads")
    sft.set_defaults(func=cmd_sft)


def cmd_sft(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from reinforge.envs.domain import DomainRegistry
    from reinforge.rl.sft import SFTConfig, run_sft

    from reinforge.cli import UserError

    if not (Path(args.model) / "config.json").is_file():
        raise UserError(
            f"--model {args.model}: no config.json there (run `reinforge model init --out DIR`)"
        )
    if args.jsonl and not Path(args.jsonl).is_file():
        raise UserError(f"--jsonl {args.jsonl}: no such file")
    try:
        tiers = tuple(int(t) for t in args.tiers.split(",") if t.strip())
    except ValueError:
        raise UserError(f"--tiers {args.tiers!r}: expected comma-separated integers") from None
    try:
        cfg = SFTConfig(
            model=args.model, out=args.out,
            domains=tuple(DomainRegistry.default().resolve(
                (d.strip() for d in args.domains.split(",") if d.strip()), where="--domains")),
            tiers=tiers, jsonl=args.jsonl, num_examples=args.examples, steps=args.steps,
            batch_size=args.batch_size, learning_rate=args.lr, max_len=args.max_len,
            seed=args.seed, torch_threads=args.threads,
        )
        result = run_sft(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(json.dumps(result, sort_keys=True))
    return 0
