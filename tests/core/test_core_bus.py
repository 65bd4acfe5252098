"""The bus against a real nats-server: core pub/sub, durable publish, pull consumers."""

import signal
import threading

import nats.js.api as js_api
import nats.js.errors
import pytest
import trio

from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.bus import BusError, classify_stream_error, open_bus
from reinforge.core.natsd import EmbeddedNats

pytestmark = pytest.mark.nats


def test_core_messages_arrive_typed_and_in_order(creds, run_name):
    async def main():
        async with open_bus(creds) as pub, open_bus(creds) as sub_bus:
            got = []
            async with sub_bus.subscribe(subjects.echo(run_name, "x")) as sub:
                for i in range(500):
                    await pub.publish(subjects.echo(run_name, "x"), m.Echo(seq=i))
                await pub.flush()
                with trio.fail_after(10):
                    async for batch in sub:
                        got.extend(m.decode(r.data) for r in batch)
                        if len(got) == 500:
                            break
            assert [e.seq for e in got] == list(range(500))
            assert pub.statistics().published == 500

    trio.run(main)


def test_request_reply_round_trips(creds, run_name):
    async def main():
        async with open_bus(creds) as a, open_bus(creds) as b:
            async with b.subscribe(f"ctl.{run_name}.rr") as sub, trio.open_nursery() as n:

                async def server():
                    async for batch in sub:
                        for r in batch:
                            req = m.decode(r.data)
                            await b.respond(r.reply, m.Echo(seq=req.seq + 1))

                n.start_soon(server)
                reply = m.decode(await a.request(f"ctl.{run_name}.rr", m.Echo(seq=41)))
                assert reply.seq == 42
                n.cancel_scope.cancel()
            with pytest.raises(BusError, match="no responder"):
                await a.request(f"ctl.{run_name}.nobody", m.Echo(seq=0), timeout_s=1)

    trio.run(main)


def test_durable_publish_deduplicates_a_retry_with_the_same_id(creds, run_name):
    async def main():
        async with open_bus(creds) as bus:
            stream = await bus.ensure_run_stream(run_name)
            first = await bus.publish_durable(subjects.echo(run_name), m.Echo(seq=1), "id-1")
            again = await bus.publish_durable(subjects.echo(run_name), m.Echo(seq=1), "id-1")
            assert not first.duplicate and again.duplicate and again.seq == first.seq
            info = await bus.stream_info(stream)
            assert info.state.messages == 1

    trio.run(main)


def test_many_durable_messages_go_in_order_in_one_trip_to_the_server(creds, run_name):
    async def main():
        async with open_bus(creds) as bus:
            stream = await bus.ensure_run_stream(run_name)
            subj = subjects.echo(run_name, "many")
            acks = await bus.publish_durable_many(
                [(subj, m.Echo(seq=i), f"many-{i}") for i in range(8)])
            assert [a.seq for a in acks] == sorted(a.seq for a in acks)
            stats = bus.statistics()
            assert stats.durable_published == 8 and stats.durable_trips == 1
            async with bus.pull_consumer(stream=stream, durable="many", filter_subject=subj) as c:
                got = await c.fetch(8, timeout_s=2)
            assert [m.decode(d.data).seq for d in got] == list(range(8))
            # awaited one by one, the same messages take a trip each
            for i in range(8):
                await bus.publish_durable(subj, m.Echo(seq=i), f"one-{i}")
            assert bus.statistics().durable_trips == 1 + 8

    trio.run(main)


def test_unacked_deliveries_come_back_after_ack_wait_and_naks_come_back_at_once(creds, run_name):
    async def main():
        async with open_bus(creds) as bus:
            stream = await bus.ensure_run_stream(run_name)
            subj = subjects.echo(run_name, "w")
            for i in range(3):
                await bus.publish_durable(subj, m.Echo(seq=i), f"w{i}")
            async with bus.pull_consumer(
                stream=stream, durable="g", filter_subject=subj, ack_wait_s=1.0
            ) as c:
                first = await c.fetch(3, timeout_s=2)
                assert [d.num_delivered for d in first] == [1, 1, 1]
                await c.ack(first[:1])
                await c.nak(first[1:2])
                # seq 1 (nak'ed) comes back at once; seq 2 (ignored) after ack_wait
                again = {}
                with trio.fail_after(10):
                    while len(again) < 2:
                        got = await c.fetch(2, timeout_s=1)
                        await c.ack(got)
                        again.update((m.decode(d.data).seq, d.num_delivered) for d in got)
                assert again == {1: 2, 2: 2}
                await trio.sleep(1.5)  # past ack_wait: nothing acked may come back
                assert await c.fetch(1, timeout_s=0.5) == []

    trio.run(main)


