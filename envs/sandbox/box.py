"""Rootless Podman sandboxes for model-written code.

Public API (stable; the code and terminal domains build on it)::

    config = SandboxConfig(timeout_s=10.0)              # limits, image, socket
    with Sandbox.start(config) as box:                   # one warm container
        # one self-contained task: clean start, files, command (what the pool runs)
        result = box.run_task({"sol.py": code, "test_sol.py": tests},
                              ["python3", "-m", "unittest", "-q"], stdin=b"", env={})
        result.status, result.exit_code, result.stdout, result.timed_out, result.limits
        # or step by step, state kept across runs (a terminal session):
        box.put_files({"notes.txt": "..."})
        result = box.run(["sh", "-c", "ls"], timeout_s=5)
        await box.arun(["sh", "-c", "ls"])               # `run` from trio (worker thread)
        box.reset()                                      # clean state for the next task
    # SandboxInfraError: the infrastructure failed (API down, image missing, ...): retry

    SandboxPool (pool.py) keeps warm sandboxes, replaces misbehaving ones, caches
    results by hash of (files, command, image), and turns persistent infrastructure failures
    into a typed `InfraFailure` — never a reward.

What a sandbox is: a container from a sandbox image, started through the Podman API socket
(podman-py) of a rootless Podman, with no network (`none`), a read-only root filesystem,
small size-capped tmpfs mounts (/work, /tmp, /var/tmp, /dev/shm, /run/reinforge), no
capabilities, no-new-privileges, the default seccomp profile, an init (catatonit) as PID 1 that
reaps orphans, and candidate code running as an unprivileged uid (a different one per sandbox,
so one sandbox's per-uid process budget is not another's). A "keeper" process running as a
second uid holds the container open; the candidate can't signal it.

A task (`run_task`, what the pool uses) is ONE exec: a wrapper shell (`task_script`) kills every
process of the candidate uid and wipes every writable dir (and checks both), unpacks the files
and stdin from its environment, prints a per-run start marker, runs the command, kills
everything the command left behind, and prints end markers with the exit status. No start
marker: the set-up failed, an infrastructure error. No end marker: the wrapper was killed, so
the sandbox is reset by a separate exec before its next task. The wrapper runs
/usr/local/bin/reinforge-sh, a copy of dash that the candidate's uid can execute but not read:
that makes the wrapper non-dumpable, so candidate processes can't ptrace it, write its memory or
read its environment (which holds the task's files) — neither this task's nor a leftover of an
earlier one.

One driver, `Sandbox.execute`, runs every exec of candidate code: `run`, `run_task` and batches
of tasks (batch.py) alike. It splits the output per task by the markers, enforces each
task's deadline (counted from the start of its set-up), the memory watchdog and the flood limit
by killing the whole container, and classifies how each task ended.

Limits. Where Podman can apply cgroup limits (cgroup v2), memory, pids and CPU are cgroup
limits *and* rlimits; on cgroup v1 rootless set-ups (these machines) Podman ignores them, so the
same limits are enforced by rlimits that the wrapper sets on the candidate (RLIMIT_NPROC on its
own uid, RLIMIT_DATA for memory, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CPU, nice for CPU share)
and by a wall-clock deadline outside (the host kills the whole container, which the pool then
replaces). `RunResult.limits` says which mechanism is in force.

Host processes. Podman runs each exec under a conmon that, once the exec has ended, waits the
service's `exit_command_delay` (300 s by default) before cleaning the session up: two processes
per exec, even after the container is gone. The sandbox makes its finished sessions clean up at
once (every `exec_reap_s`) and, when it closes, ends the monitors of its removed container, so
their number stays bounded over a long run (tests/sandbox/test_sandbox_monitors.py);
scripts/setup_podman.sh also sets a short delay for the sandbox service.

Checks (zygote.py): a code check is a harness over a payload. It runs in a fork of the sandbox's
zygote, one long-lived process per sandbox, as the candidate's uid, non-dumpable like the
wrapper, that never runs harness or candidate code itself and holds no check's input once the
child has it. The child starts clean (only its own stdin/stdout/stderr pipes, default signal
handlers and mask, the zygote's starting environment, umask 022, a wiped work dir, the rlimits
of a task); after it the zygote kills every other process of the uid and wipes every writable
dir, and checks both, as the wrapper's reset does. What changes against one exec per task: the
candidate's code runs in a fork of a process that forked earlier candidates, so the zygote's
memory must hold nothing of theirs (it zeroes each payload after handing it on; the code harness
forks the candidate's worker before it reads the tests); and the zygote outlives the task, so
a candidate may signal it (it ignores the catchable signals; SIGKILL ends the session and the
check gets exit 137 and no verdict, SIGSTOP runs the check into the host's deadline and the
container is replaced).

It protects against (each claim is attacked in tests/sandbox/):
  - fork bombs, memory bombs, disk fill, busy loops, sleeping past the timeout, infinite output
    (contained, reported with a precise status; the sandbox is replaced afterwards);
  - network egress: no interface but loopback, so no TCP to the host's ports, no DNS;
  - reading host files, environment and secrets: nothing of the host is mounted, the env is a
    whitelist;
  - writing outside the work dirs (read-only root), setuid/capability use (no caps,
    no-new-privileges), signalling processes outside the sandbox (own PID namespace);
  - one task seeing another's files or processes: every task starts with a checked reset (no
    process of the candidate uid, nothing in any writable dir) and ends by killing what it
    left; a sandbox that can't be reset, timed out or flooded is replaced; System V IPC
    objects and POSIX message queues, which outlive processes and no wipe reaches, can't be
    left behind (`IPC_SYSCTLS`); checks by one zygote see none of each other's files,
    processes, sockets, threads, patched modules, signal state, cwd, umask or environment
    (selftest.py's leak cases);
  - a candidate tampering with its wrapper (ptrace, /proc/<pid>/mem, /proc/<pid>/environ):
    the wrapper is non-dumpable (images built by scripts/setup_podman.sh; see `shell`);
  - binary garbage / invalid UTF-8 output (kept as bytes, decoded with replacement), huge
    stdin / files (refused up front as INPUT_TOO_LARGE).

It does NOT protect against:
  - kernel exploits or container-runtime escapes (runc/crun CVEs): keep the kernel and runtime
    patched; a microVM (gVisor, Firecracker) is the stronger boundary;
  - timing side channels and CPU contention between sandboxes on cgroup v1 (nice and RLIMIT_CPU
    only; no CPU quota);
  - memory pressure on cgroup v1: RLIMIT_DATA bounds heap per process, not the sum over a
    sandbox's processes (bounded by pids x data), and tmpfs pages are bounded by their sizes;
  - reward hacking inside the candidate's own process (exiting 0 early, patching the test
    runner): the verifier must run tests in a way the candidate can't fake (a nonce sentinel);
  - a candidate reading the tests it is given: put only what it may see;
  - a candidate killing its own wrapper: it only ends its own task (exit 137, status
    NONZERO_EXIT) and forces a reset;
  - sandbox direct use across turns (`put_files` + `run`, the terminal domain): state and
    background processes persist between runs by design until `reset()`.
"""

from __future__ import annotations

import base64
import contextlib
import enum
import hashlib
import io
import json
import os
import pwd
import secrets
import signal
import socket
import tarfile
import threading
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import msgspec

