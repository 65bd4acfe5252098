"""Exec monitors (conmon) never outlive their use: no process leak over many tasks and kills.

Podman keeps two conmon processes per exec for containers.conf's exit_command_delay (300 s by
default) after the exec ended, even when the container is gone; the sandbox ends them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest
import trio

from reinforge.envs.sandbox.box import (
    RunStatus,
    RunResult,
    Sandbox,
    SandboxConfig,
    exec_monitors,
    reap_exec_monitors,
)
from reinforge.envs.sandbox.pool import Job, PoolConfig, SandboxPool


def conmon_pids(container_ids: set[str] | None = None) -> list[int]:
    """Every conmon process (a container's own and its execs'), of `container_ids` if given."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/comm", "rb") as f:
                if f.read() != b"conmon\n":
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        cid = args[args.index(b"-c") + 1].decode() if b"-c" in args[:-1] else ""
        if container_ids is None or cid in container_ids:
            pids.append(int(name))
    return pids


def processes_of_uids(uids: set[int]) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid in uids:
                    pids.append(int(name))
            except OSError:
                continue
    return pids


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def fake_monitor(tmp_path):
    """A process shaped like conmon in its exit delay: comm `conmon`, exec-session args, and a
    forked child with the same command line (the one that sleeps before the exit command)."""
    fake = tmp_path / "conmon"
    shutil.copy("/bin/sh", fake)
    cid = "f" * 64
    script = tmp_path / "monitor.sh"
    script.write_text("( while :; do sleep 0.1; done ) & wait\n")
    # the shell runs the script; the rest are its arguments and mimic conmon's own
    argv = [str(fake), str(script), "-c", cid, "-u", "e" * 64]
    argv += ["--exec-process-spec", "/x", "--exit-delay", "300"]
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        assert wait_until(lambda: len(exec_monitors([cid])) == 2)
        yield cid, proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the fake, its child and their sleeps
        except ProcessLookupError:
            pass
        proc.wait()


def test_exec_monitors_are_found_by_container_and_the_waiting_child_is_told_apart(fake_monitor):
    cid, proc = fake_monitor
    monitors = sorted(exec_monitors([cid]), key=lambda m: m.waiting)
    assert [m.waiting for m in monitors] == [False, True]
    assert monitors[0].pid == proc.pid
    assert all(m.exit_delay_s == 300 and m.session_id == "e" * 64 for m in monitors)
    assert exec_monitors(["0" * 64]) == []


def test_reaping_a_live_containers_monitors_signals_only_the_waiting_child(fake_monitor):
    cid, proc = fake_monitor
    assert reap_exec_monitors(cid, removed=False, min_age_s=60.0) == 0  # too young
    assert reap_exec_monitors(cid, removed=False, min_age_s=0.0) == 1
    proc.wait(timeout=5)  # its child ended, so the parent's `wait` returned
    assert wait_until(lambda: exec_monitors([cid]) == [])


def test_reaping_a_removed_containers_monitors_kills_them_all(fake_monitor):
    cid, proc = fake_monitor
    assert reap_exec_monitors(cid, removed=True) >= 1
    proc.wait(timeout=5)
    assert wait_until(lambda: exec_monitors([cid]) == [])


@pytest.mark.podman
def test_conmon_and_candidate_processes_return_to_baseline_after_many_tasks_and_kills(
    podman_url, monkeypatch
):
    started: list[Sandbox] = []
    real_start = Sandbox.start.__func__

    def recording_start(cls, *args, **kwargs):
        box = real_start(cls, *args, **kwargs)
        started.append(box)
        return box

    monkeypatch.setattr(Sandbox, "start", classmethod(recording_start))
    files = lambda body: {"main.py": body}
    jobs = (
        [Job(files=files(f"print({i})"), argv=["python3", "main.py"]) for i in range(16)]
        + [Job(files=files("import time\ntime.sleep(30)"), argv=["python3", "main.py"])] * 3
        + [Job(files=files("import os\nos.system('sleep 60 &')"), argv=["python3", "main.py"])] * 2
        + [Job(files=files("raise SystemExit(3)"), argv=["python3", "main.py"])] * 2
    )
    cfg = PoolConfig(
        sandbox=SandboxConfig(podman_url=podman_url, timeout_s=1.0, exec_reap_s=0.5),
        size=2,
        cache_entries=0,
        max_batch=1,
    )
    others_before = foreign_containers(podman_url)
    baseline_conmon = len(conmon_pids())

    async def main():
        async with SandboxPool(cfg) as pool:
            results = [None] * len(jobs)

            async def one(i):
                results[i] = await pool.run(jobs[i])

            async with trio.open_nursery() as n:
                for i in range(len(jobs)):
                    n.start_soon(one, i)
            for i in range(12):  # the live sandboxes run many execs too
                await pool.run(Job(files=files(f"print({i})"), argv=["python3", "main.py"]))
            await trio.sleep(1.2)  # every exec so far ended over min_age_s ago
            for i in range(4):  # each live sandbox starts an exec, and reaps what came before
                await pool.run(Job(files=files(f"print({i})"), argv=["python3", "main.py"]))
            live = {box._container.id for box in pool._all}
            waiting = [m for m in exec_monitors(live) if m.waiting]
            return results, pool.statistics(), live, waiting

    results, stats, live, waiting = trio.run(main)
    # live sandboxes: only the last few execs' monitors still wait (not one per exec ever run)
    assert len(waiting) <= 6, waiting
    assert all(isinstance(r, RunResult) for r in results)
    statuses = [r.status for r in results]
    assert statuses.count(RunStatus.TIMEOUT) == 3 and statuses.count(RunStatus.OK) == 18
    assert statuses.count(RunStatus.NONZERO_EXIT) == 2
    assert stats.sandboxes_replaced >= 3 and stats.infra_failures == 0
    ids = {box._container.id for box in started}
    retired = ids - live
    assert len(retired) >= 3
    assert sum(box.monitors_reaped for box in started) > 0
    # after the pool closed: no conmon of any of its containers, no process of its candidates
    assert wait_until(lambda: conmon_pids(ids) == []), exec_monitors(ids)
    host_uids = {box.host_uid for box in started if box.host_uid is not None}
    assert wait_until(lambda: processes_of_uids(host_uids) == []), processes_of_uids(host_uids)
    # the host as a whole is back to its baseline, unless others use the service meanwhile
    # (a shared development machine; in CI the tests are its only client)
    if not others_before and not (foreign_containers(podman_url) - ids):
        assert wait_until(lambda: len(conmon_pids()) <= baseline_conmon), (
            len(conmon_pids()),
            baseline_conmon,
        )


def foreign_containers(podman_url: str) -> set[str]:
    from reinforge.envs.sandbox.box import connect

    with connect(podman_url) as client:
        return {c.id for c in client.containers.list(all=True)}
