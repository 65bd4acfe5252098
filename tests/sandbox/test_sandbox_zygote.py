"""Checks by a sandbox's zygote (envs/sandbox/zygote.py) against real rootless Podman: the same
outcomes as the two-process path, one exec for many checks, the zygote replaced when it must
be, and the limits of a task (deadline, output flood, memory) for a check too. The leak cases
(a candidate's state seen by the next one) are in the hostile suite (test_sandbox_hostile.py)."""

from __future__ import annotations

import json

import pytest
import reinforge.envs.sandbox.zygote as zygote_module
from reinforge.envs.domains.code import HARNESS_PATH
from reinforge.envs.sandbox.box import RunStatus, Sandbox, SandboxConfig
from reinforge.envs.sandbox.zygote import Check, run_checks

pytestmark = pytest.mark.podman

RUN_PAYLOAD = b"""import sys

def zygote_entry():
    exec(sys.stdin.read(), {'__name__': 'payload'})

if __name__ == '__main__':
    zygote_entry()
"""
"""A harness whose payload is a Python program: any code, as a check."""


@pytest.fixture
def box(podman_url):
    sandbox = Sandbox.start(SandboxConfig(podman_url=podman_url, timeout_s=10.0))
    yield sandbox
    sandbox.close()


def code_check(program: str, nonce: str = "n0nce") -> Check:
    payload = {
        "program": program,
        "prompt": "",
        "test": "def check(c):\n    assert c(2) == 4\n    assert c(-3) == -6\n",
        "entry_point": "f",
        "timeout_s": 3.0,
        "nonce": nonce,
    }
    return Check(harness=HARNESS_PATH.read_bytes(), payload=json.dumps(payload).encode())


def verdict(stdout: bytes, nonce: str = "n0nce") -> dict | None:
    for line in stdout.decode().splitlines():
        if line.startswith(nonce + " "):
            return json.loads(line[len(nonce) + 1 :])
    return None


def run_code(program: str) -> Check:
    return Check(harness=RUN_PAYLOAD, payload=program.encode(), timeout_s=2.0)


def exec_sessions(box: Sandbox) -> int:
    box._container.reload()
    return len(box._container.attrs.get("ExecIDs") or [])


def test_a_check_by_the_zygote_and_as_a_job_give_the_same_verdicts(box):
    checks = [code_check("def f(x):\n    return 2 * x\n"), code_check("def f(x):\n    return 4\n")]
    by_zygote = run_checks(box, checks)
    as_jobs = [box.run_task(j.files, j.argv, stdin=j.stdin) for j in (c.as_job() for c in checks)]
    statuses = [[verdict(r.stdout)["status"] for r in rs] for rs in (by_zygote, as_jobs)]
    assert statuses == [["pass", "fail"], ["pass", "fail"]]
    assert verdict(by_zygote[1].stdout)["checks"] == verdict(as_jobs[1].stdout)["checks"]


def test_many_checks_share_one_zygote_exec(box):
    results = run_checks(box, [code_check(f"def f(x):\n    return x * {k}\n") for k in range(6)])
    assert [verdict(r.stdout)["status"] for r in results] == ["fail", "fail", "pass"] + ["fail"] * 3
    assert box.zygote is not None and box.zygote.checks == 6
    assert exec_sessions(box) == 1


def test_a_job_ends_the_zygote_and_the_next_check_starts_a_fresh_one(box):
    [first] = run_checks(box, [code_check("def f(x):\n    return 2 * x\n")])
    old = box.zygote
    ran = box.run_task({"a.py": "print('job')"}, ["python3", "a.py"])
    assert ran.stdout == b"job\n" and box.zygote is None
    [second] = run_checks(box, [code_check("def f(x):\n    return 2 * x\n")])
    assert box.zygote is not old and box.zygote.checks == 1
    assert verdict(first.stdout)["status"] == verdict(second.stdout)["status"] == "pass"


def test_another_harness_gets_another_zygote(box):
    run_checks(box, [code_check("def f(x):\n    return 2 * x\n")])
    code_zygote = box.zygote
    [r] = run_checks(box, [run_code("print('from the other harness')")])
    assert r.stdout == b"from the other harness\n" and r.status is RunStatus.OK
    assert box.zygote is not code_zygote
    assert box.zygote.fingerprint != code_zygote.fingerprint


