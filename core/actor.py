"""The actor runtime: an actor is a class with typed handlers; the runtime owns the rest.

What the runtime owns, so that no actor has to:
  * the trio nursery and the bus connection;
  * intake: one loop per `Input` (a JetStream durable pull consumer, or a core
    subscription), fetching only as much as there are free handler slots
    (bounded concurrency = backpressure);
  * typed decoding and the dead-letter path: a malformed payload, an unexpected
    message type, a `Reject` from a handler, or a message that failed
    `max_deliver` times goes to `rl.<run>.dlq` with its reason and is counted;
  * settlement: a durable message is acked after its handler returned (so after
    whatever the handler published durably was acknowledged), nak'ed with a delay
    when the handler raised, and nak'ed at once when a stop cut it short;
  * heartbeats with psutil figures and *what the actor is waiting on*;
  * graceful stop on SIGTERM/SIGINT or a `Stop` message: intake stops, in-flight
    work gets `drain_timeout_s` to finish, the rest is nak'ed for redelivery.

An actor never holds a reference to another actor, only to subjects.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import psutil
import trio

from reinforge.core import subjects
from reinforge.core.bus import Bus, Delivery, PullConsumer, open_bus
from reinforge.core.messages import (
    Announce,
    DeadLetter,
    Heartbeat,
    MessageError,
    ProcessFigures,
    Stop,
    decode,
)
from reinforge.core.natsd import NatsCredentials


ORIGIN_HEADER = "Rf-Actor-Type"


class Retry(Exception):
    """Raised by a handler: not now, redeliver after `delay_s` (not a failure of the message)."""

    def __init__(self, reason: str, delay_s: float = 1.0) -> None:
        super().__init__(reason)
        self.delay_s = delay_s


class Reject(Exception):
    """Raised by a handler: this message can never be handled; dead-letter it with the reason."""


class NoConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


@dataclass(frozen=True)
class Input:
    """One stream of messages an actor consumes.

    `durable=True`: a JetStream pull consumer named after `group` (default: the actor
    type), so replicas of one actor type share the work and nothing is lost while
    none is running. `durable=False`: a core NATS subscription (at most once), in a
    queue group when `group` is set. `manual_ack=True` hands the handler a `Ticket`
    to settle the message itself (the learner acks only after its checkpoint).
    """

    subject: str
    handler: Callable[..., Awaitable[None]]
    accepts: tuple[type, ...] = ()
    durable: bool = True
    group: str = ""
    concurrency: int = 1
    batch: int = 64
    ack_wait_s: float = 30.0
    max_deliver: int = 5
    retry_delay_s: float = 1.0
    manual_ack: bool = False
    deliver_new: bool = False
    filters: tuple[str, ...] = ()
    """Several subjects through one consumer (one intake, one `concurrency` budget), e.g.
    the tasks of a hundred domains; `subject` then only names the input."""

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"Input({self.subject}): concurrency must be >= 1")
        if self.batch < 1:
            raise ValueError(f"Input({self.subject}): batch must be >= 1")
        if self.manual_ack and not self.durable:
            raise ValueError(f"Input({self.subject}): manual_ack needs a durable input")
        if self.filters and not self.durable:
            raise ValueError(f"Input({self.subject}): filters need a durable input")


class RuntimeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    heartbeat_s: float = 2.0
    """How often the actor publishes a heartbeat (the watchdog's clock)."""
    drain_timeout_s: float = 10.0
    """On stop, how long in-flight work may run before it is nak'ed for redelivery."""
    stream_max_bytes: int = -1
    """Byte cap of the run's stream (-1: the server's store limit; past it publishes fail)."""


class Ticket:
    """Settle one durable delivery by hand (manual_ack inputs)."""

    __slots__ = ("_consumer", "_acks", "delivery", "settled")

    def __init__(self, consumer: PullConsumer, delivery: Delivery,
                 acks: _AckBatcher | None = None) -> None:
        self._consumer = consumer
        self._acks = acks  # acks of handlers finishing together share one bridge crossing
        self.delivery = delivery
        self.settled = False

    @property
    def stream_seq(self) -> int:
        return self.delivery.stream_seq

    @property
    def num_delivered(self) -> int:
        return self.delivery.num_delivered

    async def ack(self) -> None:
        if not self.settled:
            self.settled = True
            if self._acks is not None:
                await self._acks.ack(self.delivery)
            else:
                await self._consumer.ack([self.delivery])

    async def nak(self, delay_s: float | None = None) -> None:
        if not self.settled:
            self.settled = True
            await self._consumer.nak([self.delivery], delay_s)

    async def in_progress(self) -> None:
        if not self.settled:
            await self._consumer.in_progress([self.delivery])

    async def term(self) -> None:
        """Never redeliver (after the caller dead-lettered it with its reason)."""
        if not self.settled:
            self.settled = True
            await self._consumer.term([self.delivery])


async def ack_all(tickets: list[Ticket]) -> None:
    """Ack many tickets in one bridge crossing per consumer."""
    by_consumer: dict[int, tuple[PullConsumer, list[Delivery]]] = {}
    for t in tickets:
        if not t.settled:
            t.settled = True
            by_consumer.setdefault(id(t._consumer), (t._consumer, []))[1].append(t.delivery)
    for consumer, deliveries in by_consumer.values():
        await consumer.ack(deliveries)


class ActorContext:
    """What an actor may touch: its identity, its run's subjects, and the bus."""

    def __init__(self, *, bus: Bus, run: str, actor_type: str, actor_id: str, stream: str) -> None:
        self.bus = bus
        self.run = run
        self.actor_type = actor_type
        self.actor_id = actor_id
        self.stream = stream
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.started_at = time.time()
        self.counts: collections.Counter[str] = collections.Counter()
        self._waits: dict[int, tuple[str, float, float]] = {}
        self._next_wait = 0
        self.stop_requested = trio.Event()
        self.state = "starting"
        # Stored with every durable publish, so `replay` knows which actor type wrote what.
        self._origin = {ORIGIN_HEADER: actor_type, "Rf-Actor-Id": actor_id}

    async def publish(self, subject: str, msg: Any) -> None:
        await self.bus.publish(subject, msg)
        self.counts["msgs_out"] += 1

    async def publish_durable(self, subject: str, msg: Any, msg_id: str) -> None:
        with self.waiting(f"ack from the bus for {subject}", deadline_s=120):
            await self.bus.publish_durable(subject, msg, msg_id, headers=self._origin)
        self.counts["msgs_out"] += 1

    async def publish_durable_many(self, items: list[tuple[str, Any, str]]) -> None:
        """Store several `(subject, msg, msg_id)` in order, in one trip to the bus."""
        with self.waiting(f"ack from the bus for {len(items)} messages", deadline_s=120):
            await self.bus.publish_durable_many(items, headers=self._origin)
        self.counts["msgs_out"] += len(items)

    async def dead_letter(
        self, subject: str, data: bytes, reason: str, *, stream_seq: int = 0, deliveries: int = 0
    ) -> None:
        """Record an unhandleable message in the run's dead-letter subject."""
        self.counts["dead_letters"] += 1
        letter = DeadLetter(
            subject=subject,
            reason=reason,
            actor_id=self.actor_id,
            payload=data[: 1 << 20],
            stream_seq=stream_seq,
            deliveries=deliveries,
        )
        # A stored message is dead-lettered once per actor type, however often it comes
        # back; a core NATS message is never redelivered, so each receipt is its own entry
        # (two identical bad messages are two letters, not one).
        key = f"{stream_seq}" if stream_seq else f"{self.actor_id}:{uuid.uuid4().hex}"
        await self.bus.publish_durable(
            subjects.dlq(self.run), letter, msg_id=f"dlq:{self.actor_type}:{subject}:{key}",
            headers=self._origin,
        )

    @contextlib.contextmanager
    def waiting(self, what: str, deadline_s: float = 0.0) -> Iterator[None]:
        """Declare what this task is blocked on; heartbeats and `status` show it."""
        self._next_wait += 1
        token = self._next_wait
        self._waits[token] = (what, time.time(), deadline_s)
        try:
            yield
        finally:
            del self._waits[token]

    def current_wait(self) -> tuple[str, float, float]:
        """The wait most worth showing: overdue first, then ones with a deadline, then oldest."""
        if not self._waits:
            return ("", 0.0, 0.0)
        now = time.time()

        def rank(w: tuple[str, float, float]) -> tuple[int, float]:
            what, since, deadline = w
            overdue = deadline > 0 and now - since > deadline
            return (0 if overdue else 1 if deadline > 0 else 2, since)

        return min(self._waits.values(), key=rank)


class Actor:
    """Base class. Subclasses set `actor_type`, a `Config` Struct, and `inputs()`."""

    actor_type: ClassVar[str] = "actor"
    Config: ClassVar[type[msgspec.Struct]] = NoConfig

    def __init__(self, ctx: ActorContext, config: Any) -> None:
        self.ctx = ctx
        self.config = config

    def inputs(self) -> list[Input]:
        return []

    def capabilities(self) -> list[str]:
        return []

    async def setup(self) -> None:
        """Before intake starts (open files, load models, ...)."""

    async def main(self) -> None:
        """An optional long-running loop beside the inputs (sources, schedulers).
        Returning from it does not stop the actor."""

    async def teardown(self) -> None:
        """After intake stopped and in-flight work settled."""

    def figures(self) -> dict[str, float]:
        """Actor-specific figures for heartbeats (e.g. queue depths)."""
        return {}


def make_actor_id(actor_type: str) -> str:
    return f"{actor_type}-{socket.gethostname()[:16]}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


async def run_actor(
    cls: type[Actor],
    *,
    creds: NatsCredentials | str,
    run: str,
    config: Any = None,
    actor_id: str = "",
    runtime: RuntimeConfig = RuntimeConfig(),
    handle_signals: bool = False,
    allow_no_auth: bool = False,
    task_status: trio.TaskStatus[ActorContext] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run one actor until it is stopped (Stop message, signal, or cancellation)."""
    subjects.check_token(run, "run name")
    config = config if config is not None else cls.Config()
    actor_id = actor_id or make_actor_id(cls.actor_type)
    async with open_bus(creds, name=actor_id, allow_no_auth=allow_no_auth) as bus:
        stream = await bus.ensure_run_stream(run, max_bytes=runtime.stream_max_bytes)
        ctx = ActorContext(
            bus=bus, run=run, actor_type=cls.actor_type, actor_id=actor_id, stream=stream
        )
        actor = cls(ctx, config)
        await actor.setup()
        runner = _Runner(actor, ctx, runtime)
        await runner.run(handle_signals=handle_signals, task_status=task_status)


class _Runner:
    def __init__(self, actor: Actor, ctx: ActorContext, runtime: RuntimeConfig) -> None:
        self.actor = actor
        self.ctx = ctx
        self.runtime = runtime
        self._process = psutil.Process()
        self._process.cpu_percent(None)

    async def run(self, *, handle_signals: bool, task_status: trio.TaskStatus[ActorContext]) -> None:
        ctx = self.ctx
        async with trio.open_nursery() as outer:
            outer.start_soon(self._heartbeats)
            await outer.start(self._listen_for_stop)
            if handle_signals:
                outer.start_soon(self._listen_for_signals)
            intake = _Intake()
            async with trio.open_nursery() as work:
                for inp in self.actor.inputs():
                    await work.start(self._serve_input, inp, intake)
                work.start_soon(self._main, intake)
                ctx.state = "running"
                await self._announce("joined")
                task_status.started(ctx)
                await ctx.stop_requested.wait()
                ctx.state = "draining"
                intake.cancel()
            with trio.CancelScope(shield=True):
                await self.actor.teardown()
                await self._announce("left")
                await self._beat()
            outer.cancel_scope.cancel()

    async def _main(self, intake: _Intake) -> None:
        with intake.scope():
            await self.actor.main()

    async def _announce(self, event: str) -> None:
        ctx = self.ctx
        await ctx.bus.publish(
            subjects.announce(ctx.run),
            Announce(
                actor_id=ctx.actor_id,
                actor_type=ctx.actor_type,
                host=ctx.host,
                pid=ctx.pid,
                capabilities=self.actor.capabilities(),
                event=event,
            ),
        )

    async def _listen_for_stop(self, task_status: trio.TaskStatus[None]) -> None:
        ctx = self.ctx
        async with ctx.bus.subscribe(subjects.control(ctx.run, "stop.>")) as mine, \
                ctx.bus.subscribe(subjects.stop(ctx.run)) as everyone:
            task_status.started()
            async with trio.open_nursery() as nursery:
                for sub in (mine, everyone):
                    nursery.start_soon(self._await_stop, sub)

    async def _await_stop(self, sub: Any) -> None:
        async for msg in sub.typed(Stop):
            if msg.actor_id in ("", self.ctx.actor_id):
                self.ctx.stop_requested.set()

    async def _listen_for_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                self.ctx.stop_requested.set()

    async def _heartbeats(self) -> None:
        while True:
            await self._beat()
            await trio.sleep(self.runtime.heartbeat_s)

    async def _beat(self) -> None:
        ctx = self.ctx
        what, since, deadline = ctx.current_wait()
        with self._process.oneshot():
            figures = ProcessFigures(
                cpu_percent=self._process.cpu_percent(None),
                rss_bytes=self._process.memory_info().rss,
                num_threads=self._process.num_threads(),
            )
        extra = {k: float(v) for k, v in self.actor.figures().items() if _finite(v)}
        await ctx.bus.publish(
            subjects.heartbeat(ctx.run, ctx.actor_id),
            Heartbeat(
                actor_id=ctx.actor_id,
                actor_type=ctx.actor_type,
                host=ctx.host,
                pid=ctx.pid,
                started_at=ctx.started_at,
                msgs_in=ctx.counts["msgs_in"],
                msgs_out=ctx.counts["msgs_out"],
                dead_letters=ctx.counts["dead_letters"],
                process=figures,
                waiting_on=what,
                waiting_since=since,
                wait_deadline_s=deadline,
                state=ctx.state,
                capabilities=self.actor.capabilities(),
                figures=extra,
            ),
        )

    # -- intake -------------------------------------------------------------------------

    async def _serve_input(
        self, inp: Input, intake: _Intake, task_status: trio.TaskStatus[None]
    ) -> None:
        if inp.durable:
            await self._serve_durable(inp, intake, task_status)
        else:
            await self._serve_core(inp, intake, task_status)

    def _decode_checked(self, inp: Input, data: bytes) -> tuple[Any, str]:
        try:
            msg = decode(data)
        except MessageError as exc:
            return None, str(exc)
        if inp.accepts and not isinstance(msg, inp.accepts):
            wanted = ", ".join(t.__name__ for t in inp.accepts)
            return None, f"unexpected message type {type(msg).__name__} (this input takes {wanted})"
        return msg, ""

    async def _serve_core(
        self, inp: Input, intake: _Intake, task_status: trio.TaskStatus[None]
    ) -> None:
        ctx = self.ctx
        async with ctx.bus.subscribe(inp.subject, queue=inp.group) as sub:
            task_status.started()
            slots = trio.Semaphore(inp.concurrency)
            handler = inp.handler
            async with trio.open_nursery() as workers:
                with intake.scope():
                    async for batch in sub:
                        # The hot path of core intake: kept flat (one await per message).
                        for raw in batch:
                            msg, error = self._decode_checked(inp, raw.data)
                            if error:
                                await ctx.dead_letter(raw.subject, raw.data, error)
                                continue
                            if inp.concurrency > 1:
                                await slots.acquire()
                                workers.start_soon(self._call_core_slot, inp, msg, raw, slots)
                                continue
                            try:
                                await handler(msg)
                            except Exception as exc:  # noqa: BLE001
                                await self._core_failure(raw.subject, raw.data, exc)
                        ctx.counts["msgs_in"] += len(batch)
                workers.cancel_scope.deadline = (
                    trio.current_time() + self.runtime.drain_timeout_s
                )

    async def _call_core_slot(self, inp: Input, msg: Any, raw: Any, slots: trio.Semaphore) -> None:
        try:
            await inp.handler(msg)
        except Exception as exc:  # noqa: BLE001
            await self._core_failure(raw.subject, raw.data, exc)
        finally:
            slots.release()

    async def _core_failure(self, subject: str, data: bytes, exc: Exception) -> None:
        """Core NATS cannot redeliver: record the failure in the dead-letter log, keep serving."""
        if isinstance(exc, Reject):
            await self.ctx.dead_letter(subject, data, f"rejected: {exc}")
            return
        self.ctx.counts["handler_errors"] += 1
        await self.ctx.dead_letter(subject, data, f"handler error: {type(exc).__name__}: {exc}")

    async def _serve_durable(
        self, inp: Input, intake: _Intake, task_status: trio.TaskStatus[None]
    ) -> None:
        ctx = self.ctx
        durable = subjects.durable_name(ctx.run, inp.group or ctx.actor_type, inp.subject,
                                        inp.filters)
        async with ctx.bus.pull_consumer(
            stream=ctx.stream,
            durable=durable,
            filter_subject=inp.subject,
            filter_subjects=inp.filters,
            ack_wait_s=inp.ack_wait_s,
            max_deliver=inp.max_deliver,
            max_ack_pending=max(inp.concurrency * 4, inp.batch * 2),
            deliver_new=inp.deliver_new,
        ) as consumer:
            task_status.started()
            acks = _AckBatcher(consumer)
            free = inp.concurrency
            slot_freed = trio.Event()

            async def process(d: Delivery) -> None:
                nonlocal free
                try:
                    await self._handle_delivery(inp, consumer, acks, d)
                finally:
                    free += 1
                    slot_freed.set()

            async with trio.open_nursery() as ackers:
                ackers.start_soon(acks.run)
                async with trio.open_nursery() as handlers:
                    with intake.scope():
                        while True:
                            while free <= 0:  # a fetch may return late extras
                                await slot_freed.wait()
                                slot_freed = trio.Event()
                            with ctx.waiting(f"messages on {inp.subject}"):
                                got = await consumer.fetch(min(inp.batch, free), timeout_s=1.0)
                            for d in got:
                                free -= 1
                                handlers.start_soon(process, d)
                    # stopping: in-flight work may finish until the drain deadline
                    handlers.cancel_scope.deadline = (
                        trio.current_time() + self.runtime.drain_timeout_s
                    )
                await acks.flush()
                ackers.cancel_scope.cancel()

    async def _handle_delivery(
        self, inp: Input, consumer: PullConsumer, acks: _AckBatcher, d: Delivery
    ) -> None:
        ctx = self.ctx
        msg, error = self._decode_checked(inp, d.data)
        if error:
            await ctx.dead_letter(
                d.subject, d.data, error, stream_seq=d.stream_seq, deliveries=d.num_delivered
            )
            await consumer.term([d])
            return
        ctx.counts["msgs_in"] += 1
        ticket = Ticket(consumer, d, acks) if inp.manual_ack else None
        try:
            if ticket is not None:
                await inp.handler(msg, ticket)
            else:
                await inp.handler(msg)
                acks.add(d)
        except Reject as exc:
            await ctx.dead_letter(
                d.subject, d.data, f"rejected: {exc}",
                stream_seq=d.stream_seq, deliveries=d.num_delivered,
            )
            await consumer.term([d])
        except Retry as exc:
            with trio.CancelScope(shield=True):
                await consumer.nak([d], exc.delay_s)
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                if ticket is None or not ticket.settled:
                    await consumer.nak([d])  # stopped mid-way: redeliver now, elsewhere
            raise
        except Exception as exc:  # noqa: BLE001 - a failing handler must not kill the actor
            ctx.counts["handler_errors"] += 1
            cause = exc
            while isinstance(cause, BaseExceptionGroup) and len(cause.exceptions) == 1:
                cause = cause.exceptions[0]  # name what failed, not the nurseries it crossed
            reason = f"handler error: {type(cause).__name__}: {cause}"
            # the actor's log says why a message came back (it is retried or dead-lettered)
            print(f"{ctx.actor_id}: {d.subject} (delivery {d.num_delivered} of "
                  f"{inp.max_deliver}): {reason}", file=sys.stderr, flush=True)
            if d.num_delivered >= inp.max_deliver:
                await ctx.dead_letter(
                    d.subject, d.data, f"{reason} (after {d.num_delivered} deliveries)",
                    stream_seq=d.stream_seq, deliveries=d.num_delivered,
                )
                await consumer.term([d])
            else:
                await consumer.nak([d], inp.retry_delay_s * d.num_delivered)


class _Intake:
    """The cancel scopes of every intake loop, cancelled together when the actor stops."""

    def __init__(self) -> None:
        self._scopes: list[trio.CancelScope] = []
        self._cancelled = False

    def scope(self) -> trio.CancelScope:
        scope = trio.CancelScope()
        if self._cancelled:
            scope.cancel()
        self._scopes.append(scope)
        return scope

    def cancel(self) -> None:
        self._cancelled = True
        for scope in self._scopes:
            scope.cancel()


class _AckBatcher:
    """Acks collected from many handlers and sent in one bridge crossing."""

    def __init__(self, consumer: PullConsumer) -> None:
        self._consumer = consumer
        self._pending: list[Delivery] = []
        self._pending_sent = trio.Event()  # set once the acks now pending are sent
        self._sending = False
        self._wakeup = trio.Event()
        self._drained = trio.lowlevel.ParkingLot()

    def add(self, d: Delivery) -> None:
        self._pending.append(d)
        self._wakeup.set()

    async def ack(self, d: Delivery) -> None:
        """Ack `d` with whatever else is pending; return once it has been sent."""
        sent = self._pending_sent
        self.add(d)
        await sent.wait()

    async def run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup = trio.Event()
            while self._pending:
                batch, self._pending = self._pending, []
                sent, self._pending_sent = self._pending_sent, trio.Event()
                self._sending = True
                with trio.CancelScope(shield=True):
                    await self._consumer.ack(batch)
                self._sending = False
                sent.set()
            self._drained.unpark_all()

    async def flush(self) -> None:
        while self._pending or self._sending:
            await self._drained.park()


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False