def test_connecting_without_credentials_is_refused_unless_allowed(nats_server):
    async def main():
        with pytest.raises(BusError, match="without credentials"):
            async with open_bus(nats_server.url):
                pass
        with pytest.raises(BusError, match="cannot connect"):
            async with open_bus(nats_server.url, allow_no_auth=True, connect_timeout_s=1):
                pass  # the server demands auth

    trio.run(main)


@pytest.mark.slow
def test_a_nats_server_restart_mid_stream_loses_no_jetstream_message(tmp_path, run_name):
    n_msgs = 600
    with EmbeddedNats(data_dir=tmp_path / "nats") as server:

        def crash_and_restart():
            server.restart(kill=True, down_s=0.5)

        async def main():
            async with open_bus(server.credentials, publish_timeout_s=60) as bus:
                stream = await bus.ensure_run_stream(run_name)
                subj = subjects.echo(run_name, "r")
                seen: set[int] = set()
                async with trio.open_nursery() as nursery:

                    async def produce():
                        for i in range(n_msgs):
                            await bus.publish_durable(subj, m.Echo(seq=i), f"r{i}")
                            if i == n_msgs // 3:
                                threading.Thread(target=crash_and_restart).start()

                    nursery.start_soon(produce)
                    async with bus.pull_consumer(
                        stream=stream, durable="r", filter_subject=subj, ack_wait_s=2
                    ) as c:
                        with trio.fail_after(120):
                            while len(seen) < n_msgs:
                                got = await c.fetch(100, timeout_s=1)
                                seen.update(m.decode(d.data).seq for d in got)
                                await c.ack(got)
                assert seen == set(range(n_msgs))
                assert bus.statistics().reconnects >= 1
                info = await bus.stream_info(stream)
                assert info.state.messages == n_msgs  # and no duplicates were stored

        trio.run(main)


@pytest.mark.slow
def test_a_consumer_asked_for_while_the_server_is_down_is_made_once_it_is_back(tmp_path,
                                                                                run_name):
    # Down longer than nats-py's 5 s JetStream API timeout: the call must wait, not fail.
    with EmbeddedNats(data_dir=tmp_path / "nats") as server:

        async def main():
            async with open_bus(server.credentials) as bus:
                stream = await bus.ensure_run_stream(run_name)
                server.stop(kill=True)
                threading.Timer(7.0, server.start).start()
                subj = subjects.echo(run_name, "late")
                async with bus.pull_consumer(stream=stream, durable="late",
                                             filter_subject=subj) as c:
                    await bus.publish_durable(subj, m.Echo(seq=1), "late-1")
                    got = await c.fetch(1, timeout_s=5)
                    assert [m.decode(d.data).seq for d in got] == [1]
                assert bus.statistics().reconnects >= 1

        trio.run(main)


def test_the_last_stored_message_on_a_subject_can_be_read_back(creds, run_name):
    async def main():
        async with open_bus(creds) as bus:
            stream = await bus.ensure_run_stream(run_name)
            assert await bus.last_message(stream, subjects.weights(run_name)) is None
            for v in (1, 2, 3):
                await bus.publish_durable(
                    subjects.weights(run_name), m.WeightsPublished(version=v, path=f"/c/{v}"),
                    f"w{v}",
                )
            last = await bus.last_message(stream, subjects.weights(run_name))
            assert m.decode(last.data).version == 3

    trio.run(main)


def _paused(server: EmbeddedNats, for_s: float) -> None:
    """SIGSTOP the server now and SIGCONT it `for_s` later (a frozen host, not a crash)."""
    server.proc.send_signal(signal.SIGSTOP)
    threading.Timer(for_s, server.proc.send_signal, args=(signal.SIGCONT,)).start()


async def _publish_echoes(bus, run: str, n: int) -> str:
    stream = await bus.ensure_run_stream(run)
    for i in range(n):
        await bus.publish_durable(subjects.echo(run, "r"), m.Echo(seq=i), f"r{i}")
    return stream


