"""`reinforge report RUN [--out DIR] [--metrics FILE]`: the run's report page and plots."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers) -> None:
    """Add `report` to the `reinforge` parser."""
    p = subparsers.add_parser(
        "report",
        help="write a run's report: PNG plots, report.md and report.json",
        description="Build a Markdown report with PNG plots from <run_dir>/metrics/metrics.jsonl "
        "(written by the monitor). Works on partial data and says what is missing.",
    )
    p.add_argument("run", help="run name (its files are in $REINFORGE_HOME/<run>/)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: <run_dir>/report/)")
    p.add_argument("--metrics", type=Path, default=None,
                   help="metrics file to read (default: <run_dir>/metrics/metrics.jsonl)")
    p.add_argument("--json", action="store_true", help="print report.json instead of a summary")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from reinforge.cli import UserError
    from reinforge.core import paths

    try:
        run_dir = paths.run_dir(args.run)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    metrics = args.metrics or run_dir / "metrics" / "metrics.jsonl"
    out = args.out or run_dir / "report"
    if not metrics.is_file():
        raise UserError(
            f"no metrics file at {metrics}: run a monitor for run {args.run!r} "
            "(reinforge.actors.monitor:Monitor) or pass --metrics FILE"
        )
    from reinforge.metrics.report import build_report

    try:
        report = build_report(metrics, out, run=args.run)
    except ValueError as exc:  # a corrupt metrics file: the reader names the line
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(json.loads((out / "report.json").read_text())))
        return 0
    print(f"report: {report.page}")
    print(f"plots:  {', '.join(report.plots) or 'none'}")
    for line in report.missing:
        print(f"missing: {line}")
    return 0
