"""`reinforge actor run`: one actor process joining a run; and the two helpers the cluster
commands share (the run's NATS credentials, an actor class with its config)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    actor = subparsers.add_parser("actor", help="run one actor process")
    actor_sub = actor.add_subparsers(dest="actor_command", metavar="ACTION")
    run = actor_sub.add_parser(
        "run",
        help="run MODULE:CLASS (or path/file.py:Class, or an entry-point name) as an actor",
    )
    run.add_argument("spec", help="pkg.module:Class | path/to/file.py:Class | entry-point name")
    run.add_argument("--run", required=True, help="the run (cluster) to join")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a field of the actor's Config (repeatable)")
    run.add_argument("--creds", help="NATS credentials file (default: the run's nats.json)")
    run.add_argument("--id", default="", help="actor id (default: type-host-pid-random)")
    run.add_argument("--allow-no-auth", action="store_true",
                     help="allow a NATS server without credentials (a URL in --creds)")
    run.set_defaults(func=cmd_actor_run)


def load_creds(run: str, creds: str | None) -> Any:
    from pathlib import Path

    from reinforge.cli import UserError
    from reinforge.core import paths
    from reinforge.core.natsd import NatsCredentials, NatsServerError

    if creds and "://" in creds:
        return NatsCredentials(url=creds)
    path = Path(creds) if creds else paths.creds_path(run)
    try:
        return NatsCredentials.read(path)
    except NatsServerError as exc:
        raise UserError(f"{exc} (is the run {run!r} up? start it with `reinforge up`)") from None


def build_actor(spec: str, overrides: list[str]) -> tuple[type, Any]:
    from reinforge.cli import UserError
    from reinforge.core import config as cfg
    from reinforge.core.registry import SpecError, resolve

    try:
        cls = resolve(spec)
    except SpecError as exc:
        raise UserError(str(exc)) from None
    try:
        config = cfg.convert(cfg.parse_overrides(overrides), cls.Config, where=f"{spec} config")
    except cfg.ConfigError as exc:
        raise UserError(str(exc)) from None
    return cls, config


def cmd_actor_run(args: argparse.Namespace) -> int:
    import trio

    from reinforge.core.actor import run_actor
    from reinforge.core.subjects import check_token

    check_token(args.run, "run name")
    cls, config = build_actor(args.spec, args.overrides)
    creds = load_creds(args.run, args.creds)
    trio.run(
        lambda: run_actor(
            cls,
            creds=creds,
            run=args.run,
            config=config,
            actor_id=args.id,
            handle_signals=True,
            allow_no_auth=args.allow_no_auth,
        )
    )
    print(f"actor {cls.actor_type} stopped", file=sys.stderr)
    return 0
