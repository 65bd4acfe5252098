"""Fixtures of the actor tests: a rollout server, a run's sandboxes (the tiny policy,
`tiny_model_dir`, is in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


def run_sandboxes(run: str) -> list:
    """The sandbox containers (any state) labelled with this run."""
    from reinforge.envs.sandbox.box import connect, default_podman_url

    client = connect(default_podman_url(), timeout_s=10)
    return client.containers.list(all=True, filters={"label": f"reinforge.run={run}"})


@pytest.fixture
def reap_run_sandboxes(podman_url: str, run_name: str):
    """After the test, remove the run's sandboxes left by actors that were killed (-9)."""
    yield run_sandboxes
    for container in run_sandboxes(run_name):
        container.remove(force=True)


@pytest.fixture(scope="module")
def server_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real `reinforge serve` process, started the way the sampler starts it."""
    import signal
    import subprocess
    import time

    from reinforge.rollout.server import ServerSpec, server_command

    where = tmp_path_factory.mktemp("srv")
    cfg = ServerSpec(model_path=str(tiny_model_dir), initial_version=0,
                     server_args=["--max-total-tokens", "8192"])
    argv = server_command(cfg, str(where / "port"))
    log = open(where / "server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (where / "port").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not start: {(where / 'server.log').read_text()}")
        time.sleep(0.1)
    yield f"http://127.0.0.1:{(where / 'port').read_text()}"
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
