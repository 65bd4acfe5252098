"""`reinforge ui`: a local, read-only web page to browse a run's rollouts from its log."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    ui = subparsers.add_parser(
        "ui", help="browse a run's rollouts, checks and dead letters in a local web page")
    ui.add_argument("--log", required=True,
                    help="a message log (`reinforge log export --run NAME -o FILE`)")
    ui.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    ui.add_argument("--port", type=int, default=8765, help="TCP port (0 = any free port)")
    ui.add_argument("--port-file", help="write the bound port to this file once listening")
    ui.set_defaults(func=cmd_ui)


def cmd_ui(args: argparse.Namespace) -> int:
    import asyncio
    import secrets
    import socket
    from pathlib import Path

    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    from reinforge.cli import UserError
    from reinforge.core.atomic import write_atomic
    from reinforge.core.msglog import LogFormatError
    from reinforge.ui.app import build_app
    from reinforge.ui.runlog import RunLog

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
    port = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.accesslog = None
    print(f"reinforge ui: {len(log.scored)} scored rollouts, {len(log.dead_letters)} dead "
          f"letters from {args.log}\n  http://{args.host}:{port}/?token={token}", flush=True)
    if args.port_file:
        write_atomic(args.port_file, f"{port} {token}".encode())
    try:
        asyncio.run(serve(build_app(log, token), config))
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0
