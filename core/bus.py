"""The NATS bus under trio: nats-py (asyncio-only) bridged with trio-asyncio.

Crossing the trio/asyncio bridge is a hop between two event loops, far dearer than a trio
call, so this module crosses once per *batch*:
  * outgoing core publishes are buffered trio-side and flushed by one pump task,
    one crossing per batch;
  * durable (JetStream) publishes are queued and sent pipelined, one crossing per
    batch, each resolved when its PubAck arrives;
  * incoming messages never cross at all: nats-py's asyncio callback appends to a
    bounded buffer and sets a trio Event (both loops run on the one trio thread).

Backpressure: `publish` waits when the outgoing buffer is full; core subscriptions
drop and count (`slow_consumer_drops`) past their bound, as NATS itself would;
JetStream pull consumers only fetch what the caller asks for.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import nats
import nats.errors
import nats.js.api as js_api
import nats.js.errors
import trio
import trio_asyncio
from trio_asyncio import aio_as_trio

from reinforge.core import subjects
from reinforge.core.messages import MessageError, decode, encode
from reinforge.core.natsd import NatsCredentials


class BusError(RuntimeError):
    """The bus could not do what was asked (after retries); the text says what."""


class _NotReadyYet(Exception):
    """JetStream answered, but the cluster cannot do it yet (still forming): retry."""


# JetStream API error codes (nats-server's errors.json) that the stream set-up tells apart.
_STREAM_NAME_IN_USE = 10058
_NO_SUITABLE_PEERS = 10005  # a just-formed cluster whose peers have not all reported in
_REPLICAS_NEED_CLUSTER = 10074


def classify_stream_error(name: str, exc: nats.js.errors.APIError) -> str:
    """What to do when creating stream `name` failed: "update" (it exists), "retry", or
    raise a BusError that says why in the server's words."""
    if exc.err_code == _STREAM_NAME_IN_USE:
        return "update"
    if exc.err_code == _NO_SUITABLE_PEERS:
        return "retry"
    hint = " (replicas > 1 needs a NATS cluster)" if exc.err_code == _REPLICAS_NEED_CLUSTER else ""
    raise BusError(f"cannot create stream {name}: {exc.description} "
                   f"(JetStream error {exc.err_code}){hint}") from exc


class BusStatistics(msgspec.Struct, frozen=True, kw_only=True):
    published: int
    received: int
    durable_published: int
    durable_trips: int  # batches sent to the server: fewer than published when they share one
    durable_retries: int
    durable_duplicates: int
    settle_trips: int  # crossings to ack/nak deliveries: fewer than deliveries when batched
    slow_consumer_drops: int
    reconnects: int
    disconnects: int
    errors: int
    pending_out: int


class RawMsg(NamedTuple):
    """A message as it came off the wire (not yet decoded). A tuple: cheap to make."""

    subject: str
    data: bytes
    headers: dict[str, str] | None
    reply: str


@dataclass(slots=True)
class Delivery:
    """One JetStream delivery from a pull consumer; ack/nak it through its consumer."""

    subject: str
    data: bytes
    headers: dict[str, str] | None
    stream_seq: int
    num_delivered: int
    timestamp: float
    _msg: Any = field(repr=False)
    num_pending: int = 0  # matching messages the consumer had not yet delivered


@dataclass(frozen=True, slots=True)
class PubAck:
    stream: str
    seq: int
    duplicate: bool


@dataclass(slots=True)
class _DurableRequest:
    subject: str
    data: bytes
    msg_id: str
    headers: dict[str, str]
    done: trio.Event = field(default_factory=trio.Event)
    result: PubAck | None = None
    error: BaseException | None = None


