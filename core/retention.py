"""What a run's stream keeps: the message log bounded by age and bytes, work never lost.

One stream is both the work queue and the message log (`core/bus.py`). It is created with
DiscardNew at its hard byte cap, so a stream that only grew would one day refuse every
publish. The keeper trims it instead: every `every_s` it purges the oldest messages that
are (a) older than `max_age_s`, or (b) past what `max_bytes` allows, but (c) never one that
a consumer of the stream has not yet acknowledged (durable work consumers and in-progress
ordered reads alike), and (d) never a weights announcement (actors read the latest at start;
they are small). Unacknowledged work therefore stays whatever the bounds say; when it alone
fills the hard cap, publishes fail loudly, as before.

The plan (`trim_point`) is pure; `keep_log_bounded` runs it against the server and writes
each trim to `<run_dir>/trimmed.jsonl`, which `reinforge log export` reports.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import trio

from reinforge.core import subjects


class LogRetention(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`[log]`: how much of its message log a run keeps (acknowledged messages only)."""

    max_age_s: float = 7 * 24 * 3600.0
    """Acknowledged messages older than this are trimmed. 0: no age bound."""
    max_bytes: int = 2 << 30
    """While the stream holds more than this, its oldest acknowledged messages are trimmed
    (down to 90 % of it). 0: no byte bound."""
    every_s: float = 30.0
    """How often the keeper looks."""

    def __post_init__(self) -> None:
        if self.max_age_s < 0 or self.max_bytes < 0:
            raise ValueError("[log] max_age_s and max_bytes must be >= 0 (0: no bound)")
        if self.every_s <= 0:
            raise ValueError(f"[log] every_s must be > 0, got {self.every_s}")


@dataclass(frozen=True)
class StreamView:
    first_seq: int
    last_seq: int
    messages: int
    bytes: int


@dataclass(frozen=True)
class ConsumerView:
    name: str
    pending: int
    """Messages matching its filter not yet delivered."""
    ack_pending: int
    ack_floor: int
    """Stream sequence up to which it acknowledged everything (for an ordered read: what
    it was handed)."""

    def holds_from(self) -> int | None:
        """The first sequence it may still need, or None when it is fully caught up."""
        if self.pending == 0 and self.ack_pending == 0:
            return None
        return self.ack_floor + 1


@dataclass(frozen=True)
class Trim:
    before_seq: int
    """Messages with a lower sequence may go (0: trim nothing)."""
    why: str
    held_by: str = ""
    """The consumer that kept the cut from going as far as the bounds wanted, if any."""


def trim_point(stream: StreamView, consumers: Sequence[ConsumerView], *, age_cut: int,
               max_bytes: int) -> Trim:
    """Where to cut: the bounds' wish (`age_cut`: the first sequence stored within the age
    bound; bytes: enough of the oldest to get under 90 % of `max_bytes`, by the stream's
    mean message size), capped at the first message any consumer still needs."""
    want, why = 0, ""
    if age_cut > stream.first_seq:
        want, why = age_cut, "age"
    if max_bytes and stream.bytes > max_bytes and stream.messages:
        mean = stream.bytes / stream.messages
        by_bytes = stream.first_seq + math.ceil((stream.bytes - 0.9 * max_bytes) / mean)
        if by_bytes > want:
            want, why = by_bytes, "bytes"
    want = min(want, stream.last_seq + 1)
    if want <= stream.first_seq:
        return Trim(0, "")
    needed = [(c.holds_from(), c.name) for c in consumers if c.holds_from() is not None]
    if needed:
        floor, holder = min(needed)
        if floor < want:
            return Trim(floor if floor > stream.first_seq else 0, why, held_by=holder)
    return Trim(want, why)


