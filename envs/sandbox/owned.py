"""Sandbox pools owned by an actor (shared by the verifier, sampler and evaluator).

Lives apart from the actor modules so that no actor module imports another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio


async def hold_sandbox_runner(
    pool_size: int,
    use: Callable[[Any, str], None],
    busy: Callable[[], int],
    *,
    labels: dict[str, str] | None = None,
    grace_s: float = 15.0,
) -> None:
    """Open a Podman sandbox pool and call `use(runner, "")` (or `use(None, why)` when Podman
    is unreachable); keep the pool open until cancelled. On cancellation, wait (at most
    `grace_s`) until `busy()` is 0, then close the pool shielded, so its containers are
    removed even while the actor is being cancelled. `labels` go on every container (so the
    sandboxes of a run, or of a killed actor, can be found and removed)."""
    from reinforge.envs.sandbox.runner import RunnerInfraError, sandbox_runner
    from reinforge.envs.sandbox.box import SandboxConfig
    from reinforge.envs.sandbox.pool import PoolConfig

    config = PoolConfig(size=pool_size, sandbox=SandboxConfig(labels=dict(labels or {})))
    stopping = trio.Event()
    inner = trio.CancelScope(shield=True)

    async def watch() -> None:
        try:
            await trio.sleep_forever()
        finally:
            stopping.set()
            inner.deadline = trio.current_time() + grace_s + 30.0  # never hang for good

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        with inner:
            try:
                async with sandbox_runner(config) as runner:
                    use(runner, "")
                    await stopping.wait()
                    with trio.move_on_after(grace_s):
                        while busy():
                            await trio.sleep(0.05)
            except RunnerInfraError as exc:
                use(None, str(exc))
                await stopping.wait()


def sandbox_labels(ctx: Any) -> dict[str, str]:
    """Container labels of an actor's sandboxes: its run and its id."""
    return {"reinforge.run": ctx.run, "reinforge.actor": ctx.actor_id}
