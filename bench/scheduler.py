"""Benchmark: the scheduler's planning cost as the number of domains grows.

What is timed is the scheduler actor's own planning code (`Scheduler._plan`: the issue
budget, the mix's probabilities, the domain draw, the tier choice, the lease), one batch of
`--batch` new tasks at a time, on D synthetic domains of 5 tiers each whose task generator
costs next to nothing (so the figure is the scheduler's, not a domain's), with tracemalloc
off. Also: the time to join D domains, the peak memory of joining and planning one batch
(tracemalloc, in a pass of its own), and the size of the saved state. The bus is not
involved.

Baseline in the same run: the smallest D; each row reports its ratio to it (how planning
grows). `--domains 100,1000,10000` by default.

Prints ONE JSON object as its last line (`--json` prints only that).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from types import SimpleNamespace


class CheapDomain:
    """A domain whose tasks cost nothing to make: the planner is what gets measured."""

    resource = "cpu"
    multi_turn = False

    def __init__(self, name: str) -> None:
        from reinforge.envs.domain import Tier

        self.name = name
        self.description = "synthetic (bench/scheduler.py)"
        self.tiers = tuple(Tier(level=k, name=f"t{k}", description="") for k in range(5))

    def sample_task(self, rng: random.Random, tier: int):
        from reinforge.envs.domain import TaskSpec

        n = rng.getrandbits(32)
        return TaskSpec(task_id=f"{self.name}-{tier}-{n:08x}", domain=self.name, tier=tier,
                        prompt=f"{n} + {tier} = ?", spec={"n": n})

    def prompt(self, task) -> str:
        return task.prompt


def scheduler_with(n_domains: int, batch: int, tmp: str):
    """A Scheduler actor set up for planning only (no bus): n domains, each weight 1."""
    from reinforge.actors.scheduler import MixOverride, Scheduler, SchedulerConfig, SchedulerState
    from reinforge.envs.domain import DomainRegistry
    from reinforge.rl.evalsets import HeldOutConfig

    names = [f"d{i:05d}" for i in range(n_domains)]
    cfg = SchedulerConfig(domains=dict.fromkeys(names, 1.0), max_in_flight=batch,
                          groups_per_version=batch, heldout=HeldOutConfig(tasks_per_tier=0),
                          state_file=f"{tmp}/state.json", mix_file=f"{tmp}/mix.json")
    sched = Scheduler(SimpleNamespace(run="bench"), cfg)
    sched.registry = DomainRegistry()
    for name in names:
        sched.registry.attach(CheapDomain(name))
    sched.domain_weights = sched.registry.resolve_weights(cfg.domains)
    sched.state, sched.mix = SchedulerState(), MixOverride()
    sched.curricula, sched.heldout, sched.file_tasks = {}, {}, {}
    sched._dirty = False
    t0 = time.perf_counter()
    for name in names:
        sched._join(name)
    return sched, time.perf_counter() - t0


def plan_once(sched) -> float:
    """Seconds to plan one batch, with no task in flight."""
    sched.state.leases.clear()
    t0 = time.perf_counter()
    planned = list(sched._plan(0.0))
    elapsed = time.perf_counter() - t0
    if len(planned) != sched.config.max_in_flight:
        raise RuntimeError(f"planned {len(planned)} tasks, wanted {sched.config.max_in_flight}")
    return elapsed


def measure(n_domains: int, batch: int, repeats: int, tmp: str) -> dict:
    """Memory with tracemalloc on (joining and one batch), then time on a fresh scheduler
    with it off: tracing every allocation slows Python code several times over, and the
    scheduler never runs under it."""
    import msgspec

    tracemalloc.start()
    plan_once(scheduler_with(n_domains, batch, tmp)[0])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    sched, join_s = scheduler_with(n_domains, batch, tmp)
    times = [plan_once(sched) for _ in range(repeats)]
    return {"domains": n_domains, "plan_batch_ms": statistics.median(times) * 1e3,
            "plan_per_task_us": statistics.median(times) / batch * 1e6,
            "join_s": join_s, "peak_mib": peak / 2**20,
            "state_kib": len(msgspec.json.encode(sched.state)) / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--domains", default="100,1000,10000")
    ap.add_argument("--batch", type=int, default=64, help="new tasks per planned batch")
    ap.add_argument("--repeats", type=int, default=7, help="batches timed (median reported)")
    args = ap.parse_args()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))

    import tempfile

    import msgspec  # noqa: F401 - imported before tracemalloc starts, as the scheduler is
    from reinforge.actors import scheduler  # noqa: F401

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.domains.split(",")):
            row = measure(n, args.batch, args.repeats, tmp)
            rows.append(row)
            say(f"{n:>6} domains: a batch of {args.batch} planned in {row['plan_batch_ms']:.2f} ms"
                f" ({row['plan_per_task_us']:.0f} us/task), joined in {row['join_s']:.2f} s, "
                f"peak {row['peak_mib']:.1f} MiB, state {row['state_kib']:.0f} KiB")
    base = rows[0]["plan_batch_ms"]
    for row in rows:
        row["plan_ratio_to_smallest"] = row["plan_batch_ms"] / base
        for k, v in row.items():
            if isinstance(v, float):
                row[k] = float(f"{v:.4g}")
    print(json.dumps({"bench": "scheduler", "code_path": "actors.scheduler.Scheduler._plan",
                      "batch": args.batch, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
