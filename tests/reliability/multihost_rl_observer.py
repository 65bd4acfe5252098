"""The multi-host RL test's eyes inside the simulated network: run on one host (namespace).

    python multihost_rl_observer.py CREDS RUN FINISH_FLAG DEADLINE_S

Follows the run's heartbeats and its newest weights announcement and prints one JSON object
per line on stdout:
  {"event": "progress", "t": wall time, "version": the newest announced version,
   "actors": {type: {"host", "waiting_on", "figures"}}}      (twice a second)
  {"event": "final", "weights": [{"version", "path", "store"}, ...], "counts": {subject
   family: messages}, "trained": [task ids, one per group trained], "dead_letters":
   [reasons], "stream_replicas": n, "bucket_replicas": n}
The final accounting is a full ordered read of the run's stream, done once FINISH_FLAG
exists. The test process lives outside the namespaces, so it sees the bus only through
this file's output.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import trio
from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.bus import open_bus
from reinforge.core.natsd import NatsCredentials


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def follow_heartbeats(bus, run: str, actors: dict) -> None:
    async with bus.subscribe(subjects.heartbeat(run)) as beats:
        async for hb in beats.typed(m.Heartbeat):
            actors[hb.actor_type] = {"host": hb.host, "waiting_on": hb.waiting_on,
                                     "figures": hb.figures}


async def newest_version(bus, stream: str, run: str) -> int:
    last = await bus.last_message(stream, subjects.weights(run))
    msg = m.decode(last.data) if last is not None else None
    return msg.version if isinstance(msg, m.WeightsPublished) else -1


async def main(creds_path: str, run: str, finish_flag: str, deadline_s: float) -> None:
    creds = NatsCredentials.read(Path(creds_path))
    deadline = time.monotonic() + deadline_s
    stream = subjects.stream_name(run)
    actors: dict[str, dict] = {}
    async with open_bus(creds, name="multihost-rl-observer") as bus:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow_heartbeats, bus, run, actors)
            version = -1
            while time.monotonic() < deadline and not Path(finish_flag).exists():
                with trio.move_on_after(1.0):
                    try:
                        version = await newest_version(bus, stream, run)
                    except Exception as exc:  # noqa: BLE001 - a partition may fail any call
                        emit(event="error", t=time.time(), error=f"{type(exc).__name__}: {exc}")
                emit(event="progress", t=time.time(), version=version, actors=actors)
                await trio.sleep(0.5)
            nursery.cancel_scope.cancel()
        weights, counts, trained, dead = [], {}, [], []
        async for d in bus.read_stream(stream):
            family = d.subject.split(".")[2]
            counts[family] = counts.get(family, 0) + 1
            msg = m.decode(d.data)
            if isinstance(msg, m.WeightsPublished):
                weights.append({"version": msg.version, "path": msg.path, "store": msg.store})
            elif isinstance(msg, m.GroupDecision) and msg.fate == m.Fate.TRAINED:
                trained.append(msg.task_id)
            elif isinstance(msg, m.DeadLetter):
                dead.append(f"{msg.subject}: {msg.reason}")
        info = await bus.stream_info(stream)
        bucket = await bus.stream_info(f"OBJ_{subjects.weights_bucket(run)}")
        emit(event="final", t=time.time(), weights=weights, counts=counts, trained=trained,
             dead_letters=dead,
             stream_replicas=info.config.num_replicas,
             bucket_replicas=bucket.config.num_replicas)


if __name__ == "__main__":
    creds_arg, run_arg, flag_arg, deadline_arg = sys.argv[1:5]
    trio.run(main, creds_arg, run_arg, flag_arg, float(deadline_arg))
