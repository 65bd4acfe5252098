"""`reinforge rm train`: a reward model from preference pairs or graded responses."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    rm = subparsers.add_parser("rm", help="reward models: train one from preferences")
    sub = rm.add_subparsers(dest="rm_command", required=True)
    train = sub.add_parser(
        "train", help="train a reward model (a scalar head on a causal LM) into an HF "
        "checkpoint, from {prompt, chosen, rejected} pairs or {prompt, response, score} rows")
    train.add_argument("--model", required=True, help="Hugging Face-format causal LM to start from")
    train.add_argument("--out", required=True, help="output directory (reused if inputs match)")
    train.add_argument("--data", default="",
                       help="JSONL of pairs or graded rows (default: the synthetic task)")
    train.add_argument("--synthetic", type=int, default=2000,
                       help="pairs of the synthetic preference task, without --data")
    train.add_argument("--planted-exploit", action="store_true",
                       help="synthetic pairs that prefer answers too long for the hidden rule: "
                            "a reward model with a known exploit (shows the gold guard)")
    train.add_argument("--held-out", type=float, default=0.1, help="share held out (0.1)")
    train.add_argument("--steps", type=int, default=300)
    train.add_argument("--batch-size", type=int, default=16)
    train.add_argument("--lr", type=float, default=3e-4)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, default=2, help="torch threads")
    train.add_argument("--json", action="store_true", help="end with one JSON object on stdout")
    train.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    import json
    import time
    from pathlib import Path

    from reinforge.cli import UserError
    from reinforge.rl.reward_model import RMConfig, train_reward_model

    if not (Path(args.model) / "config.json").is_file():
        raise UserError(
            f"--model {args.model}: no config.json there (run `reinforge model init --out DIR`)")
    if args.data and not Path(args.data).is_file():
        raise UserError(f"--data {args.data}: no such file")
    t0 = time.perf_counter()
    try:
        cfg = RMConfig(model=args.model, out=args.out, data=args.data, synthetic=args.synthetic,
                       planted_exploit=args.planted_exploit, held_out=args.held_out,
                       steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr,
                       seed=args.seed, torch_threads=args.threads)
        result = train_reward_model(
            cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(json.dumps(result, indent=2))
    return 0