class Bus:
    """A connection to a run's NATS, usable from trio. Open with `open_bus`."""

    def __init__(
        self, nc: Any, loop: Any, *, max_pending_out: int, publish_timeout_s: float
    ) -> None:
        self._nc = nc
        self._loop = loop
        self._js = nc.jetstream(timeout=10)
        self._max_pending_out = max_pending_out
        self._publish_timeout_s = publish_timeout_s
        self._out: list[tuple[str, bytes, dict[str, str] | None]] = []
        self._out_wakeup = trio.Event()
        self._out_space = trio.lowlevel.ParkingLot()
        self._out_flushed = trio.lowlevel.ParkingLot()
        self._out_in_flight = 0
        self._durable: list[_DurableRequest] = []
        self._durable_wakeup = trio.Event()
        self._counts = collections.Counter()
        self._closed = False

    def aio(self, proc: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """Call asyncio code on THIS bus's loop (several buses may share a trio run)."""
        return aio_as_trio(proc, loop=self._loop)

    # -- statistics -------------------------------------------------------------------

    def count(self, key: str, n: int = 1) -> None:
        self._counts[key] += n

    def statistics(self) -> BusStatistics:
        c = self._counts
        return BusStatistics(
            published=c["published"],
            received=c["received"],
            durable_published=c["durable_published"],
            durable_trips=c["durable_trips"],
            durable_retries=c["durable_retries"],
            durable_duplicates=c["durable_duplicates"],
            settle_trips=c["settle_trips"],
            slow_consumer_drops=c["slow_consumer_drops"],
            reconnects=c["reconnects"],
            disconnects=c["disconnects"],
            errors=c["errors"],
            pending_out=len(self._out) + self._out_in_flight,
        )

    @property
    def connected(self) -> bool:
        return bool(self._nc.is_connected)

    # -- core publish -----------------------------------------------------------------

    async def publish(self, subject: str, msg: Any, headers: dict[str, str] | None = None) -> None:
        """Send a message (at most once). Waits only when the outgoing buffer is full."""
        await self.publish_raw(subject, encode(msg), headers)

    async def publish_raw(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None
    ) -> None:
        while len(self._out) >= self._max_pending_out:
            await self._out_space.park()
        self._out.append((subject, data, headers))
        self._out_wakeup.set()

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Return once every message published so far has been written to the server."""
        with trio.fail_after(timeout_s):
            while self._out or self._out_in_flight:
                await self._out_flushed.park()
            await self.aio(self._nc.flush)(timeout=timeout_s)

    async def _publish_pump(self) -> None:
        nc = self._nc

        async def send_batch(batch: list[tuple[str, bytes, dict[str, str] | None]]) -> None:
            for subject, data, headers in batch:
                await nc.publish(subject, data, headers=headers)

        while True:
            await self._out_wakeup.wait()
            self._out_wakeup = trio.Event()
            batch, self._out = self._out, []
            self._out_in_flight = len(batch)
            self._out_space.unpark_all()
            try:
                await self.aio(send_batch)(batch)
                self.count("published", len(batch))
            except (nats.errors.OutboundBufferLimitError, nats.errors.ConnectionClosedError):
                # Core NATS is at-most-once: a message that cannot be buffered during a
                # reconnect is dropped, and counted where `statistics()` shows it.
                self.count("dropped_out", len(batch))
            finally:
                self._out_in_flight = 0
                self._out_flushed.unpark_all()

    # -- durable (JetStream) publish ------------------------------------------------------

    async def publish_durable(
        self, subject: str, msg: Any, msg_id: str, headers: dict[str, str] | None = None
    ) -> PubAck:
        """Store a message in the run's stream; return once the server acknowledged it.

        `msg_id` must be deterministic (a retry after a crash sends the same id), so the
        server drops duplicates within the stream's duplicate window. Retries with the
        same id until `publish_timeout_s`, then raises BusError: never silent loss.
        """
        return await self.publish_durable_raw(subject, encode(msg), msg_id, headers)

    async def publish_durable_raw(
        self, subject: str, data: bytes, msg_id: str, headers: dict[str, str] | None = None
    ) -> PubAck:
        return (await self._store([_DurableRequest(subject, data, msg_id, headers or {})]))[0]

    async def publish_durable_many(
        self, items: Sequence[tuple[str, Any, str]], headers: dict[str, str] | None = None
    ) -> list[PubAck]:
        """`publish_durable` for each `(subject, msg, msg_id)`, stored in this order and sent
        together: one trip to the server for all, where awaiting each in turn costs one per
        message. Every message is tried; the first failure is raised once all are done."""
        return await self._store([_DurableRequest(subject, encode(msg), msg_id, headers or {})
                                  for subject, msg, msg_id in items])

    async def _store(self, reqs: list[_DurableRequest]) -> list[PubAck]:
        if not reqs:
            return []
        self._durable.extend(reqs)
        self._durable_wakeup.set()
        for req in reqs:
            await req.done.wait()
        for req in reqs:
            if req.error is not None:
                raise req.error
        return [req.result for req in reqs]

    async def _durable_pump(self) -> None:
        while True:
            await self._durable_wakeup.wait()
            self._durable_wakeup = trio.Event()
            batch, self._durable = self._durable, []
            if not batch:
                continue
            results = await self.aio(self._aio_publish_durable_batch)(batch)
            self.count("durable_trips")
            for req, res in zip(batch, results):
                if isinstance(res, BaseException):
                    req.error = res
                else:
                    req.result = res
                    self.count("durable_published")
                    if res.duplicate:
                        self.count("durable_duplicates")
                req.done.set()

    async def _aio_publish_durable_batch(self, batch: list[_DurableRequest]) -> list[Any]:
        deadline = time.monotonic() + self._publish_timeout_s
        results: list[Any] = [None] * len(batch)
        todo = list(range(len(batch)))
        delay = 0.05
        while todo:
            futures = []
            for i in todo:
                req = batch[i]
                futures.append(
                    self._js.publish(
                        req.subject,
                        req.data,
                        timeout=min(5.0, max(0.1, deadline - time.monotonic())),
                        headers={**req.headers, "Nats-Msg-Id": req.msg_id},
                    )
                )
            outcomes = await asyncio.gather(*futures, return_exceptions=True)
            retry = []
            for i, out in zip(todo, outcomes):
                if isinstance(out, BaseException):
                    if _is_permanent(out) or time.monotonic() >= deadline:
                        results[i] = BusError(
                            f"durable publish to {batch[i].subject} (id {batch[i].msg_id}) "
                            f"failed: {type(out).__name__}: {out}"
                        )
                    else:
                        retry.append(i)
                else:
                    results[i] = PubAck(out.stream, out.seq, bool(out.duplicate))
            if retry:
                self.count("durable_retries", len(retry))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
            todo = retry
        return results

    # -- core subscribe ---------------------------------------------------------------

    @asynccontextmanager
    async def subscribe(
        self, subject: str, *, queue: str = "", max_buffered: int = 65536
    ) -> AsyncIterator[Subscription]:
        """Receive core NATS messages as batches: `async for batch in sub`."""
        sub = Subscription(self, max_buffered)
        nsub = await self.aio(self._subscribe_and_flush)(subject, queue, sub)
        try:
            yield sub
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self.aio(nsub.unsubscribe)()
                except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
                    pass

    async def _subscribe_and_flush(self, subject: str, queue: str, sub: Subscription) -> Any:
        nsub = await self._nc.subscribe(
            subject, queue=queue, pending_msgs_limit=sub.max_buffered
        )
        sub.attach(nsub)
        await self._nc.flush()  # the server knows the interest before we return
        return nsub

    # -- request / reply ----------------------------------------------------------------

    async def request(self, subject: str, msg: Any, timeout_s: float = 5.0) -> bytes:
        """Send a request and return the raw reply (decode it with messages.decode)."""
        try:
            reply = await self.aio(self._nc.request)(subject, encode(msg), timeout=timeout_s)
        except nats.errors.TimeoutError:
            raise BusError(f"no reply on {subject} within {timeout_s} s") from None
        except nats.errors.NoRespondersError:
            raise BusError(f"no responder on {subject}") from None
        return reply.data

    async def respond(self, reply_to: str, msg: Any) -> None:
        await self.publish(reply_to, msg)

    # -- JetStream management and pull consumers ---------------------------------------------

    async def ensure_run_stream(
        self,
        run: str,
        *,
        max_bytes: int = 4 << 30,
        duplicate_window_s: float = 600.0,
        replicas: int = 1,
    ) -> str:
        """Create (or update) the run's stream: the work queue and the message log at once.

        `replicas` > 1 needs a NATS cluster (core/natscluster.py). An existing stream never
        loses replicas here: an actor's R1 default must not scale down an R3 stream.
        """
        name = subjects.stream_name(run)
        config = js_api.StreamConfig(
            name=name,
            subjects=[subjects.data_wildcard(run)],
            retention=js_api.RetentionPolicy.LIMITS,
            storage=js_api.StorageType.FILE,
            # Loud back-pressure instead of silently evicting unconsumed work.
            discard=js_api.DiscardPolicy.NEW,
            max_bytes=max_bytes,
            duplicate_window=duplicate_window_s,
            num_replicas=replicas,
        )

        async def ensure() -> None:
            try:
                await self._js.add_stream(config)
                return
            except nats.js.errors.APIError as exc:
                if classify_stream_error(name, exc) == "retry":
                    raise _NotReadyYet(exc.description) from exc
            try:
                info = await self._js.stream_info(name)
            except nats.js.errors.NotFoundError as exc:  # deleted in between: start again
                raise _NotReadyYet(f"stream {name} vanished") from exc
            have = info.config.num_replicas or 1
            await self._js.update_stream(
                dataclasses.replace(config, num_replicas=max(have, replicas))
            )

        await self.js_call(ensure, what=f"creating stream {name}")
        return name

    async def object_store(self, bucket: str, *, create: bool = False,
                           replicas: int = 1) -> Any:
        """nats-py's ObjectStore for `bucket` (file storage), created when `create` (with
        `replicas` copies); call its coroutines through `js_call`."""

        async def open_it() -> Any:
            try:
                return await self._js.object_store(bucket)
            except nats.js.errors.BucketNotFoundError:
                if not create:
                    raise
                config = js_api.ObjectStoreConfig(bucket=bucket, replicas=replicas,
                                                  storage=js_api.StorageType.FILE)
                return await self._js.create_object_store(bucket, config=config)

        return await self.js_call(open_it, what=f"opening object store {bucket}")

    async def stream_replicas(self, stream: str) -> int:
        """How many copies of `stream` the cluster keeps (1 when it does not exist)."""

        async def replicas() -> int:
            try:
                return (await self._js.stream_info(stream)).config.num_replicas or 1
            except nats.js.errors.NotFoundError:
                return 1

        return await self.js_call(replicas, what=f"reading stream {stream}")

    async def next_message(self, stream: str, subject: str, from_seq: int,
                           *, what: str, deadline_s: float) -> tuple[int, bytes]:
        """The first message on `subject` at or after stream sequence `from_seq`, as
        (sequence, data): one request, which a cluster that cannot answer yet is asked again
        until `deadline_s` (`js_call`)."""
        msg = await self.js_call(
            lambda: self._js.get_msg(stream, seq=from_seq, subject=subject, next=True),
            what=what, deadline_s=deadline_s)
        return msg.seq, msg.data or b""

    async def js_call(self, call: Callable[[], Awaitable[Any]], *, what: str,
                      deadline_s: float = 60.0) -> Any:
        """Run a JetStream API call, retrying while the cluster cannot answer (a leader
        election, a node cut off, a busy server): those are waits, not failures. Past
        `deadline_s` the last error is raised, naming `what`. A publish that finds no
        responder (`NoStreamResponseError`: a stream still electing its leader) stored
        nothing, so sending it again is safe."""
        delay, give_up = 0.25, trio.current_time() + deadline_s
        while True:
            try:
                return await self.aio(call)()
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError,
                    nats.js.errors.NoStreamResponseError,
                    nats.js.errors.ServiceUnavailableError, _NotReadyYet) as exc:
                if trio.current_time() + delay > give_up:
                    raise BusError(f"{what}: JetStream did not answer within {deadline_s:g} s "
                                   f"({type(exc).__name__})") from exc
                self.count("js_api_retries")
                await trio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def last_message(self, stream: str, subject: str) -> Delivery | None:
        """The newest stored message on `subject` (e.g. the latest weights), or None."""

        async def get() -> Any:
            try:
                return await self._js.get_last_msg(stream, subject)
            except nats.js.errors.NotFoundError:
                return None

        raw = await self.js_call(get, what=f"reading the last message on {subject}")
        if raw is None:
            return None
        return Delivery(
            subject=raw.subject, data=raw.data or b"", headers=raw.headers,
            stream_seq=raw.seq, num_delivered=0, timestamp=0.0, _msg=None,
        )

    async def stream_info(self, stream: str) -> Any:
        return await self.aio(self._js.stream_info)(stream)

    async def consumer_info(self, stream: str, durable: str) -> Any:
        return await self.aio(self._js.consumer_info)(stream, durable)

    async def consumers_info(self, stream: str) -> list[Any]:
        """Every consumer of `stream`, durable and ephemeral."""
        return await self.js_call(lambda: self._js.consumers_info(stream),
                                  what=f"listing the consumers of {stream}")

    async def purge(self, stream: str, *, subject: str, before_seq: int) -> None:
        """Delete the messages on `subject` stored before `before_seq`."""
        await self.js_call(lambda: self._js.purge_stream(stream, seq=before_seq,
                                                         subject=subject),
                           what=f"trimming {subject} of {stream}")

    @asynccontextmanager
    async def pull_consumer(
        self,
        *,
        stream: str,
        durable: str,
        filter_subject: str,
        ack_wait_s: float = 30.0,
        max_deliver: int = 5,
        max_ack_pending: int = 1024,
        deliver_new: bool = False,
        filter_subjects: Sequence[str] = (),
    ) -> AsyncIterator[PullConsumer]:
        """A durable pull consumer: replicas using the same `durable` share the work. With
        `filter_subjects`, it takes those subjects (NATS 2.10+) instead of `filter_subject`."""
        config = js_api.ConsumerConfig(
            durable_name=durable,
            ack_policy=js_api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            max_deliver=max_deliver,
            max_ack_pending=max_ack_pending,
            filter_subject=None if filter_subjects else filter_subject,
            filter_subjects=list(filter_subjects) or None,
            deliver_policy=js_api.DeliverPolicy.NEW if deliver_new else js_api.DeliverPolicy.ALL,
        )
        psub = await self.js_call(
            lambda: self._js.pull_subscribe(filter_subject, durable=durable, stream=stream,
                                            config=config),
            what=f"consumer {durable} on {stream}",
        )
        try:
            yield PullConsumer(self, psub)
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self.aio(psub.unsubscribe)()
                except Exception:  # noqa: BLE001 - closing a dead connection is not an error
                    pass

    async def read_stream(
        self, stream: str, *, filter_subject: str = "", start_seq: int = 1, batch: int = 512,
        stall_s: float = 30.0, deadline_s: float = 60.0,
    ) -> AsyncIterator[Delivery]:
        """Every message stored from `start_seq` on when the read starts, in order (an
        ephemeral ordered read). An empty fetch is a wait, not the end: the read ends when
        the consumer has nothing pending. If no message comes for `stall_s` (the cluster
        lost the consumer, say) it raises BusError: a partial read never passes as whole.
        `deadline_s` bounds each JetStream call's retries (`js_call`)."""
        info = await self.js_call(lambda: self._js.stream_info(stream), what=f"reading {stream}",
                                  deadline_s=deadline_s)
        last = info.state.last_seq
        if last < start_seq:
            return
        config = js_api.ConsumerConfig(
            ack_policy=js_api.AckPolicy.NONE,
            deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start_seq,
            filter_subject=filter_subject or None,
            inactive_threshold=max(30.0, stall_s),
        )
        psub = await self.js_call(
            lambda: self._js.pull_subscribe(filter_subject or ">", durable=None, stream=stream,
                                            config=config),
            what=f"an ordered reader on {stream}", deadline_s=deadline_s,
        )
        consumer = PullConsumer(self, psub)
        try:
            pending = await self.js_call(psub.consumer_info, what=f"reading {stream}",
                                         deadline_s=deadline_s)
            if pending.num_pending == 0:
                return
            read_to, heard_at = start_seq - 1, trio.current_time()
            while True:
                got = await consumer.fetch(batch, timeout_s=1.0)
                if not got:
                    if trio.current_time() - heard_at > stall_s:
                        raise BusError(f"reading {stream}: nothing after seq {read_to} for "
                                       f"{stall_s:g} s, though it holds messages up to {last}")
                    continue
                heard_at = trio.current_time()
                for d in got:
                    if d.stream_seq <= read_to:  # a late answer to an expired fetch
                        continue
                    read_to = d.stream_seq
                    yield d
                    if d.stream_seq >= last or d.num_pending == 0:
                        return
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self.aio(psub.unsubscribe)()
                except Exception:  # noqa: BLE001
                    pass


