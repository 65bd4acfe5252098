"""Benchmark: the noise floor of a held-out evaluation, and what paired draws take off it.

One checkpoint (`--model`) evaluated with two sampling seeds: nothing changed between the
two evaluations, so every per-domain change they show is sampling noise, what a
before/after comparison of that size reads when training did nothing and the two
evaluations draw apart. (With one seed the two are the same samples: no noise at all.)

With `--versus B`, the comparison a demo makes: the start (`--model`) against a trained
checkpoint B, each evaluated with seeds 1 and 2. Two paired readings of the change (B and
the start on one seed: 1 with 1, 2 with 2, as the demo compares) and two unpaired ones (1
with 2, 2 with 1) read the same change; how far the two readings of each kind disagree
is the noise each kind of comparison carries, the baseline being the unpaired one.

With `--versus B --task-sets`, the other half of the noise: which tasks are held out. The
change is read on two disjoint sets of the run's held-out tasks (the first N a tier and the
next N, seed 0), at two shapes of evaluation with the same number of samples a domain:
4 tasks of 8 samples (the baseline, the suite's before) and the suite's 16 tasks of 2. A
policy that gives one answer whatever the task scores what its tasks happen to be, which
more samples of the same tasks do not average out. The run must have held out 32 tasks a
tier (the suite demo's 16 reported and 16 for its guard).

Every evaluation goes through `reinforge eval` (the embedded rollout server, the demo's
sizes: tier 0, `--tasks-per-tier` tasks of `--samples` samples each) and is summarised as
the suite demo summarises its before/after (`reinforge.cli.demo`): domains that moved,
improved by 0.10 or more, worse by 0.05 or more, the worst drop, and the falls the test on
the counts finds at p < 0.05.

    python bench/eval_noise.py --model DIR [--versus DIR [--task-sets]] --json

`--domains` defaults to the suite's (`reinforge demo --suite gym`); the suite's warm start,
once a suite demo has made it, is `.reinforge/models/sft-<n>domains-<hash>-150`, and its
checkpoints are in `.reinforge/runs/<run>/checkpoints/`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from statistics import fmean, median
from typing import Any

SEEDS = (1, 2)


def main() -> int:
    from reinforge.cli import demo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a checkpoint (Hugging Face format)")
    ap.add_argument("--versus", default="", help="a trained checkpoint to compare it with")
    ap.add_argument("--domains", default="", help="comma-separated (default: the suite's)")
    reported = demo.SUITE_EVAL_TASKS_PER_TIER
    ap.add_argument("--samples", type=int, default=demo.SUITE_EVAL_SAMPLES,
                    help=f"samples a task (default {demo.SUITE_EVAL_SAMPLES}, the suite demo's)")
    ap.add_argument("--tasks-per-tier", type=int, default=reported,
                    help=f"(the suite's: {reported})")
    ap.add_argument("--held-per-tier", type=int, default=demo.guarded_heldout(reported,
                                                                               suite="gym"),
                    help=f"held-out tasks a tier in the run (the suite's: {reported} reported "
                         f"+ {demo.SUITE_GUARD_TASKS_PER_TIER} for its guard)")
    ap.add_argument("--task-sets", action="store_true",
                    help="with --versus: read the change on two disjoint held-out task sets, "
                         "4 tasks of 8 samples against 16 of 2")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args()

    for model in filter(None, (args.model, args.versus)):
        if not (Path(model) / "config.json").is_file():
            ap.error(f"{model}: no config.json there")
    if args.task_sets and not args.versus:
        ap.error("--task-sets reads a change: give --versus too")
    domains = [d for d in args.domains.split(",") if d] or demo.suite_domains()[0]
    if args.task_sets:
        print(json.dumps(task_sets(args, domains)), flush=True)
        return 0
    models = {"start": args.model, **({"trained": args.versus} if args.versus else {})}
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    seconds = []
    for name, model in models.items():
        for seed in SEEDS:
            t0 = time.perf_counter()
            runs[name, seed] = demo.evaluate(
                Path(model), domains, 2, args.tasks_per_tier, [0], samples=args.samples,
                answer_prior=False, held_per_tier=args.held_per_tier, seed=seed)
            seconds.append(round(time.perf_counter() - t0, 1))
            if not args.json:
                print(f"{name} with seed {seed}: {seconds[-1]} s", flush=True)
    result: dict[str, Any] = {
        "bench": "eval_noise",
        "path": "reinforge eval: the embedded rollout server, tier 0, seeds "
                f"{SEEDS[0]} and {SEEDS[1]}",
        "model": args.model, "versus": args.versus,
        "tasks_per_tier": args.tasks_per_tier, "samples": args.samples,
        "eval_s": seconds,
    }
    if not args.versus:  # the baseline: what one checkpoint reads against itself, apart
        result["noise"] = reading(runs["start", 1], runs["start", 2], domains, args.json)
    else:
        a, b = (("start", s) for s in SEEDS), (("trained", s) for s in SEEDS)
        (a1, a2), (b1, b2) = [runs[k] for k in a], [runs[k] for k in b]
        paired = [reading(a1, b1, domains), reading(a2, b2, domains)]
        unpaired = [reading(a1, b2, domains), reading(a2, b1, domains)]
        result["paired"] = {"readings": paired, **disagreement(paired)}
        result["unpaired"] = {"readings": unpaired, **disagreement(unpaired)}
        result["disagreement_ratio"] = round(
            result["paired"]["mean_abs_disagreement"]
            / max(1e-9, result["unpaired"]["mean_abs_disagreement"]), 3)
    print(json.dumps(result), flush=True)
    return 0


SHAPES = ((4, 8), (16, 2))
"""(tasks a tier, samples a task) of `--task-sets`: the baseline, then the suite's."""


