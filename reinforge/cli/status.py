"""`reinforge status` and `reinforge top`: every live actor of a run, from its heartbeats.

The run's supervisor answers with its table (and watchdog flags); without a supervisor
(actors started by hand, or only attached ones) the command listens to heartbeats itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def register(subparsers: Any) -> None:
    status = subparsers.add_parser("status", help="list the live actors of a run")
    status.add_argument("--run", default="default")
    status.add_argument("--json", action="store_true")
    status.add_argument("--creds", help="NATS credentials file (default: the run's nats.json)")
    status.set_defaults(func=cmd_status)

    top = subparsers.add_parser("top", help="live view of a run's actors")
    top.add_argument("--run", default="default")
    top.add_argument("--creds")
    top.add_argument("--interval-s", type=float, default=1.0)
    top.add_argument("--iterations", type=int, default=0, help="stop after N refreshes (0: never)")
    top.set_defaults(func=cmd_top)


def fetch_status(creds: Any, run: str, *, listen_s: float = 2.5) -> Any:
    """The supervisor's report, or (listen_s > 0) one built from heartbeats heard meanwhile."""
    import trio

    from reinforge.core import subjects
    from reinforge.core.bus import BusError, open_bus
    from reinforge.core.messages import (
        ActorStatus,
        Heartbeat,
        MessageError,
        StatusQuery,
        StatusReport,
        decode,
    )

    async def go() -> Any:
        async with open_bus(creds, name="reinforge-status", connect_timeout_s=5) as bus:
            try:
                reply = decode(await bus.request(
                    subjects.control(run, "status"), StatusQuery(), timeout_s=2))
                if isinstance(reply, StatusReport):
                    return reply
            except (BusError, MessageError):
                if listen_s <= 0:
                    return None
            seen: dict[str, ActorStatus] = {}
            async with bus.subscribe(subjects.heartbeat(run)) as sub:
                with trio.move_on_after(listen_s):
                    async for batch in sub:
                        for raw in batch:
                            try:
                                hb = decode(raw.data)
                            except MessageError:
                                continue
                            if isinstance(hb, Heartbeat):
                                seen[hb.actor_id] = ActorStatus(heartbeat=hb, last_seen=time.time())
            return StatusReport(run=run, supervisor_pid=0, actors=sorted(
                seen.values(), key=lambda a: (a.heartbeat.actor_type, a.heartbeat.actor_id)))

    return trio.run(go)


def actor_row(a: Any, now: float) -> dict[str, Any]:
    hb = a.heartbeat
    return {
        "type": hb.actor_type,
        "id": hb.actor_id,
        "host": hb.host,
        "pid": hb.pid,
        "state": hb.state,
        "uptime_s": round(now - hb.started_at, 1),
        "msgs_in": hb.msgs_in,
        "msgs_out": hb.msgs_out,
        "dead_letters": hb.dead_letters,
        "cpu_percent": round(hb.process.cpu_percent, 1),
        "rss_bytes": hb.process.rss_bytes,
        "waiting_on": hb.waiting_on,
        "waiting_s": round(now - hb.waiting_since, 1) if hb.waiting_on else 0.0,
        "capabilities": list(hb.capabilities),
        "supervised": a.supervised,
        "restarts": a.restarts,
        "last_seen_s": round(now - a.last_seen, 1),
        "flags": list(a.flags),
        "figures": dict(hb.figures),
    }


def report_to_json(report: Any) -> dict[str, Any]:
    now = time.time()
    return {
        "run": report.run,
        "supervisor_pid": report.supervisor_pid,
        "actors": [actor_row(a, now) for a in report.actors],
        "alerts": list(report.alerts),
    }


def render_table(report: Any) -> Any:
    from rich.table import Table

    data = report_to_json(report)
    title = f"run {data['run']}  (supervisor pid {data['supervisor_pid'] or 'none'})"
    table = Table(title=title, expand=False)
    for col in ("type", "id", "host", "pid", "up", "in", "out", "cpu%", "rss", "waiting on",
                "flags"):
        table.add_column(col)
    for r in data["actors"]:
        waiting = f"{r['waiting_on']}, {r['waiting_s']:.0f} s" if r["waiting_on"] else ""
        table.add_row(
            r["type"], r["id"], r["host"], str(r["pid"]), f"{r['uptime_s']:.0f}s",
            str(r["msgs_in"]), str(r["msgs_out"]), f"{r['cpu_percent']:.0f}",
            f"{r['rss_bytes'] / 2**20:.0f}M", waiting,
            "[red]" + "; ".join(r["flags"]) if r["flags"] else "",
        )
    return table


def cmd_status(args: argparse.Namespace) -> int:
    from reinforge.cli.actor import load_creds

    creds = load_creds(args.run, args.creds)
    report = fetch_status(creds, args.run)
    if args.json:
        print(json.dumps(report_to_json(report)))
        return 0
    from rich.console import Console

    console = Console()
    console.print(render_table(report))
    for alert in report.alerts:
        console.print(f"[yellow]{alert}")
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from reinforge.cli.actor import load_creds

    creds = load_creds(args.run, args.creds)
    console = Console()
    n = 0
    if not console.is_terminal:  # plain lines when not a TTY
        while args.iterations == 0 or n < args.iterations:
            data = report_to_json(fetch_status(creds, args.run))
            for r in data["actors"]:
                print(f"{time.strftime('%H:%M:%S')} {r['type']:<14} {r['id']:<28} "
                      f"in={r['msgs_in']} out={r['msgs_out']} cpu={r['cpu_percent']:.0f}% "
                      f"rss={r['rss_bytes'] / 2**20:.0f}M wait={r['waiting_on']!r} "
                      f"{'; '.join(r['flags'])}", flush=True)
            n += 1
            time.sleep(args.interval_s)
        return 0
    with Live(console=console, refresh_per_second=4) as live:
        while args.iterations == 0 or n < args.iterations:
            live.update(render_table(fetch_status(creds, args.run)))
            n += 1
            time.sleep(args.interval_s)
    sys.stdout.flush()
    return 0
