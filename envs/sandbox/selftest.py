"""The hostile suite: model-written attacks run in real sandboxes, each checked for containment.

`reinforge sandbox selftest [--json]` runs it against the user's own set-up; tests/sandbox/
runs the same cases. A case is contained when its result is what a sound sandbox gives
(`check` returns "" — else it says what escaped), the host is unchanged (canary secrets never
appear, the host's listening port got no connection, the canary file is intact), and the next
task on the same sandbox sees no file, process or IPC object of it (`PROBE_CLEAN`).

Leak cases (`LEAK_CASES`) attack what candidates checked one after another by one zygote
(zygote.py) could share: a candidate (code-harness check) leaves state behind — files, patched
modules, threads, signal handlers, a full /tmp, its cwd and umask, environment variables,
processes, sockets, IPC objects — and the next candidate, by the same zygote, looks for it.
Each runs twice: the two as separate checks, then as one batch.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Callable

import msgspec
import trio

from reinforge.envs.sandbox.box import RunStatus, RunResult, Sandbox, SandboxConfig
from reinforge.envs.sandbox.pool import InfraFailure, Job, PoolConfig, SandboxPool
from reinforge.envs.sandbox.zygote import Check, run_checks


class Context(msgspec.Struct, kw_only=True):
    """Host-side canaries a case may try to reach."""

    canary: str
    """A secret string planted on the host (a file and an env var); must never come out."""
    canary_file: str
    host_port: int
    """A TCP port listening on the host's 127.0.0.1."""
    hostname: str