DEFAULT_IMAGE = "localhost/reinforge-sandbox-python:bookworm"
DEFAULT_SANDBOX_USER = "reinforge-sandbox"
LABEL = "reinforge.sandbox"
LABELS_ENV = "REINFORGE_SANDBOX_LABELS"
KEEPER_UID = 65534
# Candidate uids: one per sandbox, inside the rootless user's 65536 sub-uid range.
CANDIDATE_UID_BASE = 20000
CANDIDATE_UID_SPAN = 40000
WRITABLE_DIRS = ("/work", "/tmp", "/var/tmp", "/dev/shm", "/run/reinforge")
PROTECTED_SHELL = "/usr/local/bin/reinforge-sh"
"""dash, root-owned, mode 0711 (images of version >= 2): a process that execs a binary it can't
read is non-dumpable, so the task wrapper can't be ptraced, have its memory written or its
environment read by candidate processes of the same uid."""
IMAGE_VERSION_LABEL = "reinforge.sandbox.version"
STDIN_DIR = "/run/reinforge"  # where stdin is staged (a small tmpfs, wiped by reset)
IPC_SYSCTLS = {
    "kernel.shm_rmid_forced": "1",
    "kernel.msgmni": "0",
    "kernel.sem": "0 0 0 0",
    "fs.mqueue.queues_max": "0",
}
"""System V IPC objects and POSIX message queues outlive the process that made them (they
belong to the container's IPC namespace, not to a dir the reset wipes): shared memory goes
with its last user, message queues and semaphore sets can't be made (multiprocessing's
semaphores are POSIX ones, files in /dev/shm)."""


# --------------------------------------------------------------------------- types


class RunStatus(enum.Enum):
    """How the candidate's command ended (its own doing, never the infrastructure's). A
    domain turns it into a verification outcome (`reinforge.core.messages.Outcome`)."""

    OK = "ok"  # exit status 0
    NONZERO_EXIT = "nonzero_exit"  # an exception, a failed test, a wrong answer, a signal
    TIMEOUT = "timeout"  # killed at the wall-clock deadline (or RLIMIT_CPU)
    MEMORY_LIMIT = "memory_limit"  # ran out of its memory limit
    OUTPUT_LIMIT = "output_limit"  # killed for flooding output far past the cap
    INPUT_TOO_LARGE = "input_too_large"  # refused before running: argv/stdin/files too big


class LimitMechanism(enum.Enum):
    """How resource limits are enforced for this sandbox."""

    CGROUP = "cgroup+rlimit+timeout"  # cgroup v2: kernel limits per container, plus the rest
    RLIMIT = "rlimit+timeout"  # cgroup v1 rootless: rlimits inside, wall-clock kill outside


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """One command to run on fresh files: e.g. candidate code + its hidden tests."""

    files: dict[str, str | bytes] = {}
    """Relative path -> content, written to the work dir before the command."""
    argv: list[str]
    stdin: bytes = b""
    env: dict[str, str] = {}
    timeout_s: float | None = None
    """None: the sandbox config's timeout_s."""

    def cache_key(self, image: str) -> str:
        """sha256 over everything that decides the outcome: files, command, stdin, env, image."""
        h = hashlib.sha256()
        h.update(image.encode() + b"\0")
        for name in sorted(self.files):
            content = self.files[name]
            data = content.encode() if isinstance(content, str) else bytes(content)
            h.update(b"F%d:%s\0%d:" % (len(name), name.encode(), len(data)) + data)
        h.update(msgspec.msgpack.encode([self.argv, sorted(self.env.items()), self.timeout_s]))
        h.update(b"S" + self.stdin)
        return h.hexdigest()


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one command in a sandbox."""

    status: RunStatus
    exit_code: int | None
    """Exit status; 128+N when killed by signal N; None when it never ran."""
    stdout: bytes
    """At most `max_output_bytes` of stdout, raw bytes (see `stdout_text`)."""
    stderr: bytes
    stdout_bytes: int
    """How many bytes the command wrote to stdout in all (kept or not)."""
    stderr_bytes: int
    duration_s: float
    """Wall-clock seconds from start to exit (or kill)."""
    timed_out: bool
    oom_killed: bool
    """Ran out of memory: the kernel's OOM killer (cgroup mode), or an allocation failure the
    runtime reported (rlimit mode: MemoryError / ENOMEM / bad_alloc at the end of stderr)."""
    output_truncated: bool
    limits: LimitMechanism
    image: str
    detail: str = ""
    """A human note: why the input was refused, which limit fired."""

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.status is RunStatus.OK


class SandboxInfraError(RuntimeError):
    """The infrastructure failed (Podman API down, image missing, container failed to start,
    a sandbox that could not be reset). Never the candidate's fault: retry, never reward 0."""


class SandboxConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Limits and wiring of one sandbox (all pool sandboxes share one)."""

    image: str = DEFAULT_IMAGE
    """Image reference; build the default with `reinforge sandbox build-image`."""
    podman_url: str | None = None
    """Podman API socket, e.g. unix:///run/user/1001/podman/podman.sock; None: default_podman_url()."""
    timeout_s: float = 10.0
    """Default wall-clock limit of one run; the whole container is killed past it."""
    memory_bytes: int = 512 * 1024**2
    """Memory of the candidate: per container (cgroup, where available); else per process
    (RLIMIT_DATA) plus a host-side watchdog on the total RSS of the candidate's uid."""
    memory_poll_s: float = 0.1
    """How often the host-side memory watchdog looks (rlimit mode only)."""
    pids_limit: int = 64
    """Processes + threads of the candidate (RLIMIT_NPROC on its own uid; cgroup pids too)."""
    cpus: float = 1.0
    """CPU share (cgroup quota where available; on cgroup v1 only nice + RLIMIT_CPU)."""
    work_dir: str = "/work"
    work_dir_bytes: int = 64 * 1024**2
    """Size of the /work tmpfs, where files are put and commands run."""
    tmp_bytes: int = 32 * 1024**2
    """Size of each of /tmp, /var/tmp and /dev/shm."""
    file_size_bytes: int = 64 * 1024**2
    """Largest file the candidate may write (RLIMIT_FSIZE)."""
    open_files: int = 256
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 64 * 1024
    """Kept bytes of each of stdout and stderr; more is counted, dropped, and flagged."""
    max_drained_bytes: int = 4 * 1024**2
    """Past this many bytes of output the command is killed (OUTPUT_LIMIT)."""
    max_input_bytes: int = 8 * 1024**2
    """Largest argv + env + stdin + files of one run; more is refused (INPUT_TOO_LARGE)."""
    api_timeout_s: float = 30.0
    """Timeout of one Podman API call (not of the command)."""
    exec_reap_s: float = 2.0
    """At most this often (seconds, at the start of an exec) the sandbox makes Podman clean up
    its finished exec sessions now rather than after the service's `exit_command_delay`
    (containers.conf; 300 s by default), during which each exec holds two conmon processes
    (see `reap_exec_monitors`); 0 disables it (then scripts/setup_podman.sh's short delay is
    the only bound)."""
    nice: int = 5
    """Niceness of candidate processes."""
    labels: dict[str, str] = {}
    """Extra container labels (e.g. to find one run's containers); `reinforge.sandbox=1` always,
    and those of $REINFORGE_SANDBOX_LABELS (see `labels_from_env`)."""

    def __post_init__(self) -> None:
        if not self.exec_reap_s >= 0:
            raise ValueError(f"SandboxConfig.exec_reap_s must be >= 0, got {self.exec_reap_s!r}")
        for name in ("timeout_s", "cpus", "api_timeout_s", "memory_poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in (
            "memory_bytes",
            "pids_limit",
            "work_dir_bytes",
            "tmp_bytes",
            "file_size_bytes",
            "open_files",
            "max_output_bytes",
            "max_input_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"SandboxConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_drained_bytes < self.max_output_bytes:
            raise ValueError("SandboxConfig.max_drained_bytes must be >= max_output_bytes")
        if self.work_dir not in ("/work", "/tmp"):
            raise ValueError(f"SandboxConfig.work_dir must be /work or /tmp, got {self.work_dir!r}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"SandboxConfig.nice must be in 0..19, got {self.nice}")


# --------------------------------------------------------------------------- discovery


def podman_user() -> str:
    """The user that runs Podman: the dedicated one when we are root, else ourselves."""
    if os.geteuid() == 0:
        return os.environ.get("REINFORGE_SANDBOX_USER", DEFAULT_SANDBOX_USER)
    return pwd.getpwuid(os.geteuid()).pw_name


def labels_from_env() -> dict[str, str]:
    """Labels for every sandbox container this process (and its children) creates, from
    $REINFORGE_SANDBOX_LABELS, "key=value,key=value": a job, or a test session, labels all
    the containers it causes, however deep in its process tree, and removes them by label."""
    labels = {}
    for item in filter(None, os.environ.get(LABELS_ENV, "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"${LABELS_ENV}: {item!r} is not key=value")
        labels[key.strip()] = value.strip()
    return labels


def default_podman_url() -> str:
    """Where the Podman API socket is, by the convention of scripts/setup_podman.sh.

    REINFORGE_PODMAN_URL overrides; as root, the socket of the dedicated sandbox user
    (/run/user/<uid>/podman/podman.sock); as a user, $XDG_RUNTIME_DIR/podman/podman.sock.
    """
    url = os.environ.get("REINFORGE_PODMAN_URL")
    if url:
        return url
    if os.geteuid() == 0:
        user = podman_user()
        try:
            uid = pwd.getpwnam(user).pw_uid
        except KeyError:
            return f"unix:///run/user/<uid of {user}>/podman/podman.sock"
        return f"unix:///run/user/{uid}/podman/podman.sock"
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.geteuid()}"
    return f"unix://{runtime_dir}/podman/podman.sock"


def connect(url: str | None = None, *, timeout_s: float = 30.0):
    """A podman-py client for `url` (default_podman_url()), checked with a ping.

    Raises SandboxInfraError, saying how to fix it, when the service is not there.
    """
    import podman

    url = url or default_podman_url()
    fix = ("run scripts/setup_podman.sh (as root it creates the sandbox user and starts the "
           "service), or set REINFORGE_PODMAN_URL")
    if url.startswith("unix://"):
        if not os.path.exists(url[len("unix://") :]):
            raise SandboxInfraError(f"no Podman API socket at {url}: {fix}")
        # Asked first with a socket of our own: a client's failed connection would sit in
        # the reference cycles of its error chain, open until a garbage collection.
        with socket.socket(socket.AF_UNIX) as probe:
            probe.settimeout(timeout_s)
            try:
                probe.connect(url[len("unix://") :])
            except OSError as exc:
                raise SandboxInfraError(f"no Podman service answers at {url} "
                                        f"({exc.strerror or exc}): {fix}") from None
    client = podman.PodmanClient(base_url=url, timeout=timeout_s)
    try:
        answered = client.ping()
    except Exception as exc:  # requests/podman errors: the service is down
        why = f"Podman API at {url} is not answering: {exc}"
    else:
        if answered:
            return client
        why = f"Podman API at {url} did not answer its ping"
    client.close()
    raise SandboxInfraError(why)


def probe_limits(url: str | None = None, *, timeout_s: float = 30.0) -> LimitMechanism:
    """`limit_mechanism` of the service at `url`, asked over a client closed afterwards."""
    with connect(url, timeout_s=timeout_s) as client:
        return limit_mechanism(client)


def limit_mechanism(client) -> LimitMechanism:
    """CGROUP where Podman applies cgroup limits (cgroup v2), else RLIMIT."""
    try:
        host = client.info().get("host", {})
    except Exception as exc:
        raise SandboxInfraError(f"podman info failed: {exc}") from exc
    return LimitMechanism.CGROUP if host.get("cgroupVersion") == "v2" else LimitMechanism.RLIMIT


def host_uid_of(client, uid: int) -> int | None:
    """The host uid that container uid `uid` maps to (rootless user namespace), if known."""
    try:
        maps = client.info()["host"]["idMappings"]["uidmap"] or []
    except Exception:
        return None
    for m in maps:
        if m["container_id"] <= uid < m["container_id"] + m["size"]:
            return m["host_id"] + uid - m["container_id"]
    return None


def rss_of_host_uid(host_uid: int) -> int:
    """Total resident memory (bytes) of the host processes owned by `host_uid`.

    Lean on purpose (it runs every memory_poll_s during a run): one stat per /proc entry,
    /proc/<pid>/statm only for the matches.
    """
    total = 0
    page = os.sysconf("SC_PAGE_SIZE")
    with os.scandir("/proc") as it:
        for entry in it:
            if not entry.name.isdigit():
                continue
            try:
                if entry.stat().st_uid != host_uid:
                    continue
                with open(f"/proc/{entry.name}/statm", "rb") as f:
                    total += int(f.read().split()[1]) * page
            except (OSError, IndexError, ValueError):
                continue
    return total


# --------------------------------------------------------------------------- exec monitors
# Podman's API runs every exec under its own conmon. When the exec ends, conmon forks a child
# that sleeps `exit_command_delay` (containers.conf, default 300 s: "mimics Docker's exec
# cleanup") and then runs `podman container cleanup --rm --exec <session> <container>`; the
# parent waits for it. So each exec holds two conmon processes (and its session in Podman's
# state) for 5 minutes after it ended, even when its container was removed meanwhile: at a few
# execs a second that is thousands of processes. scripts/setup_podman.sh sets a short delay for
# the sandbox service; these functions bound them whatever the service's setting.


class ExecMonitor(msgspec.Struct, frozen=True, kw_only=True):
    """A conmon process of one exec session, as seen in /proc."""

    pid: int
    container_id: str
    session_id: str
    exit_delay_s: int
    """The delay before the session's clean-up (the service's exit_command_delay)."""
    waiting: bool
    """The forked child sleeping exit_delay_s before the clean-up: the exec has ended.
    False: the monitor itself (of a running exec, or the parent that waits for its child)."""
    age_s: float
    cmdline: bytes
    """Its raw /proc command line: checked again before it is signalled (pid reuse)."""


def exec_monitors(container_ids: Collection[str] | None = None) -> list[ExecMonitor]:
    """The exec sessions' conmon processes on this host (of `container_ids` only, if given).

    Empty where /proc shows none (another pid namespace, a remote Podman, not Linux)."""
    wanted = set(container_ids) if container_ids is not None else None
    found: list[tuple[int, int, bytes, list[bytes], float]] = []
    try:
        with open("/proc/uptime", "rb") as f:
            uptime_s = float(f.read().split()[0])
        names = os.listdir("/proc")
    except (OSError, ValueError, IndexError):
        return []
    ticks = os.sysconf("SC_CLK_TCK")
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/comm", "rb") as f:
                if f.read() != b"conmon\n":
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        args = cmdline.split(b"\0")
        if b"--exec-process-spec" not in args or b"-c" not in args or b"-u" not in args:
            continue  # a container's own conmon, not an exec's
        try:
            cid = args[args.index(b"-c") + 1].decode()
            if wanted is not None and cid not in wanted:
                continue
            ppid, start_ticks = int(stat[1]), int(stat[19])
        except (IndexError, ValueError, UnicodeDecodeError):
            continue
        found.append((int(name), ppid, cmdline, args, uptime_s - start_ticks / ticks))
    pids = {pid: cmdline for pid, _, cmdline, _, _ in found}
    out = []
    for pid, ppid, cmdline, args, age_s in found:
        delay = 0
        if b"--exit-delay" in args:
            try:
                delay = int(args[args.index(b"--exit-delay") + 1])
            except (IndexError, ValueError):
                pass
        out.append(
            ExecMonitor(
                pid=pid,
                container_id=args[args.index(b"-c") + 1].decode(),
                session_id=args[args.index(b"-u") + 1].decode(errors="replace"),
                exit_delay_s=delay,
                waiting=pids.get(ppid) == cmdline,  # conmon's fork for the delayed exit command
                age_s=max(0.0, age_s),
                cmdline=cmdline,
            )
        )
    return out


def _signal_monitor(monitor: ExecMonitor, sig: int) -> bool:
    """Signal `monitor` if its pid still is that process (pidfd: no pid-reuse race)."""
    try:
        fd = os.pidfd_open(monitor.pid)
    except OSError:
        return False
    try:
        with open(f"/proc/{monitor.pid}/cmdline", "rb") as f:
            if f.read() != monitor.cmdline:
                return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:  # gone meanwhile, or not ours to signal (another user's Podman)
        return False
    finally:
        os.close(fd)


def reap_exec_monitors(container_id: str, *, removed: bool, min_age_s: float = 1.0) -> int:
    """End the exec monitors of one container that only wait out the exit_command_delay.

    removed=True (the container is gone, and with it its exec sessions; their pending clean-up
    can only fail): SIGKILL all its exec monitors, a few passes until none is left.
    removed=False (a live container): SIGTERM the waiting children older than `min_age_s`; conmon
    answers by running the session's clean-up now (`podman container cleanup --rm --exec`),
    which removes the session from Podman's state, and both processes exit.
    Never raises; returns how many processes it signalled.
    """
    signalled = 0
    for attempt in range(5 if removed else 1):
        monitors = exec_monitors([container_id])
        if removed:
            todo = sorted(monitors, key=lambda m: not m.waiting)  # children before parents
            if not todo:
                break
            signalled += sum(_signal_monitor(m, signal.SIGKILL) for m in todo)
            time.sleep(0.02 * (attempt + 1))
        else:
            todo = [m for m in monitors if m.waiting and m.age_s >= min_age_s]
            signalled += sum(_signal_monitor(m, signal.SIGTERM) for m in todo)
    return signalled


def make_tar(files: Mapping[str, bytes | str]) -> bytes:
    """A tar of `files` (relative paths -> contents): dirs 0777 (so reset can wipe them),
    files 0644, or 0755 when they start with '#!'."""
    buf = io.BytesIO()
    dirs: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, content in files.items():
            path = os.path.normpath(name)
            if path.startswith(("/", "..")) or path in (".", ""):
                raise ValueError(f"file name {name!r} must be a relative path inside the work dir")
            data = content.encode() if isinstance(content, str) else bytes(content)
            parts = path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o777, int(time.time())
                    tar.addfile(info)
            info = tarfile.TarInfo(path)
            info.size, info.mtime = len(data), int(time.time())
            info.mode = 0o755 if data.startswith(b"#!") else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# --------------------------------------------------------------------------- the sandbox

_MEMORY_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")

# Reset, run as the candidate uid: kill every process of that uid (kill(-1) spares only the
# caller and PID 1; the keeper and PID 1 run as other uids), until none is left; delete everything
# in every writable place (making the candidate's own files writable first if needed).
_RESET_SCRIPT = r"""
others() {  # is any process of my uid alive, other than me? (kill -0 -1 can't tell: EPERM counts)
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" = "$$" ] && continue
    while read -r k a b; do
      [ "$k" = "Uid:" ] && { [ "$a" = "$RF_UID" ] && return 0; break; }
    done 2>/dev/null <"$p/status"
  done
  return 1
}
n=0
while kill -KILL -1 2>/dev/null; others; do
  n=$((n+1)); [ $n -gt 200 ] && { echo "reinforge: processes left" >&2; exit 1; }
  sleep 0.01
done
D="/work /tmp /var/tmp /dev/shm /run/reinforge"
find $D -mindepth 1 -delete 2>/dev/null || { chmod -R u+rwX $D 2>/dev/null; find $D -mindepth 1 -delete; } \
  || { echo "reinforge: could not wipe the writable dirs" >&2; exit 1; }
"""
_ENV_CHUNK = 100_000  # < MAX_ARG_STRLEN (128 KiB) per environment string
MAX_INLINE_BYTES = 900_000  # files + stdin sent through the exec's environment (< ARG_MAX)


def new_mark() -> str:
    """A task's marker: a nonce the candidate never sees, so it can't fake its task's end."""
    return f"reinforge-{secrets.token_hex(16)}"


def inline_inputs(files_tar: bytes, stdin: bytes, tag: str = "") -> tuple[dict[str, str], str, str]:
    """A task's files (a tar) and stdin carried in its exec's environment, base64 in chunks named
    RF_F<tag><n> and RF_S<tag><n>: (those variables, the shell that unpacks them into /work and
    STDIN_DIR, the path the command's stdin comes from)."""
    env: dict[str, str] = {}
    unpack = []
    stdin_tar = make_tar({"stdin": stdin}) if stdin else b""
    for prefix, blob, dest in (
        (f"RF_F{tag}", files_tar, "/work"),
        (f"RF_S{tag}", stdin_tar, STDIN_DIR),
    ):
        if not blob:
            continue
        text = base64.b64encode(blob).decode()
        keys = [f"{prefix}{n}" for n in range((len(text) + _ENV_CHUNK - 1) // _ENV_CHUNK)]
        env.update((k, text[n * _ENV_CHUNK : (n + 1) * _ENV_CHUNK]) for n, k in enumerate(keys))
        quoted = " ".join(f'"${k}"' for k in keys)
        unpack.append(
            f"printf %s {quoted} | base64 -d | tar -x -m -C {dest} "
            f'|| {{ echo "reinforge: unpacking into {dest} failed" >&2; exit 1; }}'
        )
    return env, "\n".join(unpack), f"{STDIN_DIR}/stdin" if stdin else "/dev/null"


def task_script(mark_var: str, unpack: str, command: str) -> str:
    """One task of an exec's wrapper: the checked reset, unpacking its inputs, its start marker,
    `command` in a subshell, killing whatever that left behind, its end markers with the status.

    The marker, the nonce in the variable `mark_var`, frames the task's output for
    `Sandbox.execute`: the start marker, first on stdout, says the set-up succeeded (without it a
    failure is the infrastructure's, whatever the exit code); the end markers close its part of
    stdout (with its exit status) and of stderr."""
    mark = f'"${mark_var}"'
    return (
        _RESET_SCRIPT
        + f"{unpack}\n"
        + f"printf '%s\\n' {mark}\n"
        + f"( {command} )\n"
        + "st=$?\nkill -KILL -1 2>/dev/null\n"
        + f"printf '\\n%s %d\\n' {mark} \"$st\"; printf '\\n%s\\n' {mark} >&2\n"
    )


class Sandbox:
    """One warm container. Blocking methods; `arun` runs `run` in a trio worker thread.

    Not thread-safe: one task at a time (the pool hands it to one job at a time).
    """

    def __init__(
        self,
        client,
        container,
        config: SandboxConfig,
        *,
        uid: int,
        limits: LimitMechanism,
        shell: str = "/bin/sh",
        host_uid: int | None = None,
    ) -> None:
        self._client = client
        self._own_client = None
        """The client `start` opened for this sandbox alone (None: the caller's), closed
        with it."""
        self.host_uid = host_uid
        """The candidate's uid as the host sees it: the memory watchdog sums its RSS."""
        self.shell = shell
        """The wrapper's shell: PROTECTED_SHELL when the image has it, else /bin/sh (then a
        candidate could ptrace its own wrapper, see the module docstring)."""
        self._container = container
        self.config = config
        self.uid = uid
        self.limits = limits
        self.healthy = True
        """False once it misbehaved (timeout, flood, failed reset, API error): replace it."""
        self.dirty = False
        """True when a task's wrapper did not finish its own clean-up (it was killed): reset()
        before the next task rather than rely on the reset at the start of run_task."""
        self.runs = 0
        self.created_s = time.monotonic()
        self._stdin_seq = 0
        self._reaped_at_s = time.monotonic()
        self.monitors_reaped = 0
        """Exec monitors this sandbox ended early (see reap_exec_monitors)."""
        self.zygote = None
        """Its zygote session (zygote.py), while one runs: checks go there; any other exec ends
        it first."""

    # -- lifecycle ----------------------------------------------------------------

    @classmethod
    def start(
        cls,
        config: SandboxConfig | None = None,
        *,
        client=None,
        uid: int | None = None,
        limits: LimitMechanism | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> Sandbox:
        """Create and start a sandbox container. Raises SandboxInfraError.

        `uid` is the candidate's uid inside (default: a random one in 20000..59999; give each
        sandbox of a pool its own); `limits` skips asking Podman which mechanism applies.
        """
        config = config or SandboxConfig()
        if client is None:  # a client of its own, closed with the sandbox (here if start fails)
            own = connect(config.podman_url, timeout_s=config.api_timeout_s)
            try:
                box = cls.start(config, client=own, uid=uid, limits=limits, labels=labels)
            except BaseException:
                own.close()
                raise
            box._own_client = own
            return box
        limits = limits or limit_mechanism(client)
        if uid is None:
            uid = CANDIDATE_UID_BASE + secrets.randbelow(CANDIDATE_UID_SPAN)
        mb = config.memory_bytes
        # Only core at the container level: runc's exec helper runs as the rootless user itself,
        # whose threads (the podman service's) would count against an RLIMIT_NPROC here. The
        # candidate's rlimits are set by the run wrapper, on the candidate's own uid.
        ulimits = [{"Name": "core", "Soft": 0, "Hard": 0}]
        tmpfs = lambda target, size, mode: {
            "type": "tmpfs",
            "target": target,
            "source": "tmpfs",
            "size": str(size),
            "mode": mode,
        }
        kwargs: dict[str, Any] = dict(
            command=["sleep", "infinity"],
            name=f"rf-sandbox-{uuid.uuid4().hex[:12]}",
            labels={LABEL: "1", **labels_from_env(), **config.labels, **(labels or {})},
            network_mode="none",
            read_only=True,
            user=f"{KEEPER_UID}:{KEEPER_UID}",
            mounts=[
                tmpfs("/work", config.work_dir_bytes, "0777"),
                tmpfs("/tmp", config.tmp_bytes, "1777"),
                tmpfs("/var/tmp", config.tmp_bytes, "1777"),
                tmpfs(STDIN_DIR, config.max_input_bytes + 65536, "0777"),
            ],
            shm_size=config.tmp_bytes,
            cap_drop=["ALL"],
            no_new_privileges=True,
            ulimits=ulimits,
            init=True,
            hostname="sandbox",
            environment={
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": config.work_dir,
                "LANG": "C.UTF-8",
                "TMPDIR": "/tmp",
                "PYTHONDONTWRITEBYTECODE": "1",
            },
            working_dir=config.work_dir,
            sysctls=dict(IPC_SYSCTLS),
        )
        if limits is LimitMechanism.CGROUP:
            kwargs.update(
                mem_limit=mb,
                memswap_limit=mb,
                pids_limit=config.pids_limit,
                nano_cpus=int(config.cpus * 1e9),
            )
        try:
            labels_of_image = client.images.get(config.image).labels or {}
            version = int(labels_of_image.get(IMAGE_VERSION_LABEL, "0") or 0)
        except Exception:
            version = 0  # a missing image is reported by create below
        shell = PROTECTED_SHELL if version >= 2 else "/bin/sh"
        try:
            container = client.containers.create(config.image, **kwargs)
        except Exception as exc:
            raise SandboxInfraError(_explain_create_error(config.image, exc)) from exc
        try:
            container.start()
        except Exception as exc:
            _quiet_remove(container)
            raise SandboxInfraError(f"sandbox container failed to start: {exc}") from exc
        host_uid = host_uid_of(client, uid) if limits is LimitMechanism.RLIMIT else None
        return cls(
            client, container, config, uid=uid, limits=limits, shell=shell, host_uid=host_uid
        )

    @property
    def name(self) -> str:
        return self._container.name

    def close(self) -> None:
        """Kill and remove the container, then end its exec sessions' conmon monitors that
        would otherwise wait out Podman's exit_command_delay (idempotent, never raises)."""
        self.healthy = False
        self.end_zygote()
        if _quiet_remove(self._container):
            self.monitors_reaped += reap_exec_monitors(self._container.id, removed=True)
        if self._own_client is not None:
            with contextlib.suppress(Exception):
                self._own_client.close()
            self._own_client = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- files ----------------------------------------------------------------------

    def put_files(self, files: Mapping[str, bytes | str], *, dest: str | None = None) -> None:
        """Write `files` (relative path -> content) under `dest` (default: the work dir).

        Raises ValueError for a bad or too-large input, SandboxInfraError for API failures.
        """
        if not files:
            return
        total = sum(len(v) for v in files.values())
        if total > self.config.max_input_bytes:
            raise ValueError(
                f"files total {total} bytes, over max_input_bytes={self.config.max_input_bytes}"
            )
        self._put_tar(make_tar(files), dest or self.config.work_dir)

    def _put_tar(self, data: bytes, dest: str) -> None:
        try:
            ok = self._container.put_archive(dest, data)
        except Exception as exc:
            self.healthy = False
            raise SandboxInfraError(f"putting files into {self.name}:{dest} failed: {exc}") from exc
        if not ok:
            self.healthy = False
            raise SandboxInfraError(f"Podman refused the files for {self.name}:{dest}")

    # -- running --------------------------------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | str = b"",
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        cwd: str | None = None,
    ) -> RunResult:
        """Run `argv` as the candidate uid in the work dir; wait for exit or the deadline.

        The candidate's own failures come back as a RunResult (status says which);
        infrastructure failures raise SandboxInfraError (and mark the sandbox unhealthy).
        """
        cfg = self.config
        timeout_s = cfg.timeout_s if timeout_s is None else float(timeout_s)
        stdin_b = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        env = dict(env or {})
        refused = self._check_input(argv, stdin_b, env, timeout_s)
        if refused is not None:
            return refused
        stdin_path = "/dev/null"
        if stdin_b:
            self._stdin_seq += 1
            name = f"stdin-{self._stdin_seq}"
            self._put_tar(make_tar({name: stdin_b}), STDIN_DIR)
            stdin_path = f"{STDIN_DIR}/{name}"
        wrapper = [
            self.shell,
            "-c",
            self.limits_prefix(timeout_s)
            + f'cd "$1" || exit 126; shift; exec nice -n {cfg.nice} "$@" <"$0"',
            stdin_path,
            cwd or cfg.work_dir,
            *argv,
        ]
        return self._run_one(wrapper, env, timeout_s)

    async def arun(self, argv: Sequence[str], *, limiter=None, **kwargs) -> RunResult:
        """`run` from trio: in a worker thread (bounded by `limiter` if given)."""
        import functools

        import trio

        return await trio.to_thread.run_sync(
            functools.partial(self.run, argv, **kwargs), limiter=limiter
        )

    def run_task(
        self,
        files: Mapping[str, bytes | str],
        argv: Sequence[str],
        *,
        stdin: bytes | str = b"",
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> RunResult:
        """One self-contained task: reset, put `files`, run `argv` — in a single exec when the
        files are small (the fast path the pool uses), else reset + put_files + run.

        The state is clean at the start (no process or file of an earlier task); what the task
        leaves behind is killed when it ends and wiped by the next reset.
        """
        cfg = self.config
        stdin_b = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        try:
            tar = make_tar(files) if files else b""
        except ValueError as exc:
            return self.input_too_large(str(exc))
        if len(tar) + len(stdin_b) > MAX_INLINE_BYTES:
            self.reset()
            try:
                self.put_files(files)
            except ValueError as exc:
                return self.input_too_large(str(exc))
            return self.run(argv, stdin=stdin_b, env=env, timeout_s=timeout_s)
        timeout_s = cfg.timeout_s if timeout_s is None else float(timeout_s)
        refused = self._check_input(argv, stdin_b, dict(env or {}), timeout_s)
        if refused is not None:
            return refused
        inputs, unpack, stdin_path = inline_inputs(tar, stdin_b)
        unset = " ".join(["RF_UID", "RF_MARK", *inputs])
        command = (
            f"unset {unset}; {self.limits_prefix(timeout_s)}"
            f'cd "$1" || exit 126; shift; exec nice -n {cfg.nice} "$@" <"$0"'
        )
        script = task_script("RF_MARK", unpack, command) + "exit $st\n"
        mark = new_mark()
        task_env = {**(env or {}), **inputs, "RF_MARK": mark, "RF_UID": str(self.uid)}
        wrapper = [self.shell, "-c", script, stdin_path, cfg.work_dir, *argv]
        return self._run_one(wrapper, task_env, timeout_s, mark=mark)

    def execute(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        timeouts: Sequence[float],
        marks: Sequence[str] | None = None,
    ) -> list[RunResult | None]:
        """Run one exec of `argv` that carries one task per entry of `timeouts`: their results.

        Framed by `marks` (the wrapper prints each task's markers, see `task_script`), task i
        owns its part of the output and its status comes from its end marker; unframed (`marks`
        None), the exec is one plain command and Podman tells its status. Task i's deadline is
        timeouts[i] from the end of the task before it (from the start of the exec for the
        first): its set-up counts. None: the task did not run (a task before it was killed, or
        its set-up failed) or the infrastructure lost it (the container died, or was killed
        before the set-up finished). Raises SandboxInfraError when the exec failed as a whole
        (and marks the sandbox unhealthy).
        """
        if len(timeouts) != (1 if marks is None else len(marks)):
            raise ValueError("timeouts: one per mark (exactly one when unframed)")
        return _Exec(self, timeouts, marks).drive(argv, env)

    def _run_one(
        self, argv, env: Mapping[str, str], timeout_s: float, *, mark: str | None = None
    ) -> RunResult:
        """`run`'s and `run_task`'s exec: its one result, or SandboxInfraError if it has none."""
        run = _Exec(self, [timeout_s], None if mark is None else [mark])
        [result] = run.drive(argv, env)
        if result is None:
            why = run.lost or "was killed before the task's set-up finished"
            raise SandboxInfraError(f"sandbox {self.name} {why}")
        return result

    def _check_input(self, argv, stdin_b: bytes, env: dict, timeout_s: float) -> RunResult | None:
        cfg = self.config
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if isinstance(argv, str) or not argv:
            raise ValueError(
                "argv must be a non-empty sequence of strings, e.g. ['python3', 'main.py']"
            )
        argv_bytes = sum(len(a) + 1 for a in argv)
        env_bytes = sum(len(k) + len(v) + 2 for k, v in env.items())
        in_bytes = len(stdin_b) + argv_bytes + env_bytes
        # the kernel refuses one argv/env string over 128 KiB (MAX_ARG_STRLEN) and ~2 MiB total
        if (
            in_bytes > cfg.max_input_bytes
            or any(len(a) > 100_000 for a in argv)
            or argv_bytes + env_bytes > 1_000_000
        ):
            return self.input_too_large(
                f"input of {in_bytes} bytes (argv {argv_bytes}, env {env_bytes}, stdin "
                f"{len(stdin_b)}) is over the limits (max_input_bytes={cfg.max_input_bytes}, "
                "argv+env <= 1 MB, one argument <= 100 kB): pass big inputs as files"
            )
        return None

    def reset(self) -> None:
        """Clean state for the next task: kill all candidate processes, wipe all writable dirs.

        Raises SandboxInfraError (and marks the sandbox unhealthy) when it can't be made clean:
        then close it and start a new one.
        """
        if not self.healthy:
            raise SandboxInfraError(f"sandbox {self.name} is unhealthy: replace it, don't reset it")
        try:
            code, out, err = self._exec_simple(
                [self.shell, "-c", _RESET_SCRIPT + "exit 0\n"],
                env={"RF_UID": str(self.uid)},
                timeout_s=10.0,
            )
        except SandboxInfraError:
            self.healthy = False
            raise
        self.dirty = code != 0
        if code != 0:
            self.healthy = False
            raise SandboxInfraError(
                f"sandbox {self.name} could not be reset (exit {code}): "
                f"{(out + err).decode(errors='replace')[-500:]}"
            )

    # -- internals --------------------------------------------------------------------

    def limits_prefix(self, timeout_s: float) -> str:
        """Shell (dash) that sets the candidate's rlimits, soft = hard, before exec."""
        cfg = self.config
        cpu_s = max(1, int(timeout_s) + 1)
        return (
            f"ulimit -p {cfg.pids_limit} && ulimit -d {cfg.memory_bytes // 1024} && "
            f"ulimit -f {cfg.file_size_bytes // 512} && ulimit -n {cfg.open_files} && "
            f"ulimit -c 0 && ulimit -t {cpu_s} || exit 125; "
        )

    def input_too_large(self, detail: str) -> RunResult:
        """The result of a run refused before it started (INPUT_TOO_LARGE)."""
        return RunResult(
            status=RunStatus.INPUT_TOO_LARGE,
            exit_code=None,
            stdout=b"",
            stderr=b"",
            stdout_bytes=0,
            stderr_bytes=0,
            duration_s=0.0,
            timed_out=False,
            oom_killed=False,
            output_truncated=False,
            limits=self.limits,
            image=self.config.image,
            detail=detail,
        )

    def end_zygote(self) -> None:
        """End the zygote session, if one runs (never raises)."""
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None

    def create_exec(
        self, argv: Sequence[str], env: Mapping[str, str], *, attach_stdin: bool = False
    ) -> str:
        """Create (not start) an exec of `argv` as the candidate uid in the work dir: its id.

        Ends the zygote first: every exec's wrapper kills all processes of the candidate uid.
        """
        self.end_zygote()
        reap_s = self.config.exec_reap_s
        if reap_s and time.monotonic() - self._reaped_at_s >= reap_s:
            # one exec at a time: every earlier session of this sandbox has ended and been read
            self._reaped_at_s = time.monotonic()
            self.monitors_reaped += reap_exec_monitors(self._container.id, removed=False)
        body = {
            "AttachStdout": True,
            "AttachStderr": True,
            "AttachStdin": attach_stdin,
            "Tty": False,
            "Cmd": list(argv),
            "Env": [f"{k}={v}" for k, v in env.items()],
            "User": f"{self.uid}:{self.uid}",
            "WorkingDir": self.config.work_dir,
        }
        resp = self._container.client.post(
            f"/containers/{self._container.id}/exec", data=json.dumps(body)
        )
        resp.raise_for_status()
        return resp.json()["Id"]

    def _exec_start(self, argv: Sequence[str], env: Mapping[str, str]):
        api = self._container.client
        try:
            exec_id = self.create_exec(argv, env)
            start = api.post(
                f"/exec/{exec_id}/start",
                data=json.dumps({"Detach": False, "Tty": False}),
                stream=True,
                timeout=(self.config.api_timeout_s, None),
            )
            start.raise_for_status()
        except Exception as exc:
            self.healthy = False
            raise SandboxInfraError(f"exec in sandbox {self.name} failed to start: {exc}") from exc
        return exec_id, start

    def _exec_inspect(self, exec_id: str) -> dict:
        resp = self._container.client.get(f"/exec/{exec_id}/json")
        resp.raise_for_status()
        return resp.json()

    def _exec_simple(
        self, argv, *, env: Mapping[str, str] | None = None, timeout_s: float
    ) -> tuple[int, bytes, bytes]:
        """A trusted helper command (reset): small output, the same uid, a deadline."""
        exec_id, start = self._exec_start(argv, env or {})
        out, err = bytearray(), bytearray()
        timer = threading.Timer(timeout_s, self.kill)
        timer.start()
        try:
            for kind, chunk in _frames(start.raw):
                (out if kind == 1 else err).extend(chunk[: 65536 - len(out)])
        except Exception as exc:
            self.healthy = False
            raise SandboxInfraError(f"reading from sandbox {self.name} failed: {exc}") from exc
        finally:
            timer.cancel()
            start.close()
        if not self.healthy:
            raise SandboxInfraError(f"helper command in sandbox {self.name} ran past {timeout_s} s")
        try:
            code = self._exec_inspect(exec_id).get("ExitCode")
        except Exception as exc:
            self.healthy = False
            raise SandboxInfraError(f"exec inspect in sandbox {self.name} failed: {exc}") from exc
        return int(code if code is not None else -1), bytes(out), bytes(err)

    def kill(self) -> None:
        """Kill the whole container (the only sure way to stop everything in it)."""
        self.healthy = False
        try:
            self._container.kill(signal=9)
        except Exception:
            pass

    def alive(self) -> bool:
        try:
            self._container.reload()
            return self._container.status == "running"
        except Exception:
            return False

    def _oom_killed(self) -> bool:
        try:
            self._container.reload()
            return bool(self._container.attrs.get("State", {}).get("OOMKilled"))
        except Exception:
            return False


class _Split:
    """One output stream (stdout or stderr) of an exec, split into the parts of its tasks.

    Framed by the tasks' marks (see `task_script`), task i's part follows its start marker
    "<mark>\\n" (stdout only) and ends at its end marker: "\\n<mark> <status>\\n" on stdout,
    "\\n<mark>\\n" on stderr. Unframed (no marks: a plain command), the whole stream is the part
    of its one task. Each part keeps its first `cap` bytes and counts them all.
    """

    def __init__(self, marks: Sequence[bytes] | None, *, stdout: bool, cap: int):
        self.marks = marks
        self.with_status = stdout
        self.cap = cap
        self.index = 0
        """The task whose part the stream is in (len(marks) once every part has ended)."""
        self.inside = marks is None or not stdout
        """Whether the current task's start marker was seen (or there is none to see)."""
        self.pending = bytearray()  # what may be the beginning of a marker
        parts = 1 if marks is None else len(marks)
        self.kept: list[bytearray] = [bytearray() for _ in range(parts)]
        self.counts = [0] * parts
        self.status: list[int | None] = [None] * parts

    def started(self, i: int) -> bool:
        return i < self.index or (i == self.index and self.inside)

    def _commit(self, data: bytes) -> None:
        i = self.index
        self.counts[i] += len(data)
        room = self.cap - len(self.kept[i])
        if room > 0:
            self.kept[i].extend(data[:room])

    def feed(self, data: bytes) -> None:
        if self.marks is None:
            self._commit(data)
            return
        self.pending.extend(data)
        while self.index < len(self.marks):
            mark = self.marks[self.index]
            if not self.inside:
                start = mark + b"\n"
                if len(self.pending) < len(start):
                    return
                if bytes(self.pending[: len(start)]) != start:
                    raise SandboxInfraError("task start marker missing (set-up failed)")
                del self.pending[: len(start)]
                self.inside = True
            end = b"\n" + mark + (b" " if self.with_status else b"\n")
            at = self.pending.find(end)
            if at < 0:
                keep = len(end) + 12
                if len(self.pending) > keep:
                    self._commit(bytes(self.pending[:-keep]))
                    del self.pending[:-keep]
                return
            if self.with_status:
                nl = self.pending.find(b"\n", at + len(end))
                if nl < 0:
                    return  # the status is not complete yet
                digits = bytes(self.pending[at + len(end) : nl])
                if not digits.isdigit():
                    raise SandboxInfraError("malformed task end marker")
                self.status[self.index] = int(digits)
                stop = nl + 1
            else:
                stop = at + len(end)
            self._commit(bytes(self.pending[:at]))
            del self.pending[:stop]
            self.index += 1
            self.inside = not self.with_status

    def flush_current(self) -> None:
        """The stream ended mid-task: what is pending belongs to the current task."""
        if self.index < len(self.kept) and self.inside and self.pending:
            self._commit(bytes(self.pending))
            self.pending.clear()


class _Exec:
    """One exec in a sandbox, driven to its end (see `Sandbox.execute`): the one place where the
    output is split per task and capped, the deadline, the memory watchdog and the flood limit
    are enforced (by killing the whole container), and how each task ended is classified. `run`,
    `run_task` and batches (batch.py) all come here, so they can't disagree."""

    def __init__(self, box: Sandbox, timeouts: Sequence[float], marks: Sequence[str] | None):
        cap = box.config.max_output_bytes
        encoded = None if marks is None else [m.encode() for m in marks]
        self.box = box
        self.timeouts = list(timeouts)
        self.framed = marks is not None
        self.out = _Split(encoded, stdout=True, cap=cap)
        self.err = _Split(encoded, stdout=False, cap=cap)
        self.began: list[float | None] = [None] * len(self.timeouts)
        self.ended: list[float | None] = [None] * len(self.timeouts)
        self.fired: tuple[str, int] | None = None
        """Why the host killed the container ("timeout", "flood", "memory"), and which task's
        doing it was."""
        self.lost = ""
        """Why the infrastructure lost the task in progress (then it has no result)."""
        self.peak_rss = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._done = threading.Event()

    def drive(self, argv, env: Mapping[str, str]) -> list[RunResult | None]:
        box = self.box
        box.runs += len(self.timeouts)
        t0 = time.monotonic()
        exec_id, start = box._exec_start(argv, env)
        self._begin(0, t0)
        if box.limits is LimitMechanism.RLIMIT and box.host_uid is not None:
            threading.Thread(target=self._watch_memory, daemon=True).start()
        try:
            self._read(start.raw)
        finally:
            with self._lock:
                self._timer.cancel()
            self._done.set()
            start.close()
        end_s = time.monotonic()
        self.out.flush_current()
        self.err.flush_current()
        if self.framed and not self.out.started(0) and not self.fired:
            box.healthy = False
            raise SandboxInfraError(
                f"task set-up failed in sandbox {box.name}: {self._stderr_tail(0)}"
            )
        code = self._exit_code(exec_id) if self.out.index < len(self.timeouts) else None
        return [self._result(i, code, end_s) for i in range(len(self.timeouts))]

    def _read(self, raw) -> None:
        box, n = self.box, len(self.timeouts)
        try:
            for kind, chunk in _frames(raw):
                if kind == 2:
                    self.err.feed(chunk)
                else:
                    ending = self.out.index
                    self.out.feed(chunk)
                    for i in range(ending, self.out.index):
                        self._end(i)
                i = self.out.index
                if i < n and self.out.counts[i] + self.err.counts[i] > box.config.max_drained_bytes:
                    self._kill_for("flood")
        except SandboxInfraError as exc:  # bytes where a start or end marker belongs
            box.healthy = False
            raise SandboxInfraError(
                f"{exc} in sandbox {box.name}: {self._stderr_tail(self.out.index)}"
            ) from exc
        except Exception as exc:
            if not self.fired:
                box.healthy = False
                raise SandboxInfraError(
                    f"reading output from sandbox {box.name} failed: {exc}"
                ) from exc

    def _begin(self, i: int, now: float) -> None:
        """Task i's part of the exec begins: its deadline runs from now, its set-up included."""
        self.began[i] = now
        with self._lock:
            if self._timer:
                self._timer.cancel()
            self._timer = threading.Timer(self.timeouts[i], self._kill_for, ("timeout", i))
            self._timer.start()

    def _end(self, i: int) -> None:
        """Task i printed its end: the next one's part (and deadline) begins."""
        now = time.monotonic()
        self.ended[i] = now
        if i + 1 < len(self.timeouts):
            self._begin(i + 1, now)
        else:
            with self._lock:
                self._timer.cancel()

    def _kill_for(self, reason: str, task: int | None = None) -> None:
        """Kill the container for `reason`, the doing of `task` (default: the one running), once;
        not for a task that has ended meanwhile (a deadline that lost the race to its end)."""
        with self._lock:
            running = self.out.index
            if self.fired or (task is not None and task != running):
                return
            self.fired = (reason, running)
        self.box.kill()

    def _watch_memory(self) -> None:
        # rlimits bound memory per process, not per sandbox: watch the uid's total RSS
        cfg = self.box.config
        while not self._done.wait(cfg.memory_poll_s):
            rss = rss_of_host_uid(self.box.host_uid)
            self.peak_rss = max(self.peak_rss, rss)
            if rss > cfg.memory_bytes:
                self._kill_for("memory")
                return

    def _exit_code(self, exec_id: str) -> int | None:
        """The exit status of an exec whose task in progress did not print its end (a plain
        command's always; a framed task's when its wrapper was killed), from Podman. None:
        unknown, or the container died under us (then `lost` says which; no result)."""
        box = self.box
        box.dirty = box.dirty or self.framed  # the wrapper did not clean up after its task
        try:
            code = box._exec_inspect(exec_id).get("ExitCode")
        except Exception as exc:
            if not self.fired:
                box.healthy = False
                self.lost = f"could not say how the run ended: exec inspect failed: {exc}"
            return None
        if not self.fired and (code is None or not 0 <= code < 125) and not box.alive():
            # the container died under us and we did not kill it: the candidate can't do that
            # (PID 1 and the keeper are out of its reach), so it is the infrastructure
            box.healthy = False
            self.lost = "died during the run"
            return None
        return code

    def _result(self, i: int, code: int | None, end_s: float) -> RunResult | None:
        """Task i's result; `code`: the exec's exit status, for the task in progress."""
        if not self.out.started(i):
            return None  # never ran: its set-up failed or was killed, or a task before it was
        in_progress = i == self.out.index
        if in_progress and self.lost:
            return None
        if not in_progress:
            code = self.out.status[i]
        why = self.fired[0] if self.fired and self.fired[1] == i else None
        if why:
            code = 137 if code in (None, 0, -1) else code
        duration_s = (self.ended[i] or end_s) - self.began[i]
        return self._classify(i, code, why, duration_s)

    def _classify(self, i: int, code: int, why: str | None, duration_s: float) -> RunResult:
        return classify(
            self.box,
            code=code,
            why=why,
            timeout_s=self.timeouts[i],
            duration_s=duration_s,
            stdout=bytes(self.out.kept[i]),
            stderr=bytes(self.err.kept[i]),
            counts=(self.out.counts[i], self.err.counts[i]),
            peak_rss=self.peak_rss,
        )

    def _stderr_tail(self, i: int) -> str:
        kept = self.err.kept[min(i, len(self.err.kept) - 1)]
        return bytes(kept[-500:]).decode(errors="replace")


def classify(
    box: Sandbox,
    *,
    code: int,
    why: str | None,
    timeout_s: float,
    duration_s: float,
    stdout: bytes,
    stderr: bytes,
    counts: tuple[int, int],
    peak_rss: int,
    detail: str = "",
) -> RunResult:
    """How a run of candidate code in `box` ended, from its exit status and `why` the host (or
    the zygote) killed it ("timeout", "flood", "memory"; None: it was not killed): the one
    place every path of running code (execs, zygote checks) gets its RunResult from."""
    cfg = box.config
    rlimit = box.limits is LimitMechanism.RLIMIT
    timed_out = (
        why == "timeout"
        or code == 128 + 24  # SIGXCPU: RLIMIT_CPU
        # RLIMIT_CPU ends in SIGKILL: at the deadline it is the deadline's
        or (code == 128 + 9 and not why and rlimit and duration_s >= timeout_s - 0.05)
    )
    tail = stderr[-512:]
    oom = why == "memory" or (
        code != 0 and not timed_out and any(m in tail for m in _MEMORY_MARKERS)
    )
    if not oom and not timed_out and not rlimit and code == 128 + 9:
        oom = box._oom_killed()
    stdout_bytes, stderr_bytes = counts
    if timed_out:
        status, detail = RunStatus.TIMEOUT, f"killed at the {timeout_s:g} s deadline"
    elif why == "flood":
        status = RunStatus.OUTPUT_LIMIT
        detail = f"killed after {stdout_bytes + stderr_bytes} bytes of output"
    elif oom:
        status = RunStatus.MEMORY_LIMIT
        if why == "memory":
            detail = (
                f"killed by the host memory watchdog: the candidate's processes held "
                f"{peak_rss} bytes, over memory_bytes={cfg.memory_bytes}"
            )
    else:
        status = RunStatus.OK if code == 0 else RunStatus.NONZERO_EXIT
    return RunResult(
        status=status,
        exit_code=code,
        stdout=stdout,
        stderr=stderr,
        stdout_bytes=stdout_bytes,
        stderr_bytes=stderr_bytes,
        duration_s=duration_s,
        timed_out=timed_out,
        oom_killed=oom,
        output_truncated=max(stdout_bytes, stderr_bytes) > cfg.max_output_bytes,
        limits=box.limits,
        image=cfg.image,
        detail=detail,
    )


def _frames(raw):
    """(stream, chunk) pairs from a multiplexed exec stream, in bounded chunks."""
    while True:
        header = _read_exact(raw, 8)
        if len(header) < 8:
            return
        kind = header[0]
        remaining = int.from_bytes(header[4:8], "big")
        while remaining:
            chunk = raw.read(min(remaining, 65536))
            if not chunk:
                return
            remaining -= len(chunk)
            yield kind, chunk


def _read_exact(raw, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = raw.read(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _quiet_remove(container) -> bool:
    """Remove a container, killing it first; retried (a just-killed one may still be stopping).
    True once it is gone (removed now or before)."""
    for attempt in range(10):
        try:
            container.remove(force=True)
            return True
        except Exception as exc:
            if "no such container" in str(exc).lower() or type(exc).__name__ == "NotFound":
                return True
            time.sleep(0.1 * (attempt + 1))
    return False


def _explain_create_error(image: str, exc: Exception) -> str:
    text = str(exc)
    if (
        "image not known" in text
        or "ImageNotFound" in type(exc).__name__
        or "no such image" in text.lower()
    ):
        return (
            f"sandbox image {image} is missing: run `reinforge sandbox build-image` "
            f"(or scripts/setup_podman.sh) ({text})"
        )
    return f"sandbox container could not be created from {image}: {text}"
