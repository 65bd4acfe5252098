"""The verifier actor against a real nats-server (and real rootless Podman where marked)."""

from __future__ import annotations

import functools
import random
import signal

import msgspec
import pytest
import trio
from reinforge.actors.verifier import VerifierActor, VerifierConfig, resource_limits
from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.actor import run_actor
from reinforge.core.bus import open_bus
from reinforge.envs.domain import Check, DomainRegistry, Verdict
from reinforge.envs.sandbox.pool import PoolConfig
from reinforge.rl.samples import scored_from_verdict, task_spec_of

VERIFIER = "reinforge.actors.verifier:VerifierActor"
BAD = {
    "math": "I think it is \\boxed{-123456}.",
    "docqa": "{}",
    "judge": "I do not know.",
    "code": "    return None\n",
    "terminal": "$ ls\n$ exit",
}


def rollout_for(task, completion: str, index: int) -> m.Rollout:
    return m.Rollout(
        rollout_id=f"{task.task_id}:{index}:1",
        task_id=task.task_id,
        sample_index=index,
        domain=task.domain,
        tier=task.tier,
        prompt=task.prompt,
        completion=completion,
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5],
        logprobs=[-0.5, -0.25],
        policy_version=7,
        spec=task.spec,
        group_size=2,
    )


def good_and_bad(domain: str, tier: int, seed: int = 0) -> list[m.Rollout]:
    task = DomainRegistry.default().get(domain).sample_task(random.Random(seed), tier)
    return [rollout_for(task, task.reference, 0), rollout_for(task, BAD[domain], 1)]


async def publish_rollouts(bus, run: str, rollouts: list[m.Rollout]) -> None:
    await bus.ensure_run_stream(run)
    for r in rollouts:
        await bus.publish_durable(subjects.rollout(run, r.domain), r, msg_id=r.rollout_id)


async def collect_scored(
    bus, run: str, n: int, *, timeout_s: float, group: str = "observer"
) -> dict[str, m.ScoredRollout]:
    """Every scored rollout stored in the stream, by rollout_id, until `n` distinct are seen."""
    stream = await bus.ensure_run_stream(run)
    got: dict[str, m.ScoredRollout] = {}
    durable = subjects.durable_name(run, group, subjects.scored(run))
    async with bus.pull_consumer(
        stream=stream, durable=durable, filter_subject=subjects.scored(run)
    ) as consumer:
        with trio.fail_after(timeout_s):
            while len(got) < n:
                batch = await consumer.fetch(64, timeout_s=0.5)
                for d in batch:
                    msg = m.decode(d.data)
                    assert isinstance(msg, m.ScoredRollout)
                    got[msg.rollout.rollout_id] = msg
                await consumer.ack(batch)
    return got


async def count_stored(bus, run: str, subject: str) -> int:
    n = 0
    async for _ in bus.read_stream(subjects.stream_name(run), filter_subject=subject):
        n += 1
    return n


class SlowMath:
    """Test domain: math, but each check takes 4 s (longer than a short lease)."""

    def __new__(cls):
        from reinforge.envs.domains.math import MathDomain

        class _Slow(MathDomain):
            name = "slowmath"
            checks = 0

            async def verify(self, task, completion):
                self.checks += 1
                await trio.sleep(4.0)
                return await super().verify(task, completion)

        return _Slow()


class FlakyMath:
    """Test domain: math whose first two checks of every rollout are infrastructure faults."""

    def __new__(cls):
        from reinforge.envs.domains.math import MathDomain

        class _Flaky(MathDomain):
            name = "flakymath"

            def __init__(self):
                super().__init__()
                self.tries: dict[str, int] = {}  # per rollout

            async def verify(self, task, completion):
                key = f"{task.task_id}|{completion}"
                self.tries[key] = self.tries.get(key, 0) + 1
                if self.tries[key] <= 2:
                    raise ConnectionError("judge pod restarting")
                return await super().verify(task, completion)

        return _Flaky()


def renamed(rollouts: list[m.Rollout], domain: str) -> list[m.Rollout]:
    return [msgspec.structs.replace(r, domain=domain, rollout_id=f"{domain}-{r.rollout_id}")
            for r in rollouts]


# ----------------------------------------------------------------------------- pure parts


