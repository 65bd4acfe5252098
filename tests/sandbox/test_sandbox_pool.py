"""SandboxPool: warm reuse, replacement, typed infrastructure failures, cache, flakiness."""

from __future__ import annotations

import pytest
import trio
from session_hygiene import unix_sockets_left_open_by

from reinforge.envs.sandbox.box import RunStatus, RunResult, SandboxConfig
from reinforge.envs.sandbox.pool import InfraFailure, Job, PoolConfig, SandboxPool

pytestmark = pytest.mark.podman

TESTS = "import unittest\nfrom sol import add\nclass T(unittest.TestCase):\n    def test(self):\n        self.assertEqual(add(2, 3), 5)\n"


def job(body: str, **kw) -> Job:
    return Job(
        files={"sol.py": f"def add(a, b):\n    {body}\n", "test_sol.py": TESTS},
        argv=["python3", "-m", "unittest", "-q"],
        **kw,
    )


def run(coro_fn):
    return trio.run(coro_fn)


def test_concurrent_jobs_share_the_pool_and_get_their_own_results(podman_url):
    async def main():
        cfg = PoolConfig(sandbox=SandboxConfig(podman_url=podman_url), size=2, cache_entries=0)
        async with SandboxPool(cfg) as pool:
            results = {}

            async def one(i):
                results[i] = await pool.run(job("return a + b" if i % 2 else "return a - b"))

            async with trio.open_nursery() as n:
                for i in range(6):
                    n.start_soon(one, i)
            return results, pool.statistics()

    results, stats = run(main)
    assert all(isinstance(r, RunResult) for r in results.values())
    assert [results[i].ok for i in range(6)] == [False, True] * 3
    assert stats.jobs == 6 and stats.sandboxes_started == 2 and stats.busy == 0
    assert stats.latency_p95_s >= stats.latency_p50_s > 0


def test_identical_candidates_are_served_from_the_cache(podman_url):
    async def main():
        async with SandboxPool(
            PoolConfig(sandbox=SandboxConfig(podman_url=podman_url), size=1)
        ) as pool:
            a = await pool.run(job("return a + b"))
            b = await pool.run(job("return a + b"))
            return a, b, pool.statistics()

    a, b, stats = run(main)
    assert a == b and a.ok
    assert stats.jobs == 1 and stats.cache_hits == 1


def test_a_sandbox_that_timed_out_is_replaced_and_the_next_job_runs(podman_url):
    async def main():
        async with SandboxPool(
            PoolConfig(sandbox=SandboxConfig(podman_url=podman_url), size=1)
        ) as pool:
            slow = await pool.run(job("import time; time.sleep(100)", timeout_s=1))
            fine = await pool.run(job("return a + b"))
            return slow, fine, pool.statistics()

    slow, fine, stats = run(main)
    assert slow.status is RunStatus.TIMEOUT
    assert fine.ok
    assert stats.sandboxes_replaced == 1


def test_persistent_infrastructure_failure_is_typed_never_a_result(podman_url):
    async def main():
        cfg = PoolConfig(
            sandbox=SandboxConfig(podman_url=podman_url, image="localhost/no-such-image:0"),
            size=1,
            infra_attempts=2,
            acquire_timeout_s=1.0,
        )
        async with SandboxPool(cfg) as pool:
            out = await pool.run(job("return a + b"))
            again = await pool.run(job("return a + b"))
            return out, again, pool.statistics()

    out, again, stats = run(main)
    assert isinstance(out, InfraFailure) and isinstance(again, InfraFailure)
    assert (
        out.attempts == 2 and "no sandbox became ready" in out.error and "build-image" in out.error
    )
    assert stats.infra_failures == 2 and stats.cache_entries == 0 and stats.start_failures >= 1


def test_flaky_tests_are_detected_by_rerunning(podman_url):
    flaky = Job(
        files={"t.py": "import os, sys\nsys.exit(os.urandom(1)[0] % 2)\n"}, argv=["python3", "t.py"]
    )
    steady = job("return a + b")

    async def main():
        async with SandboxPool(
            PoolConfig(sandbox=SandboxConfig(podman_url=podman_url), size=2)
        ) as pool:
            reports = [
                await pool.check_flaky(flaky, runs=12),
                await pool.check_flaky(steady, runs=3),
            ]
            return reports, pool.statistics()

    (f, s), stats = run(main)
    assert f.flaky and set(f.exit_codes) == {0, 1}
    assert not s.flaky and s.statuses == ["ok"] * 3
    assert stats.flaky_checks == 2 and stats.flaky_found == 1


def test_a_pool_that_is_not_open_reports_an_infrastructure_failure(podman_url):
    async def main():
        pool = SandboxPool(PoolConfig(sandbox=SandboxConfig(podman_url=podman_url), size=1))
        return await pool.run(job("return a + b"))

    out = run(main)
    assert isinstance(out, InfraFailure) and "not open" in out.error


def test_a_session_held_while_its_pool_closes_removes_its_container_on_exit(podman_url):
    from reinforge.envs.domains.terminal import SESSION_ARGV, TerminalDomain, TerminalSpec

    config = TerminalDomain().session_config(TerminalSpec(instruction="x", checks=[]))

    async def main():
        cfg = PoolConfig(sandbox=SandboxConfig(podman_url=podman_url), size=1)
        pool = SandboxPool(cfg)
        await pool.__aenter__()
        async with pool.session(SESSION_ARGV, config) as session:
            reply = await session.request({"op": "run", "cmd": "echo hi", "timeout_s": 5}, 5)
            box = session.raw.box
            await pool.aclose()  # e.g. the actor stops mid-episode
        return reply, box

    reply, box = run(main)
    assert reply["output"] == "hi\n" and reply["commands"] == 1
    assert not box.alive()  # closed on the way out, not left running


def test_a_pool_leaves_no_podman_client_open_after_it_closes(podman_url):
    async def main():
        cfg = PoolConfig(sandbox=SandboxConfig(podman_url=podman_url), size=1, cache_entries=0)
        async with SandboxPool(cfg) as pool:
            assert (await pool.run(job("return a + b"))).ok

    assert unix_sockets_left_open_by(lambda: run(main)) == 0
