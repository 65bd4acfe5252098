"""RL throughput: the same short training, synchronous against asynchronous, one process run.

Same SFT checkpoint, domains, group size, groups per step, learning rate, rollout server,
sandbox pool, curriculum and learner code in every mode:

  sync      one process, one phase at a time (bench/rl_sync_loop.py): generate a round of
            groups, then verify it, then (once enough groups carry signal) train, checkpoint
            and load the weights into the rollout server; no bus.
  async     the demo's cluster (`reinforge up`: scheduler, sampler with its embedded rollout
            server, verifier with Podman sandboxes, learner, monitor) at max_staleness 2:
            samplers keep generating for the next versions while the learner trains.
  onpolicy  (with --modes) the same cluster at max_staleness 0: its phases overlap within a
            version, but groups still in flight when the version changes are dropped.

After the first policy version (start-up and warm-up excluded), each mode runs for
`--window` seconds. Figures (the cluster's from the monitor's metrics file):
  samples_per_s   samples that entered a learner update, per second of the window
  generated_per_s samples generated and verified, per second
  learner_idle    1 - (learner compute + checkpoint time) / window
  stale_groups_dropped  groups dropped as too old (cluster), or groups with signal beyond
                  the step's that the sync loop discarded
  signal_share    the share of groups generated in the window whose rewards differ (over
                  all and per domain): trained samples/s = generated/s x about this share
  cpu_busy        the machine's CPU busy share over the window (all processes, all cores)
  sync phase_share/generate|verify|train|load_weights: where the sync loop's time goes
The sync loop's cpu_busy b bounds what overlap alone can buy on this machine: `overlap_bound`
= 1 / b (async can only fill idle cycles); its phase shares bound it too: 1 / the largest.
Modes alternate over `--rounds` so machine noise falls on all; medians are reported.
Last line: one JSON object with sync_samples_per_s, async_samples_per_s, speedup,
sync_learner_idle, async_learner_idle (and the other figures per mode).

    python bench/rl_throughput.py --json [--window 120] [--rounds 1] [--modes sync,async]
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import trio
from reinforge.cli import demo
from reinforge.core import paths

sys.path.insert(0, str(Path(__file__).parent))  # bench/ is not a package
from rl_sync_loop import CpuMeter, SyncSettings, run_sync, signal_shares

LEARNING_RATE = 1e-4
"""The demo's default, for every mode."""


def read_records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            continue
    return out


def window_figures(records: list[dict], t0: float, window_s: float) -> dict[str, float]:
    train = [r for r in records if r.get("kind") == "train" and t0 < r["t"] <= t0 + window_s]
    scored = [r for r in records if r.get("kind") == "scored" and t0 < r["t"] <= t0 + window_s]
    trained = sum(r["figures"].get("samples", 0.0) for r in train)
    busy = sum(r["figures"].get("compute_s", 0.0) + r["figures"].get("checkpoint_s", 0.0)
               for r in train)
    # the learner's counter is cumulative: what it added over the window
    stale_counts = [r["figures"].get("dropped_stale_groups", 0.0) for r in train]
    stale = stale_counts[-1] - stale_counts[0] if stale_counts else 0.0
    groups: dict[str, list[dict]] = {}
    for r in scored:
        if r.get("purpose", "train") == "train":
            groups.setdefault(r["task_id"], []).append(r)
    return {
        "samples_per_s": trained / window_s,
        "generated_per_s": len(scored) / window_s,
        "steps": float(len(train)),
        "learner_idle": max(0.0, 1.0 - busy / window_s),
        "stale_groups_dropped": stale,
        **signal_shares([(g[0]["domain"], [r["reward"] for r in g]) for g in groups.values()]),
    }