class _WakingQueue(asyncio.Queue):
    """nats-py's per-subscription queue, plus a trio wake-up on every put.

    nats-py would otherwise run one asyncio task per subscription that awaits each
    message and calls a callback; under trio-asyncio that task switch per message
    costs more than everything else on the receive path. With this queue the
    parser's `put_nowait` wakes the trio side, which drains a whole batch at once.
    """

    def __init__(self, maxsize: int, wakeup: Callable[[], None]) -> None:
        super().__init__(maxsize=maxsize)
        self._wake = wakeup

    def put_nowait(self, item: Any) -> None:
        super().put_nowait(item)
        self._wake()


class Subscription:
    """Batches of core NATS messages, delivered without crossing the bridge."""

    def __init__(self, bus: Bus, max_buffered: int) -> None:
        self._bus = bus
        self.max_buffered = max_buffered
        self._nsub: Any = None
        self._queue: _WakingQueue | None = None
        self._wakeup = trio.Event()

    def attach(self, nsub: Any) -> None:
        # Relies on nats-py's Subscription internals (`_pending_queue`, `_pending_size`),
        # stable since nats-py 2.0; tests/core/test_core_bus.py covers it.
        self._nsub = nsub
        self._queue = _WakingQueue(self.max_buffered, self._on_put)
        nsub._pending_queue = self._queue

    def _on_put(self) -> None:
        self._wakeup.set()

    def __aiter__(self) -> Subscription:
        return self

    async def typed(self, *types: type) -> AsyncIterator[Any]:
        """Decoded messages of `types`, skipping anything else: for control-plane observers,
        where a stray or malformed message is noise (counted), not work to dead-letter."""
        async for batch in self:
            for raw in batch:
                try:
                    msg = decode(raw.data)
                except MessageError:
                    self._bus.count("skipped_malformed")
                    continue
                if isinstance(msg, types):
                    yield msg

    async def __anext__(self) -> list[RawMsg]:
        queue = self._queue
        assert queue is not None, "Subscription used before it was attached"
        while queue.empty():
            await self._wakeup.wait()
            self._wakeup = trio.Event()
        batch = []
        size = 0
        while not queue.empty():
            msg = queue.get_nowait()
            size += len(msg.data)
            batch.append(RawMsg(msg.subject, msg.data, msg.headers, msg.reply))
        self._nsub._pending_size -= size
        self._bus.count("received", len(batch))
        return batch


