"""The Sandbox API against real rootless Podman."""

from __future__ import annotations

import os
import socket

import pytest
import trio

from session_hygiene import unix_sockets_left_open_by

from reinforge.envs.sandbox.box import (
    LimitMechanism,
    RunStatus,
    Sandbox,
    SandboxConfig,
    SandboxInfraError,
    probe_limits,
    connect,
)

pytestmark = pytest.mark.podman


@pytest.fixture
def box(podman_url):
    with Sandbox.start(SandboxConfig(podman_url=podman_url, timeout_s=5)) as b:
        yield b


def test_files_stdin_env_and_exit_code_come_through(box):
    box.put_files(
        {
            "main.py": "import os, sys\nprint(sys.stdin.read().upper(), os.environ['X'])\nsys.exit(3)\n"
        }
    )
    r = box.run(["python3", "main.py"], stdin=b"hello", env={"X": "y"})
    assert r.exit_code == 3 and r.status is RunStatus.NONZERO_EXIT
    assert r.stdout == b"HELLO y\n" and r.stderr == b""
    assert r.duration_s > 0 and not r.timed_out and not r.output_truncated


def test_result_says_which_limit_mechanism_is_in_force(box, podman_url):
    r = box.run(["true"])
    assert r.limits is probe_limits(podman_url)
    assert r.limits in (LimitMechanism.CGROUP, LimitMechanism.RLIMIT)


def test_candidate_runs_unprivileged_with_no_capabilities(box):
    r = box.run(["sh", "-c", "id -u; grep -E 'CapEff|NoNewPrivs' /proc/self/status"])
    uid, caps, nnp = r.stdout_text.split("\n")[:3]
    assert int(uid) == box.uid and int(uid) != 0
    assert caps.split()[1] == "0000000000000000" and nnp.split()[1] == "1"


def test_timeout_kills_the_whole_container_and_marks_it_unhealthy(box):
    r = box.run(["sh", "-c", "sleep 100 & sleep 100"], timeout_s=1)
    assert r.status is RunStatus.TIMEOUT and r.timed_out and r.exit_code == 137
    assert 1 <= r.duration_s < 4
    assert not box.healthy


def test_reset_removes_files_and_processes_of_the_previous_task(box):
    box.put_files({"a.txt": "x"})
    box.run(["sh", "-c", "mkdir -p d && chmod 000 d; echo x > /tmp/t; (sleep 100 &) ; echo ok"])
    box.reset()
    r = box.run(
        [
            "sh",
            "-c",
            "ls -A /work /tmp /dev/shm | grep -v : | grep . ; "
            'for p in /proc/[0-9]*; do grep -q "^Uid:.$(id -u)" $p/status 2>/dev/null && echo $p; done | wc -l',
        ]
    )
    # only this command's own processes (sh, the loop's subshell, wc) remain
    assert r.stdout_text.split()[-1] in ("1", "2", "3") and "a.txt" not in r.stdout_text


@pytest.mark.smoke
def test_run_task_starts_clean_and_returns_exact_output(box):
    first = box.run_task(
        {"a.py": "open('/tmp/keep', 'w').write('x')\nprint('one', end='')"}, ["python3", "a.py"]
    )
    assert first.stdout == b"one" and first.ok
    second = box.run_task(
        {"b.py": "import os\nprint(sorted(os.listdir('/work')), os.listdir('/tmp'))"},
        ["python3", "b.py"],
    )
    assert second.stdout_text.strip() == "['b.py'] []"


def test_a_sandbox_carries_the_labels_of_its_environment_so_a_session_can_sweep_it(box, podman_url):
    # tests/conftest.py puts this session's label in REINFORGE_SANDBOX_LABELS
    session = os.environ["REINFORGE_TEST_SESSION"]
    with connect(podman_url, timeout_s=10) as client:
        found = client.containers.list(
            all=True, filters={"label": f"reinforge.test-session={session}"})
    assert box.name in {c.name for c in found}


def test_big_files_go_through_the_archive_path(box):
    big = "x = 1\n" * 200_000  # 1.2 MB: over the inline limit
    r = box.run_task({"big.py": big, "main.py": "import big\nprint(big.x)"}, ["python3", "main.py"])
    assert r.ok and r.stdout == b"1\n"


def test_missing_image_is_an_infrastructure_error_that_says_how_to_fix_it(podman_url):
    with pytest.raises(SandboxInfraError, match="build-image"):
        Sandbox.start(SandboxConfig(podman_url=podman_url, image="localhost/no-such-image:0"))


def test_dead_api_socket_is_an_infrastructure_error(tmp_path):
    with pytest.raises(SandboxInfraError, match="setup_podman"):
        Sandbox.start(SandboxConfig(podman_url=f"unix://{tmp_path}/none.sock"))


def test_a_socket_nobody_serves_is_an_infrastructure_error_that_leaves_no_socket_open(tmp_path):
    path = tmp_path / "podman.sock"
    with socket.socket(socket.AF_UNIX) as bound:  # a stale socket: bound, nobody listening
        bound.bind(str(path))

        def refused():
            with pytest.raises(SandboxInfraError, match="setup_podman"):
                connect(f"unix://{path}", timeout_s=5)

        assert unix_sockets_left_open_by(refused) == 0


def test_arun_works_from_trio(box):
    async def main():
        return await box.arun(["echo", "hi"], limiter=trio.CapacityLimiter(1))

    assert trio.run(main).stdout == b"hi\n"


def test_the_podman_service_is_found_and_runs_in_a_folder_that_exists(podman_url, tmp_path):
    import subprocess

    from reinforge.envs.sandbox.image import cwd_deleted, service_pid

    pid = service_pid(podman_url)
    assert pid is not None
    # a service started inside a checkout later deleted broke every container (conmon:
    # "Failed to get working directory"); scripts/setup_podman.sh starts it from /
    assert os.readlink(f"/proc/{pid}/cwd") == "/" and not cwd_deleted(pid)
    # the check itself, on a real process whose folder is removed under it
    where = tmp_path / "checkout"
    where.mkdir()
    proc = subprocess.Popen(["sleep", "60"], cwd=where)
    try:
        assert not cwd_deleted(proc.pid)
        where.rmdir()
        assert cwd_deleted(proc.pid)
    finally:
        proc.kill()
        proc.wait()



def test_a_sandbox_started_without_a_client_closes_the_one_it_opened(podman_url):
    def start_run_close():
        with Sandbox.start(SandboxConfig(podman_url=podman_url, timeout_s=5)) as b:
            assert b.run(["true"]).status is RunStatus.OK

    assert unix_sockets_left_open_by(start_run_close) == 0
