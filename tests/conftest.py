"""Shared fixtures: a real nats-server per test session (loopback, random port, JetStream),
rootless Podman, and the hygiene of a session: the streams a test made are deleted after
it, and whatever a session started (processes, sandbox containers) is swept at its end.

In CI (`CI=true`) a missing service is a failure, never a skip. Hypothesis runs
derandomized (profile "ci"), so a failure in CI reproduces locally; set
HYPOTHESIS_PROFILE=explore for fresh random examples.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import reinforge  # noqa: F401 - first: takes the checkout root off sys.path (see its docstring)

import pytest
from hypothesis import settings

from reinforge.core.natsd import EmbeddedNats, NatsCredentials, NatsServerError, find_nats_server

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SESSION_ENV = "REINFORGE_TEST_SESSION"
"""Set for the session and inherited by every process it starts: the sweep finds them by it."""
SESSION_LABEL = "reinforge.test-session"
"""Put on every sandbox container the session causes (via REINFORGE_SANDBOX_LABELS)."""

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
    left = sweep_session(os.environ[SESSION_ENV])
    if left:
        print(f"\nsession sweep: removed what tests left running: {', '.join(left)}",
              file=sys.stderr)


def sweep_session(session: str) -> list[str]:
    """Kill the processes and remove the sandbox containers this session started."""
    import psutil

    procs = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if proc.pid != os.getpid() and proc.environ().get(SESSION_ENV) == session:
                procs.append(proc)
        except (psutil.Error, OSError):
            continue
    left = [f"{p.info['name']} (pid {p.pid})" for p in procs]
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return left + [f"container {name}" for name in remove_session_containers(session)]


def remove_session_containers(session: str) -> list[str]:
    from reinforge.envs.sandbox import SandboxInfraError, connect, default_podman_url

    try:
        client = connect(default_podman_url(), timeout_s=10)
        containers = client.containers.list(
            all=True, filters={"label": f"{SESSION_LABEL}={session}"})
    except SandboxInfraError:  # no Podman here: the tests that needed it said so
        return []
    for container in containers:
        container.remove(force=True)
    return [container.name for container in containers]


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
    creds = request.getfixturevalue("nats_server").credentials
    before = asyncio.run(stream_names(creds))
    yield
    asyncio.run(delete_streams(creds, asyncio.run(stream_names(creds)) - before))


async def stream_names(creds: NatsCredentials) -> set[str]:
    import nats

    nc = await nats.connect(creds.url, user=creds.user or None, password=creds.password or None)
    try:
        return {info.config.name for info in await nc.jetstream().streams_info()}
    finally:
        await nc.close()


async def delete_streams(creds: NatsCredentials, names: set[str]) -> None:
    import nats
    from nats.js.errors import NotFoundError

    if not names:
        return
    nc = await nats.connect(creds.url, user=creds.user or None, password=creds.password or None)
    try:
        for name in names:
            try:
                await nc.jetstream().delete_stream(name)
            except NotFoundError:
                pass
    finally:
        await nc.close()


@pytest.fixture(scope="session")
def podman_url() -> str:
    from reinforge.envs.sandbox import DEFAULT_IMAGE, SandboxInfraError, connect, default_podman_url

    url = default_podman_url()
    try:
        client = connect(url, timeout_s=10)
        if not client.images.exists(DEFAULT_IMAGE):
            raise SandboxInfraError(f"image {DEFAULT_IMAGE} missing")
    except SandboxInfraError as exc:
        require(False, f"rootless Podman is not ready ({exc}); run `sudo "
                       "scripts/setup_podman.sh` then `reinforge sandbox doctor`")
    return url


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
