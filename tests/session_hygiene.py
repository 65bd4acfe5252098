"""What keeps a test session from leaving anything behind (used by tests/conftest.py).

Every process the session starts inherits `REINFORGE_TEST_SESSION`; every sandbox container
it causes carries the label `reinforge.test-session` (through REINFORGE_SANDBOX_LABELS).
At the end, `sweep_session` removes what still carries them. After each test that used the
session's nats-server, `dropping_new_streams` deletes the streams the test created.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import Iterator

from reinforge.core.natsd import NatsCredentials

SESSION_ENV = "REINFORGE_TEST_SESSION"
SESSION_LABEL = "reinforge.test-session"


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
    from reinforge.envs.sandbox.box import SandboxInfraError, connect, default_podman_url

    try:
        client = connect(default_podman_url(), timeout_s=10)
    except SandboxInfraError:  # no Podman here: the tests that needed it said so
        return []
    with client:
        containers = client.containers.list(
            all=True, filters={"label": f"{SESSION_LABEL}={session}"})
        for container in containers:
            container.remove(force=True)
    return [container.name for container in containers]



@contextlib.contextmanager
def dropping_new_streams(creds: NatsCredentials) -> Iterator[None]:
    """Delete, on exit, the JetStream streams created inside the block (and only those)."""
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



def unix_sockets_left_open_by(work) -> int:
    """How many more UNIX sockets (a Podman client's connection) this process holds right
    after `work` than before: one left for the garbage collector to close counts (a client
    sits in reference cycles, so only a collection, whenever it comes, would close it)."""
    import psutil

    proc = psutil.Process()
    gc.collect()
    before = len(proc.net_connections(kind="unix"))
    work()
    return len(proc.net_connections(kind="unix")) - before