def test_the_task_spec_is_rebuilt_from_what_the_rollout_carries():
    (good, _) = good_and_bad("math", 1)
    spec = task_spec_of(good)
    assert (spec.task_id, spec.domain, spec.tier, spec.prompt) == (
        good.task_id, "math", 1, good.prompt)
    assert spec.spec == good.spec


def test_an_infra_error_verdict_keeps_zero_reward_and_says_how_often_it_was_tried():
    (good, _) = good_and_bad("math", 0)
    verdict = Verdict(reward=0.0, outcome="infra_error", reason="sandbox down")
    scored = scored_from_verdict(good, verdict, verifier_id="v1", verify_s=0.5, attempts=3)
    assert scored.outcome is m.Outcome.INFRA_ERROR
    assert scored.reward == 0.0
    assert scored.reason == "sandbox down (infra_error on all 3 attempts)"
    assert scored.rollout.timings.verify_s == 0.5
    # what the learner needs is carried through untouched
    for field in ("prompt_ids", "output_ids", "logprobs", "policy_version", "group_size",
                  "task_id", "sample_index"):
        assert getattr(scored.rollout, field) == getattr(good, field)


def test_checks_and_output_of_the_domain_verdict_go_on_the_bus():
    (good, _) = good_and_bad("math", 0)
    verdict = Verdict(reward=1.0, outcome="pass", reason="ok", output="computed 42\n",
                      checks=[Check(name="answer", passed=True, detail="42 == 42")])
    scored = scored_from_verdict(good, verdict, verifier_id="v1", verify_s=0.0, attempts=1)
    assert scored.checks == [m.Check(name="answer", passed=True, detail="42 == 42")]
    assert scored.reason == "ok" and scored.outcome is m.Outcome.PASS
    assert m.decode(m.encode(scored)).output == "computed 42\n"


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"concurrency": 0}, "concurrency"),
        ({"infra_attempts": 0}, "infra_attempts"),
        ({"ack_wait_s": 1}, "ack_wait_s"),
        ({"resource_limits": {"sandbox": 0}}, "resource_limits['sandbox']"),
    ],
)
def test_a_bad_verifier_config_is_refused_with_the_field_named(overrides, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        VerifierConfig(**overrides)


def test_the_sandbox_limit_defaults_to_what_the_pool_takes_at_once():
    # 2 sandboxes x the pool's batch of 4: fewer would keep its batches from forming
    assert resource_limits(VerifierConfig(sandbox_pool_size=2))["sandbox"] == 8
    assert resource_limits(VerifierConfig(resource_limits={"sandbox": 3}))["sandbox"] == 3
    assert resource_limits(VerifierConfig())["judge"] == 4


# ----------------------------------------------------------------------------- on the bus


@pytest.mark.nats
def test_cpu_domains_are_scored_from_the_bus_with_typed_outcomes(creds, run_name):
    rollouts = [r for d in ("math", "docqa", "judge") for r in good_and_bad(d, 1)]

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            cfg = VerifierConfig(domains=["math", "docqa", "judge"], sandbox=False)
            await nursery.start(functools.partial(
                run_actor, VerifierActor, creds=creds, run=run_name, config=cfg))
            await publish_rollouts(bus, run_name, rollouts)
            got = await collect_scored(bus, run_name, len(rollouts), timeout_s=60)
            nursery.cancel_scope.cancel()
        for r in rollouts:
            s = got[r.rollout_id]
            if r.sample_index == 0:
                assert (s.outcome, s.reward) == (m.Outcome.PASS, 1.0), s.reason
            else:
                assert s.outcome is m.Outcome.FAIL and s.reward == 0.0, s.reason
            assert s.reason and s.verifier_id.startswith("verifier-")
            assert s.rollout == msgspec.structs.replace(r, timings=s.rollout.timings)

    trio.run(main)


@pytest.mark.nats
def test_a_sandbox_domain_without_a_sandbox_is_published_as_infra_error_never_a_plain_fail(
    creds, run_name
):
    rollouts = good_and_bad("code", 0)

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            cfg = VerifierConfig(domains=["code"], sandbox=False, infra_attempts=2,
                                 infra_retry_delay_s=0.05)
            await nursery.start(functools.partial(
                run_actor, VerifierActor, creds=creds, run=run_name, config=cfg))
            await publish_rollouts(bus, run_name, rollouts)
            got = await collect_scored(bus, run_name, 2, timeout_s=60)
            nursery.cancel_scope.cancel()
        for s in got.values():
            assert s.outcome is m.Outcome.INFRA_ERROR and s.reward == 0.0
            assert "no sandbox attached" in s.reason
            assert "infra_error on all 2 attempts" in s.reason

    trio.run(main)


@pytest.mark.nats
def test_a_rollout_of_a_domain_the_verifier_does_not_serve_is_dead_lettered(creds, run_name):
    (good, _) = good_and_bad("math", 0)

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            cfg = VerifierConfig(sandbox=False)  # every domain: one input on rollout.*
            await nursery.start(functools.partial(
                run_actor, VerifierActor, creds=creds, run=run_name, config=cfg))
            alien = msgspec.structs.replace(good, domain="chess", rollout_id="alien:0:1")
            await publish_rollouts(bus, run_name, [alien, good])
            got = await collect_scored(bus, run_name, 1, timeout_s=60)
            assert set(got) == {good.rollout_id}
            with trio.fail_after(30):
                while not await count_stored(bus, run_name, subjects.dlq(run_name)):
                    await trio.sleep(0.1)
            async for d in bus.read_stream(subjects.stream_name(run_name),
                                           filter_subject=subjects.dlq(run_name)):
                letter = m.decode(d.data)
                assert isinstance(letter, m.DeadLetter)
                assert "does not serve domain 'chess'" in letter.reason
            nursery.cancel_scope.cancel()

    trio.run(main)


async def sandbox_figures(bus, run: str, timeout_s: float = 30) -> dict[str, float]:
    """The figures of the first verifier heartbeat that reports sandbox work."""
    with trio.fail_after(timeout_s):
        async with bus.subscribe(subjects.heartbeat(run)) as sub:
            async for batch in sub:
                for record in batch:
                    beat = m.decode(record.data)
                    if beat.actor_type == "verifier" and beat.figures.get("sandbox_jobs", 0.0) > 0:
                        return beat.figures
    raise AssertionError("the heartbeat subscription ended")


@pytest.mark.nats
@pytest.mark.podman
@pytest.mark.slow
def test_a_verifier_in_a_running_cluster_scores_rollouts_of_all_five_domains(
    creds, run_name, podman_url
):
    domains = ("math", "code", "docqa", "terminal", "judge")
    rollouts = [r for d in domains for r in good_and_bad(d, 0, seed=1)]
    rollouts += good_and_bad("code", 2, seed=2) + good_and_bad("terminal", 3, seed=2)

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            cfg = VerifierConfig(sandbox_pool_size=2)
            ctx = await nursery.start(functools.partial(
                run_actor, VerifierActor, creds=creds, run=run_name, config=cfg))
            assert ctx.actor_type == "verifier"
            await publish_rollouts(bus, run_name, rollouts)
            got = await collect_scored(bus, run_name, len(rollouts), timeout_s=240)
            figures = await sandbox_figures(bus, run_name)
            nursery.cancel_scope.cancel()
        # the pool's work shows in the verifier's heartbeats: every code check went through it
        code_checks = sum(r.domain == "code" for r in rollouts)
        assert figures["sandbox_jobs"] >= code_checks, figures
        assert figures["sandbox_execs"] >= 1
        assert 1.0 <= figures["sandbox_jobs_per_exec"] <= PoolConfig().max_batch
        for r in rollouts:
            s = got[r.rollout_id]
            if r.sample_index == 0:
                assert (s.outcome, s.reward) == (m.Outcome.PASS, 1.0), (r.domain, s.reason)
            else:
                assert s.outcome in (m.Outcome.FAIL, m.Outcome.ERROR), (r.domain, s.reason)
                assert s.reward < 1.0
            assert s.outcome is not m.Outcome.INFRA_ERROR

    trio.run(main)


@pytest.mark.nats
@pytest.mark.podman
@pytest.mark.slow
def test_a_killed_verifier_redelivers_its_rollouts_and_each_is_scored_exactly_once(
    creds, creds_file, run_name, spawn, podman_url, reap_run_sandboxes
):
    # slow but correct candidates, so checks are in flight when the verifier is killed
    registry = DomainRegistry.default()
    rollouts = []
    for seed in range(8):
        task = registry.get("code").sample_task(random.Random(100 + seed), 0)
        body = ("    import time\n    if not getattr(time, 'slept', False):\n"
                "        time.slept = True\n        time.sleep(1.5)\n" + task.reference)
        rollouts.append(rollout_for(task, body, 0))

    async def main():
        async with open_bus(creds) as bus:
            await publish_rollouts(bus, run_name, rollouts)
            args = ("actor", "run", VERIFIER, "--run", run_name, "--creds", str(creds_file),
                    "--set", "domains=['code']", "--set", "ack_wait_s=4",
                    "--set", "sandbox_pool_size=2",
                    # one check at a time: the first result comes while the other seven are
                    # still held (unacked) by this verifier, however the pool batches
                    "--set", "resource_limits.sandbox=1")
            first = spawn(*args, log_name="verifier1.log")
            await collect_scored(bus, run_name, 1, timeout_s=120, group="first")
            first.send_signal(signal.SIGKILL)
            first.wait()
            second = spawn(*args, log_name="verifier2.log")
            got = await collect_scored(bus, run_name, len(rollouts), timeout_s=180)
            assert {s.outcome for s in got.values()} == {m.Outcome.PASS}, [
                s.reason for s in got.values()]
            # the first verifier took all 8 at once (handler concurrency) but checked them one
            # at a time, so what the second one scored had been in flight in the killed one
            # and was redelivered
            assert len({s.verifier_id for s in got.values()}) == 2
            # nothing lost (above), nothing stored twice (msg_id dedupe of redelivered checks)
            assert await count_stored(bus, run_name, subjects.scored(run_name)) == len(rollouts)
            # a verifier stopped by SIGTERM removes its sandboxes; only the killed one's remain
            second.send_signal(signal.SIGTERM)
            assert await trio.to_thread.run_sync(lambda: second.wait(60)) == 0
            owners = {c.labels["reinforge.actor"] for c in reap_run_sandboxes(run_name)}
            assert len(owners) == 1
            assert owners <= {s.verifier_id for s in got.values()}

    trio.run(main)


ARITHMETIC = ["gym-basic_arithmetic", "gym-bitwise_arithmetic", "gym-calendar_arithmetic",
              "gym-complex_arithmetic", "gym-decimal_arithmetic"]


async def first_announcement(announcements, actor_type: str, timeout_s: float) -> m.Announce:
    with trio.fail_after(timeout_s):
        async for batch in announcements:
            for msg in (m.decode(r.data) for r in batch):
                if msg.actor_type == actor_type:
                    return msg
    raise AssertionError("the announcement subscription ended")


@pytest.mark.nats
@pytest.mark.slow
def test_a_glob_in_the_verifiers_config_serves_every_family_domain_it_matches(
    creds, creds_file, run_name, spawn
):
    registry = DomainRegistry.default()
    tasks = [registry.get(d).sample_task(random.Random(d), 0) for d in ARITHMETIC]
    rollouts = [rollout_for(t, t.reference, 0) for t in tasks]

    async def main():
        async with open_bus(creds) as bus, bus.subscribe(subjects.announce(run_name)) as ann:
            await publish_rollouts(bus, run_name, rollouts)
            spawn("actor", "run", VERIFIER, "--run", run_name, "--creds", str(creds_file),
                  "--set", "domains=['gym-*_arithmetic']", "--set", "sandbox=false",
                  log_name="verifier.log")
            hello = await first_announcement(ann, "verifier", timeout_s=60)
            got = await collect_scored(bus, run_name, len(rollouts), timeout_s=60)
        assert hello.capabilities == [f"verifier for domain {d}" for d in ARITHMETIC]
        assert {s.rollout.domain: (s.outcome, s.reward) for s in got.values()} == {
            d: (m.Outcome.PASS, 1.0) for d in ARITHMETIC}

    trio.run(main)


@pytest.mark.nats
def test_a_check_longer_than_the_lease_keeps_it_and_is_not_redelivered(creds, run_name):
    rollouts = renamed(good_and_bad("math", 0), "slowmath")

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            cfg = VerifierConfig(domains=["slowmath"], ack_wait_s=3.0,
                                 extra_domains=["slowmath=test_actors_verifier:SlowMath"])
            await nursery.start(functools.partial(
                run_actor, VerifierActor, creds=creds, run=run_name, config=cfg))
            await publish_rollouts(bus, run_name, rollouts)
            got = await collect_scored(bus, run_name, 2, timeout_s=60)
            durable = subjects.durable_name(run_name, "verifier",
                                            subjects.rollout(run_name, "slowmath"))
            with trio.fail_after(10):  # acks are batched: they may land just after the result
                while (info := await bus.consumer_info(subjects.stream_name(run_name),
                                                       durable)).num_ack_pending:
                    await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
        assert info.num_redelivered == 0 and info.num_ack_pending == 0
        assert [got[r.rollout_id].outcome for r in rollouts] == [m.Outcome.PASS, m.Outcome.FAIL]
        assert all(s.rollout.timings.verify_s >= 4.0 for s in got.values())

    trio.run(main)


@pytest.mark.nats
def test_infrastructure_faults_are_retried_inside_the_handler_before_anything_is_published(
    creds, run_name
):
    rollouts = renamed(good_and_bad("math", 2), "flakymath")

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            cfg = VerifierConfig(domains=["flakymath"], infra_attempts=3,
                                 infra_retry_delay_s=0.05,
                                 extra_domains=["flakymath=test_actors_verifier:FlakyMath"])
            await nursery.start(functools.partial(
                run_actor, VerifierActor, creds=creds, run=run_name, config=cfg))
            await publish_rollouts(bus, run_name, rollouts)
            got = await collect_scored(bus, run_name, 2, timeout_s=60)
            nursery.cancel_scope.cancel()
        assert [got[r.rollout_id].outcome for r in rollouts] == [m.Outcome.PASS, m.Outcome.FAIL]

    trio.run(main)


@pytest.mark.nats
def test_an_infrastructure_fault_that_persists_is_published_as_infra_error_with_its_cause(
    creds, run_name
):
    rollouts = renamed(good_and_bad("math", 2), "flakymath")

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            cfg = VerifierConfig(domains=["flakymath"], infra_attempts=2,
                                 infra_retry_delay_s=0.05,
                                 extra_domains=["flakymath=test_actors_verifier:FlakyMath"])
            await nursery.start(functools.partial(
                run_actor, VerifierActor, creds=creds, run=run_name, config=cfg))
            await publish_rollouts(bus, run_name, rollouts)
            got = await collect_scored(bus, run_name, 2, timeout_s=60)
            nursery.cancel_scope.cancel()
        for s in got.values():
            assert s.outcome is m.Outcome.INFRA_ERROR and s.reward == 0.0
            assert "ConnectionError: judge pod restarting" in s.reason
            assert "infra_error on all 2 attempts" in s.reason

    trio.run(main)


@pytest.mark.nats
def test_a_verifier_given_a_reward_model_scores_the_rm_domain_with_it(
        creds, run_name, tiny_model_dir, tmp_path):
    import math

    from reinforge.envs.domains.reward_model import RewardModelDomain
    from reinforge.rl.reward_model import load_reward_model

    rm_dir = tmp_path / "rm"
    load_reward_model(tiny_model_dir).save_pretrained(str(rm_dir))
    for f in tiny_model_dir.glob("tokenizer*"):
        (rm_dir / f.name).write_bytes(f.read_bytes())
    task = RewardModelDomain().sample_task(random.Random(0), 0)
    rollouts = [rollout_for(task, task.reference, 0), rollout_for(task, "no", 1)]
    want = [RewardModelDomain().score(str(rm_dir), task.prompt, r.completion)
            for r in rollouts]

    async def main():
        async with open_bus(creds) as bus, trio.open_nursery() as nursery:
            cfg = VerifierConfig(domains=["rm-synthetic"], reward_model=str(rm_dir),
                                 sandbox=False)
            await nursery.start(functools.partial(
                run_actor, VerifierActor, creds=creds, run=run_name, config=cfg))
            await publish_rollouts(bus, run_name, rollouts)
            got = await collect_scored(bus, run_name, 2, timeout_s=60)
            nursery.cancel_scope.cancel()
        return got

    got = trio.run(main)
    for r, w in zip(rollouts, want, strict=True):
        assert math.isclose(got[r.rollout_id].reward, 1 / (1 + math.exp(-w)), rel_tol=1e-5)