def test_the_zygote_enforces_the_deadline_and_the_output_flood_and_lives_on(box):
    spin, flood = run_checks(
        box, [run_code("while True:\n    pass\n"), run_code("while True:\n    print('A' * 4096)\n")]
    )
    assert spin.status is RunStatus.TIMEOUT and spin.timed_out
    assert flood.status is RunStatus.OUTPUT_LIMIT and flood.output_truncated
    assert len(flood.stdout) <= box.config.max_output_bytes
    [after] = run_checks(box, [run_code("print('still here')")])
    assert after.stdout == b"still here\n" and box.healthy and box.zygote.checks == 3


def test_a_candidate_that_kills_the_zygote_gets_no_verdict_and_the_sandbox_is_reset(box):
    killer = (
        "import os\nharness = os.getppid()\n"
        "zygote = int(open('/proc/%d/status' % harness).read().split('PPid:')[1].split()[0])\n"
        "os.kill(zygote, 9)\nos.kill(harness, 9)\n"
    )
    [r] = run_checks(box, [run_code(killer)])
    assert r.status is RunStatus.NONZERO_EXIT and r.exit_code == 137 and "zygote" in r.detail
    assert box.dirty and box.healthy and box.zygote is None
    [after] = run_checks(box, [code_check("def f(x):\n    return 2 * x\n")])
    assert verdict(after.stdout)["status"] == "pass" and not box.dirty


def test_a_stopped_zygote_runs_into_the_hosts_deadline_and_the_sandbox_is_retired(box, monkeypatch):
    monkeypatch.setattr(zygote_module, "ZYGOTE_GRACE_S", 1.0)
    stopper = (
        "import os, signal\nharness = os.getppid()\n"
        "zygote = int(open('/proc/%d/status' % harness).read().split('PPid:')[1].split()[0])\n"
        "os.kill(zygote, signal.SIGSTOP)\n"
    )
    [r] = run_checks(box, [Check(harness=RUN_PAYLOAD, payload=stopper.encode(), timeout_s=1.0)])
    assert r.status is RunStatus.TIMEOUT and not box.healthy


def test_memory_over_the_sandboxs_limit_across_processes_is_caught_in_a_check(box):
    many = (
        "import os, time\nfor i in range(11):\n    if os.fork() == 0:\n        break\n"
        "x = b'x' * (300 * 1024**2)\ntime.sleep(30)\n"
    )
    [r] = run_checks(box, [Check(harness=RUN_PAYLOAD, payload=many.encode(), timeout_s=20.0)])
    assert r.status is RunStatus.MEMORY_LIMIT and r.oom_killed and r.duration_s < 10


def test_a_payload_too_big_for_the_zygotes_pipe_runs_as_a_job(box):
    program = "# " + "x" * (zygote_module.MAX_PAYLOAD_BYTES + 1000) + "\nprint('ran')\n"
    [r] = run_checks(box, [Check(harness=RUN_PAYLOAD, payload=program.encode(), timeout_s=5.0)])
    assert r.status is RunStatus.OK and r.stdout == b"ran\n"
    assert box.zygote is None  # never started: the job's exec would have ended it anyway


@pytest.mark.parametrize("zygote", [True, False])
def test_the_pool_runs_checks_and_jobs_given_together_each_their_way(podman_url, zygote):
    import trio

    from reinforge.envs.sandbox.pool import InfraFailure, Job, PoolConfig, SandboxPool

    checks = [code_check(f"def f(x):\n    return x * {k}\n", nonce=f"n{k}") for k in range(6)]
    jobs = [Job(files={"a.py": f"print({k})"}, argv=["python3", "a.py"]) for k in range(4)]

    async def main():
        cfg = PoolConfig(
            sandbox=SandboxConfig(podman_url=podman_url), size=2, cache_entries=0, zygote=zygote
        )
        async with SandboxPool(cfg) as pool:
            assert await pool.wait_ready(60)
            out: dict = {}

            async def go(key, item):
                out[key] = await pool.run(item)

            async with trio.open_nursery() as n:
                for k, item in enumerate(checks + jobs):
                    n.start_soon(go, k, item)
            return out, pool.statistics()

    out, stats = trio.run(main)
    assert not any(isinstance(r, InfraFailure) for r in out.values())
    statuses = [verdict(out[k].stdout, f"n{k}")["status"] for k in range(6)]
    assert statuses == ["fail", "fail", "pass", "fail", "fail", "fail"]
    assert [out[6 + k].stdout for k in range(4)] == [b"%d\n" % k for k in range(4)]
    assert stats.checks == (6 if zygote else 0)
    assert stats.batched_jobs == (4 if zygote else 10)
