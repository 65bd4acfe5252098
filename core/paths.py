"""Where a run keeps its files: `<home>/<run>/` with home = $REINFORGE_HOME or ./.reinforge."""

from __future__ import annotations

import os
from pathlib import Path

from reinforge.core import subjects


def home() -> Path:
    return Path(os.environ.get("REINFORGE_HOME", ".reinforge")).absolute()


def run_dir(run: str) -> Path:
    return home() / subjects.check_token(run, "run name")


def creds_path(run: str) -> Path:
    """The run's NATS credentials (mode 0600), or $REINFORGE_NATS_CREDS."""
    override = os.environ.get("REINFORGE_NATS_CREDS")
    return Path(override) if override else run_dir(run) / "nats.json"


def actor_server_log(run: str, actor_id: str) -> Path | None:
    """Where an actor's own rollout server logs: in the run's log folder when it has one
    (`reinforge up` makes it), so `down` and a crash leave it beside the actor's log; else
    None (the server's scratch folder, removed when it stops)."""
    logs = run_dir(run) / "logs"
    return logs / f"{actor_id}-rollout-server.log" if logs.is_dir() else None
