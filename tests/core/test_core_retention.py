"""The message log's bounds: the keeper trims acknowledged messages, never unacknowledged work."""

import functools

import pytest
import trio

from reinforge.actors.echo import EchoActor, EchoConfig, EchoSource, EchoSourceConfig
from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.actor import RuntimeConfig, run_actor
from reinforge.core.bus import open_bus
from reinforge.core.retention import (
    AgeClock,
    ConsumerView,
    LogRetention,
    StreamView,
    keep_log_bounded,
    read_trims,
    trim_once,
    trim_point,
)
from reinforge.cli.log import trim_summary

STREAM = StreamView(first_seq=101, last_seq=1100, messages=1000, bytes=1_000_000)


def consumer(name, floor, *, pending=5, ack_pending=0):
    return ConsumerView(name=name, pending=pending, ack_pending=ack_pending, ack_floor=floor)


def test_the_bounds_say_how_far_to_cut_and_unacknowledged_work_says_where_to_stop():
    """Unit test of the plan alone."""
    # within both bounds: nothing
    assert trim_point(STREAM, [], age_cut=0, max_bytes=2_000_000).before_seq == 0
    # age: everything stored before seq 400
    assert trim_point(STREAM, [], age_cut=400, max_bytes=0).before_seq == 400
    # bytes: 1 MB held, 0.5 MB allowed: cut to 90 % of it (550 messages of 1000 bytes go)
    by_bytes = trim_point(STREAM, [], age_cut=0, max_bytes=500_000)
    assert (by_bytes.before_seq, by_bytes.why) == (651, "bytes")
    # a consumer that acknowledged up to 300 (and has more to do) stops the cut at 301 ...
    held = trim_point(STREAM, [consumer("sampler", 300), consumer("learner", 900)],
                      age_cut=0, max_bytes=500_000)
    assert (held.before_seq, held.held_by) == (301, "sampler")
    # ... one that is fully caught up holds nothing back, whatever its floor says
    idle = consumer("evaluator", 120, pending=0, ack_pending=0)
    assert trim_point(STREAM, [idle], age_cut=0, max_bytes=500_000).before_seq == 651
    # one with work out but unacknowledged at the very start: nothing can go
    assert trim_point(STREAM, [consumer("verifier", 100, pending=0, ack_pending=3)],
                      age_cut=900, max_bytes=0).before_seq == 0


def test_the_age_clock_knows_what_was_stored_before_the_bound():
    clock = AgeClock()
    for t, seq in ((0.0, 10), (50.0, 20), (100.0, 30)):
        clock.note(t, seq)
    assert clock.cut(now=40.0, max_age_s=60.0) == 0  # nothing is 60 s old yet
    assert clock.cut(now=110.0, max_age_s=60.0) == 21  # up to seq 20 was stored by t=50
    assert clock.cut(now=110.0, max_age_s=0.0) == 0  # no age bound


def test_a_bad_bound_is_refused_by_name():
    with pytest.raises(ValueError, match=r"\[log\] every_s must be > 0"):
        LogRetention(every_s=0)


def test_the_export_says_what_was_trimmed_and_when_nothing_was():
    trims = [{"why": "bytes", "messages": 40, "bytes": 4000, "before_seq": 41},
             {"why": "age", "messages": 10, "bytes": 900, "before_seq": 51}]
    assert trim_summary(trims, 51) == (
        "trimmed by the run's [log] bounds (age, bytes): 50 acknowledged messages, "
        "4900 bytes, in 2 passes; the log is kept from seq 51")
    assert trim_summary([], 1) == "nothing was trimmed: the log is whole"


@pytest.mark.nats
def test_a_stream_run_far_past_its_byte_cap_keeps_working_and_loses_no_work(
    creds, run_name, tmp_path
):
    # Before: the stream only grew, and with its cap reached every publish failed
    # (DiscardNew). Traffic here is about five times the hard cap.
    cap, n = 192 * 1024, 6000
    runtime = RuntimeConfig(stream_max_bytes=cap, heartbeat_s=0.5)
    keep = LogRetention(max_bytes=64 * 1024, max_age_s=0, every_s=0.2)
    journal = tmp_path / "trimmed.jsonl"

    async def main():
        async with open_bus(creds) as bus:
            stream = await bus.ensure_run_stream(run_name, max_bytes=cap)
            out_subject = subjects.echo(run_name, "out")
            seen: set[int] = set()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_log_bounded, bus, run_name, keep, journal)
                await nursery.start(functools.partial(
                    run_actor, EchoActor, creds=creds, run=run_name, runtime=runtime,
                    config=EchoConfig(concurrency=16)))
                await nursery.start(functools.partial(
                    run_actor, EchoSource, creds=creds, run=run_name, runtime=runtime,
                    config=EchoSourceConfig(count=n, rate_per_s=0)))
                async with bus.pull_consumer(stream=stream, durable="watch",
                                             filter_subject=out_subject) as c:
                    with trio.fail_after(240):
                        while len(seen) < n:
                            got = await c.fetch(256, timeout_s=0.5)
                            seen.update(m.decode(d.data).seq for d in got)
                            await c.ack(got)
                nursery.cancel_scope.cancel()
            info = await bus.stream_info(stream)
            return seen, info.state

    seen, state = trio.run(main)
    assert seen == set(range(n))  # every message went in and came out: no publish failed
    trims = read_trims(journal)
    assert sum(t["messages"] for t in trims) > n  # most of the 2n messages were trimmed
    assert state.bytes <= cap and state.first_seq > 1


@pytest.mark.nats
def test_unacknowledged_work_outlives_every_bound_and_weights_are_kept(creds, run_name):
    async def main():
        async with open_bus(creds) as bus:
            stream = await bus.ensure_run_stream(run_name)
            work = subjects.echo(run_name, "work")
            await bus.publish_durable(subjects.weights(run_name),
                                      m.WeightsPublished(version=1, path="/w1"), "w1")
            for i in range(100):
                await bus.publish_durable(work, m.Echo(seq=i), f"work{i}")
            async with bus.pull_consumer(stream=stream, durable="slow", filter_subject=work,
                                         ack_wait_s=60) as c:
                first = await c.fetch(40, timeout_s=2)
                await c.ack(first[:30])  # 30 done, 10 in hand, 60 not yet fetched
                trim = await trim_once(bus, run_name, LogRetention(max_bytes=1, max_age_s=0),
                                       AgeClock(), None)
                assert trim.held_by == "slow"
                await c.ack(first[30:])
                rest = []
                with trio.fail_after(10):
                    while len(rest) < 60:
                        rest += await c.fetch(60, timeout_s=1)
                await c.ack(rest)
            latest = await bus.last_message(stream, subjects.weights(run_name))
            kept = [m.decode(d.data).seq async for d in bus.read_stream(stream,
                                                                       filter_subject=work)]
            return trim, [m.decode(d.data).seq for d in rest], latest, kept

    trim, rest, latest, kept = trio.run(main)
    assert rest == list(range(40, 100))
    assert m.decode(latest.data).version == 1  # the weights announcement was not trimmed
    assert kept == list(range(30, 100))  # only the 30 acknowledged ones went
    assert trim.why == "bytes"
