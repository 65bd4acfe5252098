"""Replay: feed an actor type its recorded inputs in isolation and diff its outputs.

The actor runs against a private nats-server and in a scratch home: a fresh temporary
directory set as $REINFORGE_HOME for the replay, so its run directory (state, checkpoints,
journals) is `<scratch>/<run>/`, never the live run's. A path in its config that points into
the live run's directory is rewritten to the same place in the scratch home, and what it
names is copied there first (a learner given the live `checkpoint_dir` resumes from a copy);
paths left to their defaults start empty (a fresh actor). The live run's files are read,
never written. The scratch home is removed afterwards unless `keep_home`. Its inputs
are the log records on its input subjects; the recorded outputs are the records that an
actor of the same type stored (every durable publish carries the writer's type in the
`Rf-Actor-Type` header). Outputs are matched by their deterministic `Nats-Msg-Id` and
compared as decoded messages, ignoring fields that differ by nature between two runs
(`IGNORED_FIELDS`). Any other difference is non-determinism or a behaviour change, and
is what the user asked to see.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from reinforge.core import paths, subjects
from reinforge.core.actor import ORIGIN_HEADER, ActorContext, run_actor
from reinforge.core.bus import open_bus
from reinforge.core.messages import MessageError, decode, to_builtins
from reinforge.core.msglog import LogRecord, subject_matches
from reinforge.core.natsd import EmbeddedNats

# Fields that differ between two runs by nature: send times, who answered, and the measured
# durations of a rollout's stages (`Rollout.timings`: queueing, generation, verification).
IGNORED_FIELDS = frozenset({"sent_at", "actor_id", "verifier_id", "timings"})


@dataclass
class ReplayResult:
    inputs: int
    recorded_outputs: int
    replayed_outputs: int
    missing: list[str] = field(default_factory=list)  # recorded, not produced
    extra: list[str] = field(default_factory=list)  # produced, not recorded
    changed: list[tuple[str, str]] = field(default_factory=list)  # (msg id, diff text)
    scratch_home: str = ""  # where the replayed actor's files were kept ("" = removed)

    @property
    def identical(self) -> bool:
        return not (self.missing or self.extra or self.changed)


def run_of(records: list[LogRecord]) -> str:
    for rec in records:
        parts = rec.subject.split(".")
        if len(parts) > 2 and parts[0] == "rl":
            return parts[1]
    raise ValueError("the log holds no rl.<run>.* records")


def normalise(payload: bytes) -> Any:
    try:
        msg = decode(payload)
    except MessageError:
        return {"undecodable": payload.hex()}
    return _strip(to_builtins(msg))


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in IGNORED_FIELDS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def diff_text(recorded: Any, replayed: Any, path: str = "$") -> list[str]:
    """Readable differences between two decoded messages, located like msgspec errors."""
    if isinstance(recorded, dict) and isinstance(replayed, dict):
        out = []
        for key in sorted(set(recorded) | set(replayed)):
            if key not in replayed:
                out.append(f"{path}.{key}: recorded {recorded[key]!r}, replay has no such field")
            elif key not in recorded:
                out.append(f"{path}.{key}: replay added {replayed[key]!r}")
            else:
                out += diff_text(recorded[key], replayed[key], f"{path}.{key}")
        return out
    if isinstance(recorded, list) and isinstance(replayed, list) and len(recorded) == len(replayed):
        out = []
        for i, (a, b) in enumerate(zip(recorded, replayed)):
            out += diff_text(a, b, f"{path}[{i}]")
        return out
    if recorded != replayed:
        return [f"{path}: recorded {_short(recorded)} != replayed {_short(replayed)}"]
    return []


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 160 else text[:157] + "..."


async def replay(
    records: list[LogRecord],
    cls: type,
    config: Any,
    *,
    only: str = "",
    idle_s: float = 3.0,
    timeout_s: float = 300.0,
    workdir: Path | None = None,
    keep_home: bool = False,
) -> ReplayResult:
    run = run_of(records)
    live_run = paths.run_dir(run)
    home = Path(tempfile.mkdtemp(prefix=f"reinforge-replay-{run}-", dir=workdir))
    say(f"{cls.actor_type} runs in scratch home {home} "
        f"({'kept' if keep_home else 'removed'} afterwards); the live run's files in "
        f"{live_run} are read, never written")
    try:
        config = confined_config(config if config is not None else cls.Config(),
                                 live_run, home / run)
        with tempfile.TemporaryDirectory(dir=workdir) as tmp, reinforge_home(home):
            server = EmbeddedNats(data_dir=Path(tmp) / "nats").start()
            try:
                result = await _replay_on(server, records, cls, config, run, only, idle_s,
                                          timeout_s)
            finally:
                server.stop()
    finally:
        if not keep_home:
            shutil.rmtree(home, ignore_errors=True)
    result.scratch_home = str(home) if keep_home else ""
    return result


def say(text: str) -> None:
    print(f"replay: {text}", file=sys.stderr, flush=True)


@contextmanager
def reinforge_home(home: Path) -> Iterator[None]:
    """$REINFORGE_HOME = `home` while the replay runs: the actor, and any process it starts,
    finds its run directory through it (`core/paths.py`). Process-wide, which is why the
    replay sets it only around the actor and puts it back after."""
    before = os.environ.get("REINFORGE_HOME")
    os.environ["REINFORGE_HOME"] = str(home)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("REINFORGE_HOME", None)
        else:
            os.environ["REINFORGE_HOME"] = before


def confined_config(config: Any, live_run: Path, scratch_run: Path) -> Any:
    """`config` with every path into the live run's directory moved to the same place under
    `scratch_run`, what it names copied there first: the actor reads copies of the live
    run's files and writes only into the scratch home."""
    moved = False

    def confine(value: Any) -> Any:
        nonlocal moved
        if isinstance(value, dict):
            return {k: confine(v) for k, v in value.items()}
        if isinstance(value, list):
            return [confine(v) for v in value]
        inside = path_inside(value, live_run) if isinstance(value, str) else None
        if inside is None:
            return value
        target = scratch_run / inside
        if inside != Path("."):  # the run directory itself starts empty, like the defaults
            copy_for_replay(Path(value), target)
        say(f"config path {value} -> {target}")
        moved = True
        return str(target)

    data = confine(msgspec.to_builtins(config))
    return msgspec.convert(data, type(config)) if moved else config


