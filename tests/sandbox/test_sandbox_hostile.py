"""The hostile suite (envs/sandbox/selftest.py) against real rootless Podman: every case
contained, the host unchanged (canary secrets, a listening host port, no leftover containers),
the next task on the same sandbox clean."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
import trio

from reinforge.envs.sandbox.box import RunStatus, SandboxConfig, connect
from reinforge.envs.sandbox.pool import Job, PoolConfig, SandboxPool
from reinforge.envs.sandbox.selftest import CASE_NAMES, LEAK_CASE_NAMES, run_selftest

pytestmark = pytest.mark.podman


def containers_labelled(url: str, run_id: str) -> list[str]:
    with connect(url) as client:
        found = client.containers.list(all=True, filters={"label": f"reinforge.test={run_id}"})
    return [c.name for c in found]


@pytest.mark.parametrize("name", CASE_NAMES + LEAK_CASE_NAMES)
def test_hostile_case_is_contained(name, podman_url, tmp_path):
    run_id = uuid.uuid4().hex
    config = SandboxConfig(podman_url=podman_url, labels={"reinforge.test": run_id})
    report = trio.run(lambda: run_selftest(config, names=[name], root=str(tmp_path)))
    (result,) = report.results
    assert result.contained, f"{name}: {result.detail}"
    assert containers_labelled(podman_url, run_id) == [], "sandbox containers left behind"
    assert not list((tmp_path / ".reinforge").glob("*/nats.creds")), "canary not cleaned up"


def test_killing_everything_in_one_sandbox_leaves_a_concurrent_sandbox_running(podman_url):
    killer = Job(
        files={"k.py": "import os, signal, time\ntime.sleep(0.5)\nos.kill(-1, signal.SIGKILL)\n"},
        argv=["python3", "k.py"],
    )
    steady = Job(
        files={
            "s.py": "import time\nfor i in range(20):\n    time.sleep(0.1)\nprint('survived')\n"
        },
        argv=["python3", "s.py"],
    )

    async def main():
        cfg = PoolConfig(sandbox=SandboxConfig(podman_url=podman_url), size=2, cache_entries=0)
        async with SandboxPool(cfg) as pool:
            assert await pool.wait_ready(60)
            out = {}

            async def go(key, job):
                out[key] = await pool.run(job)

            async with trio.open_nursery() as n:
                n.start_soon(go, "steady", steady)
                n.start_soon(go, "killer", killer)
            return out

    out = trio.run(main)
    assert out["steady"].stdout == b"survived\n" and out["steady"].status is RunStatus.OK
    assert out["killer"].exit_code == 137


@pytest.mark.slow
def test_selftest_cli_reports_every_case_contained(podman_url):
    proc = subprocess.run(
        [sys.executable, "-m", "reinforge", "sandbox", "selftest", "--json"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["escaped"] == 0, [r for r in report["results"] if not r["contained"]]
    assert report["cases"] >= 15 and proc.returncode == 0


def test_a_fork_bomb_does_not_take_the_process_budget_of_a_concurrent_sandbox(podman_url):
    bomb = Job(
        files={
            "b.py": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
        },
        argv=["python3", "b.py"],
        timeout_s=4,
    )
    spawner = Job(
        files={"s.sh": "sleep 1\nfor i in $(seq 20); do sleep 1 & done\nwait\necho spawned\n"},
        argv=["sh", "s.sh"],
        timeout_s=10,
    )

    async def main():
        cfg = PoolConfig(sandbox=SandboxConfig(podman_url=podman_url), size=2, cache_entries=0)
        async with SandboxPool(cfg) as pool:
            assert await pool.wait_ready(60)
            out = {}

            async def go(key, job):
                out[key] = await pool.run(job)

            async with trio.open_nursery() as n:
                n.start_soon(go, "bomb", bomb)
                n.start_soon(go, "spawner", spawner)
            return out

    out = trio.run(main)
    assert out["bomb"].status is RunStatus.TIMEOUT
    assert out["spawner"].status is RunStatus.OK and out["spawner"].stdout == b"spawned\n"


def test_hostile_cases_are_contained_when_the_pool_batches_them_together(podman_url, tmp_path):
    from reinforge.envs.sandbox.selftest import CASES, HostCanaries

    canaries = HostCanaries(str(tmp_path))
    try:
        ctx = canaries.context()

        async def main():
            cfg = PoolConfig(sandbox=SandboxConfig(podman_url=podman_url), size=2, cache_entries=0)
            async with SandboxPool(cfg) as pool:
                assert await pool.wait_ready(60)
                out = {}

                async def go(case):
                    out[case.name] = await pool.run(case.job(ctx))

                async with trio.open_nursery() as n:
                    for case in CASES:
                        n.start_soon(go, case)
                return out, pool.statistics()

        out, stats = trio.run(main)
        problems = {c.name: c.check(out[c.name], ctx) for c in CASES}
        assert {k: v for k, v in problems.items() if v} == {}
        assert stats.batched_jobs > stats.batches and stats.infra_failures == 0
        assert canaries.connections == 0 and canaries.intact()
    finally:
        canaries.close()
