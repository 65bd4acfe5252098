"""Shared fixtures: a real nats-server per test session (loopback, random port, JetStream).

In CI (`CI=true`) a missing service is a failure, never a skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from reinforge.core.natsd import EmbeddedNats, NatsServerError, find_nats_server

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, why: str) -> None:
    """Skip locally, fail in CI: a test that needs a missing service must not pass silently."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"required service missing in CI: {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory):
    try:
        find_nats_server()
    except NatsServerError as exc:
        require(False, str(exc))
    server = EmbeddedNats(data_dir=tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def creds(nats_server: EmbeddedNats):
    return nats_server.credentials


@pytest.fixture
def run_name() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def creds_file(nats_server: EmbeddedNats, tmp_path: Path) -> Path:
    path = tmp_path / "nats.json"
    nats_server.credentials.write(path)
    return path


def reinforge_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "reinforge", *args]


@pytest.fixture
def spawn(tmp_path: Path):
    """Start `reinforge ...` processes; every one is killed at the end of the test."""
    procs: list[subprocess.Popen] = []

    def start(*args: str, log_name: str | None = None) -> subprocess.Popen:
        log = open(tmp_path / (log_name or f"proc{len(procs)}.log"), "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            reinforge_cmd(*args), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