def path_inside(text: str, root: Path) -> Path | None:
    """`text` relative to `root` when it is a path to something inside it. A string without
    a separator is a name ("math", "*"), not a path."""
    if os.sep not in text:
        return None
    try:
        return Path(text).resolve().relative_to(root.resolve())
    except (ValueError, OSError):
        return None


def copy_for_replay(src: Path, dst: Path) -> None:
    try:
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True,
                            copy_function=_copy_unless_gone)
        elif src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    except (OSError, shutil.Error) as exc:
        raise ValueError(f"replay: cannot copy {src} (named in the actor's config) into the "
                         f"scratch home: {exc}") from None


def _copy_unless_gone(src: str, dst: str) -> str:
    try:
        return shutil.copy2(src, dst)
    except FileNotFoundError:  # the live actor removed it meanwhile (e.g. a temp file)
        return dst


async def _replay_on(
    server: EmbeddedNats, records: list[LogRecord], cls: type, config: Any, run: str,
    only: str, idle_s: float, timeout_s: float,
) -> ReplayResult:
    async with open_bus(server.credentials, name="replay") as bus:
        stream = await bus.ensure_run_stream(run)
        probe_ctx = ActorContext(bus=bus, run=run, actor_type=cls.actor_type,
                                 actor_id="replay-probe", stream=stream)
        filters = [inp.subject for inp in cls(probe_ctx, config).inputs()]
        if only:
            filters = [f for f in filters if subject_matches(only, f) or f == only] or [only]

        def is_input(subject: str) -> bool:
            return any(subject_matches(f, subject) for f in filters)

        inputs = [r for r in records if is_input(r.subject)]
        recorded = {
            r.msg_id or f"{r.subject}#{r.stream_seq}": r for r in records
            if r.headers.get(ORIGIN_HEADER) == cls.actor_type and not is_input(r.subject)
        }
        produced: dict[str, bytes] = {}
        last_output = [trio.current_time()]

        async def capture(sub: Any) -> None:
            async for batch in sub:
                for raw in batch:
                    headers = raw.headers or {}
                    if headers.get(ORIGIN_HEADER) != cls.actor_type or is_input(raw.subject):
                        continue
                    key = headers.get("Nats-Msg-Id") or f"{raw.subject}#{len(produced)}"
                    produced[key] = raw.data
                    last_output[0] = trio.current_time()

        async with bus.subscribe(subjects.data_wildcard(run)) as sub, trio.open_nursery() as n:
            n.start_soon(capture, sub)
            for i, rec in enumerate(inputs):  # into the private stream, in recorded order
                await bus.publish_durable_raw(rec.subject, rec.payload,
                                              rec.msg_id or f"replay:{rec.stream_seq}:{i}")
            await n.start(functools.partial(
                run_actor, cls, creds=server.credentials, run=run, config=config,
                actor_id=f"{cls.actor_type}-replay",
            ))
            with trio.move_on_after(timeout_s):
                while True:
                    await trio.sleep(0.25)
                    quiet = trio.current_time() - last_output[0] > idle_s
                    if quiet and await _inputs_settled(bus, stream):
                        break
            n.cancel_scope.cancel()

    result = ReplayResult(inputs=len(inputs), recorded_outputs=len(recorded),
                          replayed_outputs=len(produced))
    for key in sorted(set(recorded) | set(produced)):
        if key not in produced:
            result.missing.append(key)
        elif key not in recorded:
            result.extra.append(key)
        else:
            lines = diff_text(normalise(recorded[key].payload), normalise(produced[key]))
            if lines:
                result.changed.append((key, "\n".join(lines)))
    return result