def task_sets(args: argparse.Namespace, domains: list[str]) -> dict[str, Any]:
    """One change read on two disjoint held-out task sets at each of SHAPES."""
    from reinforge.cli.demo import evaluate

    out: dict[str, Any] = {
        "bench": "eval_noise", "mode": "task_sets",
        "path": "reinforge eval: the embedded rollout server, tier 0, sampling seed 0",
        "model": args.model, "versus": args.versus, "held_per_tier": args.held_per_tier,
        "domains": len(domains), "eval_s": [], "shapes": {},
    }
    for tasks, samples in SHAPES:
        if 2 * tasks > args.held_per_tier:
            raise SystemExit(f"{tasks} tasks a set need {2 * tasks} held out a tier "
                             f"(--held-per-tier {args.held_per_tier})")
        readings = []
        for skip in (0, tasks):  # set A, then the disjoint set B after it
            runs = []
            for model in (args.model, args.versus):
                t0 = time.perf_counter()
                runs.append(evaluate(Path(model), domains, 2, tasks, [0], samples=samples,
                                     answer_prior=False, held_per_tier=args.held_per_tier,
                                     skip=skip, seed=0))
                out["eval_s"].append(round(time.perf_counter() - t0, 1))
            readings.append(reading(*runs, domains))
            if not args.json:
                print(f"{tasks} tasks x {samples} samples, tasks {skip + 1}-{skip + tasks}: "
                      f"mean change {readings[-1]['mean_change']:+.3f}", flush=True)
        out["shapes"][f"{tasks}x{samples}"] = {"readings": readings, **disagreement(readings)}
    (base, base_s), (suite, suite_s) = SHAPES
    out["disagreement_ratio"] = round(
        out["shapes"][f"{suite}x{suite_s}"]["mean_abs_disagreement"]
        / max(1e-9, out["shapes"][f"{base}x{base_s}"]["mean_abs_disagreement"]), 3)
    return out


def reading(before: dict[str, Any], after: dict[str, Any], domains: list[str],
            quiet: bool = True) -> dict[str, Any]:
    """The suite's summary of one before/after, with each domain's change."""
    from reinforge.cli.demo import change_and_fall, suite_summary

    changes, falls = {}, {}
    for d in domains:
        changes[d], falls[d] = change_and_fall(before, after, d)
    summary = suite_summary(changes, {}, falls=falls)
    del summary["left_out"]
    if not quiet:
        for d in sorted(changes, key=lambda d: changes[d].delta):
            if changes[d].delta:
                print(f"{d:32s} {changes[d].delta:+.3f}  fall p {falls[d].p_value:.3f}")
    return {"moved": sum(c.delta != 0 for c in changes.values()), **summary,
            "deltas": {d: round(c.delta, 4) for d, c in changes.items()}}


def disagreement(readings: list[dict[str, Any]]) -> dict[str, Any]:
    """How far two readings of one change disagree, domain by domain."""
    first, second = (r["deltas"] for r in readings)
    gaps = [abs(first[d] - second[d]) for d in first]
    return {"mean_abs_disagreement": round(fmean(gaps), 4),
            "median_abs_disagreement": round(median(gaps), 4),
            "domains_disagreeing_by_0_05": sum(g >= 0.05 for g in gaps),
            "worse_by_0_05": [r["worse_by_0_05"] for r in readings],
            "improved_by_0_10": [r["improved_by_0_10"] for r in readings]}


if __name__ == "__main__":
    raise SystemExit(main())
