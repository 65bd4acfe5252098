"""The multi-host test's eyes inside the simulated network: run on one host (namespace).

    python multihost_observer.py CREDS RUN N FINISH_FLAG DEADLINE_S

Creates the run's stream with three replicas (before any actor starts), then follows
`rl.<run>.echo.out` and prints one JSON object per line on stdout:
  {"event": "ready", "replicas": 3}
  {"event": "progress", "t": wall time, "unique": k, "leader": "n1", "peers": {...}}
  {"event": "final", "in": [...], "out": [...], "out_t": [...], "messages": M,
   "deliveries": D, "ack_pending": A, "pending": P}   (D, A, P: the echo actors' consumer;
   D counts redeliveries too)
The final accounting is a full ordered read of the stream, done once FINISH_FLAG exists
(the test decides when the cut host had time to come back and replay its work).
The test process itself lives outside the namespaces, so it sees the bus only through
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


async def cluster_view(bus, stream: str) -> dict:
    info = await bus.stream_info(stream)
    cl = info.cluster
    peers = {p.name: {"current": bool(p.current), "offline": bool(p.offline)}
             for p in (cl.replicas or [])} if cl else {}
    return {"leader": cl.leader if cl else "", "peers": peers,
            "replicas": info.config.num_replicas}


async def main(creds_path: str, run: str, n: int, finish_flag: str, deadline_s: float) -> None:
    creds = NatsCredentials.read(Path(creds_path))
    deadline = time.monotonic() + deadline_s
    async with open_bus(creds, name="multihost-observer") as bus:
        stream = await bus.ensure_run_stream(run, replicas=3)
        emit(event="ready", **(await cluster_view(bus, stream)))
        seen: dict[int, int] = {}  # stream seq -> echo seq (redeliveries to us collapse)
        async with bus.pull_consumer(
            stream=stream, durable="observer-out", filter_subject=subjects.echo(run, "out"),
            ack_wait_s=10.0, max_deliver=1000,
        ) as consumer:
            last_report = 0.0
            view: dict = {}
            while time.monotonic() < deadline:
                try:
                    batch = await consumer.fetch(256, timeout_s=0.5)
                    for d in batch:
                        seen[d.stream_seq] = m.decode(d.data).seq
                    await consumer.ack(batch)
                except Exception as exc:  # noqa: BLE001 - a partition may fail any call
                    emit(event="error", t=time.time(), error=f"{type(exc).__name__}: {exc}")
                    await trio.sleep(0.2)
                if time.time() - last_report >= 0.5:
                    last_report = time.time()
                    with trio.move_on_after(1.0):
                        try:
                            view = await cluster_view(bus, stream)
                        except Exception as exc:  # noqa: BLE001
                            view = {"error": f"{type(exc).__name__}: {exc}"}
                    emit(event="progress", t=time.time(), unique=len(set(seen.values())),
                         stored=len(seen), **view)
                if Path(finish_flag).exists():
                    break
        ins, outs, out_t, others = [], [], [], {}
        async for d in bus.read_stream(stream):
            if d.subject == subjects.echo(run, "in"):
                ins.append(m.decode(d.data).seq)
            elif d.subject == subjects.echo(run, "out"):
                outs.append(m.decode(d.data).seq)
                out_t.append(d.timestamp)
            else:
                others[d.subject] = others.get(d.subject, 0) + 1
        info = await bus.stream_info(stream)
        work = await bus.consumer_info(
            stream, subjects.durable_name(run, "echo", subjects.echo(run, "in"))
        )
        emit(event="final", t=time.time(), messages=info.state.messages, others=others,
             deliveries=work.delivered.consumer_seq, ack_pending=work.num_ack_pending,
             pending=work.num_pending,
             **{"in": ins, "out": outs, "out_t": out_t}, **(await cluster_view(bus, stream)))


if __name__ == "__main__":
    creds_arg, run_arg, n_arg, flag_arg, deadline_arg = sys.argv[1:6]
    trio.run(main, creds_arg, run_arg, int(n_arg), flag_arg, float(deadline_arg))
