"""`reinforge log export|show` and `reinforge replay`: the message log, and debugging by it."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    log = subparsers.add_parser("log", help="export or show a run's message log")
    log_sub = log.add_subparsers(dest="log_command", metavar="ACTION")
    export = log_sub.add_parser("export", help="write a run's stored messages to a file")
    export.add_argument("--run", default="default")
    export.add_argument("--subject", default="", help="subject filter, e.g. 'rl.RUN.scored.*'")
    export.add_argument("--since", help="ISO time or epoch seconds")
    export.add_argument("--until", help="ISO time or epoch seconds")
    export.add_argument("--creds", help="NATS credentials file (default: the run's nats.json)")
    export.add_argument("-o", "--output", required=True, help="the log file to write")
    export.set_defaults(func=cmd_export)

    show = log_sub.add_parser("show", help="print a log file's messages, decoded")
    show.add_argument("file")
    show.add_argument("--json", action="store_true", help="one JSON object per line")
    show.add_argument("--type", default="", help="only messages of this type (tag or class)")
    show.add_argument("--task-id", default="", help="only messages about this task")
    show.set_defaults(func=cmd_show)

    reviews = log_sub.add_parser(
        "reviews", help="write a log's review marks as a JSONL set for SFT or a reward model")
    reviews.add_argument("file", help="a log written by `reinforge log export`")
    reviews.add_argument("-o", "--output", required=True, help="the JSONL file to write")
    reviews.add_argument("--min-score", type=float, default=None,
                         help="keep only rollouts whose right reward is at least this (e.g. 1: "
                              "answers to imitate, for SFT)")
    reviews.set_defaults(func=cmd_reviews)

    rp = subparsers.add_parser(
        "replay", help="feed an actor its recorded inputs in isolation; diff its outputs",
        description="Feed an actor its recorded inputs on a private nats-server and diff its "
        "outputs. The actor runs in a scratch home (a fresh temporary $REINFORGE_HOME, said on "
        "stderr): the live run's files are read, never written. A --set path into the live "
        "run's directory is rewritten to the same place in the scratch home, what it names "
        "copied there first (e.g. a learner's checkpoint_dir: it resumes from a copy).",
    )
    rp.add_argument("file", help="a log written by `reinforge log export`")
    rp.add_argument("--actor", required=True, help="MODULE:CLASS | file.py:Class | entry point")
    rp.add_argument("--only", default="", help="replay only inputs on this subject (pattern)")
    rp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    rp.add_argument("--idle-s", type=float, default=3.0,
                    help="stop once no output came for this long and all input was consumed")
    rp.add_argument("--timeout-s", type=float, default=300.0)
    rp.add_argument("--json", action="store_true")
    rp.add_argument("--keep", action="store_true",
                    help="keep the scratch home (the actor's run directory: state, checkpoints) "
                         "for inspection; by default it is removed after the replay")
    rp.set_defaults(func=cmd_replay)


def parse_time(text: str | None) -> float | None:
    from reinforge.cli import UserError

    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise UserError(f"cannot read time {text!r}: use ISO 8601 or epoch seconds") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


def cmd_export(args: argparse.Namespace) -> int:
    import trio

    from reinforge.core import subjects
    from reinforge.core.bus import open_bus
    from reinforge.cli.actor import load_creds
    from reinforge.core import paths
    from reinforge.core.msglog import LogRecord, LogWriter
    from reinforge.core.retention import read_trims, trim_log_path

    creds = load_creds(args.run, args.creds)
    since, until = parse_time(args.since), parse_time(args.until)
    stream = subjects.stream_name(args.run)

    async def go() -> int:
        async with open_bus(creds, name="reinforge-log-export") as bus:
            with LogWriter(Path(args.output)) as writer:
                async for d in bus.read_stream(stream, filter_subject=args.subject):
                    if since is not None and d.timestamp < since:
                        continue
                    if until is not None and d.timestamp > until:
                        break
                    writer.write(LogRecord(
                        subject=d.subject, headers=dict(d.headers or {}),
                        stream_seq=d.stream_seq, timestamp=d.timestamp, payload=d.data,
                    ))
                    if writer.count % 5000 == 0:
                        print(f"exported {writer.count} messages...", file=sys.stderr)
                return writer.count, (await bus.stream_info(stream)).state.first_seq

    count, first_seq = trio.run(go)
    print(f"wrote {count} messages to {args.output}")
    print(trim_summary(read_trims(trim_log_path(paths.run_dir(args.run))), first_seq))
    return 0


def cmd_reviews(args: argparse.Namespace) -> int:
    import collections

    from reinforge.cli import UserError
    from reinforge.core.msglog import LogFormatError
    from reinforge.ui.runlog import RunLog, review_rows

    try:
        log = RunLog.from_file(args.file)
    except (OSError, LogFormatError) as exc:
        raise UserError(str(exc)) from None
    rows = review_rows(log.marks, args.min_score)
    with open(args.output, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    per = collections.Counter(row["domain"] for row in rows)
    print(f"wrote {len(rows)} reviewed rollouts to {args.output} "
          f"({', '.join(f'{d} {n}' for d, n in sorted(per.items())) or 'none'}) "
          f"from {len(log.marks)} review marks")
    return 0


def trim_summary(trims: list[dict[str, Any]], first_seq: int) -> str:
    """What the run's log keeper removed before this export could read it."""
    if not trims:
        if first_seq > 1:
            return f"messages before seq {first_seq} are no longer stored"
        return "nothing was trimmed: the log is whole"
    whys = sorted({t["why"] for t in trims})
    return (f"trimmed by the run's [log] bounds ({', '.join(whys)}): "
            f"{sum(t['messages'] for t in trims)} acknowledged messages, "
            f"{sum(t['bytes'] for t in trims)} bytes, in {len(trims)} passes; "
            f"the log is kept from seq {first_seq}")


