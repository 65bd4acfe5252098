"""Building the default sandbox image and diagnosing a Podman set-up (`build-image`, `doctor`).

The set-up itself (packages, the dedicated user, runtime and storage config, the service, the
image) is scripts/setup_podman.sh; `build-image` runs it from the source tree when it is there,
and otherwise pulls the image through podman-py.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from pathlib import Path

import msgspec

from reinforge.envs.sandbox.box import (
    DEFAULT_IMAGE,
    SandboxInfraError,
    connect,
    default_podman_url,
    podman_user,
)

PULL_IMAGE = "docker.io/library/python:3.11-slim"


class SetupCheck(msgspec.Struct, frozen=True, kw_only=True):
    """One finding of `reinforge sandbox doctor`: what was checked, and how to fix it."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


def service_pid(url: str) -> int | None:
    """The pid of the `podman system service` listening at `url`, if this user can see it."""
    sock = url.removeprefix("unix://")
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"service" in argv and any(a.decode(errors="replace").endswith(sock) for a in argv):
            return int(proc.name)
    return None


def cwd_deleted(pid: int) -> bool:
    """Whether process `pid` runs in a folder that was deleted (one that outlived a checkout)."""
    try:
        return os.stat(f"/proc/{pid}/cwd").st_nlink == 0
    except OSError:
        return False


def setup_script() -> Path | None:
    """scripts/setup_podman.sh of the source tree this package is installed from, if any."""
    here = Path(__file__).resolve().parents[2]  # envs/sandbox/image.py -> the checkout
    path = here / "scripts" / "setup_podman.sh"
    return path if path.exists() else None


def doctor(image: str = DEFAULT_IMAGE) -> list[SetupCheck]:
    """What is missing for sandboxes here, and how to fix each thing."""
    checks: list[SetupCheck] = []
    add = lambda *a, **k: checks.append(SetupCheck(*a, **k))
    setup = "run `sudo scripts/setup_podman.sh` (idempotent)"
    podman = shutil.which("podman")
    add(
        name="podman",
        ok=bool(podman),
        detail=podman or "podman is not installed",
        fix=""
        if podman
        else "apt-get install podman runc uidmap slirp4netns fuse-overlayfs catatonit",
    )
    user = podman_user()
    try:
        pw = pwd.getpwnam(user)
        add(
            name="user",
            ok=True,
            detail=f"podman runs as {user} (uid {pw.pw_uid})"
            + (" — the dedicated user, since we are root" if os.geteuid() == 0 else ""),
        )
    except KeyError:
        add(name="user", ok=False, detail=f"no user {user}", fix=setup)
    subuid = Path("/etc/subuid").read_text() if Path("/etc/subuid").exists() else ""
    has_subuid = any(line.split(":")[0] == user for line in subuid.splitlines())
    add(
        name="subuids",
        ok=has_subuid,
        detail="/etc/subuid has an entry" if has_subuid else f"no /etc/subuid entry for {user}",
        fix=""
        if has_subuid
        else f"usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {user}",
    )
    cgroup2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    add(
        name="cgroups",
        ok=True,
        detail="cgroup v2: cgroup limits are enforced"
        if cgroup2
        else "cgroup v1/hybrid: rootless Podman ignores cgroup limits; sandboxes enforce rlimits + timeouts instead",
    )
    init = any(Path(p).exists() for p in ("/usr/libexec/podman/catatonit", "/usr/bin/catatonit"))
    add(
        name="init",
        ok=init,
        detail="catatonit found" if init else "no catatonit (podman --init)",
        fix="" if init else "apt-get install catatonit",
    )
    url = default_podman_url()
    try:
        client = connect(url, timeout_s=10)
    except SandboxInfraError as exc:
        add(name="service", ok=False, detail=str(exc), fix=setup)
        return checks
    with client:  # everything the checks below ask of the service
        info = client.info()
        version = client.version().get("Version")
        exists = client.images.exists(image)
        labels = (client.images.get(image).labels or {}) if exists else {}
    runtime = info.get("host", {}).get("ociRuntime", {})
    add(name="service", ok=True, detail=f"Podman {version} at {url}")
    pid = service_pid(url)
    gone = pid is not None and cwd_deleted(pid)
    add(
        name="service dir",
        ok=not gone,
        detail=f"the service (pid {pid}) runs in a deleted folder: conmon fails every container "
        "('Failed to get working directory')" if gone
        else f"the service (pid {pid}) runs in a folder that exists" if pid is not None
        else "the service's process is not visible from here",
        fix=setup + " (it restarts the service from /)" if gone else "",
    )
    add(
        name="runtime",
        ok=True,
        detail=f"{runtime.get('name')} {str(runtime.get('version', '')).splitlines()[0]}",
    )
    driver = info.get("store", {}).get("graphDriverName")
    add(
        name="storage",
        ok=driver == "overlay",
        detail=f"storage driver {driver}",
        fix=""
        if driver == "overlay"
        else 'set [storage] driver = "overlay" in ~/.config/containers/storage.conf, then podman system reset',
    )
    add(
        name="image",
        ok=exists,
        detail=f"{image} {'present' if exists else 'missing'}",
        fix="" if exists else "reinforge sandbox build-image",
    )
    if exists:
        version = int(labels.get("reinforge.sandbox.version", "0") or 0)
        add(
            name="wrapper",
            ok=version >= 2,
            detail="image has the protected task wrapper (reinforge-sh)"
            if version >= 2
            else "image lacks the protected wrapper: candidates could ptrace their task wrapper",
            fix="" if version >= 2 else "run scripts/setup_podman.sh (rebuilds the image)",
        )
    if exists and cgroup2 is False and runtime.get("name") == "crun":
        add(
            name="runtime-cgroups",
            ok=False,
            detail="crun refuses hybrid cgroups",
            fix='set [engine] runtime = "runc" in ~/.config/containers/containers.conf',
        )
    return checks


def build_image(image: str = DEFAULT_IMAGE, *, offline: bool = False) -> str:
    """Make `image` exist: reuse it, else run the set-up script (pull, else debootstrap +
    import, cached), else pull through podman-py. Returns how it was obtained."""
    with connect() as client:
        if client.images.exists(image):
            return f"{image} already present (reused)"
        script = setup_script()
        if script is not None:
            env = dict(
                os.environ, REINFORGE_SANDBOX_IMAGE=image, REINFORGE_OFFLINE="1" if offline else "0"
            )
            proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SandboxInfraError(f"{script} failed: {proc.stderr.strip()[-800:]}")
            return f"{image} built by {script}"
        if offline:
            raise SandboxInfraError(
                "offline build needs scripts/setup_podman.sh from the source tree")
        try:
            img = client.images.pull(PULL_IMAGE)
            img.tag(image.rsplit(":", 1)[0], image.rsplit(":", 1)[1])
        except Exception as exc:
            raise SandboxInfraError(
                f"pulling {PULL_IMAGE} failed ({exc}); with no registry, run "
                "scripts/setup_podman.sh from the source tree (builds offline)"
            ) from exc
        return f"{image} pulled from {PULL_IMAGE}"