@pytest.mark.slow
def test_an_ordered_read_waits_out_a_server_pause_instead_of_ending_early(tmp_path, run_name):
    # Before: the first empty fetch (1 s) ended the read, and the caller got a prefix of
    # the stream as if it were all of it (the multi-host test's final count lost 525 of 600).
    with EmbeddedNats(data_dir=tmp_path / "nats") as server:

        async def main():
            async with open_bus(server.credentials) as bus:
                stream = await _publish_echoes(bus, run_name, 1000)
                seqs = []
                async for d in bus.read_stream(stream, batch=100):
                    seqs.append(m.decode(d.data).seq)
                    if len(seqs) == 100:
                        _paused(server, 2.5)
                assert seqs == list(range(1000))

        trio.run(main)


@pytest.mark.slow
def test_an_ordered_read_that_cannot_go_on_raises_instead_of_returning_a_prefix(tmp_path,
                                                                                run_name):
    with EmbeddedNats(data_dir=tmp_path / "nats") as server:

        async def main():
            async with open_bus(server.credentials) as bus:
                stream = await _publish_echoes(bus, run_name, 300)
                seqs = []
                with pytest.raises(BusError, match=r"nothing after seq 100 for 2 s.*up to 300"):
                    async for d in bus.read_stream(stream, batch=100, stall_s=2.0):
                        seqs.append(m.decode(d.data).seq)
                        if len(seqs) == 100:
                            _paused(server, 6.0)
                assert seqs == list(range(100))

        trio.run(main)


def test_a_filtered_read_returns_only_its_subject_and_an_empty_one_returns_nothing(creds,
                                                                                   run_name):
    async def main():
        async with open_bus(creds) as bus:
            stream = await bus.ensure_run_stream(run_name)
            for i in range(10):
                await bus.publish_durable(subjects.echo(run_name, "a" if i % 3 else "b"),
                                          m.Echo(seq=i), f"f{i}")
            b = [m.decode(d.data).seq
                 async for d in bus.read_stream(stream, filter_subject=subjects.echo(run_name, "b"))]
            none = [d async for d in bus.read_stream(stream,
                                                     filter_subject=subjects.echo(run_name, "c"))]
            assert (b, none) == ([0, 3, 6, 9], [])

    trio.run(main)


def test_a_run_stream_whose_subjects_clash_is_refused_with_the_servers_reason(creds, run_name):
    # Before: any 400 was read as "the stream exists", and the follow-up lookup failed with
    # a bare "stream not found" that named neither the stream nor the cause.
    async def main():
        async with open_bus(creds) as bus:
            clash = js_api.StreamConfig(name=f"CLASH-{run_name}",
                                        subjects=[subjects.echo(run_name, ">")])
            await bus.aio(bus._js.add_stream)(clash)
            try:
                with pytest.raises(BusError, match=r"cannot create stream .*subjects overlap"):
                    await bus.ensure_run_stream(run_name)
            finally:
                await bus.aio(bus._js.delete_stream)(clash.name)

    trio.run(main)


def test_stream_set_up_errors_split_into_update_retry_and_a_clear_refusal():
    """Unit test of the classification alone (the codes are nats-server's)."""

    def error(err_code: int, description: str) -> nats.js.errors.APIError:
        return nats.js.errors.BadRequestError(code=400, err_code=err_code,
                                              description=description)

    assert classify_stream_error("S", error(10058, "stream name already in use")) == "update"
    assert classify_stream_error("S", error(10005, "no suitable peers for placement")) == "retry"
    with pytest.raises(BusError, match=r"stream S: replicas > 1 not supported .*needs a NATS"):
        classify_stream_error("S", error(10074, "replicas > 1 not supported in non-clustered mode"))


def test_a_jetstream_call_waits_out_a_stream_without_a_leader(creds):
    """A stream just made with three replicas has no leader for a moment: a publish to it
    finds no responder, which nats-py raises as NoStreamResponseError. The bus waits that
    out like the other cluster waits. (The call is scripted; the bus is real.)"""
    calls = []

    async def publish_once_a_leader_answers():
        calls.append(trio.current_time())
        if len(calls) < 3:
            raise nats.js.errors.NoStreamResponseError
        return "acked"

    async def main():
        async with open_bus(creds) as bus:
            assert await bus.js_call(publish_once_a_leader_answers, what="a publish") == "acked"

    trio.run(main)
    assert len(calls) == 3 and calls[1] - calls[0] >= 0.25  # retried after the back-off
