"""Malformed and hostile messages thrown at every RL actor type on every subject it reads:
each is dead-lettered with a reason and the actor keeps serving (property-based, against a
real nats-server; the sampler against a real `reinforge serve`)."""

from __future__ import annotations

import functools
import uuid
from pathlib import Path

import msgspec
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reinforge.rl.evalsets import HeldOutConfig
from reinforge.actors.evaluator import Evaluator, EvaluatorConfig
from reinforge.actors.learner import Learner, LearnerConfig
from reinforge.actors.monitor import Monitor, MonitorConfig
from reinforge.actors.sampler import SamplerActor, SamplerConfig
from reinforge.actors.scheduler import Scheduler, SchedulerConfig
from reinforge.actors.verifier import VerifierActor, VerifierConfig
from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.actor import RuntimeConfig, run_actor
from reinforge.core.bus import open_bus

pytestmark = [pytest.mark.nats, pytest.mark.slow]

_json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8,
)
_int = st.integers(-2**63, 2**63 - 1)
_rollout_like = st.fixed_dictionaries({
    "rollout_id": st.one_of(st.text(max_size=6), _int),
    "task_id": st.one_of(st.text(max_size=6), st.none()),
    "sample_index": st.one_of(_int, st.text(max_size=3)),
    "output_ids": st.one_of(st.lists(_int, max_size=4), st.text(max_size=4)),
})
# Not one of the types these actors accept: random bytes, msgpack of the wrong shape, look-
# alikes of their own types with hostile fields, and well-formed messages of other types.
garbage = st.one_of(
    st.binary(max_size=200),
    st.builds(msgspec.msgpack.encode, _json_like),
    st.builds(lambda r: msgspec.msgpack.encode({"type": "rollout/1", **r}), _rollout_like),
    st.builds(lambda r, w: msgspec.msgpack.encode({"type": "scored/1", "rollout": r, "reward": w}),
              _rollout_like, st.one_of(st.floats(), st.text(max_size=3), st.none())),
    st.builds(lambda v: msgspec.msgpack.encode({"type": "weights/1", "version": v, "path": 3}),
              st.one_of(_int, st.text(max_size=3), st.none())),
    st.just(m.encode(m.Echo(seq=1))),
    st.just(m.encode(m.Stop(reason="not for this input"))),
)


def _durable_subjects(run: str) -> dict[str, list[str]]:
    """Each actor type's durable inputs (JetStream): bad messages there are terminated."""
    return {
        "scheduler": [],
        "verifier": [subjects.rollout(run, "math")],
        "learner": [subjects.scored(run, "math"), subjects.weights(run)],
        "monitor": [],
        "evaluator": [subjects.weights(run)],
        "sampler": [subjects.task(run, "math")],
    }


def _core_subjects(run: str) -> dict[str, list[str]]:
    """Each actor type's core NATS inputs (at most once): bad messages are recorded."""
    return {
        "scheduler": [subjects.scored(run, "math"), subjects.weights(run),
                      subjects.announce(run)],
        "verifier": [],
        "learner": [],
        "monitor": [subjects.scored(run, "math"), subjects.weights(run)],
        "evaluator": [],
        "sampler": [subjects.weights(run)],
    }


def _actor(kind: str, run: str, tmp: Path, model: Path, server_url: str):
    if kind == "scheduler":
        return Scheduler, SchedulerConfig(domains={"math": 1.0}, state_file=str(tmp / "s.json"),
                                          mix_file=str(tmp / "mix.json"), max_in_flight=2)
    if kind == "verifier":
        return VerifierActor, VerifierConfig(domains=["math"], sandbox=False)
    if kind == "learner":
        return Learner, LearnerConfig(model=str(model), checkpoint_dir=str(tmp / "ckpt"),
                                      torch_threads=1)
    if kind == "monitor":
        return Monitor, MonitorConfig(port=0)
    if kind == "evaluator":
        return Evaluator, EvaluatorConfig(domains=["math"], state_file=str(tmp / "e.json"),
                                          heldout=HeldOutConfig(tasks_per_tier=1, tiers=[0]))
    return SamplerActor, SamplerConfig(url=server_url, model_path=str(model), domains=["math"])


async def _delete_stream(bus, run: str) -> None:
    js = bus._js  # the test's own clean-up; the runtime never deletes a run's stream

    async def drop() -> None:
        try:
            await js.delete_stream(subjects.stream_name(run))
        except Exception:  # noqa: BLE001 - already gone
            pass

    await bus.aio(drop)()


@pytest.mark.parametrize("kind", ["scheduler", "verifier", "learner", "monitor", "evaluator",
                                  "sampler"])
def test_every_actor_type_dead_letters_bad_input_and_keeps_serving(
    kind, creds, tiny_model_dir, tmp_path_factory, monkeypatch, request
):
    server_url = request.getfixturevalue("server_url") if kind == "sampler" else ""
    monkeypatch.setenv("REINFORGE_HOME", str(tmp_path_factory.mktemp("home")))

    @settings(max_examples=6, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(payloads=st.lists(garbage, min_size=1, max_size=4))
    def check(payloads: list[bytes]) -> None:
        run = "bad" + uuid.uuid4().hex[:10]
        tmp = tmp_path_factory.mktemp(kind)
        cls, config = _actor(kind, run, tmp, tiny_model_dir, server_url)
        targets = [(s, True) for s in _durable_subjects(run)[kind]]
        targets += [(s, False) for s in _core_subjects(run)[kind]]

        async def main() -> None:
            async with open_bus(creds) as bus:
                stream = await bus.ensure_run_stream(run)
                try:
                    async with trio.open_nursery() as nursery:
                        ctx = await nursery.start(functools.partial(
                            run_actor, cls, creds=creds, run=run, config=config,
                            runtime=RuntimeConfig(heartbeat_s=0.2)))
                        sent = []
                        for subject, durable in targets:
                            for i, data in enumerate(payloads):
                                if durable:
                                    await bus.publish_durable_raw(subject, data,
                                                                  f"bad:{subject}:{i}")
                                else:
                                    await bus.publish_raw(subject, data)
                                sent.append(data)
                        letters = await _dead_letters(bus, stream, run, len(sent))
                        assert all(x.reason and x.actor_id == ctx.actor_id for x in letters)
                        assert sorted(x.payload for x in letters) == sorted(sent)
                        await _beats_after(bus, run, ctx.actor_id)  # still serving
                        assert not ctx.stop_requested.is_set()
                        ctx.stop_requested.set()  # a graceful stop: teardown closes files
                finally:
                    await _delete_stream(bus, run)

        trio.run(main)

    check()


async def _beats_after(bus, run: str, actor_id: str) -> None:
    """Wait for a heartbeat of `actor_id` sent after now, saying it is running."""
    import time

    since = time.time()
    async with bus.subscribe(subjects.heartbeat(run, actor_id)) as sub:
        with trio.fail_after(10):
            async for batch in sub:
                for raw in batch:
                    hb = m.decode(raw.data)
                    if hb.sent_at > since and hb.state == "running":
                        return


async def _dead_letters(bus, stream: str, run: str, n: int) -> list[m.DeadLetter]:
    letters: list[m.DeadLetter] = []
    async with bus.pull_consumer(stream=stream, durable="obs-dlq",
                                 filter_subject=subjects.dlq(run)) as dlq:
        with trio.fail_after(60):
            while len(letters) < n:
                batch = await dlq.fetch(50, 0.2)
                letters += [m.decode(d.data) for d in batch]
                await dlq.ack(batch)
    return letters