class PullConsumer:
    """Fetch and settle JetStream deliveries, one bridge crossing per call."""

    def __init__(self, bus: Bus, psub: Any) -> None:
        self._bus = bus
        self._psub = psub

    async def fetch(self, max_msgs: int, timeout_s: float = 1.0) -> list[Delivery]:
        async def fetch() -> list[Any]:
            try:
                return await self._psub.fetch(max_msgs, timeout=timeout_s)
            except (nats.errors.TimeoutError, TimeoutError):
                return []

        try:
            msgs = await self._bus.aio(fetch)()
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError):
            await trio.sleep(min(timeout_s, 0.5))
            return []
        except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError):
            # In a cluster the consumer has no leader for a moment: just created, an
            # election, or this node is cut off from the quorum. Nothing to fetch yet.
            self._bus.count("fetch_unavailable")
            await trio.sleep(min(timeout_s, 0.5))
            return []
        out = []
        for m in msgs:
            md = m.metadata
            out.append(
                Delivery(
                    subject=m.subject,
                    data=m.data,
                    headers=m.headers,
                    stream_seq=md.sequence.stream,
                    num_delivered=md.num_delivered,
                    timestamp=md.timestamp.timestamp() if md.timestamp else 0.0,
                    _msg=m,
                    num_pending=md.num_pending or 0,
                )
            )
        self._bus.count("received", len(out))
        return out

    async def _settle(self, deliveries: list[Delivery], how: Callable[[Any], Awaitable[None]]) -> int:
        """Returns how many could not be settled (connection down: they will be redelivered)."""

        async def settle_all() -> int:
            failed = 0
            for d in deliveries:
                try:
                    await how(d._msg)
                except (nats.errors.Error, nats.js.errors.Error):
                    failed += 1
            return failed

        if not deliveries:
            return 0
        self._bus.count("settle_trips")
        failed = await self._bus.aio(settle_all)()
        if failed:
            self._bus.count("settle_failures", failed)
        return failed

    async def ack(self, deliveries: list[Delivery]) -> int:
        return await self._settle(deliveries, lambda m: m.ack())

    async def nak(self, deliveries: list[Delivery], delay_s: float | None = None) -> int:
        return await self._settle(deliveries, lambda m: m.nak(delay=delay_s))

    async def term(self, deliveries: list[Delivery]) -> int:
        return await self._settle(deliveries, lambda m: m.term())

    async def in_progress(self, deliveries: list[Delivery]) -> int:
        return await self._settle(deliveries, lambda m: m.in_progress())


