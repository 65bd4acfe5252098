"""The code-domain test harness. Standalone (stdlib only): it is copied into the sandbox.

Two processes, one file:

    python3 -I code_harness.py            # the HARNESS: reads its job from stdin
    python3 -I code_harness.py worker     # the WORKER: gets the program, serves its calls

or, in a sandbox's zygote (reinforge/envs/sandbox/zygote_proc.py), `zygote_entry()` in a
fork of the zygote, whose worker is a fork of the harness made BEFORE the job is read, so
the worker's memory never held the tests or the nonce; each check is then two forks
instead of two interpreter start-ups.

The harness reads a JSON job on stdin (a nonce, the trusted task prompt, the hidden
tests, the entry point, a time budget), deletes the file its stdin came from, makes
itself non-dumpable (so a same-uid process can't read its memory or fds through /proc
or ptrace), then sends the worker the program and its entry point (the first line on
the worker's stdin). The candidate's code runs ONLY in the worker.
The tests run in the harness against a proxy: each call of the candidate sends the
arguments to the worker and gets back a plain value (None, bool, int, float, complex,
str, bytes, list, tuple, dict, set, frozenset; nothing else crosses), so

- printing cannot pass: the candidate's stdout goes to a drained pipe, and the
  harness's verdict is one line on ITS stdout, prefixed by the job's nonce;
- exiting early (sys.exit(0), os._exit(0)) or crashing only kills the worker: the
  call in flight fails, and a dead or timed-out worker fails the run whatever the
  tests do afterwards (sticky; the error derives from BaseException, so the tests'
  own `except Exception` cannot swallow it);
- monkeypatching unittest, builtins, `assert` helpers or the comparison happens in
  the worker's interpreter, not where the tests run;
- `__eq__`/`__hash__` overrides cannot cross: return values are rebuilt from the
  wire as exact built-in types;
- the expected values never reach the worker: the tests arrive on stdin (the
  staged stdin file is deleted before the worker starts) and live only in the
  non-dumpable harness.

Not protected here: a candidate can kill the harness (same uid), which yields no
verdict line, and the host scores that as an error (reward 0). Resource limits,
isolation from the host and other tasks are the sandbox's job.

The result line: NONCE + " " + JSON {"status": "pass"|"fail"|"timeout"|"error",
"reason": str, "checks": [[name, passed, detail], ...], "calls": int}.
"""

import builtins
import json
import math
import os
import select
import subprocess
import sys
import threading
import time

MAX_LINE_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 64


# ----------------------------------------------------------------- wire codec (both sides)