def run_mode(mode: str, sft: Path, args: argparse.Namespace) -> dict[str, float]:
    run = f"bench-rl-{mode}"
    run_dir = paths.run_dir(run)
    demo.reinforge("down", "--run", run, capture=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    domains = [d for d in args.domains.split(",") if d]
    if mode == "sync":
        return run_sync_mode(sft, domains, run_dir, args)
    cfg_args = argparse.Namespace(group_size=args.group_size, groups_per_version=args.groups_per_version,
                                  learning_rate=LEARNING_RATE, tis_cap=2.0, kl_coef=0.0,
                                  lora_rank=0)
    config = run_dir / "bench.toml"
    config.write_text(demo.cluster_config(run, run_dir, sft, domains, cfg_args,
                                          max_staleness=0 if mode == "onpolicy" else 2))
    started = time.time()
    up = demo.reinforge("up", str(config), "--run", run, "--detach", capture=True)
    if up.returncode != 0:
        raise SystemExit(f"reinforge up failed ({mode}):\n{up.stdout}\n{up.stderr[-3000:]}")
    metrics = run_dir / "metrics" / "metrics.jsonl"
    try:
        deadline = started + args.warmup_timeout
        first = None
        while first is None:
            if time.time() > deadline:
                raise SystemExit(f"{mode}: no policy version within {args.warmup_timeout} s")
            time.sleep(1.0)
            first = next((r for r in read_records(metrics) if r.get("kind") == "train"), None)
        demo.say(f"{mode}: first version {first['t'] - started:.0f} s after `up`; "
                 f"measuring {args.window:.0f} s")
        cpu = CpuMeter()  # from about a second after the first version
        time.sleep(max(0.0, first["t"] + args.window - time.time()))
        cpu_busy = cpu.busy_share()
        time.sleep(2.0)  # the window's last records
        figures = {**window_figures(read_records(metrics), first["t"], args.window),
                   "cpu_busy": cpu_busy}
    finally:
        demo.reinforge("down", "--run", run, capture=True)
    demo.say(f"{mode}: {json.dumps({k: round(v, 3) for k, v in figures.items()})}")
    return figures


def run_sync_mode(sft: Path, domains: list[str], run_dir: Path,
                  args: argparse.Namespace) -> dict[str, float]:
    settings = SyncSettings(group_size=args.group_size, groups_per_version=args.groups_per_version,
                            learning_rate=LEARNING_RATE, max_in_flight=demo.MAX_IN_FLIGHT,
                            max_new_tokens=demo.MAX_NEW_TOKENS,
                            sandbox_pool_size=demo.SANDBOX_POOL_SIZE)
    figures = trio.run(functools.partial(
        run_sync, sft, domains, settings, run_dir, window_s=args.window,
        warmup_timeout_s=args.warmup_timeout))
    demo.say(f"sync: {json.dumps({k: round(v, 3) for k, v in figures.items()})}")
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=float, default=120.0, help="seconds measured per mode")
    p.add_argument("--rounds", type=int, default=1, help="sync+async pairs (medians reported)")
    p.add_argument("--domains", default="math,code,docqa")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-version", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--warmup-timeout", type=float, default=600.0)
    p.add_argument("--policy", default="tiny",
                   help="policy size: tiny (the demo's) or wide (about 8x the compute per token)")
    p.add_argument("--modes", default="sync,async",
                   help="sync and async, optionally onpolicy (the cluster at max_staleness 0)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    domains = [d for d in args.domains.split(",") if d]
    _, sft = demo.ensure_models(paths.home(), domains, args.sft_steps, args.policy)
    modes = [m for m in args.modes.split(",") if m]
    if not {"sync", "async"} <= set(modes) or not set(modes) <= {"sync", "async", "onpolicy"}:
        raise SystemExit(f"--modes must hold sync and async (and may hold onpolicy), got {modes}")
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            results[mode].append(run_mode(mode, sft, args))

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    sync, asyn = median("sync", "samples_per_s"), median("async", "samples_per_s")
    out: dict[str, object] = {
        "sync_samples_per_s": round(sync, 3),
        "async_samples_per_s": round(asyn, 3),
        "speedup": round(asyn / sync, 3) if sync > 0 else None,
        "sync_learner_idle": round(median("sync", "learner_idle"), 3),
        "async_learner_idle": round(median("async", "learner_idle"), 3),
    }
    for mode in modes:
        for key in ("samples_per_s", "learner_idle", "generated_per_s", "stale_groups_dropped",
                    "steps", "signal_share", "cpu_busy"):
            out.setdefault(f"{mode}_{key}", round(median(mode, key), 3))
    gen_sync = median("sync", "generated_per_s")
    if gen_sync > 0:
        out["generated_speedup"] = round(median("async", "generated_per_s") / gen_sync, 3)
    if median("sync", "cpu_busy") > 0:
        out["overlap_bound"] = round(1.0 / median("sync", "cpu_busy"), 3)
    for mode in modes:
        shares = sorted({k for r in results[mode] for k in r if "/" in k})
        out[f"{mode}_shares"] = {k: round(statistics.median(r.get(k, 0.0) for r in results[mode]), 3)
                                 for k in shares}
    if "onpolicy" in modes and median("onpolicy", "samples_per_s") > 0:
        out["speedup_vs_onpolicy"] = round(asyn / median("onpolicy", "samples_per_s"), 3)
    out.update({"window_s": args.window, "rounds": args.rounds,
                "per_round": {m: [round(r["samples_per_s"], 3) for r in results[m]]
                              for m in modes}})
    if not args.json:
        for k, v in out.items():
            print(f"{k:24s} {v}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