def _is_permanent(exc: BaseException) -> bool:
    """Errors that a retry with the same id cannot fix."""
    if isinstance(exc, nats.js.errors.APIError) and not isinstance(
        exc, nats.js.errors.ServiceUnavailableError
    ):
        # e.g. "maximum bytes exceeded" (DiscardNew) or no stream for the subject
        return exc.code not in (None, 503)
    return isinstance(exc, (nats.errors.MaxPayloadError, nats.errors.BadSubjectError))


@contextlib.contextmanager
def collapse_single_exception() -> Iterator[None]:
    """Re-raise a lone exception out of the nurseries it passed through.

    Nurseries wrap errors in ExceptionGroups; at this API boundary a caller wants
    `BusError` (or its own AssertionError), not three levels of groups around it.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if len(leaves) == 1 and not isinstance(leaves[0], trio.Cancelled):
            raise leaves[0] from None
        raise


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


@asynccontextmanager
async def open_bus(
    creds: NatsCredentials | str,
    *,
    name: str = "reinforge",
    max_pending_out: int = 65536,
    publish_timeout_s: float = 60.0,
    ping_interval_s: float = 5.0,
    connect_timeout_s: float = 10.0,
    allow_no_auth: bool = False,
) -> AsyncIterator[Bus]:
    """Connect to NATS from trio; the connection reconnects forever until closed.

    Must run inside trio; opens its own trio-asyncio loop. Clients ping every few
    seconds (nats-py's default is two minutes) so a dead link is noticed quickly.
    """
    if isinstance(creds, str):
        creds = NatsCredentials(url=creds)
    if not creds.user and not allow_no_auth:
        raise BusError(
            f"refusing to connect to {creds.url} without credentials "
            "(pass allow_no_auth=True for a server that is deliberately open)"
        )
    with collapse_single_exception():
        async with _open_bus(
            creds, name, max_pending_out, publish_timeout_s, ping_interval_s, connect_timeout_s
        ) as bus:
            yield bus


@asynccontextmanager
async def _open_bus(
    creds: NatsCredentials,
    name: str,
    max_pending_out: int,
    publish_timeout_s: float,
    ping_interval_s: float,
    connect_timeout_s: float,
) -> AsyncIterator[Bus]:
    async with trio_asyncio.open_loop() as loop:
        bus_ref: list[Bus] = []

        async def on_error(exc: Exception) -> None:
            if bus_ref:
                bus_ref[0].count("errors")
                if isinstance(exc, nats.errors.SlowConsumerError):
                    bus_ref[0].count("slow_consumer_drops")

        async def on_disconnect() -> None:
            if bus_ref:
                bus_ref[0].count("disconnects")

        async def on_reconnect() -> None:
            if bus_ref:
                bus_ref[0].count("reconnects")

        last_error: list[BaseException] = []

        async def on_connect_error(exc: Exception) -> None:
            last_error.append(exc)
            await on_error(exc)

        # nats-py retries a failing first connect forever when reconnects are allowed;
        # bound it, and report the server's own reason (e.g. an authorization violation).
        nc = None
        tls = None
        if creds.ca_file:  # a private cluster CA (natscluster's client_tls)
            import ssl

            tls = ssl.create_default_context(cafile=creds.ca_file)
        with trio.move_on_after(connect_timeout_s):
            nc = await aio_as_trio(nats.connect, loop=loop)(
                servers=creds.auth_urls(),
                tls=tls,
                # In order: a host's credentials list its nearest cluster node first.
                dont_randomize=True,
                name=name,
                ping_interval=ping_interval_s,
                max_outstanding_pings=3,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                connect_timeout=2,
                pending_size=64 * 1024 * 1024,
                error_cb=on_connect_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
            )
        if nc is None:
            why = f": {last_error[-1]}" if last_error else ""
            raise BusError(
                f"cannot connect to NATS at {creds.url} within {connect_timeout_s} s{why}"
            )
        bus = Bus(nc, loop, max_pending_out=max_pending_out, publish_timeout_s=publish_timeout_s)
        bus_ref.append(bus)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(bus._publish_pump)
                nursery.start_soon(bus._durable_pump)
                try:
                    yield bus
                finally:
                    with trio.CancelScope(shield=True):
                        with trio.move_on_after(5):
                            if nc.is_connected:
                                await bus.flush(timeout_s=5)
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(5):
                    if not nc.is_closed:
                        await bus.aio(nc.close)()