class Case(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    what: str
    job: Callable[[Context], Job]
    check: Callable[[RunResult, Context], str]
    """'' when contained, else what went wrong."""


class CaseResult(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    contained: bool
    detail: str
    status: str
    exit_code: int | None
    duration_s: float


class SelftestReport(msgspec.Struct, frozen=True, kw_only=True):
    cases: int
    contained: int
    escaped: int
    limits: str
    image: str
    results: list[CaseResult]


def py(code: str, *, timeout_s: float = 5.0, stdin: bytes = b"", argv_extra: tuple = ()) -> Job:
    return Job(
        files={"main.py": code},
        argv=["python3", "main.py", *argv_extra],
        timeout_s=timeout_s,
        stdin=stdin,
    )


def _all(*conds: tuple[bool, str]) -> str:
    return "; ".join(msg for ok, msg in conds if not ok)


def _no_canary(r: RunResult, ctx: Context) -> tuple[bool, str]:
    blob = r.stdout + r.stderr
    return ctx.canary.encode() not in blob, "the host's canary secret appeared in the output"


def _lines_all_blocked(r: RunResult, n: int) -> tuple[bool, str]:
    lines = [ln for ln in r.stdout_text.splitlines() if ln.strip()]
    bad = [ln for ln in lines if not ln.startswith("BLOCKED")]
    return (len(lines) == n and not bad, f"expected {n} BLOCKED lines, got {lines[: n + 2]}")


PROBE_ATTEMPTS = r"""
import os, sys
def attempt(label, fn):
    try:
        fn()
    except BaseException as exc:
        print("BLOCKED", label, type(exc).__name__)
    else:
        print("ALLOWED", label)
"""


def _cases() -> list[Case]:
    c: list[Case] = []
    add = lambda name, what, job, check: c.append(Case(name=name, what=what, job=job, check=check))

    add(
        "fork_bomb",
        "os.fork() forever",
        lambda ctx: py(
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
            timeout_s=3,
        ),
        lambda r, ctx: _all(
            (r.status in (RunStatus.TIMEOUT, RunStatus.NONZERO_EXIT), f"status {r.status}"),
            (r.duration_s < 3 + 5, f"took {r.duration_s:.1f} s"),
        ),
    )
    add(
        "memory_bomb",
        "allocate 16 GiB at once, then grow a list forever",
        lambda ctx: py(
            "x = []\ntry:\n    x.append(bytearray(16 * 1024**3))\nexcept MemoryError:\n    pass\n"
            "while True:\n    x.append(b' ' * 10**7)\n",
            timeout_s=10,
        ),
        lambda r, ctx: _all(
            (r.status is RunStatus.MEMORY_LIMIT, f"status {r.status}, {r.stderr_text[-200:]}"),
            (r.oom_killed, "oom_killed not set"),
        ),
    )
    add(
        "memory_bomb_many_processes",
        "12 processes of 300 MB each: under the per-process limit, far over the sandbox's",
        lambda ctx: py(
            "import os, time\nfor i in range(11):\n    if os.fork() == 0:\n        break\n"
            "x = b'x' * (300 * 1024**2)\ntime.sleep(30)\n",
            timeout_s=20,
        ),
        lambda r, ctx: _all(
            (r.status is RunStatus.MEMORY_LIMIT and r.oom_killed, f"status {r.status} {r.detail}"),
            (r.duration_s < 10, f"took {r.duration_s:.1f} s"),
        ),
    )
    add(
        "disk_fill",
        "write to the work dir until it is full",
        lambda ctx: py(
            "import os\nf = open('/work/fill', 'wb')\nwhile True:\n    f.write(b'0' * 2**20)\n    f.flush()\n",
            timeout_s=10,
        ),
        lambda r, ctx: _all(
            (r.status is RunStatus.NONZERO_EXIT, f"status {r.status}"),
            (
                any(
                    s in r.stderr_text
                    for s in ("No space left", "File too large", "Errno 27", "Errno 28")
                )
                or r.exit_code == 128 + 25,
                f"no ENOSPC/EFBIG: {r.stderr_text[-200:]}",
            ),
        ),
    )
    add(
        "tmp_fill",
        "fill /tmp and /dev/shm with many files",
        lambda ctx: py(
            "import os\nn = 0\ntry:\n    while True:\n        for d in ('/tmp', '/dev/shm'):\n"
            "            open(f'{d}/f{n}', 'wb').write(b'x' * 65536)\n        n += 1\n"
            "except OSError as e:\n    print('stopped', n, e.errno)\n",
            timeout_s=10,
        ),
        lambda r, ctx: _all(
            (
                r.status is RunStatus.OK and "stopped" in r.stdout_text,
                f"status {r.status} {r.stdout_text[-100:]}",
            )
        ),
    )
    add(
        "infinite_output",
        "print forever",
        lambda ctx: py("while True:\n    print('A' * 1000)\n", timeout_s=10),
        lambda r, ctx: _all(
            (r.output_truncated, "output_truncated not set"),
            (len(r.stdout) <= 64 * 1024, f"kept {len(r.stdout)} bytes"),
            (r.status in (RunStatus.OUTPUT_LIMIT, RunStatus.TIMEOUT), f"status {r.status}"),
        ),
    )
    add(
        "long_line",
        "one huge line without a newline",
        lambda ctx: py("import sys\nsys.stdout.write('x' * 10**7)\n", timeout_s=10),
        lambda r, ctx: _all(
            (r.output_truncated and len(r.stdout) <= 64 * 1024, f"kept {len(r.stdout)}")
        ),
    )
    add(
        "sleep_past_timeout",
        "ignore SIGTERM and sleep",
        lambda ctx: py(
            "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(1000)\n",
            timeout_s=1.5,
        ),
        lambda r, ctx: _all(
            (r.status is RunStatus.TIMEOUT and r.timed_out, f"status {r.status}"),
            (r.duration_s < 1.5 + 2, f"killed after {r.duration_s:.2f} s"),
        ),
    )
    add(
        "busy_loop",
        "spin on the CPU",
        lambda ctx: py("while True:\n    pass\n", timeout_s=1.5),
        lambda r, ctx: _all(
            (r.status is RunStatus.TIMEOUT, f"status {r.status}"),
            (r.duration_s < 1.5 + 2, f"killed after {r.duration_s:.2f} s"),
        ),
    )
    add(
        "network_egress",
        "TCP to the host's loopback port, DNS, raw socket, UDP out",
        lambda ctx: py(
            PROBE_ATTEMPTS
            + f"""
import socket
attempt('tcp-host-loopback', lambda: socket.create_connection(('127.0.0.1', {ctx.host_port}), timeout=2))
attempt('tcp-host-gateway', lambda: socket.create_connection(('10.0.2.2', {ctx.host_port}), timeout=2))
attempt('tcp-internet', lambda: socket.create_connection(('1.1.1.1', 80), timeout=2))
attempt('dns', lambda: socket.getaddrinfo('example.com', 80))
attempt('raw-socket', lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
attempt('udp-out', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53)))
attempt('non-lo-interface', lambda: [1 / 0 for n in os.listdir('/sys/class/net') if n != 'lo'] or 1 / 0)
""",
            timeout_s=15,
        ),
        lambda r, ctx: _all(_lines_all_blocked(r, 7)),
    )
    add(
        "host_files",
        "read host files and the NATS credentials file",
        lambda ctx: py(
            PROBE_ATTEMPTS
            + f"""
attempt('canary', lambda: open({ctx.canary_file!r}).read())
attempt('shadow', lambda: open('/etc/shadow').read())
attempt('root-home', lambda: os.listdir('/root') and open('/root/.bash_history').read())
attempt('proc1-root', lambda: os.listdir('/proc/1/root/'))
attempt('dotdot', lambda: open('../../../../..' + {ctx.canary_file!r}).read())
""",
            timeout_s=20,
        ),
        lambda r, ctx: _all(_lines_all_blocked(r, 5), _no_canary(r, ctx)),
    )
    add(
        "env_secrets",
        "dump the environment and PID 1's",
        lambda ctx: py(
            "import os\nprint(dict(os.environ))\ntry:\n    print(open('/proc/1/environ').read())\n"
            "except OSError as e:\n    print('no /proc/1/environ', e.errno)\n"
        ),
        lambda r, ctx: _all(
            _no_canary(r, ctx),
            (r.status is RunStatus.OK, f"status {r.status}"),
            (
                "NATS" not in r.stdout_text and "HF_TOKEN" not in r.stdout_text,
                "host env vars visible",
            ),
        ),
    )
    add(
        "write_outside",
        "write to /, /etc, /usr, /home",
        lambda ctx: py(
            PROBE_ATTEMPTS
            + """
attempt('root', lambda: open('/x', 'w').write('x'))
attempt('etc', lambda: open('/etc/passwd', 'a').write('x'))
attempt('usr', lambda: open('/usr/bin/python3', 'ab').write(b'x'))
attempt('home', lambda: os.makedirs('/home/x'))
"""
        ),
        lambda r, ctx: _all(_lines_all_blocked(r, 4)),
    )
    add(
        "proc_sys_probe",
        "read /proc/kcore and keys, write /proc/sys and cgroups, sysrq",
        lambda ctx: py(
            PROBE_ATTEMPTS
            + """
attempt('kcore', lambda: open('/proc/kcore', 'rb').read(16) or 1 / 0)
attempt('sysrq', lambda: open('/proc/sysrq-trigger', 'w').write('b'))
attempt('sysctl', lambda: open('/proc/sys/kernel/hostname', 'w').write('pwned'))
attempt('cgroup', lambda: open('/sys/fs/cgroup/pids/tasks', 'w').write('1'))
attempt('keys', lambda: open('/proc/keys').read() or 1 / 0)
attempt('firmware', lambda: os.listdir('/sys/firmware') or 1 / 0)
"""
        ),
        lambda r, ctx: _all(_lines_all_blocked(r, 6)),
    )
    add(
        "setuid_caps",
        "become root, use capabilities, mount, chown",
        lambda ctx: py(
            PROBE_ATTEMPTS
            + """
st = open('/proc/self/status').read()
print('BLOCKED' if 'CapEff:\\t0000000000000000' in st else 'ALLOWED', 'caps')
print('BLOCKED' if 'NoNewPrivs:\\t1' in st else 'ALLOWED', 'no-new-privs')
attempt('setuid0', lambda: os.setuid(0))
attempt('chown-root', lambda: os.chown('/work/main.py', 0, 0))
attempt('mount', lambda: os.system('mount -t tmpfs none /mnt 2>/dev/null') == 0 and None or 1 / 0)
attempt('su', lambda: os.system('su -c true root </dev/null 2>/dev/null') == 0 and None or 1 / 0)
"""
        ),
        lambda r, ctx: _all(_lines_all_blocked(r, 6)),
    )
    add(
        "symlink_tricks",
        "symlinks to / and /proc/1/root, then read through them",
        lambda ctx: py(
            PROBE_ATTEMPTS
            + f"""
os.symlink('/', '/work/root')
print('hostname-through-link', open('/work/root/etc/hostname').read().strip() if os.path.exists('/work/root/etc/hostname') else '-')
os.symlink('/proc/1/root', '/work/p1')
attempt('proc1-root-link', lambda: os.listdir('/work/p1/'))
os.symlink({ctx.canary_file!r}, '/work/canary')
attempt('canary-link', lambda: open('/work/canary').read())
"""
        ),
        lambda r, ctx: _all(
            _no_canary(r, ctx),
            (ctx.hostname not in r.stdout_text.replace("sandbox", ""), "host hostname visible"),
            ("ALLOWED" not in r.stdout_text, r.stdout_text[-300:]),
        ),
    )
    add(
        "kill_outside",
        "signal PID 1, the keeper, everything (-1), and look for other sandboxes",
        lambda ctx: py("""
import os, signal
for pid in (1, 2, 3, 4, 5, 6, 7):
    try:
        os.kill(pid, signal.SIGKILL)
        print('killed', pid)
    except OSError as e:
        pass
pids = [p for p in os.listdir('/proc') if p.isdigit()]
print('visible', len(pids))
os.kill(-1, signal.SIGKILL)
"""),
        lambda r, ctx: _all(
            (
                r.status is RunStatus.NONZERO_EXIT and r.exit_code == 137,
                f"status {r.status} {r.exit_code}",
            ),
            ("killed 1" not in r.stdout_text, "killed PID 1"),
        ),
    )
    add(
        "attack_wrapper",
        "ptrace the task wrapper, read its environment, write its memory",
        lambda ctx: py(
            PROBE_ATTEMPTS
            + """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
ppid = os.getppid()
def ptrace_attach():
    if libc.ptrace(16, ppid, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), 'ptrace')
attempt('ptrace-parent', ptrace_attach)
attempt('parent-environ', lambda: open(f'/proc/{ppid}/environ', 'rb').read() or 1 / 0)
attempt('parent-mem', lambda: open(f'/proc/{ppid}/mem', 'r+b'))
"""
        ),
        lambda r, ctx: _all(
            _lines_all_blocked(r, 3), ("reinforge-" not in r.stdout_text, "marker leaked")
        ),
    )
    add(
        "kill_wrapper_leave_daemon",
        "leave a daemon, then kill the task wrapper so it can't clean up",
        lambda ctx: py(
            "import os, signal, time\nif os.fork() == 0:\n    os.setsid()\n"
            "    open('/tmp/daemon', 'w').write('here')\n    time.sleep(1000)\n"
            "time.sleep(0.3)\nos.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(1000)\n",
            timeout_s=10,
        ),
        lambda r, ctx: _all(
            (
                r.status is RunStatus.NONZERO_EXIT and r.exit_code == 137,
                f"status {r.status} {r.exit_code}",
            ),
            (r.duration_s < 5, f"took {r.duration_s:.1f} s"),
        ),
    )
    add(
        "background_leftover",
        "leave daemons and files behind for the next task",
        lambda ctx: Job(
            files={
                "run.sh": "#!/bin/sh\nnohup sleep 1000 >/dev/null 2>&1 &\n"
                "setsid sh -c 'while :; do sleep 1; done' >/dev/null 2>&1 &\n"
                "python3 -c 'import os\nif os.fork() == 0:\n  os.setsid()\n  import time; time.sleep(1000)' &\n"
                "echo secret-leftover > /tmp/leftover; echo x > /dev/shm/leftover; echo started\n"
            },
            argv=["sh", "run.sh"],
            timeout_s=5,
        ),
        lambda r, ctx: _all(
            (r.status is RunStatus.OK and "started" in r.stdout_text, f"status {r.status}"),
            (r.duration_s < 4, f"took {r.duration_s:.1f} s: the task waited for its daemons"),
        ),
    )
    add(
        "binary_output",
        "raw bytes, NULs and invalid UTF-8 on stdout",
        lambda ctx: py(
            "import os\nos.write(1, bytes(range(256)) * 4 + b'\\xff\\xfe\\x00\\xc3(')\n"
        ),
        lambda r, ctx: _all(
            (r.status is RunStatus.OK, f"status {r.status}"),
            (r.stdout == bytes(range(256)) * 4 + b"\xff\xfe\x00\xc3(", "bytes changed"),
            (isinstance(r.stdout_text, str), "no text"),
        ),
    )
    add(
        "huge_stdin",
        "20 MB of stdin",
        lambda ctx: py(
            "import sys\nprint(len(sys.stdin.buffer.read()))\n", stdin=b"x" * 20_000_000
        ),
        lambda r, ctx: _all((r.status is RunStatus.INPUT_TOO_LARGE, f"status {r.status}")),
    )
    add(
        "huge_argv",
        "a 300 kB argument",
        lambda ctx: py("print(1)\n", argv_extra=("y" * 300_000,)),
        lambda r, ctx: _all((r.status is RunStatus.INPUT_TOO_LARGE, f"status {r.status}")),
    )
    add(
        "engine_socket",
        "look for a Podman or Docker socket to drive",
        lambda ctx: py(
            "import glob\nsocks = [p for pat in ('/run/**/*.sock', '/var/run/**/*.sock', '/tmp/**/*.sock')\n"
            "         for p in glob.glob(pat, recursive=True)]\nmounts = open('/proc/self/mountinfo').read()\n"
            "print('socks', socks, 'podman.sock' in mounts or 'docker.sock' in mounts)\n"
        ),
        lambda r, ctx: _all((r.stdout_text.strip() == "socks [] False", r.stdout_text[-200:])),
    )
    add(
        "sysv_ipc_left_behind",
        "System V shared memory, message queue and semaphores that outlive the task",
        lambda ctx: py(SYSV_IPC_ATTACK),
        lambda r, ctx: _all((r.status is RunStatus.OK, f"status {r.status} {r.stderr_text[-200:]}")),
    )
    return c


SYSV_IPC_ATTACK = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
IPC_CREAT = 0o1000
shm = libc.shmget(0x5EED, 4096, IPC_CREAT | 0o666)
if shm >= 0:
    at = libc.shmat(shm, None, 0)
    ctypes.memmove(at, b"LEAKED-SECRET", 13)
    libc.shmdt(ctypes.c_void_p(at))
msg = libc.msgget(0x5EEE, IPC_CREAT | 0o666)
sem = libc.semget(0x5EEF, 1, IPC_CREAT | 0o666)
print("made", shm, msg, sem)
"""


CASES: list[Case] = _cases()
CASE_NAMES = [c.name for c in CASES]

PROBE_CLEAN = Job(
    files={
        "probe.py": r"""
import os
me = os.getuid()
left = []
for d in ('/work', '/tmp', '/var/tmp', '/dev/shm', '/run/reinforge'):
    for name in os.listdir(d):
        if not (d == '/work' and name == 'probe.py'):
            left.append(d + '/' + name)
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) not in (os.getpid(), os.getppid()):
        try:
            st = open(f'/proc/{p}/status').read()
        except OSError:
            continue
        uid = int(st.split('Uid:')[1].split()[0])
        if uid == me:
            left.append('pid %s %s' % (p, open(f'/proc/{p}/cmdline').read().replace('\0', ' ')))
for kind in ('shm', 'msg', 'sem'):
    rows = open(f'/proc/sysvipc/{kind}').read().splitlines()[1:]
    left += [f'sysv {kind}: {row.split()[:2]}' for row in rows]
print('LEFT' if left else 'CLEAN', left)
"""
    },
    argv=["python3", "probe.py"],
    timeout_s=10,
)


class LeakCase(msgspec.Struct, frozen=True, kw_only=True):
    """State one candidate leaves that the next one, checked by the same zygote, must not see."""

    name: str
    what: str
    attack: str
    """The first candidate's code (the body of its function, run when the tests call it)."""
    probe: str
    """The next candidate's code: appends to `found` what it sees of the attack."""


def _leak_program(body: str) -> str:
    lines = ["import os, signal, socket, subprocess, sys, threading, time", "def f(x):",
             "    found = []"]
    lines += ["    " + line if line else "" for line in body.strip("\n").splitlines()]
    return "\n".join(lines) + "\n    return found\n"


# What every probe also checks: files in the writable dirs, processes of the candidate's uid
# other than itself and its ancestors (the harness, the zygote), System V IPC objects.
_PROBE_COMMON = r"""
for d in ('/work', '/tmp', '/var/tmp', '/dev/shm', '/run/reinforge'):
    found += [d + '/' + n for n in os.listdir(d)]
mine, up = {os.getpid()}, os.getpid()
while up > 1:
    up = int(open('/proc/%d/status' % up).read().split('PPid:')[1].split()[0])
    mine.add(up)
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) not in mine:
        try:
            st = open('/proc/%s/status' % p).read()
        except OSError:
            continue
        if int(st.split('Uid:')[1].split()[0]) == os.getuid():
            found.append('process %s %s' % (p, open('/proc/%s/cmdline' % p).read()[:60]))
for kind in ('shm', 'msg', 'sem'):
    found += ['sysv ' + kind + ' ' + r for r in open('/proc/sysvipc/' + kind).read().splitlines()[1:]]
"""

LEAK_CASES: list[LeakCase] = [
    LeakCase(
        name="leak_files",
        what="files (one in a dir it made unreadable) in every writable dir",
        attack="""
for d in ('/work', '/tmp', '/var/tmp', '/dev/shm', '/run/reinforge'):
    open(d + '/left.txt', 'w').write('from the last candidate')
os.makedirs('/tmp/locked/deep')
open('/tmp/locked/deep/x', 'w').write('x')
os.chmod('/tmp/locked', 0)
""",
        probe="",
    ),
    LeakCase(
        name="leak_patched_modules",
        what="sys.modules, builtins and stdlib functions patched in place",
        attack="""
import builtins, json
json.dumps = lambda *a, **k: 'patched'
os.getcwd = lambda: '/patched'
builtins.len = lambda o: 7
sys.modules['math'] = None
sys.path.insert(0, '/tmp')
""",
        probe="""
import builtins, json
import math
if json.dumps([1]) != '[1]': found.append('json.dumps patched')
if os.getcwd() == '/patched': found.append('os.getcwd patched')
if len([1, 2]) != 2: found.append('builtins.len patched')
if '/tmp' in sys.path: found.append('sys.path patched')
""",
    ),
    LeakCase(
        name="leak_threads",
        what="a non-daemon thread that keeps writing files",
        attack="""
def spin():
    n = 0
    while True:
        n += 1
        try:
            open('/tmp/thread-%d' % n, 'w').close()
        except OSError:
            pass
        time.sleep(0.01)
threading.Thread(target=spin).start()
""",
        probe="""
time.sleep(0.3)
if threading.active_count() != 1: found.append('threads: %d' % threading.active_count())
""",
    ),
    LeakCase(
        name="leak_signal_state",
        what="signal handlers, a blocked signal, a pending alarm",
        attack="""
signal.signal(signal.SIGTERM, lambda *a: None)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
signal.alarm(30)
""",
        probe="""
for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
    if signal.getsignal(s) != signal.SIG_DFL: found.append('handler of %s' % s)
if signal.pthread_sigmask(signal.SIG_BLOCK, []): found.append('blocked signals')
if signal.alarm(0): found.append('a pending alarm')
""",
    ),
    LeakCase(
        name="leak_tmp_full",
        what="/tmp and /dev/shm filled to the last byte",
        attack="""
for d in ('/tmp', '/dev/shm'):
    try:
        with open(d + '/fill', 'wb') as fh:
            while True:
                fh.write(b'x' * 65536)
    except OSError:
        pass
""",
        probe="""
for d in ('/tmp', '/dev/shm'):
    st = os.statvfs(d)
    if st.f_bfree < st.f_blocks: found.append('%s: %d blocks used' % (d, st.f_blocks - st.f_bfree))
""",
    ),
    LeakCase(
        name="leak_cwd_umask",
        what="the working directory and the umask changed",
        attack="""
os.chdir('/tmp')
os.umask(0o777)
""",
        probe="""
if os.getcwd() != '/work': found.append('cwd ' + os.getcwd())
if os.umask(0o022) != 0o022: found.append('umask changed')
""",
    ),
    LeakCase(
        name="leak_environment",
        what="environment variables set (os.environ and putenv)",
        attack="""
os.environ['LEAKED'] = '1'
os.environ['PYTHONPATH'] = '/tmp'
os.putenv('LD_PRELOAD', '/tmp/evil.so')
""",
        probe="""
for k in ('LEAKED', 'PYTHONPATH', 'LD_PRELOAD'):
    if k in os.environ: found.append('env ' + k)
""",
    ),
    LeakCase(
        name="leak_processes",
        what="a child process and a double-forked daemon in its own session",
        attack="""
subprocess.Popen(['sleep', '600'])
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            time.sleep(0.05)
    os._exit(0)
""",
        probe="",
    ),
    LeakCase(
        name="leak_abstract_socket",
        what="a daemon listening on an abstract unix socket (no file to wipe)",
        attack="""
if os.fork() == 0:
    s = socket.socket(socket.AF_UNIX)
    s.bind('\\0reinforge-leak')
    s.listen(1)
    while True:
        c, _ = s.accept()
        c.sendall(b'secret from the last candidate')
        c.close()
time.sleep(0.2)
""",
        probe="""
s = socket.socket(socket.AF_UNIX)
try:
    s.connect('\\0reinforge-leak')
    found.append('abstract socket answered: %r' % s.recv(100))
except OSError:
    pass
""",
    ),
    LeakCase(
        name="leak_sysv_ipc",
        what="System V shared memory with a secret, a message queue, semaphores",
        attack=SYSV_IPC_ATTACK.replace('print("made", shm, msg, sem)', ""),
        probe="""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
if libc.shmget(0x5EED, 0, 0) >= 0: found.append('shared memory still there')
if libc.msgget(0x5EEE, 0) >= 0: found.append('message queue still there')
""",
    ),
    LeakCase(
        name="leak_signals_the_zygote",
        what="SIGUSR1, SIGUSR2, SIGALRM, SIGHUP, SIGINT and SIGTERM to every process of its uid",
        attack="""
sigs = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGHUP, signal.SIGINT, signal.SIGTERM)
for s in sigs:
    signal.signal(s, signal.SIG_IGN)
for s in sigs:
    try:
        os.kill(-1, s)
    except OSError:
        pass
""",
        probe="",
    ),
]
LEAK_CASE_NAMES = [c.name for c in LEAK_CASES]


def leak_checks(case: LeakCase, nonce: str) -> tuple[Check, Check]:
    """The attack's and the probe's code-harness checks."""
    from reinforge.envs.domains.code import HARNESS_PATH  # the harness code checks really use

    def check(body: str, test: str) -> Check:
        payload = {
            "program": _leak_program(body),
            "prompt": "",
            "test": test,
            "entry_point": "f",
            "timeout_s": 5.0,
            "nonce": nonce,
        }
        return Check(harness=HARNESS_PATH.read_bytes(), payload=msgspec.json.encode(payload),
                     timeout_s=10.0)

    return (
        check(case.attack, "def check(c):\n    c(0)\n"),
        check(case.probe + _PROBE_COMMON, "def check(c):\n    found = c(0)\n    assert found == [], found\n"),
    )


def run_leak_case(box: Sandbox, case: LeakCase) -> CaseResult:
    """The attack, then the probe (two checks by the zygote), then both in one batch: the
    probe must pass both times. Blocking (a trio caller runs it in a thread)."""
    nonce = uuid.uuid4().hex
    attack, probe = leak_checks(case, nonce)
    problems: list[str] = []
    seen: RunResult | None = None
    for how, results in (
        ("alone", [run_checks(box, [attack])[0], run_checks(box, [probe])[0]]),
        ("batched", run_checks(box, [attack, probe])),
    ):
        probed = results[1]
        if probed is None:
            problems.append(f"{how}: the probe did not run")
            continue
        seen = probed
        verdict = seen.stdout_text.partition(nonce + " ")[2]
        if '"status": "pass"' not in verdict:
            problems.append(f"{how}: the next candidate saw {verdict[:300] or seen.stderr_text[-300:]}")
    detail = "; ".join(problems)
    return CaseResult(  # status, exit code and duration: the last probe's
        name=case.name,
        contained=not detail,
        detail=detail or "contained",
        status=seen.status.value if seen else "not_run",
        exit_code=seen.exit_code if seen else None,
        duration_s=round(seen.duration_s, 3) if seen else 0.0,
    )


class HostCanaries:
    """Plants a canary secret (file under .reinforge/<run>/, env vars) and a listening port."""

    def __init__(self, root: str) -> None:
        self.canary = f"CANARY-{uuid.uuid4().hex}"
        run_dir = os.path.join(root, ".reinforge", f"selftest-{uuid.uuid4().hex[:8]}")
        os.makedirs(run_dir, exist_ok=True)
        self.canary_file = os.path.join(run_dir, "nats.creds")
        with open(self.canary_file, "w") as f:
            f.write(self.canary)
        self._saved = {k: os.environ.get(k) for k in ("NATS_TOKEN", "HF_TOKEN")}
        os.environ["NATS_TOKEN"] = self.canary
        os.environ["HF_TOKEN"] = self.canary
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.listener.settimeout(0.2)
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            conn.close()

    def context(self) -> Context:
        return Context(
            canary=self.canary,
            canary_file=self.canary_file,
            host_port=self.listener.getsockname()[1],
            hostname=socket.gethostname(),
        )

    def intact(self) -> bool:
        with open(self.canary_file) as f:
            return f.read() == self.canary

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.listener.close()
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            os.remove(self.canary_file)
            os.rmdir(os.path.dirname(self.canary_file))
        except OSError:
            pass


async def run_case(
    pool: SandboxPool, case: Case, ctx: Context, canaries: HostCanaries
) -> CaseResult:
    """Run one hostile case and the clean-state probe after it; judge containment."""
    outcome = await pool.run(case.job(ctx), use_cache=False)
    if isinstance(outcome, InfraFailure):
        return CaseResult(
            name=case.name,
            contained=False,
            detail=f"infrastructure failure: {outcome.error}",
            status="infra_failure",
            exit_code=None,
            duration_s=0.0,
        )
    problems = [case.check(outcome, ctx)]
    probe = await pool.run(PROBE_CLEAN, use_cache=False)
    if isinstance(probe, InfraFailure):
        problems.append(f"the next task failed to run: {probe.error}")
    elif not probe.stdout_text.startswith("CLEAN"):
        problems.append(f"the next task was not clean: {probe.stdout_text[:300]}")
    if canaries.connections:
        problems.append(f"{canaries.connections} connection(s) reached the host's port")
    if not canaries.intact():
        problems.append("the host canary file changed")
    detail = "; ".join(p for p in problems if p)
    return CaseResult(
        name=case.name,
        contained=not detail,
        detail=detail or "contained",
        status=outcome.status.value,
        exit_code=outcome.exit_code,
        duration_s=round(outcome.duration_s, 3),
    )


async def run_selftest(
    config: SandboxConfig | None = None,
    *,
    names: list[str] | None = None,
    root: str = ".",
    on_result: Callable[[CaseResult], None] | None = None,
) -> SelftestReport:
    """Run the hostile cases (all, or `names`) against a fresh 1-sandbox pool."""
    config = config or SandboxConfig()
    cases = [c for c in CASES if names is None or c.name in names]
    leaks = [c for c in LEAK_CASES if names is None or c.name in names]
    canaries = HostCanaries(root)
    results = []

    def record(res: CaseResult) -> None:
        results.append(res)
        if on_result:
            on_result(res)

    limits = "?"
    try:
        ctx = canaries.context()
        if cases:
            async with SandboxPool(PoolConfig(sandbox=config, size=1, cache_entries=0)) as pool:
                for case in cases:
                    record(await run_case(pool, case, ctx, canaries))
                limits = pool._limits.value if pool._limits else "?"
        if leaks:
            box = await trio.to_thread.run_sync(Sandbox.start, config)
            try:
                limits = box.limits.value
                for leak in leaks:
                    record(await trio.to_thread.run_sync(run_leak_case, box, leak))
                    if not box.healthy:  # a case killed it: the next one gets a fresh sandbox
                        box.close()
                        box = await trio.to_thread.run_sync(Sandbox.start, config)
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(box.close)
    finally:
        canaries.close()
    contained = sum(r.contained for r in results)
    return SelftestReport(
        cases=len(results),
        contained=contained,
        escaped=len(results) - contained,
        limits=limits,
        image=config.image,
        results=results,
    )


def main_selftest(json_out: bool) -> int:  # used by cli.py
    import sys

    def show(r: CaseResult) -> None:
        if not json_out:
            mark = "contained" if r.contained else "ESCAPED"
            print(f"{r.name:>26}  {mark:<9}  {r.status:<15} {r.detail if not r.contained else ''}")

    report = trio.run(lambda: run_selftest(on_result=show))
    if json_out:
        print(msgspec.json.encode(report).decode())
    else:
        print(
            f"{report.contained}/{report.cases} contained, {report.escaped} escaped "
            f"(limits: {report.limits})"
        )
        print(
            msgspec.json.encode(
                {
                    "cases": report.cases,
                    "contained": report.contained,
                    "escaped": report.escaped,
                    "limits": report.limits,
                }
            ).decode()
        )
    sys.stdout.flush()
    return 0 if report.escaped == 0 else 1
