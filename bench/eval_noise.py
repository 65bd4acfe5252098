"""Benchmark: the noise floor of a held-out evaluation, one checkpoint evaluated twice.

Nothing changed between the two evaluations, so every per-domain change they show is
sampling noise: what a before/after comparison of that size reads when training did nothing.
Both go through `reinforge eval` (the embedded rollout server, the demo's sizes: tier 0,
`--tasks-per-tier` tasks of `--samples` samples each), the first standing as the baseline,
and are summarised as the suite demo summarises its before/after (`reinforge.cli.demo`):
domains that moved, improved by 0.10 or more, worse by 0.05 or more, the worst drop, and the
falls the test on the counts finds at p < 0.05.

    python bench/eval_noise.py --model DIR --json        # last line: one JSON object

`--domains` defaults to the suite's (`reinforge demo --suite gym`); the suite's warm start,
once a suite demo has made it, is `.reinforge/models/sft-<n>domains-<hash>-150`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint (Hugging Face format)")
    ap.add_argument("--domains", default="", help="comma-separated (default: the suite's)")
    ap.add_argument("--samples", type=int, default=2,
                    help="samples a task (default 2; the suite demo takes 8)")
    ap.add_argument("--tasks-per-tier", type=int, default=4, help="(the suite's: 4)")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args()

    from reinforge.cli.demo import (
        change_and_fall,
        evaluate,
        suite_domains,
        suite_summary,
    )

    if not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there")
    domains = [d for d in args.domains.split(",") if d] or suite_domains()[0]
    runs, seconds = [], []
    for i in range(2):
        t0 = time.perf_counter()
        runs.append(evaluate(Path(args.model), domains, args.samples, args.tasks_per_tier,
                             [0], answer_prior=False))
        seconds.append(round(time.perf_counter() - t0, 1))
        if not args.json:
            print(f"evaluation {i + 1} of 2: {seconds[-1]} s", flush=True)
    first, second = runs
    changes, falls = {}, {}
    for d in domains:
        changes[d], falls[d] = change_and_fall(first, second, d)
    summary = suite_summary(changes, {}, falls=falls)
    del summary["left_out"]
    result = {
        "bench": "eval_noise",
        "path": "reinforge eval: the embedded rollout server, the same checkpoint twice",
        "model": args.model,
        "tasks_per_tier": args.tasks_per_tier,
        "samples": args.samples,
        "tiers": [0],
        "moved": sum(c.delta != 0 for c in changes.values()),
        **summary,
        "eval_s": seconds,
    }
    if not args.json:
        for d in sorted(changes, key=lambda d: changes[d].delta):
            if changes[d].delta:
                print(f"{d:32s} {changes[d].delta:+.3f}  fall p {falls[d].p_value:.3f}")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
