"""The zygote: one long-lived process per sandbox that forks a fresh child per check.

Standalone (stdlib only): the host starts it as `python3 -I -B -c <this source>` in one exec
of the sandbox, as the candidate's uid, and talks to it over that exec's stdin and stdout
(zygote.py is the host's side). Frames both ways: a 4-byte big-endian length, then the bytes.

    host -> zygote  JSON config {"harness": source, "limits": {...}, ...}   once
    zygote -> host  JSON {"ready": fingerprint}
    host -> zygote  JSON {"id", "length", "timeout_s"}, then `length` payload bytes   per check
    zygote -> host  JSON {"id", "exit_code", "why", "duration_s", "clean", ...}, stdout, stderr

The harness (the config's Python source, executed once here) defines `zygote_entry()`: it
reads its payload from stdin until EOF and writes its verdict on stdout, like a script would.
Per check the zygote copies the payload into a fresh pipe (and zeroes its own copy: a later
child must not find an earlier check's secrets in memory it inherits), forks the check's
child, and waits for it until the deadline. The child, before any harness code runs: takes
the pipe as stdin and fresh pipes as stdout and stderr, closes every other descriptor,
resets every signal to its default, the environment to the one the zygote started with, its
umask, its working directory (wiped), its niceness, and sets the rlimits. The zygote never
runs harness or candidate code per check itself and holds no check's input after the copy.

The zygote runs as the candidate's uid, as an exec's wrapper does: a child can't drop to it
from another uid without CAP_SETUID in the container, which the sandbox never grants.

After every check the zygote kills every other process of its uid (`kill(-1)` spares the
caller), wipes every writable dir, and checks both; when that fails it reports it and exits
(the host replaces the sandbox). It is non-dumpable (no ptrace, no /proc/<pid>/mem, fd or
environ for same-uid processes) and ignores the catchable signals a candidate could send it;
SIGKILL and SIGSTOP it can't ignore: the host sees the first as the session's end and the
second as a deadline passed, and replaces the zygote (a killed one) or the sandbox.
"""

import hashlib
import json
import os
import resource
import select
import signal
import stat
import struct
import sys
import time

MAX_FRAME = 64 * 1024 * 1024
_IGNORED = [
    getattr(signal, name)
    for name in (
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGTERM",
        "SIGUSR1",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
        "SIGVTALRM",
        "SIGPROF",
        "SIGWINCH",
        "SIGURG",
    )
    if hasattr(signal, name)
]


def read_exact(fd, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            raise EOFError("the host closed the session")
        got += k
    return buf


def read_frame(fd):
    (n,) = struct.unpack(">I", bytes(read_exact(fd, 4)))
    if n > MAX_FRAME:
        raise ValueError("frame of %d bytes is over the limit" % n)
    return read_exact(fd, n)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def send(*parts):
    out = b"".join(struct.pack(">I", len(p)) + p for p in parts)
    write_all(1, out)


def make_non_dumpable():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE
    except Exception:
        return False


# ----------------------------------------------------------------- clean state between checks


def others(me):
    """Pids of processes of my uid other than me (zombies included)."""
    uid = str(os.getuid())
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open("/proc/%s/status" % name) as fh:
                for line in fh:
                    if line.startswith("Uid:"):
                        if line.split()[1] == uid:
                            found.append(int(name))
                        break
        except OSError:
            continue
    return found


def kill_others():
    me = os.getpid()
    for _ in range(300):
        try:
            os.kill(-1, signal.SIGKILL)  # every process of my uid but me
        except ProcessLookupError:
            pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:  # our own children's zombies
                pass
        except ChildProcessError:
            pass
        left = others(me)
        if not left:
            return ""
        time.sleep(0.005)
    return "processes of the candidate's uid left: %s" % left[:10]


def wipe(path):
    """Delete everything under `path` (not `path` itself); the first error, or ''."""
    try:
        entries = list(os.scandir(path))
    except OSError as exc:
        return "%s: %s" % (path, exc)
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                os.chmod(entry.path, stat.S_IRWXU)
                error = wipe(entry.path)
                if error:
                    return error
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
        except OSError as exc:
            return "%s: %s" % (entry.path, exc)
    return ""


def make_clean(writable):
    """Kill every other process of my uid, wipe the writable dirs, check both: '' or why not."""
    error = kill_others()
    if error:
        return error
    for path in writable:
        error = wipe(path)
        if error:
            return "could not wipe %s" % error
        if os.listdir(path):
            return "%s is not empty after the wipe" % path
    return ""


# ----------------------------------------------------------------- one check


def set_limits(limits, timeout_s):
    cpu_s = max(1, int(timeout_s) + 1)
    for name, value in (
        ("RLIMIT_NPROC", limits["pids"]),
        ("RLIMIT_DATA", limits["data_bytes"]),
        ("RLIMIT_FSIZE", limits["file_size_bytes"]),
        ("RLIMIT_NOFILE", limits["open_files"]),
        ("RLIMIT_CORE", 0),
        ("RLIMIT_CPU", cpu_s),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))


