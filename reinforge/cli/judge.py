"""`reinforge judge`: how far a judge model agrees with labels, and how calibrated it is."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    judge = subparsers.add_parser("judge", help="judge models: calibrate one against labels")
    sub = judge.add_subparsers(dest="judge_command", required=True)
    labels = sub.add_parser(
        "labels", help="write a labelled set from the judge domain's built-in tasks (JSONL of "
        "{instruction, answer, criterion, label})")
    labels.add_argument("-n", type=int, default=100,
                        help="items (100): half labelled YES, as far as its 65 YES items go")
    labels.add_argument("--seed", type=int, default=0)
    labels.add_argument("-o", "--out", required=True, help="JSONL file to write")
    labels.set_defaults(func=cmd_labels)

    cal = sub.add_parser(
        "calibrate", help="ask a served judge model every labelled item: agreement (accuracy, "
        "Cohen's kappa) of its YES/NO and calibration (Brier, ECE, AUROC) of its P(YES)")
    cal.add_argument("--url", required=True,
                     help="the judge's server (`reinforge serve` or SGLang), e.g. "
                          "http://127.0.0.1:30000; its tokenizer must be on this host")
    cal.add_argument("--labels", default="",
                     help="JSONL of labelled items (default: --synthetic N built-in items)")
    cal.add_argument("--synthetic", type=int, default=100,
                     help="built-in labelled items to use without --labels (100, half YES)")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--raw-text", action="store_true",
                     help="ask in raw text, not in the judge model's chat template")
    cal.add_argument("--timeout-s", type=float, default=60.0, help="per request (60)")
    cal.add_argument("--json", action="store_true", help="end with one JSON object on stdout")
    cal.set_defaults(func=cmd_calibrate)


def cmd_labels(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    import msgspec

    from reinforge.cli import UserError
    from reinforge.envs.domains.judge_calibration import synthetic_labels

    try:
        items = synthetic_labels(args.n, args.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(msgspec.to_builtins(i)) + "\n" for i in items))
    print(f"{len(items)} labelled items ({sum(i.label for i in items)} YES) -> {out}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import json
    import time
    from pathlib import Path

    import trio

    from reinforge.cli import UserError
    from reinforge.envs.domains.judge import JudgeUnavailable, SGLangJudgeClient
    from reinforge.envs.domains.judge_calibration import calibrate, load_labels, synthetic_labels

    try:
        if args.labels:
            if not Path(args.labels).is_file():
                raise UserError(f"--labels {args.labels}: no such file")
            items, source = load_labels(args.labels), args.labels
        else:
            items, source = synthetic_labels(args.synthetic, args.seed), "synthetic"
    except ValueError as exc:
        raise UserError(str(exc)) from None
    client = SGLangJudgeClient(url=args.url, timeout_s=args.timeout_s,
                               chat_template=not args.raw_text)

    def progress(done: int, total: int) -> None:
        if done % 20 == 0 or done == total:
            print(f"judge: {done}/{total} items asked", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    try:
        result = trio.run(lambda: calibrate(client, items, seed=args.seed, progress=progress))
    except JudgeUnavailable as exc:
        raise UserError(str(exc)) from None
    result = {"labels": source, **result, "wall_s": round(time.perf_counter() - t0, 2)}
    table = result["reliability"]
    print(f"{result['items']} items, {result['labelled_yes']:.0%} labelled YES; the judge "
          f"parsed {result['parsed']:.0%}, said YES to {_pct(result['judge_yes'])}",
          file=sys.stderr)
    print(f"agreement: accuracy {_f(result['accuracy'])}, Cohen's kappa "
          f"{_f(result['cohen_kappa'])}; P(YES): Brier {_f(result['brier'])}, ECE "
          f"{_f(result['ece'])}, AUROC {_f(result['auroc'])}", file=sys.stderr)
    for row in table:
        lo, hi = row["bin"]
        print(f"  P(YES) in [{lo:.1f}, {hi:.1f}): {row['n']:4d} items, mean "
              f"{row['p_yes_mean']:.3f}, labelled YES {row['labelled_yes']:.3f}",
              file=sys.stderr)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"
