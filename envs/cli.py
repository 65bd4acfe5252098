"""`reinforge envs ...`, `reinforge verify` and `reinforge sandbox ...`."""

from __future__ import annotations


def register(subparsers) -> None:
    from reinforge.envs import domains_cli
    from reinforge.envs.sandbox import cli as sandbox_cli

    domains_cli.register(subparsers)
    sandbox_cli.register(subparsers)