def to_wire(v, depth=0):
    """Plain values only, by exact type (subclasses are refused)."""
    if depth > MAX_DEPTH:
        raise TypeError("value nested too deeply")
    t = type(v)
    if v is None or t is bool or t is str:
        return v
    if t is int:
        return v if abs(v) < 2**53 else {"i": str(v)}
    if t is float:
        if math.isfinite(v):
            return {"f": v}
        return {"f": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
    if t is complex:
        return {"c": [to_wire(v.real, depth + 1), to_wire(v.imag, depth + 1)]}
    if t is bytes:
        return {"b": v.hex()}
    if t is list:
        return [to_wire(x, depth + 1) for x in v]
    if t is tuple:
        return {"t": [to_wire(x, depth + 1) for x in v]}
    if t is set or t is frozenset:
        return {"s" if t is set else "fs": [to_wire(x, depth + 1) for x in v]}
    if t is dict:
        return {"d": [[to_wire(k, depth + 1), to_wire(x, depth + 1)] for k, x in v.items()]}
    raise TypeError("cannot pass a value of type %s" % t.__name__)


def from_wire(w, depth=0):
    """Rebuild exact built-in values; anything unexpected is a TypeError."""
    if depth > MAX_DEPTH:
        raise TypeError("value nested too deeply")
    if w is None or type(w) in (bool, str):
        return w
    if type(w) is int:
        return w
    if type(w) is list:
        return [from_wire(x, depth + 1) for x in w]
    if type(w) is dict and len(w) == 1:
        ((tag, x),) = w.items()
        if tag == "i" and type(x) is str:
            return int(x)
        if tag == "f":
            return float(x)
        if tag == "c":
            return complex(from_wire(x[0], depth + 1), from_wire(x[1], depth + 1))
        if tag == "b" and type(x) is str:
            return bytes.fromhex(x)
        if tag == "t":
            return tuple(from_wire(y, depth + 1) for y in x)
        if tag == "s":
            return set(from_wire(y, depth + 1) for y in x)
        if tag == "fs":
            return frozenset(from_wire(y, depth + 1) for y in x)
        if tag == "d":
            return {from_wire(k, depth + 1): from_wire(y, depth + 1) for k, y in x}
    raise TypeError("malformed wire value")


# ----------------------------------------------------------------- worker (candidate side)


def worker_main():
    reply = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the candidate's prints go to the drained stderr pipe
    sys.stdout = sys.stderr

    def send(obj):
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    try:
        load = json.loads(sys.stdin.readline())
        source, entry_point = load["program"], load["entry_point"]
        namespace = {"__name__": "__candidate__", "__builtins__": builtins}
        exec(compile(source, "candidate.py", "exec"), namespace)
        fn = namespace.get(entry_point)
        if not callable(fn):
            send({"id": 0, "load_error": "no function named %r" % entry_point})
            return
    except SystemExit as exc:
        send({"id": 0, "load_error": "the program called exit(%r) while loading" % (exc.code,)})
        return
    except BaseException as exc:
        send({"id": 0, "load_error": "%s: %s" % (type(exc).__name__, str(exc)[:500])})
        return
    send({"id": 0, "ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            result = fn(*from_wire(req["args"]), **from_wire(req["kwargs"]))
            out = {"id": req["id"], "ok": to_wire(result)}
        except SystemExit as exc:
            out = {"id": req["id"], "exit": str(exc.code)[:200]}
        except BaseException as exc:
            out = {"id": req["id"], "exc": type(exc).__name__, "msg": str(exc)[:500]}
        send(out)


# ----------------------------------------------------------------- harness (trusted side)


class CandidateDied(BaseException):
    """The worker exited, crashed, timed out or broke the protocol: the run fails."""


class CandidateError(Exception):
    """The candidate raised an exception that is not a built-in one."""


def worker_process():
    """The worker as a fresh interpreter (the harness run as a script)."""
    return subprocess.Popen(
        [sys.executable, "-I", "-B", os.path.abspath(__file__), "worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        close_fds=True,
    )


_exit = os._exit  # bound now: the candidate's code may replace os._exit in the worker


class ForkedWorker:
    """The worker as a fork of this process (the zygote's way: no interpreter start-up), with
    the part of subprocess.Popen's interface the proxy uses. Fork it before the job is read:
    the fork's memory is the harness's at that moment."""

    def __init__(self):
        to_r, to_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.dup2(to_r, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                os.closerange(3, 1 << 16)
                sys.stdin = open(0, "r", encoding="utf-8", closefd=False)
                # line-buffered, as a fresh interpreter's stderr: the worker is killed,
                # never flushed, and what it printed is the verdict's `output`
                sys.stdout = sys.stderr = open(2, "w", encoding="utf-8", closefd=False,
                                               buffering=1)
                worker_main()
            finally:
                _exit(0)
        for fd in (to_r, out_w, err_w):
            os.close(fd)
        self.pid = pid
        self.returncode = None
        self.stdin = os.fdopen(to_w, "wb")
        self.stdout = os.fdopen(out_r, "rb")
        self.stderr = os.fdopen(err_r, "rb")

    def kill(self):
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass

    def wait(self):
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


class Proxy:
    def __init__(self, proc, entry_point, deadline):
        self.entry_point = entry_point
        self.deadline = deadline
        self.calls = 0
        self.fatal = None  # (status, reason), sticky
        self.stderr_tail = b""
        self.proc = proc
        self.buf = b""
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()

    def _drain(self):
        while True:
            chunk = self.proc.stderr.read(4096)
            if not chunk:
                return
            self.stderr_tail = (self.stderr_tail + chunk)[-2000:]

    def _fail(self, status, reason):
        if self.fatal is None:
            self.fatal = (status, reason)
        try:
            self.proc.kill()
        except OSError:
            pass
        raise CandidateDied(reason)

    def _read_line(self):
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = self.deadline - time.monotonic()
            if left <= 0:
                self._fail("timeout", "the candidate ran past the time budget")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait()
                self._fail(
                    "fail", "the candidate's process exited (code %s) before answering" % code
                )
            self.buf += chunk
            if len(self.buf) > MAX_LINE_BYTES:
                self._fail("fail", "the candidate sent an oversized reply")
        line, _, self.buf = self.buf.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            self._fail("fail", "the candidate broke the reply protocol")

    def load(self, program):
        """Send the worker its program; return once it has loaded (or fail the run)."""
        line = json.dumps({"program": program, "entry_point": self.entry_point}) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except OSError:
            self._fail("fail", "the candidate's process is gone")
        msg = self._read_line()
        if msg.get("id") != 0 or not msg.get("ready"):
            self._fail("fail", "program did not load: %s" % msg.get("load_error", "bad reply"))

    def __call__(self, *args, **kwargs):
        if self.fatal is not None:
            raise CandidateDied(self.fatal[1])
        self.calls += 1
        try:
            req = {"id": self.calls, "args": to_wire(list(args)), "kwargs": to_wire(dict(kwargs))}
        except TypeError as exc:
            raise HarnessUnsupported(
                "test passes an argument the harness cannot send: %s" % exc
            ) from None
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self._fail("fail", "the candidate's process is gone")
        msg = self._read_line()
        if type(msg) is not dict or msg.get("id") != self.calls:
            self._fail("fail", "the candidate broke the reply protocol")
        if "ok" in msg:
            try:
                return from_wire(msg["ok"])
            except (TypeError, ValueError, KeyError, IndexError):
                self._fail("fail", "the candidate sent a malformed value")
        if "exit" in msg:
            self._fail("fail", "the candidate called exit(%s) during a test" % msg["exit"])
        name, text = str(msg.get("exc", "Exception")), str(msg.get("msg", ""))
        cls = getattr(builtins, name, None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            raise cls(text)
        raise CandidateError("%s: %s" % (name, text))

    def close(self):
        try:
            self.proc.kill()
        except OSError:
            pass

    def output(self):
        """The end of what the candidate printed (its prints go to the drained pipe), read
        after `close`: the wait is bounded, as a child it left may hold the pipe open."""
        self._drainer.join(0.5)
        return self.stderr_tail.decode("utf-8", "replace")


class HarnessUnsupported(BaseException):
    """The tests need something this harness cannot do (not the candidate's fault)."""


def _make_non_dumpable():
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(4, 0, 0, 0, 0) == 0  # PR_SET_DUMPABLE = 4
    except Exception:
        return False


def _forget_stdin_file():
    try:
        path = os.readlink("/proc/self/fd/0")
    except OSError:
        return
    if path.startswith("/") and os.path.isfile(path):
        try:
            os.unlink(path)
        except OSError:
            pass


def run_tests(job, worker=None):
    """Run the job's tests against its program in `worker` (default: a fresh interpreter);
    (status, reason, checks, calls, output), output being the end of what the candidate
    printed."""
    deadline = time.monotonic() + float(job["timeout_s"])
    proxy = Proxy(worker or worker_process(), job["entry_point"], deadline)
    checks = []
    try:
        status, reason, calls = _run_units(job, proxy, checks)
    except HarnessUnsupported as exc:
        status, reason, calls = "error", str(exc), proxy.calls
    finally:
        proxy.close()
    return status, reason, checks, calls, proxy.output()


def _run_units(job, proxy, checks):
    """The tests, each a check appended to `checks`; (status, reason, calls)."""
    entry = job["entry_point"]
    try:
        proxy.load(job["program"])
    except CandidateDied as exc:
        status, _ = proxy.fatal
        checks.append(["loads", False, str(exc)])
        return status, str(exc), 0
    checks.append(["loads", True, ""])
    ns = {"__name__": "__tests__"}
    try:  # the trusted task prompt: helpers the tests may use (e.g. HumanEval/32's poly)
        exec(compile(job.get("prompt") or "", "prompt.py", "exec"), ns)
    except Exception:
        pass
    for setup in job.get("setup") or []:
        exec(compile(setup, "setup.py", "exec"), ns)
    ns[entry] = proxy
    ns["candidate"] = proxy
    units = []
    if job.get("test"):
        units.append(("tests", job["test"], True))
    for i, line in enumerate(job.get("test_list") or []):
        units.append(("test[%d]" % i, line, False))
    for name, code, is_check_module in units:
        try:
            exec(compile(code, name, "exec"), ns)
            if is_check_module and callable(ns.get("check")):
                ns["check"](proxy)
            ok, detail = True, ""
        except CandidateDied as exc:
            ok, detail = False, str(exc)
        except HarnessUnsupported:
            raise
        except AssertionError as exc:
            ok, detail = False, "assertion failed" + (": %s" % exc if str(exc) else "")
        except Exception as exc:
            ok, detail = False, "%s: %s" % (type(exc).__name__, str(exc)[:300])
        checks.append([name, ok, detail])
    if proxy.fatal is not None:
        status, reason = proxy.fatal
        return status, reason, proxy.calls
    if proxy.calls == 0:
        return "error", "the tests never called the candidate", 0
    failed = [c for c in checks if not c[1]]
    if failed:
        return "fail", "%s: %s" % (failed[0][0], failed[0][2]), proxy.calls
    return "pass", "all tests passed", proxy.calls


def harness_main(worker=None):
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    _forget_stdin_file()
    hardened = _make_non_dumpable()
    out = sys.stdout
    sys.stdout = sys.stderr  # prints from the tests don't mix with the result line
    status, reason, checks, calls, output = run_tests(job, worker)
    out.write(
        job["nonce"]
        + " "
        + json.dumps(
            {
                "status": status,
                "reason": reason,
                "checks": checks,
                "calls": calls,
                "hardened": hardened,
                "output": output,
            }
        )
        + "\n"
    )
    out.flush()


def zygote_entry():
    """One check in a fork of the sandbox's zygote: the worker forks before the job is read."""
    harness_main(ForkedWorker())


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "worker":
        worker_main()
    else:
        harness_main()
