"""Several tasks in one exec: what lets the pool pay Podman's exec cost once for a few jobs.

Each task gets exactly what `Sandbox.run_task` gives it: a checked reset before it (no process
of the candidate uid, nothing in any writable dir), its own files and stdin, its own rlimits and
deadline, and everything it left behind killed when it ends. The wrapper prints a start marker
and an end marker with the status per task (per-task random nonces) on stdout, and an end marker
on stderr; the host splits both streams by them. The nonces and every task's files sit in the
wrapper's environment, which candidate processes can't read because the wrapper is
non-dumpable (PROTECTED_SHELL) and each task's subshell unsets them before exec: batching is
only offered on images that have the protected shell.

When a task times out, floods or blows the memory watchdog, the container is killed: that task
gets its result, the tasks after it get None (not run; the pool runs them elsewhere).
"""

from __future__ import annotations

import base64
import re
import secrets
import shlex
import threading
import time
from collections.abc import Mapping, Sequence

import msgspec

from reinforge.envs.sandbox import (
    _ENV_CHUNK,
    _MEMORY_MARKERS,
    _RESET_SCRIPT,
    MAX_INLINE_BYTES,
    PROTECTED_SHELL,
    STDIN_DIR,
    LimitMechanism,
    Outcome,
    RunResult,
    Sandbox,
    SandboxInfraError,
    _frames,
    make_tar,
    rss_of_host_uid,
)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class Task(msgspec.Struct, frozen=True, kw_only=True):
    files: dict[str, str | bytes] = {}
    argv: list[str]
    stdin: bytes = b""
    env: dict[str, str] = {}
    timeout_s: float | None = None


def inline_size(task: Task) -> int:
    """Bytes this task adds to the exec's environment (files + stdin, base64)."""
    raw = sum(len(v) for v in task.files.values()) + len(task.stdin)
    raw += sum(len(a) for a in task.argv) + sum(len(k) + len(v) for k, v in task.env.items())
    return raw * 4 // 3 + 2048


def can_batch(box: Sandbox) -> bool:
    return box.shell == PROTECTED_SHELL


def _chunks(blob: bytes) -> list[str]:
    text = base64.b64encode(blob).decode()
    return [text[i : i + _ENV_CHUNK] for i in range(0, len(text), _ENV_CHUNK)]


class _Stream:
    """Splits one output stream (stdout or stderr) into per-task parts by the markers."""

    def __init__(self, marks: list[bytes], *, with_start: bool, with_status: bool, cap: int):
        self.marks = marks
        self.with_start = with_start
        self.with_status = with_status
        self.cap = cap
        self.index = 0
        self.started = not with_start
        self.pending = bytearray()
        self.kept: list[bytearray] = [bytearray() for _ in marks]
        self.counts = [0] * len(marks)
        self.status: list[int | None] = [None] * len(marks)
        self.on_start = None  # callback(index)
        self.on_end = None  # callback(index)

    def _commit(self, data: bytes) -> None:
        i = self.index
        self.counts[i] += len(data)
        room = self.cap - len(self.kept[i])
        if room > 0:
            self.kept[i].extend(data[:room])

    def feed(self, data: bytes) -> None:
        self.pending.extend(data)
        while self.index < len(self.marks):
            mark = self.marks[self.index]
            if not self.started:
                start = mark + b"\n"
                if len(self.pending) < len(start):
                    return
                if bytes(self.pending[: len(start)]) != start:
                    raise SandboxInfraError("batch: task start marker missing (set-up failed)")
                del self.pending[: len(start)]
                self.started = True
                if self.on_start:
                    self.on_start(self.index)
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
                    raise SandboxInfraError("batch: malformed end marker")
                self.status[self.index] = int(digits)
                stop = nl + 1
            else:
                stop = at + len(end)
            self._commit(bytes(self.pending[:at]))
            del self.pending[:stop]
            if self.on_end:
                self.on_end(self.index)
            self.index += 1
            self.started = not self.with_start

    def flush_current(self) -> None:
        """The stream ended mid-task: what is pending belongs to the current task."""
        if self.index < len(self.marks) and self.started and self.pending:
            self._commit(bytes(self.pending))
            self.pending.clear()


