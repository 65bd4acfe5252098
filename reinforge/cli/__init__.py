"""The `reinforge` command line: this dispatcher, and one module per command in this package.

Each module in COMMAND_MODULES defines `register(subparsers)`, which adds its
sub-commands and sets `func(args) -> int` on each. Registration must stay cheap:
heavy imports (torch, tvm) happen inside the command functions, so that
`reinforge --help` and `reinforge status` start fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# One module per command (group), named after it; imported by name so that a command whose
# optional dependencies are missing is left out instead of breaking the others.
COMMAND_MODULES = tuple(f"reinforge.cli.{name}" for name in (
    "up", "status", "log", "actor", "envs", "sandbox", "kernels", "model", "serve", "sft",
    "rm", "judge", "eval", "report", "demo", "ui",
))


def reinforge_argv(*args: str) -> list[str]:
    """The command line that runs `reinforge ARGS` as a child process: this interpreter, with
    `-P` so the child's working directory never lands on `sys.path` (from a checkout, the
    folder `kernels/` there would shadow the `kernels` distribution transformers imports)."""
    return [sys.executable, "-P", "-m", "reinforge", *args]


class UserError(Exception):
    """A mistake the user can fix: printed as one line, no traceback, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reinforge",
        description="RL post-training from verifiable rewards, as an actor system over NATS.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency, not a missing module
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"reinforge {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `reinforge status --json | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
