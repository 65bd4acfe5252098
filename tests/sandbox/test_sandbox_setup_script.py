"""scripts/setup_podman.sh on a machine whose Podman processes died but whose /run survived.

It runs the real script as root for a throwaway user, so the suite's own Podman service is
never touched."""

from __future__ import annotations

import os
import pwd
import subprocess
import time
from pathlib import Path

import pytest

from reinforge.envs.sandbox.box import DEFAULT_IMAGE as IMAGE, Sandbox, SandboxConfig

pytestmark = [pytest.mark.podman, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "setup_podman.sh"
USER = "reinforge-setup-t"
TARBALL = Path("/var/cache/reinforge/rootfs-bookworm-python3.tar")


def setup_podman() -> subprocess.CompletedProcess:
    env = {**os.environ, "REINFORGE_SANDBOX_USER": USER}
    if TARBALL.exists():  # no registry here: import the rootfs the suite's own setup built
        env["REINFORGE_OFFLINE"] = "1"
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=300)


def kill_everything_of(uid: int) -> None:
    subprocess.run(["pkill", "-KILL", "-U", str(uid)], check=False)
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-U", str(uid)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, f"processes of uid {uid} outlived SIGKILL"
        time.sleep(0.1)


def as_user(uid: int, *argv: str) -> subprocess.CompletedProcess:
    home = pwd.getpwuid(uid).pw_dir
    return subprocess.run(
        ["runuser", "-u", USER, "--", "env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin",
         f"XDG_RUNTIME_DIR=/run/user/{uid}", *argv],
        capture_output=True, text=True, cwd="/", timeout=60)


@pytest.fixture
def throwaway_user(root):
    """setup_podman.sh creates its user only as root."""
    yield
    try:
        uid = pwd.getpwnam(USER).pw_uid
    except KeyError:
        return
    kill_everything_of(uid)
    subprocess.run(["userdel", "-r", USER], capture_output=True, check=False)
    subprocess.run(["rm", "-rf", f"/run/user/{uid}"], check=True)


def test_setup_brings_podman_back_after_its_processes_died_and_run_survived(throwaway_user):
    first = setup_podman()
    assert first.returncode == 0, first.stderr
    uid = pwd.getpwnam(USER).pw_uid

    # What a machine restored without its processes looks like: /run/user/<uid> still says
    # Podman is set up with a container running, but the pause process (the user namespace)
    # and the container's conmon are gone, so Podman has no namespace to join.
    running = as_user(uid, "podman", "run", "-d", "--network=none", IMAGE, "sleep", "600")
    assert running.returncode == 0, running.stderr
    kill_everything_of(uid)
    stale = as_user(uid, "podman", "info")
    assert stale.returncode != 0 and "invalid internal status" in stale.stderr

    second = setup_podman()
    assert second.returncode == 0, second.stderr
    url = second.stdout.strip().splitlines()[-1]
    assert url == f"unix:///run/user/{uid}/podman/podman.sock"
    with Sandbox.start(SandboxConfig(podman_url=url, timeout_s=30)) as box:
        assert box.run(["echo", "back"]).stdout == b"back\n"
