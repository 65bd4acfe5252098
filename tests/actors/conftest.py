"""Fixtures of the actor tests: a run's sandboxes (the tiny policy, `tiny_model_dir`, and
the rollout server, `server_url`, are in tests/conftest.py)."""

from __future__ import annotations

import pytest


def run_sandboxes(run: str, *, remove: bool = False) -> list:
    """The sandbox containers (any state) labelled with this run; `remove`: removed too."""
    from reinforge.envs.sandbox.box import connect, default_podman_url

    with connect(default_podman_url(), timeout_s=10) as client:
        found = client.containers.list(all=True, filters={"label": f"reinforge.run={run}"})
        for container in found if remove else ():
            container.remove(force=True)
    return found


@pytest.fixture
def reap_run_sandboxes(podman_url: str, run_name: str):
    """After the test, remove the run's sandboxes left by actors that were killed (-9)."""
    yield run_sandboxes
    run_sandboxes(run_name, remove=True)
