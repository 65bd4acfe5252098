"""Helpers of the scheduler/evaluator tests: a fake sampler+verifier on a real bus."""

from __future__ import annotations

from collections.abc import Callable

import trio
from reinforge.core import messages as m
from reinforge.core import subjects
from reinforge.core.actor import Actor, Input
from reinforge.envs.domain import TaskSpec, Tier, Verdict, check_tier


def scored_group(task: m.Task, rewards: list[float], *, tokens: int = 10,
                 attempt: int | None = None, infra: tuple[int, ...] = (),
                 policy_version: int = 0) -> list[m.ScoredRollout]:
    """What verifiers would publish for one group of `task` (one reward per sample)."""
    attempt = task.attempt if attempt is None else attempt
    out = []
    for i, reward in enumerate(rewards):
        rollout = m.Rollout(
            rollout_id=f"{task.task_id}:{i}:{attempt}", task_id=task.task_id, sample_index=i,
            domain=task.domain, tier=task.tier, prompt=task.prompt, completion="...",
            output_ids=list(range(tokens)), logprobs=[-1.0] * tokens, spec=task.spec,
            group_size=task.group_size, purpose=task.purpose, policy_version=policy_version,
        )
        bad = i in infra
        out.append(m.ScoredRollout(
            rollout=rollout, reward=0.0 if bad else reward,
            outcome=m.Outcome.INFRA_ERROR if bad else (
                m.Outcome.PASS if reward >= 1.0 else m.Outcome.FAIL),
        ))
    return out


async def publish_scored(bus, run: str, scored: list[m.ScoredRollout]) -> None:
    for s in scored:
        await bus.publish_durable(
            subjects.scored(run, s.rollout.domain), s, msg_id=f"scored:{s.rollout.rollout_id}"
        )


async def publish_decision(bus, run: str, task: m.Task, fate: m.Fate, *,
                           signal: bool | None = None, version: int = 0,
                           tokens: int = 0) -> None:
    """What the learner would publish about `task`'s group."""
    msg = m.GroupDecision(task_id=task.task_id, domain=task.domain, fate=fate, version=version,
                          signal=signal, samples=task.group_size, tokens=tokens)
    await bus.publish_durable(subjects.decision(run, task.domain), msg,
                              msg_id=f"decision:{task.task_id}:{fate.value}:{version}")


class TaskWatcher:
    """Reads every Task the scheduler publishes (its own durable consumer on task.*)."""

    def __init__(self, bus, run: str, group: str = "watcher") -> None:
        self.bus = bus
        self.run = run
        self.group = group
        self.tasks: list[m.Task] = []

    async def until(self, pred: Callable[[list[m.Task]], bool], timeout_s: float = 30.0,
                    on_task: Callable | None = None) -> list[m.Task]:
        stream = await self.bus.ensure_run_stream(self.run)
        subject = subjects.task(self.run, "*")
        durable = subjects.durable_name(self.run, self.group, subject)
        async with self.bus.pull_consumer(stream=stream, durable=durable,
                                          filter_subject=subject) as c:
            with trio.fail_after(timeout_s):
                while not pred(self.tasks):
                    batch = await c.fetch(256, timeout_s=0.3)
                    for d in batch:
                        task = m.decode(d.data)
                        self.tasks.append(task)
                        if on_task is not None:
                            await on_task(task)
                    await c.ack(batch)
        return self.tasks


class HangingSampler(Actor):
    """A sampler that takes tasks and never answers: to be killed with its work in hand."""

    actor_type = "sampler"

    def inputs(self) -> list[Input]:
        return [Input(subject=subjects.task(self.ctx.run, "*"), handler=self.on_task,
                      accepts=(m.Task,), ack_wait_s=60.0)]

    async def on_task(self, msg: m.Task) -> None:
        with self.ctx.waiting(f"pretend generation of {msg.task_id}"):
            await trio.sleep_forever()


class LadderDomain:
    """Four tiers of made-up tasks; tier 1 has four prompts, which a held-out set of four
    tasks a tier (the default) takes, so a scheduler can draw no training task at tier 1
    (`domain_specs=["ladder=sched_fixtures:LadderDomain"]`)."""

    name = "ladder"
    description = "a test domain with a tier that evaluation takes whole"
    resource = "cpu"
    multi_turn = False
    tiers = tuple(Tier(level=t, name=f"t{t}", description=f"tier {t}") for t in range(4))

    def sample_task(self, rng, tier):
        check_tier(self, tier)
        n = rng.randrange(4 if tier == 1 else 10**9)
        return TaskSpec(task_id=f"ladder-t{tier}-{n}", domain=self.name, tier=tier,
                        prompt=f"Tier {tier}, task {n}.", spec={}, reference="")

    def load_tasks(self, path):
        return []

    def task_from_row(self, row, *, where):
        raise ValueError(f"{where}: the ladder domain has no task files")

    def prompt(self, task):
        return task.prompt

    async def verify(self, task, completion):
        return Verdict(reward=0.0, outcome="fail", reason="never run")
