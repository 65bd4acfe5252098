"""Chaos: a real cluster on a short training config, faults at random moments, then an
accounting check over the ledger.

The cluster is `reinforge up` of a small config (scheduler, sampler, verifier, learner,
evaluator, monitor, and the run's rollout server as its own process), from the demo's SFT
checkpoint. Fault kinds:

  kill:<type>     kill -9 of the actor process (scheduler, sampler, verifier, learner,
                  evaluator, monitor); the supervisor restarts it
  kill:rollout-server, kill:nats-server
                  kill -9 of the rollout server / the embedded nats-server (the supervisor
                  restarts both on the same port; JetStream resumes from its files)
  stall:verifier  SIGSTOP of the verifier for `--stall` seconds (a slow consumer), then SIGCONT

Recovery time of a fault: from the kill (for a stall: from SIGCONT) until the faulted part
is back (a heartbeat from the new process; for nats-server: every actor heartbeating again)
and a scored rollout has been seen since.

Accounting, after new issuing is paused (the scheduler's mix file) and the pipeline drained:
every task issued (read back from the stream) must be decided in the learner's ledger —
trained in exactly one update, or dropped with its reason (stale, no signal, rolled back) —
or abandoned by the scheduler or dead-lettered, with a reason. `lost` counts the rest;
`double_counted` counts groups trained more than once (the learner's trained-groups counter
against the distinct tasks it trained).

    python bench/chaos.py --json [--faults 12] [--seed 0] [--kinds kill:learner,...]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import trio

from reinforge.rl import checkpoint as ckpt
from reinforge.cli import demo
from reinforge.actors.learner import DecisionJournal
from reinforge.core import messages as m
from reinforge.core import paths, subjects
from reinforge.core.bus import open_bus
from reinforge.core.natsd import NatsCredentials

ACTOR_TYPES = ("scheduler", "sampler", "verifier", "learner", "evaluator", "monitor")
KINDS = (*(f"kill:{t}" for t in ACTOR_TYPES), "kill:rollout-server", "kill:nats-server",
         "stall:verifier")
DOMAINS = ("math", "docqa")


def say(text: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def cluster_config(run: str, run_dir: Path, sft: Path, args: argparse.Namespace) -> str:
    mix = ", ".join(f"{d} = 1.0" for d in DOMAINS)
    dlist = ", ".join(json.dumps(d) for d in DOMAINS)
    held = '{ tasks_per_tier = 2, tiers = [0] }'
    return f"""# Written by bench/chaos.py
[run]
name = "{run}"
group_size = 4
groups_per_version = 1
max_staleness = 2
temperature = 1.0
heldout = {held}

[supervisor]
healthy_timeout_s = 300
max_restarts = 10

[rollout_server]
enabled = true
model = {json.dumps(str(sft))}

[[actors]]
spec = "reinforge.actors.scheduler:Scheduler"
config = {{ domains = {{ {mix} }}, max_in_flight = 4, lease_s = {args.lease_s} }}

[[actors]]
spec = "reinforge.actors.sampler:SamplerActor"
config = {{ model_path = {json.dumps(str(sft))}, domains = [{dlist}], max_new_tokens = 64, concurrency = 2, sandbox = false, ack_wait_s = 20.0 }}

[[actors]]
spec = "reinforge.actors.verifier:VerifierActor"
config = {{ domains = [{dlist}], concurrency = 4, ack_wait_s = 15.0 }}

[[actors]]
spec = "reinforge.actors.learner:Learner"
config = {{ model = {json.dumps(str(sft))}, checkpoint_dir = {json.dumps(str(run_dir / 'checkpoints'))}, learning_rate = 1e-5, torch_threads = 1, keep_last = 2, ack_wait_s = 20.0, incomplete_group_timeout_s = 100.0 }}

[[actors]]
spec = "reinforge.actors.evaluator:Evaluator"
config = {{ domains = ["math"], k = 2, every_versions = 10, max_new_tokens = 48, concurrency = 2 }}

