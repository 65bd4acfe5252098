"""Simulated hosts: network namespaces on a private switch (scripts/netns.sh).

Creating namespaces needs root. Locally without it the tests skip; in CI (`CI=true`,
where bootstrap runs as root) they fail, so a broken set-up cannot pass unseen.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
NETNS_SH = Path(__file__).resolve().parents[2] / "scripts" / "netns.sh"


@dataclass(frozen=True)
class NetnsLab:
    """Hosts `<prefix>-h1..hN` at `addresses[i]`, wired to one switch namespace."""

    prefix: str
    addresses: list[str]

    def host(self, i: int) -> str:
        """Namespace of host i (1-based)."""
        return f"{self.prefix}-h{i}"

    def cut(self, i: int) -> None:
        netns("cut", self.prefix, str(i))

    def heal(self, i: int) -> None:
        netns("heal", self.prefix, str(i))

    def throttle(self, i: int, rate: str) -> None:
        """Host i's link carries at most `rate` (tc's units: "1mbit") each way."""
        netns("throttle", self.prefix, str(i), rate)


def netns(*args: str) -> str:
    proc = subprocess.run(
        ["bash", str(NETNS_SH), *args], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/netns.sh {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def _unavailable(why: str) -> None:
    if IN_CI:
        pytest.fail(f"network namespaces are required in CI: {why}")
    pytest.skip(why)


@pytest.fixture
def netns_lab() -> NetnsLab:
    """Three simulated hosts; every namespace (and what runs in it) is gone afterwards."""
    if os.geteuid() != 0:
        _unavailable("creating network namespaces needs root")
    prefix = "rf" + uuid.uuid4().hex[:8]
    try:
        netns("up", prefix, "3")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        netns("down", prefix)
        _unavailable(str(exc))
    try:
        yield NetnsLab(prefix=prefix, addresses=[netns("addr", str(i)) for i in (1, 2, 3)])
    finally:
        netns("down", prefix)
