"""Shared fixtures: a real nats-server per test session (loopback, random port, JetStream),
rootless Podman, and the hygiene of a session: the streams a test made are deleted after
it, and whatever a session started (processes, sandbox containers) is swept at its end.

In CI (`CI=true`) a missing service is a failure, never a skip. Hypothesis runs
derandomized (profile "ci"), so a failure in CI reproduces locally; set
HYPOTHESIS_PROFILE=explore for fresh random examples.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import reinforge  # noqa: F401 - first: takes the checkout root off sys.path (see its docstring)

import pytest
from hypothesis import settings

from reinforge.core.natsd import EmbeddedNats, NatsServerError, find_nats_server
from session_hygiene import SESSION_ENV, SESSION_LABEL, dropping_new_streams, sweep_session

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    # A new id even when nested in another session (a test running pytest): its sweep must
    # not take the outer session's processes.
    session = uuid.uuid4().hex[:12]
    os.environ[SESSION_ENV] = session
    labels = [os.environ.get("REINFORGE_SANDBOX_LABELS", ""), f"{SESSION_LABEL}={session}"]
    os.environ["REINFORGE_SANDBOX_LABELS"] = ",".join(filter(None, labels))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from reinforge.envs.domains import gym_scorer

    gym_scorer.close_worker()  # this process's, which lives until its exit: not a leftover
    left = sweep_session(os.environ[SESSION_ENV])
    if left:
        print(f"\nsession sweep: removed what tests left running: {', '.join(left)}",
              file=sys.stderr)


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


@pytest.fixture(autouse=True)
def _drop_the_streams_a_test_made(request: pytest.FixtureRequest):
    """After a test that used the session's nats-server, delete the streams it created:
    each run stream holds a share of the server's JetStream store, and a session of
    hundreds of tests would fill it."""
    if "nats_server" not in request.fixturenames:
        yield
        return
    with dropping_new_streams(request.getfixturevalue("nats_server").credentials):
        yield


@pytest.fixture
def root() -> None:
    """For tests that set up the machine itself (users, services), as CI does: as root."""
    require(os.geteuid() == 0, "this test sets up the machine and needs root")


@pytest.fixture(scope="session")
def podman_url() -> str:
    from reinforge.envs.sandbox.box import DEFAULT_IMAGE, SandboxInfraError, connect, default_podman_url
    from reinforge.envs.sandbox.image import cwd_deleted, service_pid

    url = default_podman_url()
    try:
        with connect(url, timeout_s=10) as client:
            if not client.images.exists(DEFAULT_IMAGE):
                raise SandboxInfraError(f"image {DEFAULT_IMAGE} missing")
        pid = service_pid(url)
        if pid is not None and cwd_deleted(pid):  # every container would hang or fail
            raise SandboxInfraError(f"the service (pid {pid}) runs in a deleted folder")
    except SandboxInfraError as exc:
        require(False, f"rootless Podman is not ready ({exc}); run `sudo "
                       "scripts/setup_podman.sh` then `reinforge sandbox doctor`")
    return url


@pytest.fixture(scope="session")
def chromedriver() -> Iterator[str]:
    """A real chromedriver (W3C WebDriver) for Debian's headless Chromium; its URL."""
    import shutil
    import time

    import httpx

    from reinforge.core.ports import free_port

    driver = shutil.which("chromedriver")
    require(driver is not None and shutil.which("chromium") is not None,
            "Chromium and chromedriver are missing: run `sudo scripts/setup_browser.sh`")
    port = free_port()
    proc = subprocess.Popen([driver, f"--port={port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/status").json()["value"]["ready"]:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "chromedriver did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny policy written by `reinforge model init`'s code (smallest useful shape)."""
    from reinforge.engine.tiny import TinyModelSpec, init_tiny_model

    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                         num_kv_heads=1, vocab_size=1024)
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "model", spec)


@contextlib.contextmanager
def _serving(model_dir: Path, where: Path, server_args: list[str]) -> Iterator[str]:
    """A real `reinforge serve` process on a free port, started by the command line the
    sampler and the supervisor use; yields its URL, stopped (SIGINT) after."""
    import signal
    import time

    from reinforge.rollout.server import ServerSpec, server_command

    spec = ServerSpec(model_path=str(model_dir), initial_version=0, server_args=server_args)
    with open(where / "server.log", "wb") as log:
        proc = subprocess.Popen(server_command(spec, str(where / "port")), stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not (where / "port").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"server did not start: {(where / 'server.log').read_text()}")
                time.sleep(0.1)
            yield f"http://127.0.0.1:{(where / 'port').read_text()}"
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def server_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The tiny policy served by a real `reinforge serve`, shared by a test module."""
    with _serving(tiny_model_dir, tmp_path_factory.mktemp("srv"),
                  ["--max-total-tokens", "8192"]) as url:
        yield url


@pytest.fixture
def serve_model(tmp_path: Path):
    """`with serve_model(model_dir, *flags) as url:` a real `reinforge serve` of any model."""
    return lambda model_dir, *flags: _serving(model_dir, tmp_path, list(flags))


@pytest.fixture
def serve_tiny(tiny_model_dir: Path, tmp_path: Path):
    """`with serve_tiny(*flags) as url:` another real server of the tiny policy, own flags."""
    return lambda *flags: _serving(tiny_model_dir, tmp_path,
                                   ["--max-total-tokens", "8192", *flags])