def run_batch(box: Sandbox, tasks: Sequence[Task]) -> list[RunResult | None]:
    """Run `tasks` one after another in one exec of `box`. None: not run (the box died first).

    Raises SandboxInfraError when the exec could not run at all (and marks the box unhealthy).
    """
    cfg = box.config
    if not can_batch(box):
        raise ValueError("batching needs an image with the protected wrapper shell")
    if sum(inline_size(t) for t in tasks) > MAX_INLINE_BYTES:
        raise ValueError(f"batch over {MAX_INLINE_BYTES} bytes inline: split it")
    env: dict[str, str] = {"RF_UID": str(box.uid)}
    names: list[str] = []
    parts: list[str] = []
    marks: list[bytes] = []
    timeouts: list[float] = []
    for i, t in enumerate(tasks):
        for k in t.env:
            if not _NAME.match(k):
                raise ValueError(f"task {i}: env name {k!r} is not a valid identifier")
        timeout_s = cfg.timeout_s if t.timeout_s is None else float(t.timeout_s)
        timeouts.append(timeout_s)
        mark = f"reinforge-{secrets.token_hex(16)}"
        marks.append(mark.encode())
        env[f"RF_M{i}"] = mark
        env[f"RF_A{i}"] = " ".join(shlex.quote(a) for a in t.argv)
        env[f"RF_E{i}"] = "; ".join(f"export {k}={shlex.quote(v)}" for k, v in t.env.items())
        names += [f"RF_M{i}", f"RF_A{i}", f"RF_E{i}"]
        unpack = []
        for tag, blob, dest in (
            ("F", make_tar(t.files) if t.files else b"", "/work"),
            ("S", make_tar({"stdin": t.stdin}) if t.stdin else b"", STDIN_DIR),
        ):
            if not blob:
                continue
            keys = [f"RF_{tag}{i}_{c}" for c in range(len(_chunks(blob)))]
            env.update(zip(keys, _chunks(blob), strict=True))
            names += keys
            quoted = " ".join(f'"${k}"' for k in keys)
            unpack.append(
                f"printf %s {quoted} | base64 -d | tar -x -m -C {dest} "
                f'|| {{ echo "reinforge: unpacking into {dest} failed" >&2; exit 1; }}'
            )
        stdin_path = f"{STDIN_DIR}/stdin" if t.stdin else "/dev/null"
        parts.append(
            _RESET_SCRIPT
            + "\n".join(unpack)
            + f'\nprintf "%s\\n" "$RF_M{i}"\n'
            + f'( eval "$RF_E{i}"; a="$RF_A{i}"; unset RF_UID ALLNAMES; '
            + box._limits_prefix(timeout_s)
            + f'cd {cfg.work_dir} || exit 126; eval "set -- $a"; '
            + f'exec nice -n {cfg.nice} "$@" <{stdin_path} )\n'
            + "st=$?\nkill -KILL -1 2>/dev/null\n"
            + f'printf "\\n%s %d\\n" "$RF_M{i}" "$st"; printf "\\n%s\\n" "$RF_M{i}" >&2\n'
        )
    script = "".join(parts).replace("ALLNAMES", " ".join(names)) + "exit 0\n"
    return _drive(box, [box.shell, "-c", script], env, marks, timeouts, tasks)