class AgeClock:
    """Which sequences are older than the age bound, from (time, last_seq) samples the
    keeper takes each pass: everything up to a sample's last_seq was stored by its time."""

    def __init__(self) -> None:
        self._samples: list[tuple[float, int]] = []

    def note(self, now: float, last_seq: int) -> None:
        self._samples.append((now, last_seq))

    def cut(self, now: float, max_age_s: float) -> int:
        """The first sequence that may be younger than `max_age_s` (0: none known older)."""
        old = [i for i, (t, _) in enumerate(self._samples) if t <= now - max_age_s]
        if not max_age_s or not old:
            return 0
        del self._samples[:old[-1]]  # the newest old sample is all that is needed of them
        return self._samples[0][1] + 1


def trimmed_subjects(run: str) -> list[str]:
    """Every stored subject family but the weights announcements."""
    return [subjects.task(run, ">"), subjects.rollout(run, ">"), subjects.scored(run, ">"),
            subjects.decision(run, ">"), subjects.stats(run, ">"), subjects.dlq(run),
            subjects.echo(run, ">")]


def trim_log_path(run_dir: Path) -> Path:
    return run_dir / "trimmed.jsonl"


async def stream_views(bus: Any, stream: str) -> tuple[StreamView, list[ConsumerView]]:
    info = await bus.stream_info(stream)
    st = info.state
    view = StreamView(first_seq=st.first_seq, last_seq=st.last_seq, messages=st.messages,
                      bytes=st.bytes)
    consumers = [
        ConsumerView(name=c.name, pending=c.num_pending or 0, ack_pending=c.num_ack_pending or 0,
                     ack_floor=(c.ack_floor.stream_seq if c.ack_floor else 0) or 0)
        for c in await bus.consumers_info(stream)
    ]
    return view, consumers


async def trim_once(bus: Any, run: str, keep: LogRetention, clock: AgeClock,
                    journal: Path | None) -> Trim:
    """One pass of the keeper; returns what it did (before_seq 0: nothing)."""
    stream = subjects.stream_name(run)
    view, consumers = await stream_views(bus, stream)
    now = time.time()
    clock.note(now, view.last_seq)
    trim = trim_point(view, consumers, age_cut=clock.cut(now, keep.max_age_s),
                      max_bytes=keep.max_bytes)
    if not trim.before_seq:
        return trim
    for family in trimmed_subjects(run):
        await bus.purge(stream, subject=family, before_seq=trim.before_seq)
    after, _ = await stream_views(bus, stream)
    if journal is not None:
        record = {"t": now, "before_seq": trim.before_seq, "why": trim.why,
                  "held_by": trim.held_by, "messages": view.messages - after.messages,
                  "bytes": view.bytes - after.bytes}
        with open(journal, "ab") as f:
            f.write(msgspec.json.encode(record) + b"\n")
    return trim


async def keep_log_bounded(bus: Any, run: str, keep: LogRetention,
                           journal: Path | None = None) -> None:
    """Trim the run's stream every `keep.every_s`, forever (the supervisor runs this). A
    failed pass (the server away, say) is said and retried next time: trimming is never
    worth stopping a run for."""
    clock, said = AgeClock(), ""
    while True:
        try:
            trim = await trim_once(bus, run, keep, clock, journal)
        except Exception as exc:  # noqa: BLE001
            print(f"log keeper: trimming {subjects.stream_name(run)} failed this pass: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        else:
            if trim.held_by and trim.held_by != said:  # e.g. the consumer of a removed actor
                print(f"log keeper: consumer {trim.held_by} has not acknowledged older "
                      f"messages, so the log stays over its [log] bound ({trim.why})",
                      file=sys.stderr, flush=True)
            said = trim.held_by
        await trio.sleep(keep.every_s)


def read_trims(journal: Path) -> list[dict[str, Any]]:
    if not journal.exists():
        return []
    out = []
    for line in journal.read_bytes().splitlines():
        try:
            out.append(msgspec.json.decode(line))
        except msgspec.DecodeError:
            continue  # a torn last line
    return out
