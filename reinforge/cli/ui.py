"""`reinforge ui`: a local web page to browse a run's rollouts, from its exported log or live
from its stream, and (with `--review`) to mark rewards wrong, marks that go into the run's log."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    ui = subparsers.add_parser(
        "ui", help="browse a run's rollouts, checks and dead letters in a local web page",
        description="Serve a local page over a run's messages: an exported log (--log), or a "
        "running run's stream (--run), read again every few seconds. With --review (and "
        "--run), each rollout has a form to mark its reward wrong or flag it as an exploit: "
        "the marks are stored in the run's log (`reinforge log reviews` exports them).")
    source = ui.add_mutually_exclusive_group(required=True)
    source.add_argument("--log", help="a message log (`reinforge log export --run NAME -o FILE`)")
    source.add_argument("--run", help="a running run: read its stream, live")
    ui.add_argument("--creds", help="NATS credentials file (default: the run's nats.json)")
    ui.add_argument("--review", action="store_true",
                    help="allow review marks (needs --run: they are messages in its log)")
    ui.add_argument("--reviewer", default="", help="the name marks carry (default: the user)")
    ui.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    ui.add_argument("--port", type=int, default=8765, help="TCP port (0 = any free port)")
    ui.add_argument("--port-file", help="write the bound port to this file once listening")
    ui.set_defaults(func=cmd_ui)


def cmd_ui(args: argparse.Namespace) -> int:
    import getpass
    import secrets
    import socket
    from pathlib import Path

    import trio

    from reinforge.cli import UserError
    from reinforge.core.msglog import LogFormatError
    from reinforge.ui.runlog import RunLog

    if args.review and not args.run:
        raise UserError("--review needs --run NAME: a mark is a message in that run's log")
    log = RunLog()
    if args.log:
        if not Path(args.log).is_file():
            raise UserError(f"--log {args.log}: no such file")
        try:
            log = RunLog.from_file(args.log)
        except LogFormatError as exc:
            raise UserError(str(exc)) from None
    token = secrets.token_urlsafe(16)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(64)
    sock.set_inheritable(True)
    reviewer = args.reviewer or getpass.getuser()
    try:
        trio.run(serve, args, log, token, sock, reviewer)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0


async def serve(args: argparse.Namespace, log: Any, token: str, sock: Any,
                reviewer: str) -> None:
    import contextlib

    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    from reinforge.cli.actor import load_creds
    from reinforge.core import subjects
    from reinforge.core.atomic import write_atomic
    from reinforge.core.bus import open_bus
    from reinforge.ui.app import build_app, mark_id
    from reinforge.ui.runlog import catch_up, follow

    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.accesslog = None
    async with contextlib.AsyncExitStack() as stack:
        review = None
        bus = None
        if args.run:
            bus = await stack.enter_async_context(
                open_bus(load_creds(args.run, args.creds), name="reinforge-ui"))
        nursery = await stack.enter_async_context(trio.open_nursery())  # closed before the bus
        if bus is not None:
            stream = subjects.stream_name(args.run)
            await catch_up(bus, stream, log)  # all of it before the page opens
            nursery.start_soon(follow, bus, stream, log)
            if args.review:
                async def review(mark: Any) -> None:
                    await bus.publish_durable(subjects.review(args.run, mark.domain), mark,
                                              msg_id=mark_id(mark))
        port = sock.getsockname()[1]
        where = f"run {args.run} (live)" if args.run else args.log
        print(f"reinforge ui: {len(log.scored)} scored rollouts, {len(log.dead_letters)} dead "
              f"letters from {where}{'; review marks on' if review else ''}\n"
              f"  http://{args.host}:{port}/?token={token}", flush=True)
        if args.port_file:
            write_atomic(args.port_file, f"{port} {token}".encode())
        await hypercorn_serve(build_app(log, token, review=review, reviewer=reviewer), config)
        nursery.cancel_scope.cancel()