def _drive(box: Sandbox, argv, env, marks, timeouts, tasks) -> list[RunResult | None]:
    cfg = box.config
    n = len(tasks)
    box.runs += n
    out = _Stream(marks, with_start=True, with_status=True, cap=cfg.max_output_bytes)
    err = _Stream(marks, with_start=False, with_status=False, cap=cfg.max_output_bytes)
    started_at: list[float | None] = [None] * n
    ended_at: list[float | None] = [None] * n
    fired: dict[str, int | None] = {"timeout": None, "flood": None, "memory": None}
    lock = threading.Lock()
    timer: list[threading.Timer | None] = [None]
    peak_rss = [0]

    def kill_for(reason: str) -> None:
        with lock:
            if any(v is not None for v in fired.values()):
                return
            fired[reason] = out.index
        box._kill()

    def on_start(i: int) -> None:
        started_at[i] = time.monotonic()
        if timer[0]:
            timer[0].cancel()
        timer[0] = threading.Timer(timeouts[i], kill_for, args=("timeout",))
        timer[0].start()

    def on_end(i: int) -> None:
        ended_at[i] = time.monotonic()
        if timer[0]:
            timer[0].cancel()

    out.on_start, out.on_end = on_start, on_end
    exec_id, start = box._exec_start(argv, env)
    stop_watch = threading.Event()
    if box.limits is LimitMechanism.RLIMIT and box.host_uid is not None:

        def watch_memory() -> None:
            while not stop_watch.wait(cfg.memory_poll_s):
                rss = rss_of_host_uid(box.host_uid)
                peak_rss[0] = max(peak_rss[0], rss)
                if rss > cfg.memory_bytes:
                    kill_for("memory")
                    return

        threading.Thread(target=watch_memory, daemon=True).start()
    killed = lambda: any(v is not None for v in fired.values())
    try:
        for kind, chunk in _frames(start.raw):
            if kind == 2:
                err.feed(chunk)
            else:
                out.feed(chunk)
            i = out.index
            if i < n and out.counts[i] + err.counts[min(i, n - 1)] > cfg.max_drained_bytes:
                kill_for("flood")
    except SandboxInfraError:
        box.healthy = False
        raise
    except Exception as exc:
        if not killed():
            box.healthy = False
            raise SandboxInfraError(
                f"reading output from sandbox {box.name} failed: {exc}"
            ) from exc
    finally:
        if timer[0]:
            timer[0].cancel()
        stop_watch.set()
        start.close()
    now = time.monotonic()
    out.flush_current()
    err.flush_current()
    if started_at[0] is None and not killed():
        box.healthy = False
        raise SandboxInfraError(
            f"task set-up failed in sandbox {box.name}: "
            f"{bytes(err.kept[0][-500:]).decode(errors='replace')}"
        )
    last = out.index  # tasks before `last` ended normally
    wrapper_code: int | None = None
    if last < n:
        box.dirty = True
        try:
            wrapper_code = box._exec_inspect(exec_id).get("ExitCode")
        except Exception:
            wrapper_code = None
        if not killed() and not box._alive():
            box.healthy = False
    results: list[RunResult | None] = []
    for i in range(n):
        if i > last or (i == last and started_at[i] is None):
            results.append(None)
            continue
        ran_s = (ended_at[i] or now) - (started_at[i] or now)
        if i < last:
            code = out.status[i]
            why = None
        else:
            why = next((k for k, v in fired.items() if v == i), None)
            if why is None and not box.healthy:
                results.append(None)  # the container died under us: not the candidate's doing
                continue
            code = 137 if why else (wrapper_code if wrapper_code is not None else 137)
        results.append(_result(box, i, code, why, ran_s, out, err, timeouts[i], peak_rss[0]))
    return results


def _result(box, i, code, why, ran_s, out, err, timeout_s, peak_rss) -> RunResult:
    cfg = box.config
    tail = bytes(err.kept[i][-512:])
    timed_out = why == "timeout" or code == 128 + 24
    oom = why == "memory" or (
        code not in (0, None) and not timed_out and any(m in tail for m in _MEMORY_MARKERS)
    )
    if timed_out:
        status, detail = Outcome.TIMEOUT, f"killed at the {timeout_s:g} s deadline"
    elif why == "flood":
        status = Outcome.OUTPUT_LIMIT
        detail = f"killed after {out.counts[i] + err.counts[i]} bytes of output"
    elif oom:
        status = Outcome.MEMORY_LIMIT
        detail = (
            f"killed by the host memory watchdog at {peak_rss} bytes" if why == "memory" else ""
        )
    else:
        status, detail = (Outcome.OK if code == 0 else Outcome.NONZERO_EXIT), ""
    return RunResult(
        status=status,
        exit_code=code,
        stdout=bytes(out.kept[i]),
        stderr=bytes(err.kept[i]),
        stdout_bytes=out.counts[i],
        stderr_bytes=err.counts[i],
        duration_s=ran_s,
        timed_out=timed_out,
        oom_killed=oom,
        output_truncated=out.counts[i] > cfg.max_output_bytes
        or err.counts[i] > cfg.max_output_bytes,
        limits=box.limits,
        image=cfg.image,
        detail=detail,
    )


def run_tasks(box: Sandbox, tasks: Sequence[Task] | Sequence[Mapping]) -> list[RunResult | None]:
    """`run_batch` for a batch of one or more (a single task goes through `run_task`)."""
    tasks = [t if isinstance(t, Task) else Task(**t) for t in tasks]
    if len(tasks) == 1 or not can_batch(box):
        t = tasks[0]
        return [box.run_task(t.files, t.argv, stdin=t.stdin, env=t.env, timeout_s=t.timeout_s)]
    return run_batch(box, tasks)