def summarise(msg: Any) -> str:
    name = type(msg).__name__
    if name == "ScoredRollout":
        r = msg.rollout
        return f"{r.rollout_id} v{r.policy_version} {msg.outcome.value} reward={msg.reward:g}"
    if name == "Rollout":
        return f"{msg.rollout_id} v{msg.policy_version} {len(msg.output_ids)} tokens"
    if name == "Task":
        return f"{msg.task_id} {msg.domain} tier {msg.tier} x{msg.group_size}"
    if name == "DeadLetter":
        return f"from {msg.subject}: {msg.reason}"
    if name == "ReviewMark":
        return (f"{msg.rollout_id} {msg.kind.value}: reward {msg.recorded_reward:g} -> "
                f"{msg.corrected_reward:g} ({msg.reviewer}) {msg.note}")
    fields = [f for f in msg.__struct_fields__ if f != "sent_at"][:3]
    return " ".join(f"{f}={getattr(msg, f)!r}" for f in fields)


def task_id_of(msg: Any) -> str:
    for obj in (msg, getattr(msg, "rollout", None)):
        if obj is not None and getattr(obj, "task_id", ""):
            return obj.task_id
    return ""


def cmd_show(args: argparse.Namespace) -> int:
    from reinforge.cli import UserError
    from reinforge.core.messages import MessageError, decode, tag_of, to_builtins
    from reinforge.core.msglog import LogFormatError, read_log

    try:
        for rec in read_log(args.file):
            try:
                msg = decode(rec.payload)
            except MessageError as exc:
                msg, error = None, str(exc)
            tag = tag_of(type(msg)) if msg is not None else "malformed"
            if args.type and args.type not in (tag, tag.split("/")[0], type(msg).__name__):
                continue
            if args.task_id and (msg is None or task_id_of(msg) != args.task_id):
                continue
            if args.json:
                body = to_builtins(msg) if msg is not None else {"error": error}
                print(json.dumps({"seq": rec.stream_seq, "time": rec.timestamp,
                                  "subject": rec.subject, "msg_id": rec.msg_id, "type": tag,
                                  "message": body}, default=str))
            else:
                when = dt.datetime.fromtimestamp(rec.timestamp).strftime("%H:%M:%S.%f")[:-3]
                text = summarise(msg) if msg is not None else error
                print(f"{rec.stream_seq:>7} {when} {rec.subject:<32} {tag:<14} {text}")
    except (FileNotFoundError, LogFormatError) as exc:
        raise UserError(str(exc)) from None
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    import trio

    from reinforge.cli import UserError
    from reinforge.cli.actor import build_actor
    from reinforge.core.msglog import LogFormatError, read_log
    from reinforge.core.replay import format_result, replay, result_json

    cls, config = build_actor(args.actor, args.overrides)
    try:
        records = list(read_log(args.file))
    except (FileNotFoundError, LogFormatError) as exc:
        raise UserError(str(exc)) from None
    try:
        result = trio.run(lambda: replay(records, cls, config, only=args.only,
                                         idle_s=args.idle_s, timeout_s=args.timeout_s,
                                         keep_home=args.keep))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print(json.dumps(result_json(result)) if args.json else format_result(result))
    return 0 if result.identical else 1
