"""Several tasks in one exec: what lets the pool pay Podman's exec cost once for a few jobs.

Each task gets exactly what `Sandbox.run_task` gives it, by the same code: its part of the
wrapper is `task_script` (a checked reset before it: no process of the candidate uid, nothing in
any writable dir; its own files and stdin; its own rlimits; everything it left behind killed
when it ends; its markers, per-task random nonces) and the exec is driven by `Sandbox.execute`
(each task's own output, deadline and status, by the rules of a single task). The nonces and
every task's files sit in the wrapper's environment, which candidate processes can't read
because the wrapper is non-dumpable (PROTECTED_SHELL) and each task's subshell unsets them
before exec: batching is only offered on images that have the protected shell.

When a task times out, floods or blows the memory watchdog, the container is killed: that task
gets its result, the tasks after it get None (not run; the pool runs them elsewhere).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

from reinforge.envs.sandbox.box import (
    MAX_INLINE_BYTES,
    PROTECTED_SHELL,
    Job,
    RunResult,
    Sandbox,
    inline_inputs,
    make_tar,
    new_mark,
    task_script,
)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def inline_size(task: Job) -> int:
    """Bytes this task adds to the exec's environment (files + stdin, base64)."""
    raw = sum(len(v) for v in task.files.values()) + len(task.stdin)
    raw += sum(len(a) for a in task.argv) + sum(len(k) + len(v) for k, v in task.env.items())
    return raw * 4 // 3 + 2048


def can_batch(box: Sandbox) -> bool:
    return box.shell == PROTECTED_SHELL


def run_batch(box: Sandbox, tasks: Sequence[Job]) -> list[RunResult | None]:
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
    marks: list[str] = []
    timeouts: list[float] = []
    for i, t in enumerate(tasks):
        for k in t.env:
            if not _NAME.match(k):
                raise ValueError(f"task {i}: env name {k!r} is not a valid identifier")
        timeout_s = cfg.timeout_s if t.timeout_s is None else float(t.timeout_s)
        timeouts.append(timeout_s)
        marks.append(new_mark())
        inputs, unpack, stdin_path = inline_inputs(
            make_tar(t.files) if t.files else b"", t.stdin, f"{i}_"
        )
        env.update(inputs)
        env[f"RF_M{i}"] = marks[-1]
        env[f"RF_A{i}"] = " ".join(shlex.quote(a) for a in t.argv)
        env[f"RF_E{i}"] = "; ".join(f"export {k}={shlex.quote(v)}" for k, v in t.env.items())
        names += [f"RF_M{i}", f"RF_A{i}", f"RF_E{i}", *inputs]
        command = (
            f'eval "$RF_E{i}"; a="$RF_A{i}"; unset RF_UID ALLNAMES; '
            + box.limits_prefix(timeout_s)
            + f'cd {cfg.work_dir} || exit 126; eval "set -- $a"; '
            + f'exec nice -n {cfg.nice} "$@" <{stdin_path}'
        )
        parts.append(task_script(f"RF_M{i}", unpack, command))
    script = "".join(parts).replace("ALLNAMES", " ".join(names)) + "exit 0\n"
    return box.execute([box.shell, "-c", script], env, timeouts=timeouts, marks=marks)


def run_tasks(box: Sandbox, tasks: Sequence[Job] | Sequence[Mapping]) -> list[RunResult | None]:
    """`run_batch` for a batch of one or more (a single task goes through `run_task`)."""
    tasks = [t if isinstance(t, Job) else Job(**t) for t in tasks]
    if len(tasks) == 1 or not can_batch(box):
        t = tasks[0]
        return [box.run_task(t.files, t.argv, stdin=t.stdin, env=t.env, timeout_s=t.timeout_s)]
    return run_batch(box, tasks)
