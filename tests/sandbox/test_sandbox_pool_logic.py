"""Unit tests of the sandbox pool's logic above Podman, with FAKE sandbox starts (the pool's
seams: probe_limits, Sandbox.start, run_checks) on trio's fake clock. The real
pool against real Podman is tests/sandbox/test_sandbox_pool.py.

Seen in CI: with every container start failing (the Podman service ran in a deleted folder),
each check waited acquire_timeout_s (60 s) x infra_attempts (3) for a sandbox that could
never start, two at a time: `reinforge eval`'s 16 code checks took 24 minutes, idle."""

from __future__ import annotations

import types

import trio
import trio.testing

from reinforge.envs.sandbox import pool as P
from reinforge.envs.sandbox.box import LimitMechanism, SandboxInfraError
from reinforge.envs.sandbox.zygote import Check


def _no_podman(monkeypatch, start):
    async def run_sync(fn, *args, **kwargs):  # in the trio thread: deterministic virtual time
        await trio.lowlevel.checkpoint()
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)
    monkeypatch.setattr(P, "probe_limits", lambda *a, **k: LimitMechanism.CGROUP)
    monkeypatch.setattr(P.Sandbox, "start", staticmethod(start))


def test_checks_on_a_pool_whose_sandboxes_never_start_fail_fast_as_infra_errors(monkeypatch):
    def start(*args, **kwargs):
        raise SandboxInfraError("sandbox container failed to start: 500 (exit status 1)")

    _no_podman(monkeypatch, start)

    async def main():
        limiter = trio.CapacityLimiter(4)  # as evaluate_sets: 8 code tasks, 2 samples each
        outs = []
        async with P.SandboxPool(P.PoolConfig(size=2)) as pool:
            async def task(i):
                async with limiter:
                    for s in range(2):
                        outs.append(await pool.run(Check(harness=b"h", payload=b"%d-%d" % (i, s))))

            with trio.fail_after(5):  # virtual seconds; before the fix: 24 minutes
                async with trio.open_nursery() as n:
                    for i in range(8):
                        n.start_soon(task, i)
        return outs

    outs = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(outs) == 16 and all(isinstance(o, P.InfraFailure) for o in outs)
    assert all("exit status 1" in o.error and "became ready" in o.error for o in outs)
    assert all(o.error.count("last error") == 1 for o in outs)  # no nested messages


def test_a_pool_that_could_not_start_sandboxes_recovers_when_starts_work_again(monkeypatch):
    failures = [5]

    class Box:
        healthy, dirty, name = True, False, "box"

        def __init__(self, uid):
            self.uid = uid

        def close(self):
            self.healthy = False

    def start(config, *, uid, limits):
        if failures[0]:
            failures[0] -= 1
            raise SandboxInfraError("start failed")
        return Box(uid)

    _no_podman(monkeypatch, start)
    ran = []
    monkeypatch.setattr(P, "run_checks", lambda box, checks: [  # pool.run reads .status only
        ran.append(c.payload) or types.SimpleNamespace(status=P.RunStatus.OK) for c in checks])

    async def main():
        async with P.SandboxPool(P.PoolConfig(size=2, cache_entries=0)) as pool:
            early = await pool.run(Check(harness=b"h", payload=b"early"))
            await trio.sleep(30)  # the starters' backoff ends; starts work again
            late = await pool.run(Check(harness=b"h", payload=b"late"))
            return early, late

    early, late = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert isinstance(early, P.InfraFailure) and "start failed" in early.error
    assert not isinstance(late, P.InfraFailure) and ran == [b"late"]
