"""Fixtures for the domain tests: the runners the code and terminal domains use.

`runner_kind` parametrizes a test over the unsafe local runner (always; the harness
logic is the same) and the real Podman sandbox pool (marked `podman`: fails in CI when
Podman is missing, skips elsewhere).
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def podman_available() -> str | None:
    """None if the Podman API answers, else why not."""
    try:
        from reinforge.envs.sandbox.box import connect

        connect(timeout_s=5.0).close()
    except Exception as exc:  # noqa: BLE001 - any failure means "not available"
        return str(exc)
    return None


@pytest.fixture(params=["local", pytest.param("podman", marks=pytest.mark.podman)])
def runner_kind(request) -> str:
    if request.param == "podman":
        why = podman_available()
        if why is not None:
            if IN_CI:
                pytest.fail(f"Podman required in CI: {why}")
            pytest.skip(f"Podman not available: {why}")
    return request.param


@pytest.fixture
def with_runner(runner_kind):
    """`await with_runner(fn)`: call `fn(runner)` inside a trio context with the runner open."""
    from contextlib import asynccontextmanager

    from reinforge.envs.sandbox.runner import UnsafeLocalRunner, sandbox_runner
    from reinforge.envs.sandbox.pool import PoolConfig

    @asynccontextmanager
    async def open_runner():
        if runner_kind == "local":
            yield UnsafeLocalRunner()
        else:
            async with sandbox_runner(PoolConfig(size=2)) as r:
                yield r

    return open_runner


@pytest.fixture
def sandbox_runner_only():
    """Like `with_runner`, but only the real sandbox (for what only it can do)."""
    from reinforge.envs.sandbox.runner import sandbox_runner
    from reinforge.envs.sandbox.pool import PoolConfig

    why = podman_available()
    if why is not None:
        if IN_CI:
            pytest.fail(f"Podman required in CI: {why}")
        pytest.skip(f"Podman not available: {why}")
    return lambda: sandbox_runner(PoolConfig(size=1))