[[actors]]
spec = "reinforge.actors.monitor:Monitor"
config = {{ snapshot_interval_s = 2.0, port = 0 }}
"""


# ----------------------------------------------------------------------------- processes


def find_process(run_dir: Path, run: str, part: str) -> psutil.Process | None:
    """The live process of one part of the run, by its command line."""
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if p.info["status"] == psutil.STATUS_ZOMBIE or not cmd:
            continue
        line = " ".join(cmd)
        if part == "nats-server":
            hit = "nats-server" in Path(cmd[0]).name and str(run_dir) in line
        elif part == "rollout-server":
            hit = " serve " in f" {line} " and str(run_dir) in line
        else:
            hit = f"--id {part}-{run}-0" in line
        if hit:
            return p
    return None


class Observer:
    """What the bench sees on the bus: heartbeats per actor id and scored rollouts."""

    def __init__(self) -> None:
        self.beats: dict[str, tuple[float, int]] = {}  # actor type -> (time, pid)
        self.learner: m.Heartbeat | None = None
        self.last_scored = 0.0
        self.scored = 0
        self.version = 0

    async def watch(self, bus: Any, run: str, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with bus.subscribe(subjects.heartbeat(run)) as beats, \
                bus.subscribe(subjects.scored(run)) as scored, \
                bus.subscribe(subjects.weights(run)) as weights, trio.open_nursery() as n:
            task_status.started()
            n.start_soon(self._beats, beats)
            n.start_soon(self._scored, scored)
            n.start_soon(self._weights, weights)

    async def _beats(self, sub: Any) -> None:
        async for batch in sub:
            for raw in batch:
                try:
                    hb = m.decode(raw.data)
                except m.MessageError:
                    continue
                if isinstance(hb, m.Heartbeat):
                    self.beats[hb.actor_type] = (time.time(), hb.pid)
                    if hb.actor_type == "learner":
                        self.learner = hb

    async def _scored(self, sub: Any) -> None:
        async for batch in sub:
            self.scored += len(batch)
            self.last_scored = time.time()

    async def _weights(self, sub: Any) -> None:
        async for batch in sub:
            for raw in batch:
                msg = m.decode(raw.data)
                if isinstance(msg, m.WeightsPublished):
                    self.version = max(self.version, msg.version)


async def inject(kind: str, run: str, run_dir: Path, obs: Observer,
                 args: argparse.Namespace) -> float:
    """Inject one fault; returns its recovery time in seconds (raises on no recovery)."""
    action, part = kind.split(":")
    proc = find_process(run_dir, run, part)
    if proc is None:
        raise RuntimeError(f"{kind}: no live process found")
    old_pid = proc.pid
    if action == "stall":
        proc.send_signal(signal.SIGSTOP)
        await trio.sleep(args.stall)
        proc.send_signal(signal.SIGCONT)
    else:
        proc.send_signal(signal.SIGKILL)
    t0 = time.time()

    def back() -> bool:
        if obs.last_scored <= t0:
            return False
        if part == "nats-server":
            return all(obs.beats.get(t, (0.0, 0))[0] > t0 for t in ACTOR_TYPES)
        if part == "rollout-server":
            return (p := find_process(run_dir, run, part)) is not None and p.pid != old_pid
        if action == "stall":
            return True
        beat_t, pid = obs.beats.get(part, (0.0, 0))
        return beat_t > t0 and pid != old_pid

    with trio.fail_after(args.recovery_timeout):
        while not back():
            await trio.sleep(0.2)
    return time.time() - t0


# ----------------------------------------------------------------------------- accounting


async def account(bus: Any, run: str, run_dir: Path) -> dict[str, Any]:
    stream = subjects.stream_name(run)
    issued: dict[str, str] = {}  # task_id -> domain
    async for d in bus.read_stream(stream, filter_subject=subjects.task(run)):
        task = m.decode(d.data)
        issued[task.task_id] = task.domain
    dead: dict[str, str] = {}
    async for d in bus.read_stream(stream, filter_subject=subjects.dlq(run)):
        letter = m.decode(d.data)
        try:
            inner = m.decode(letter.payload)
        except m.MessageError:
            continue
        task_id = getattr(inner, "task_id", "") or getattr(
            getattr(inner, "rollout", None), "task_id", "")
        if task_id:
            dead.setdefault(task_id, letter.reason)
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    state = ckpt.load_trainer_state(latest[1]) if latest else {"tasks": {}, "counters": {}}
    decided: dict[str, str] = dict(state.get("tasks", {}))
    journal = DecisionJournal(run_dir / "checkpoints" / DecisionJournal.NAME)
    decided.update({task_id: outcome for task_id, outcome, _ in journal.read()})
    sched = json.loads((run_dir / "scheduler_state.json").read_text())
    abandoned = set(sched.get("abandoned", []))
    outcome: collections.Counter[str] = collections.Counter()
    lost = []
    for task_id in issued:
        if task_id in decided:
            verdict = decided[task_id]
            outcome["trained" if verdict.startswith("v") else f"dropped:{verdict}"] += 1
        elif task_id in abandoned:
            outcome["dropped:abandoned"] += 1
        elif task_id in dead:
            outcome["dropped:dead_letter"] += 1
        else:
            lost.append(task_id)
    trained_tasks = sum(1 for v in decided.values() if v.startswith("v"))
    trained_groups = int(state.get("counters", {}).get("trained_groups", 0))
    return {
        "tasks_issued": len(issued),
        "lost": len(lost),
        "lost_examples": lost[:5],
        "double_counted": max(0, trained_groups - trained_tasks),
        "trained": outcome["trained"],
        "dropped_with_reason": sum(v for k, v in outcome.items() if k.startswith("dropped")),
        "dropped_by_reason": {k.split(":", 1)[1]: v for k, v in sorted(outcome.items())
                              if k.startswith("dropped")},
        "versions": latest[0] if latest else 0,
    }


async def drain(bus: Any, run: str, run_dir: Path, obs: Observer, timeout_s: float) -> bool:
    """Pause new issuing; wait until the scheduler holds no lease (every group complete or
    abandoned), the learner has no complete group left undecided, and its consumer has
    nothing undelivered or unacked (a killed learner's deliveries come back first)."""
    durable = subjects.durable_name(run, "learner", subjects.scored(run, "*"))
    mix = {"max_in_flight_per_domain": dict.fromkeys(DOMAINS, 0)}
    (run_dir / "scheduler_mix.json").write_text(json.dumps(mix))
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        await trio.sleep(2.0)
        try:
            state = json.loads((run_dir / "scheduler_state.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        hb = obs.learner
        idle = (hb is not None and time.time() - hb.sent_at < 10
                and hb.figures.get("ready_groups", 1.0) == 0 and "complete groups" in hb.waiting_on)
        if not state.get("leases") and idle:
            info = await bus.consumer_info(subjects.stream_name(run), durable)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                return True
    return False


# ----------------------------------------------------------------------------- the run


async def chaos(args: argparse.Namespace, run: str, run_dir: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    kinds = [k for k in args.kinds.split(",") if k] if args.kinds else list(KINDS)
    plan = rng.sample(kinds, len(kinds))
    while len(plan) < args.faults:
        plan.append(rng.choice(kinds))
    creds = NatsCredentials.read(run_dir / "nats.json")
    obs = Observer()
    recovery: dict[str, list[float]] = collections.defaultdict(list)
    failures: list[str] = []
    async with open_bus(creds, name="chaos-bench") as bus, trio.open_nursery() as nursery:
        await nursery.start(obs.watch, bus, run)
        with trio.fail_after(args.warmup_timeout):
            while obs.version < 1:
                await trio.sleep(0.5)
        say(f"training: version {obs.version}; injecting {len(plan)} faults")
        for kind in plan:
            await trio.sleep(rng.uniform(args.gap_min, args.gap_max))
            try:
                took = await inject(kind, run, run_dir, obs, args)
            except (RuntimeError, trio.TooSlowError) as exc:
                failures.append(f"{kind}: {exc or 'no recovery'}")
                say(f"{kind}: NOT RECOVERED ({exc or 'timeout'})")
                continue
            recovery[kind].append(took)
            say(f"{kind}: recovered in {took:.1f} s (version {obs.version}, "
                f"{obs.scored} scored seen)")
        versions_after_faults = obs.version
        say("pausing new tasks and draining the pipeline")
        drained = await drain(bus, run, run_dir, obs, args.drain_timeout)
        ledger = await account(bus, run, run_dir)
        nursery.cancel_scope.cancel()
    return {
        "faults_injected": sum(len(v) for v in recovery.values()) + len(failures),
        "faults_recovered": sum(len(v) for v in recovery.values()),
        "not_recovered": failures,
        "kinds": sorted(recovery),
        "recovery_s_max": {k: round(max(v), 2) for k, v in sorted(recovery.items())},
        "recovery_s_median": round(statistics.median(
            [x for v in recovery.values() for x in v]), 2) if recovery else None,
        "drained": drained,
        "versions_after_faults": versions_after_faults,
        **{k: v for k, v in ledger.items() if k != "versions"},
        "versions": ledger["versions"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--faults", type=int, default=12, help="faults to inject (each kind once first)")
    p.add_argument("--kinds", default="", help=f"comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gap-min", type=float, default=3.0, help="seconds between faults (min)")
    p.add_argument("--gap-max", type=float, default=12.0)
    p.add_argument("--stall", type=float, default=15.0, help="seconds a stalled consumer stops")
    p.add_argument("--lease-s", type=float, default=30.0, help="the scheduler's task lease")
    p.add_argument("--recovery-timeout", type=float, default=180.0)
    p.add_argument("--warmup-timeout", type=float, default=600.0)
    p.add_argument("--drain-timeout", type=float, default=300.0)
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--run", default="bench-chaos")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    unknown = [k for k in args.kinds.split(",") if k and k not in KINDS]
    if unknown:
        p.error(f"unknown fault kinds {unknown}; known: {', '.join(KINDS)}")

    _, sft = demo.ensure_models(paths.home(), list(DOMAINS), args.sft_steps)
    run_dir = paths.run_dir(args.run)
    demo.reinforge("down", "--run", args.run, capture=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config = run_dir / "chaos.toml"
    config.write_text(cluster_config(args.run, run_dir, sft, args))
    t0 = time.time()
    up = demo.reinforge("up", str(config), "--run", args.run, "--detach", capture=True)
    if up.returncode != 0:
        raise SystemExit(f"reinforge up failed:\n{up.stdout}\n{up.stderr[-3000:]}")
    try:
        out = trio.run(chaos, args, args.run, run_dir)
    finally:
        demo.reinforge("down", "--run", args.run, capture=True)
    out["wall_s"] = round(time.time() - t0, 1)
    if not args.json:
        for k, v in out.items():
            print(f"{k:24s} {v}", file=sys.stderr)
    print(json.dumps(out))
    return 0 if out["lost"] == 0 and out["double_counted"] == 0 and not out["not_recovered"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