def child(entry, config, base_env, stdin_r, out_w, err_w, timeout_s):
    """The check's process: a clean start, then the harness's entry. Never returns."""
    code = 1
    try:
        os.dup2(stdin_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 1 << 16)
        for sig in signal.valid_signals():
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                try:
                    signal.signal(sig, signal.SIG_DFL)
                except (OSError, ValueError):
                    pass
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.environ.clear()
        os.environ.update(base_env)
        os.umask(0o022)
        os.chdir(config["work_dir"])
        os.nice(config["nice"])
        set_limits(config["limits"], timeout_s)
        sys.stdin = open(0, "r", encoding="utf-8", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False)
        entry()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        try:
            import traceback

            traceback.print_exc()
        except BaseException:
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


def collect(pid, out_r, err_r, deadline, max_output, max_drained):
    """Read the child's output until it exits or the deadline: (status, out, err, why, counts)."""
    kept = {out_r: bytearray(), err_r: bytearray()}
    counts = {out_r: 0, err_r: 0}
    pidfd = os.pidfd_open(pid)
    open_fds = [out_r, err_r]
    why = ""
    status = None
    try:
        while status is None or open_fds:
            left = deadline - time.monotonic()
            if left <= 0 and status is None:
                why = "timeout"
                break
            watch = open_fds + ([pidfd] if status is None else [])
            ready, _, _ = select.select(watch, [], [], max(0.0, left) if status is None else 0.05)
            if not ready and status is not None:
                break  # exited; a descendant holds its pipes open: the sweep ends it
            for fd in ready:
                if fd == pidfd:
                    status = os.waitpid(pid, 0)[1]
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_fds.remove(fd)
                    continue
                counts[fd] += len(chunk)
                room = max_output - len(kept[fd])
                if room > 0:
                    kept[fd] += chunk[:room]
                if counts[out_r] + counts[err_r] > max_drained:
                    why = "flood"
                    break
            if why:
                break
    finally:
        os.close(pidfd)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
    return status, bytes(kept[out_r]), bytes(kept[err_r]), why, (counts[out_r], counts[err_r])


def run_check(entry, config, base_env, header):
    length, timeout_s = int(header["length"]), float(header["timeout_s"])
    payload = read_exact(0, length)
    stdin_r, stdin_w = os.pipe()
    try:
        import fcntl

        fcntl.fcntl(stdin_w, 1031, max(length, 4096))  # F_SETPIPE_SZ: the copy can't block
        write_all(stdin_w, payload)
    finally:
        payload[:] = bytes(length)  # no later child inherits this check's input
        os.close(stdin_w)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(entry, config, base_env, stdin_r, out_w, err_w, timeout_s)
    for fd in (stdin_r, out_w, err_w):
        os.close(fd)
    try:
        status, out, err, why, counts = collect(
            pid,
            out_r,
            err_r,
            t0 + timeout_s,
            config["max_output_bytes"],
            config["max_drained_bytes"],
        )
    finally:
        os.close(out_r)
        os.close(err_r)
    duration_s = time.monotonic() - t0
    dirt = make_clean(config["writable"])
    reply = {
        "id": header["id"],
        "exit_code": os.waitstatus_to_exitcode(status)
        if not os.WIFSIGNALED(status)
        else 128 + os.WTERMSIG(status),
        "why": why,
        "duration_s": duration_s,
        "stdout_bytes": counts[0],
        "stderr_bytes": counts[1],
        "clean": not dirt,
        "dirt": dirt,
    }
    send(json.dumps(reply).encode(), out, err)
    return not dirt


def main():
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    hardened = make_non_dumpable()
    raw = bytes(read_frame(0))
    config = json.loads(raw)
    harness = config["harness"]
    namespace = {"__name__": "reinforge_harness"}
    exec(compile(harness, "harness.py", "exec"), namespace)
    entry = namespace["zygote_entry"]
    base_env = dict(os.environ)
    fingerprint = hashlib.sha256(raw).hexdigest()  # the host checks it is what it sent
    dirt = make_clean(config["writable"])
    send(json.dumps({"ready": fingerprint, "hardened": hardened, "dirt": dirt}).encode())
    if dirt:
        return 3
    while True:
        try:
            header = json.loads(bytes(read_frame(0)))
        except EOFError:
            return 0
        if not run_check(entry, config, base_env, header):
            return 3


if __name__ == "__main__":
    sys.exit(main())
