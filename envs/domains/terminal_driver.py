"""The terminal-domain driver. Standalone (stdlib + code_harness.py): copied into the sandbox.

    python3 -I terminal_driver.py             # job as JSON on stdin
    python3 -I -c <this file> --session       # one episode, a request per step

It deletes its staged stdin file and makes itself non-dumpable (like code_harness.py),
writes the task's files into ./task, runs the agent's shell commands there one by one
(each with a timeout, output captured), then

- mode "steps": reports each command's exit status and output;
- mode "final": ends every leftover process of the agent (in the sandbox: every
  process of this uid but the driver itself), then runs the hidden checks, which
  live only in the driver's memory: file contents/existence, and Python unit tests
  run through code_harness (tests and candidate in separate processes).

It prints one line: NONCE + " " + JSON. Nothing the agent prints can forge it: the
agent's commands write into pipes the driver reads, never to the driver's stdout.
"""

import json
import os
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import types

code_harness = None  # loaded by main(), before any agent command can replace the file


def _load_harness():
    global code_harness
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import code_harness as module

    code_harness = module


MAX_OBS_CHARS = 2000
MAX_FILE_BYTES = 1 << 20


def run_command(cmd, cwd, timeout_s):
    proc = subprocess.Popen(
        ["/bin/sh", "-c", cmd],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        close_fds=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _killpg(proc.pid)
        out, _ = proc.communicate()
        code = None
    _killpg(proc.pid)
    text = out.decode("utf-8", errors="replace")
    if len(text) > MAX_OBS_CHARS:
        text = text[:MAX_OBS_CHARS] + "\n[output truncated]"
    return code, text


def _killpg(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _ancestors():
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            with open("/proc/%d/status" % pid) as fh:
                pid = int([ln for ln in fh if ln.startswith("PPid:")][0].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return pids


def kill_leftovers(rounds=50):
    """SIGKILL every process of our uid except us and our ancestors (sandbox only)."""
    keep, uid = _ancestors(), str(os.getuid())
    for _ in range(rounds):
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in keep:
                continue
            try:
                with open("/proc/%s/status" % name) as fh:
                    owner = [ln for ln in fh if ln.startswith("Uid:")][0].split()[1]
            except (OSError, IndexError):
                continue
            if owner == uid:
                found = True
                try:
                    os.kill(int(name), signal.SIGKILL)
                except OSError:
                    pass
        if not found:
            return True
    return False


def read_file(path):
    """Contents of a regular file (no FIFOs, devices), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MAX_FILE_BYTES + 1)
        return None if len(data) > MAX_FILE_BYTES else data
    finally:
        os.close(fd)


def run_check(check, task_dir, scratch):
    kind = check["kind"]
    path = os.path.join(task_dir, check.get("path", ""))
    name = "%s:%s" % (kind, check.get("path", ""))
    if kind == "file_exists":
        ok = os.path.lexists(path)
        return [name, ok, "" if ok else "missing"]
    if kind == "file_absent":
        ok = not os.path.lexists(path)
        return [name, ok, "" if ok else "still there"]
    if kind == "file_equals":
        data = read_file(path)
        if data is None:
            return [name, False, "missing or not a regular file"]
        got = data.decode("utf-8", errors="replace").rstrip("\n")
        want = check["content"].rstrip("\n")
        return [name, got == want, "" if got == want else "content %r" % got[:80]]
    if kind == "python_tests":
        data = read_file(path)
        if data is None:
            return [name, False, "missing or not a regular file"]
        here = os.getcwd()
        os.chdir(scratch)
        try:
            status, reason, *_ = code_harness.run_tests(
                {
                    "program": data.decode("utf-8", errors="replace"),
                    "prompt": "",
                    "test": check["test"],
                    "entry_point": check["entry_point"],
                    "timeout_s": check.get("timeout_s", 5.0),
                }
            )
        finally:
            os.chdir(here)
        return [name, status == "pass", reason]
    return [name, False, "unknown check kind %r" % kind]


def prepare(files):
    """The task directory with its starting files, and a scratch directory for the checks."""
    base = os.getcwd()
    task_dir = os.path.join(base, "task")
    scratch = os.path.join(base, ".check")
    os.makedirs(task_dir, exist_ok=True)
    os.makedirs(scratch, exist_ok=True)
    for rel, content in files.items():
        path = os.path.join(task_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(content)
    return task_dir, scratch


def final_checks(checks, task_dir, scratch, sandboxed):
    if sandboxed and os.geteuid() != 0:
        kill_leftovers()  # no helper of the agent's survives to tamper with the checks
    results = [run_check(c, task_dir, scratch) for c in checks]
    failed = [c for c in results if not c[1]]
    return {
        "status": "fail" if failed else "pass",
        "checks": results,
        "reason": ("%s: %s" % (failed[0][0], failed[0][2])) if failed else "all checks passed",
    }


def main():
    _load_harness()
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    code_harness._forget_stdin_file()
    hardened = code_harness._make_non_dumpable()
    task_dir, scratch = prepare(job.get("files", {}))
    observations = []
    for cmd in job["commands"]:
        code, text = run_command(cmd, task_dir, float(job["command_timeout_s"]))
        observations.append({"exit": code, "output": text})
    result = {"observations": observations, "hardened": hardened}
    if job["mode"] == "final":
        result.update(final_checks(job["checks"], task_dir, scratch, job.get("sandboxed")))
    sys.stdout.write(job["nonce"] + " " + json.dumps(result) + "\n")
    sys.stdout.flush()


# -- session mode (envs/sandbox/session.py): frames of a 4-byte big-endian length + JSON ------


def _read_exact(n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _receive():
    head = _read_exact(4)
    if head is None:
        return None
    body = _read_exact(struct.unpack(">I", head)[0])
    return None if body is None else json.loads(body.decode("utf-8"))


def _answer(obj):
    data = json.dumps(obj).encode("utf-8")
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(1, data) :]


def session_main():
    """One episode in one process: the config (files, code_harness's source), then one
    request per step ({"op": "run", "cmd", "timeout_s"}) and a last {"op": "final",
    "checks"}; one answer each. The checks arrive only at the end, and the agent's commands
    never write where the answers go (their output is piped to this process)."""
    global code_harness
    config = _receive()
    if config is None:
        return
    task_dir, scratch = prepare(config.get("files", {}))
    # the trusted side runs from this memory; the file is what the check's worker (the
    # candidate's side) starts from, as in job mode
    path = os.path.join(tempfile.mkdtemp(prefix=".harness-"), "code_harness.py")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(config["harness"])
    code_harness = types.ModuleType("code_harness")
    code_harness.__file__ = path
    exec(compile(config["harness"], path, "exec"), code_harness.__dict__)
    hardened = code_harness._make_non_dumpable()
    _answer({"ready": True, "hardened": hardened})
    commands = 0
    while True:
        req = _receive()
        if req is None:
            return
        if req.get("op") == "run":
            code, text = run_command(req["cmd"], task_dir, float(req["timeout_s"]))
            commands += 1
            _answer({"exit": code, "output": text, "commands": commands})
        elif req.get("op") == "final":
            result = final_checks(req["checks"], task_dir, scratch, config.get("sandboxed"))
            result["commands"] = commands
            _answer(result)
            return
        else:
            _answer({"error": "unknown request %r" % req.get("op")})


if __name__ == "__main__":
    if "--session" in sys.argv:
        session_main()
    else:
        main()