async def _inputs_settled(bus: Any, stream: str) -> bool:
    """True when no durable consumer of the private stream has work pending or in flight."""

    async def check() -> bool:
        infos = await bus._js.consumers_info(stream)
        return all(i.num_pending == 0 and i.num_ack_pending == 0 for i in infos)

    return await bus.aio(check)()


def format_result(result: ReplayResult, limit: int = 20) -> str:
    lines = [
        f"inputs replayed: {result.inputs}; outputs recorded: {result.recorded_outputs}, "
        f"replayed: {result.replayed_outputs}"
    ]
    for key in result.missing[:limit]:
        lines.append(f"- missing (recorded, not produced): {key}")
    for key in result.extra[:limit]:
        lines.append(f"+ extra (produced, not recorded): {key}")
    for key, text in result.changed[:limit]:
        lines.append(f"~ differs: {key}")
        lines += [f"    {line}" for line in text.splitlines()]
    hidden = len(result.missing) + len(result.extra) + len(result.changed) - 3 * limit
    if hidden > 0:
        lines.append(f"... and more ({hidden} not shown)")
    if result.scratch_home:
        lines.append(f"scratch home (kept): {result.scratch_home}")
    lines.append("identical" if result.identical else "DIFFERENT")
    return "\n".join(lines)


def result_json(result: ReplayResult) -> dict[str, Any]:
    return msgspec.to_builtins({
        "identical": result.identical, "inputs": result.inputs,
        "recorded_outputs": result.recorded_outputs, "replayed_outputs": result.replayed_outputs,
        "missing": result.missing, "extra": result.extra,
        "changed": [{"msg_id": k, "diff": d} for k, d in result.changed],
        "scratch_home": result.scratch_home,
    })
