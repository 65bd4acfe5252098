"""The test session's own hygiene (tests/session_hygiene.py), against real services."""

import asyncio
import os
import subprocess
import sys

import psutil
import pytest
import trio
from hypothesis import settings
from session_hygiene import (
    SESSION_ENV,
    SESSION_LABEL,
    dropping_new_streams,
    stream_names,
    sweep_session,
)

from reinforge.core.bus import open_bus


def test_hypothesis_runs_derandomized_so_a_ci_failure_reproduces_locally():
    assert settings.get_profile("ci").derandomize
    asked_to_explore = os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci"
    assert settings.default.derandomize is not asked_to_explore


@pytest.mark.nats
def test_streams_made_inside_the_block_are_deleted_and_older_ones_kept(creds, run_name):
    async def make_stream(run: str) -> None:
        async with open_bus(creds, name="hygiene") as bus:
            await bus.ensure_run_stream(run)

    trio.run(make_stream, run_name + "-old")
    with dropping_new_streams(creds):
        trio.run(make_stream, run_name)
        inside = asyncio.run(stream_names(creds))
    after = asyncio.run(stream_names(creds))
    assert f"RL_{run_name}" in inside and f"RL_{run_name}-old" in inside
    assert f"RL_{run_name}" not in after and f"RL_{run_name}-old" in after


def test_the_sweep_kills_the_processes_of_its_session_and_no_others():
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            env=dict(os.environ, **{SESSION_ENV: "sweep-me"}))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             env=dict(os.environ, **{SESSION_ENV: "not-me"}))
    try:
        left = sweep_session("sweep-me")
        mine.wait(timeout=10)  # (the sweep reaped it already: its exit code is lost)
        assert not psutil.pid_exists(mine.pid)
        assert len(left) == 1 and left[0].endswith(f"(pid {mine.pid})")
        assert other.poll() is None
    finally:
        for proc in (mine, other):
            proc.kill()
            proc.wait()


@pytest.mark.podman
def test_the_sweep_removes_the_sandbox_containers_labelled_with_its_session(podman_url):
    from reinforge.envs.sandbox.box import Sandbox, SandboxConfig, connect

    box = Sandbox.start(SandboxConfig(podman_url=podman_url),
                        labels={SESSION_LABEL: "sweep-containers"})
    assert sweep_session("sweep-containers") == [f"container {box.name}"]
    with connect(podman_url, timeout_s=10) as client:
        assert client.containers.list(all=True, filters={"name": box.name}) == []
