"""Several tasks in one exec (envs/sandbox/batch.py): each as isolated as a task of its own."""

from __future__ import annotations

import pytest
import trio

from reinforge.envs.sandbox.box import RunStatus, Sandbox, SandboxConfig
from reinforge.envs.sandbox.batch import can_batch, run_batch
from reinforge.envs.sandbox.pool import Job, PoolConfig, SandboxPool

pytestmark = pytest.mark.podman

SNOOP = """import os, sys
me = os.getuid()
procs = []
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) not in (os.getpid(), os.getppid()):
        try:
            if int(open(f'/proc/{p}/status').read().split('Uid:')[1].split()[0]) == me:
                procs.append(p)
        except OSError:
            pass
files = [d + '/' + f for d in ('/work', '/tmp', '/dev/shm') for f in os.listdir(d)]
print(sorted(files), procs, sorted(k for k in os.environ if k.startswith('RF_')),
      sys.stdin.read(), os.environ.get('MINE'))
"""


@pytest.fixture
def box(podman_url):
    with Sandbox.start(SandboxConfig(podman_url=podman_url, timeout_s=5)) as b:
        assert can_batch(b), "the image lacks the protected wrapper: run scripts/setup_podman.sh"
        yield b


def test_each_task_of_a_batch_starts_clean_and_sees_only_its_own_input(box):
    litter = Job(
        files={"l.sh": "echo x > /tmp/litter; echo y > /dev/shm/litter; (sleep 100 &); echo ok\n"},
        argv=["sh", "l.sh"],
    )
    snoop = lambda i: Job(
        files={"s.py": SNOOP}, argv=["python3", "s.py"], stdin=b"in%d" % i, env={"MINE": str(i)}
    )
    results = run_batch(box, [litter, snoop(1), litter, snoop(2)])
    assert [r.status for r in results] == [RunStatus.OK] * 4
    assert results[0].stdout == b"ok\n"
    assert results[1].stdout_text.strip() == "['/work/s.py'] [] [] in1 1"
    assert results[3].stdout_text.strip() == "['/work/s.py'] [] [] in2 2"


def test_a_timeout_in_a_batch_ends_that_task_and_leaves_the_rest_unrun(box):
    tasks = [
        Job(files={"a.py": "print('first')"}, argv=["python3", "a.py"]),
        Job(files={"a.py": "while True: pass"}, argv=["python3", "a.py"], timeout_s=1),
        Job(files={"a.py": "print('third')"}, argv=["python3", "a.py"]),
    ]
    first, second, third = run_batch(box, tasks)
    assert first.stdout == b"first\n" and first.ok
    assert second.status is RunStatus.TIMEOUT and 1 <= second.duration_s < 3
    assert third is None and not box.healthy


def test_exit_codes_stdout_and_stderr_are_split_exactly_per_task(box):
    tasks = [
        Job(
            files={
                "a.py": f"import sys\nsys.stdout.write('o{i}')\nsys.stderr.write('e{i}\\n')\n"
                f"sys.exit({i})"
            },
            argv=["python3", "a.py"],
        )
        for i in range(4)
    ]
    results = run_batch(box, tasks)
    assert [r.exit_code for r in results] == [0, 1, 2, 3]
    assert [r.stdout for r in results] == [b"o0", b"o1", b"o2", b"o3"]
    assert [r.stderr for r in results] == [b"e0\n", b"e1\n", b"e2\n", b"e3\n"]


def test_the_pool_batches_waiting_jobs_and_gets_every_result_right(podman_url):
    jobs = [
        Job(files={"a.py": f"import sys\nprint({i})\nsys.exit({i % 3})"}, argv=["python3", "a.py"])
        for i in range(12)
    ]
    jobs[5] = Job(
        files={"a.py": "import time\ntime.sleep(60)"}, argv=["python3", "a.py"], timeout_s=1
    )

    async def main():
        cfg = PoolConfig(sandbox=SandboxConfig(podman_url=podman_url), size=2, cache_entries=0)
        async with SandboxPool(cfg) as pool:
            assert await pool.wait_ready(60)
            out = [None] * len(jobs)

            async def go(i):
                out[i] = await pool.run(jobs[i])

            async with trio.open_nursery() as n:
                for i in range(len(jobs)):
                    n.start_soon(go, i)
            return out, pool.statistics()

    out, stats = trio.run(main)
    for i, r in enumerate(out):
        if i == 5:
            assert r.status is RunStatus.TIMEOUT
        else:
            assert (r.exit_code, r.stdout) == (i % 3, f"{i}\n".encode()), i
    assert stats.batched_jobs > stats.batches, "no job was batched"
    assert stats.infra_failures == 0
