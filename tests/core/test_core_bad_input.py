"""Hostile and malformed messages thrown at a running actor: each one is dead-lettered with a
reason, and the actor keeps serving (property-based, against a real nats-server)."""

import functools
import uuid

import msgspec
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reinforge.actors.echo import EchoActor, EchoConfig
from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.actor import run_actor
from reinforge.core.bus import open_bus

pytestmark = [pytest.mark.nats, pytest.mark.slow]

# Payloads that are not an Echo: random bytes, valid msgpack of the wrong shape,
# other message types, and Echo look-alikes with hostile field values.
garbage = st.one_of(
    st.binary(min_size=0, max_size=300),
    st.builds(lambda v: msgspec.msgpack.encode(v), st.recursive(
        st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats()
        | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                       max_size=4),
        max_leaves=10)),
    st.builds(lambda seq, body: msgspec.msgpack.encode({"type": "echo/1", "seq": seq,
                                                       "body": body}),
              st.one_of(st.text(max_size=5), st.floats(), st.none()), st.integers(-9, 9)),
    st.just(m.encode(m.Stop(reason="not for this input"))),
    st.just(m.encode(m.Task(task_id="t", domain="d", tier=0, prompt="p"))),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payloads=st.lists(garbage, min_size=1, max_size=6))
def test_every_malformed_message_is_dead_lettered_and_the_actor_keeps_serving(creds, payloads):
    run = "bad" + uuid.uuid4().hex[:10]

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            stream = await bus.ensure_run_stream(run)
            ctx = await nursery.start(functools.partial(
                run_actor, EchoActor, creds=creds, run=run, config=EchoConfig()))
            src = subjects.echo(run, "in")
            for i, data in enumerate(payloads):
                await bus.publish_durable_raw(src, data, f"bad-{i}")
            await bus.publish_durable(src, m.Echo(seq=99), "good")
            letters, outs = [], []
            async with bus.pull_consumer(stream=stream, durable="obs-dlq",
                                         filter_subject=subjects.dlq(run)) as dlq, \
                    bus.pull_consumer(stream=stream, durable="obs-out",
                                      filter_subject=subjects.echo(run, "out")) as out:
                with trio.fail_after(30):
                    while len(letters) < len(payloads) or not outs:
                        letters += [m.decode(d.data) for d in await dlq.fetch(50, 0.2)]
                        outs += [m.decode(d.data) for d in await out.fetch(50, 0.2)]
            assert all(isinstance(x, m.DeadLetter) and x.reason for x in letters)
            assert sorted(x.payload for x in letters) == sorted(payloads)
            assert [x.seq for x in outs] == [99]  # still serving
            assert ctx.counts["dead_letters"] == len(payloads)
            nursery.cancel_scope.cancel()

    trio.run(main)


class _Failing(EchoActor):
    """An echo whose handler fails inside a nursery (the error arrives wrapped in a group)."""

    actor_type = "failing"

    def inputs(self):
        from reinforge.core.actor import Input

        return [Input(subject=subjects.echo(self.ctx.run, "in"), handler=self.on_echo,
                      accepts=(m.Echo,), max_deliver=2, retry_delay_s=0.05)]

    async def on_echo(self, msg):
        async def boom():
            raise KeyError("no such key")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(boom)


def test_a_failing_handler_is_logged_by_its_own_error_each_delivery_then_dead_lettered(
        creds, capsys):
    run = "fail" + uuid.uuid4().hex[:10]

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            stream = await bus.ensure_run_stream(run)
            await nursery.start(functools.partial(
                run_actor, _Failing, creds=creds, run=run, config=EchoConfig()))
            await bus.publish_durable(subjects.echo(run, "in"), m.Echo(seq=1), "one")
            async with bus.pull_consumer(stream=stream, durable="obs-dlq",
                                         filter_subject=subjects.dlq(run)) as dlq:
                with trio.fail_after(30):
                    letters = []
                    while not letters:
                        letters = [m.decode(d.data) for d in await dlq.fetch(10, 0.2)]
            nursery.cancel_scope.cancel()
        return letters

    [letter] = trio.run(main)
    assert letter.reason == "handler error: KeyError: 'no such key' (after 2 deliveries)"
    log = [ln for ln in capsys.readouterr().err.splitlines() if "handler error" in ln]
    assert [ln.split(": ", 1)[1] for ln in log] == [
        f"{subjects.echo(run, 'in')} (delivery {n} of 2): handler error: KeyError: 'no such key'"
        for n in (1, 2)]
