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
