"""The reference loop: its logic with a scripted generator and verifier (the real draw, GRPO
step and checkpoints on the tiny policy), then a few real iterations end to end through
`reinforge serve` and the math domain."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import trio
from reinforge.actors.learner import LearnerConfig
from reinforge.core.messages import (
    Outcome,
    Rollout,
    ScoredRollout,
    Task,
    WeightsPublished,
    rollout_id,
)
from reinforge.envs.domain import DomainRegistry
from reinforge.rl import checkpoint as ckpt
from reinforge.rl.grpo import AdvantageNorm
from reinforge.rl.loop import (
    LoopSettings,
    ReferenceLoop,
    Step,
    TaskDraw,
    generate_group,
    verify_rollout,
)
from reinforge.rl.trainer import Trainer

SIGNAL, FLAT, ALL_PASS = [1.0, 0.0, 0.0, 0.0], [0.0] * 4, [1.0] * 4
INFRA = None
"""In a scripted group: this sample's verification failed on our side (masked)."""


def loop_settings(**overrides) -> LoopSettings:
    base = {"group_size": 4, "groups_per_version": 2, "max_in_flight": 3, "min_signal_rate": 0.05,
            "signal_share_floor": 0.1, "advantage_norm": AdvantageNorm.GROUP_STD}
    return LoopSettings(**{**base, **overrides})


def tiny_trainer(model_dir: Path) -> Trainer:
    return Trainer(LearnerConfig(model=str(model_dir), torch_threads=1), model_dir)


class ScriptedServer:
    """Stands in for the rollout server: G fixed token sequences per task, tagged with the
    version it serves, which `load_weights` changes."""

    def __init__(self) -> None:
        self.version = 0
        self.loaded: list[WeightsPublished] = []
        self.rounds: list[tuple[int, list[str]]] = []
        """Per generate call: the version served and the task ids asked for."""

    async def generate(self, tasks: list[Task]) -> list[list[Rollout]]:
        self.rounds.append((self.version, [t.task_id for t in tasks]))
        return [[Rollout(
            rollout_id=rollout_id(t.task_id, k, 1), task_id=t.task_id, sample_index=k,
            domain=t.domain, tier=t.tier, prompt=t.prompt, completion=f"sample {k}",
            prompt_ids=[5, 6, 7], output_ids=[10 + k, 20 + k], logprobs=[-1.0, -1.0],
            policy_version=self.version, spec=dict(t.spec), group_size=t.group_size,
        ) for k in range(t.group_size)] for t in tasks]

    async def load_weights(self, weights: WeightsPublished) -> None:
        self.loaded.append(weights)
        self.version = weights.version


class ScriptedVerifier:
    """Scores the i-th group of the r-th call with script[r][i] (INFRA: an infra error)."""

    def __init__(self, script: list[list[list[float | None]]]) -> None:
        self.script = script
        self.calls = 0

    async def __call__(self, groups: list[list[Rollout]]) -> list[list[ScoredRollout]]:
        rewards = self.script[self.calls]
        self.calls += 1
        return [[scored(r, reward) for r, reward in zip(group, group_rewards, strict=True)]
                for group, group_rewards in zip(groups, rewards, strict=True)]


def scored(r: Rollout, reward: float | None) -> ScoredRollout:
    if reward is INFRA:
        return ScoredRollout(rollout=r, reward=0.0, outcome=Outcome.INFRA_ERROR)
    return ScoredRollout(rollout=r, reward=reward, outcome=Outcome.PASS if reward else Outcome.FAIL)


class Recorder:
    """The test's Watch: runs until `steps` steps (or `max_rounds` rounds, so that a loop
    that never steps ends) and keeps what it is told."""

    def __init__(self, *, steps: int, max_rounds: int) -> None:
        self.want, self.max_rounds = steps, max_rounds
        self.rounds: list[list[list[ScoredRollout]]] = []
        self.steps: list[Step] = []
        self.stale: list[int] = []

    def keep_going(self) -> bool:
        return len(self.steps) < self.want and len(self.rounds) < self.max_rounds

    def scored(self, groups: list[list[ScoredRollout]]) -> None:
        self.rounds.append(groups)

    def stepped(self, step: Step, stale_groups: int) -> None:
        self.steps.append(step)
        self.stale.append(stale_groups)


def scripted_loop(settings: LoopSettings, model_dir: Path, root: Path,
                  script: list[list[list[float | None]]]) -> tuple[ReferenceLoop, ScriptedServer]:
    server = ScriptedServer()
    loop = ReferenceLoop(settings, {"math": DomainRegistry.default().get("math")},
                         tiny_trainer(model_dir), generate=server.generate,
                         verify=ScriptedVerifier(script), load_weights=server.load_weights,
                         checkpoint_root=root, tokenizer_src=model_dir)
    return loop, server


def test_unit_scripted_generator_trains_once_a_batch_of_groups_with_signal_exists(
        tiny_model_dir, tmp_path):
    # Round 1: one group with signal of the two needed. Round 2: a group whose rewards
    # differ only through a masked sample, then two with signal: the first completes the
    # batch, the second was generated by the policy the step replaces (stale, dropped).
    # Round 3: a fresh batch.
    script = [[SIGNAL, FLAT, ALL_PASS], [[1.0, INFRA, 1.0, 1.0], SIGNAL, SIGNAL],
              [SIGNAL, FLAT, SIGNAL]]
    loop, server = scripted_loop(loop_settings(), tiny_model_dir, tmp_path, script)
    watch = Recorder(steps=2, max_rounds=4)

    trio.run(loop.run, watch)

    first, second, third = [task_ids for _, task_ids in server.rounds]
    assert [step.task_ids for step in watch.steps] == [[first[0], second[1]],
                                                       [third[0], third[2]]]
    assert watch.stale == [1, 0]
    assert [step.samples for step in watch.steps] == [8, 8]
    assert server.loaded == [step.weights for step in watch.steps]
    assert loop.learner.version == 2


def test_unit_scripted_generator_takes_no_step_without_signal(tiny_model_dir, tmp_path):
    script = [[FLAT, ALL_PASS, [1.0, INFRA, 1.0, 1.0]]] * 3
    loop, server = scripted_loop(loop_settings(), tiny_model_dir, tmp_path, script)
    watch = Recorder(steps=1, max_rounds=3)

    trio.run(loop.run, watch)

    assert len(watch.rounds) == 3
    assert watch.steps == [] and server.loaded == []
    assert loop.learner.version == 0
    assert ckpt.list_checkpoints(tmp_path) == []


def test_unit_scripted_generator_loads_each_new_version_before_generating_again(
        tiny_model_dir, tmp_path):
    settings = loop_settings(max_in_flight=2, keep_checkpoints=2)
    loop, server = scripted_loop(settings, tiny_model_dir, tmp_path, [[SIGNAL, SIGNAL]] * 3)
    watch = Recorder(steps=3, max_rounds=3)

    trio.run(loop.run, watch)

    assert [version for version, _ in server.rounds] == [0, 1, 2]
    assert [(w.version, w.path) for w in server.loaded] == [
        (v, str(ckpt.version_dir(tmp_path, v))) for v in (1, 2, 3)]
    assert [v for v, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]  # keep_checkpoints
    assert ckpt.read_manifest(ckpt.version_dir(tmp_path, 3)).version == 3
    assert watch.stale == [0, 0, 0]


def test_the_draw_issues_the_tasks_expected_to_fill_the_missing_groups():
    math = DomainRegistry.default().get("math")
    draw = TaskDraw({"math": math}, loop_settings(max_in_flight=5))

    # at the prior signal rate of 1/2, two tasks per missing group, at most max_in_flight
    assert [len(draw.tasks(missing)) for missing in (1, 2, 3)] == [2, 4, 5]
    tasks = draw.tasks(2)
    # numbered as issued, as the scheduler does: a task drawn twice makes two groups
    assert [t.task_id.rsplit("@", 1)[1] for t in tasks] == ["11", "12", "13", "14"]
    assert {(t.domain, t.group_size) for t in tasks} == {("math", 4)}
    assert all(t.prompt.endswith("End with '#### <answer>'.") for t in tasks)


def test_the_draw_moves_its_mix_to_the_domain_whose_groups_carry_signal():
    registry = DomainRegistry.default()
    draw = TaskDraw({d: registry.get(d) for d in ("math", "docqa")}, loop_settings())
    assert draw.mix == {"math": 0.5, "docqa": 0.5}
    for _ in range(60):
        for domain, rewards in (("math", SIGNAL), ("docqa", FLAT)):
            draw.record([scored(Rollout(
                rollout_id=f"t:{k}:1", task_id="t", sample_index=k, domain=domain, tier=0,
                prompt="p", completion="c", output_ids=[1], logprobs=[-1.0], spec={},
                group_size=4), reward) for k, reward in enumerate(rewards)])
    # math's rate near 1, docqa's at the floor (0.1): shares 1 / 1.1 and 0.1 / 1.1
    assert draw.mix["docqa"] == pytest.approx(0.1 / (0.1 + draw.signal_rates["math"]))
    assert draw.mix["docqa"] < 0.1


# ----------------------------------------------------------------------------- end to end


class NumberTasks:
    """The math domain's own tasks (a user's row), prompt and check, for a question that any
    number answers: an untrained policy writing one token answers with a number about a third
    of the time, so its groups carry signal, which real arithmetic would not give it."""

    def __init__(self) -> None:
        self.math = DomainRegistry.default().get("math")
        self.tiers = self.math.tiers[:1]

    def sample_task(self, rng: random.Random, tier: int):
        row = {"question": "Name a number.", "answer": "0", "abs_tol": 1e12,
               "task_id": f"number-{rng.getrandbits(32):08x}"}
        return self.math.task_from_row(row, where="test:1")

    def prompt(self, task) -> str:
        return self.math.prompt(task)

    async def verify(self, task, completion: str):
        return await self.math.verify(task, completion)


@pytest.mark.slow
def test_a_few_real_iterations_train_the_tiny_policy_through_a_rollout_server(
        tiny_model_dir, tmp_path):
    from reinforge.engine.tokenizer import load_tokenizer
    from reinforge.rollout.client import RolloutClient
    from reinforge.rollout.server import ServerProcess, ServerSpec
    from safetensors.torch import load_file

    domains = {"math": NumberTasks()}
    tokenizer = load_tokenizer(tiny_model_dir)
    rounds: list[tuple[int, set[int]]] = []
    """Per round: the version loaded last before it, and the versions its rollouts carry."""
    loaded: list[int] = [0]
    watch = Recorder(steps=2, max_rounds=20)

    async def main() -> str:
        server = ServerProcess(ServerSpec(model_path=str(tiny_model_dir),
                                          server_args=["--max-total-tokens", "8192"]),
                               tmp_path / "server.log")
        server.start()
        try:
            async with RolloutClient(await server.wait_url(120.0), timeout_s=60) as client:

                async def generate(tasks: list[Task]) -> list[list[Rollout]]:
                    groups = [await generate_group(client, tokenizer, task, {"max_new_tokens": 1})
                              for task in tasks]
                    rounds.append((loaded[-1], {r.policy_version for g in groups for r in g}))
                    return groups

                async def verify(groups: list[list[Rollout]]) -> list[list[ScoredRollout]]:
                    return [[await verify_rollout(domains[r.domain], r, verifier_id="test")
                             for r in group] for group in groups]

                async def load_weights(weights: WeightsPublished) -> None:
                    await client.update_weights_from_disk(weights.path,
                                                          weight_version=str(weights.version))
                    loaded.append(weights.version)

                loop = ReferenceLoop(
                    loop_settings(max_in_flight=4), domains, tiny_trainer(tiny_model_dir),
                    generate=generate, verify=verify, load_weights=load_weights,
                    checkpoint_root=tmp_path / "checkpoints", tokenizer_src=tiny_model_dir)
                await loop.run(watch)
                return await client.weight_version()
        finally:
            server.stop()

    served = trio.run(main)

    assert loaded == [0, 1, 2] and served == "2"
    assert [step.samples for step in watch.steps] == [8, 8]
    assert {version for version, _ in rounds} == {0, 1}
    assert all(carried == {version} for version, carried in rounds)
    rewards = {s.reward for groups in watch.rounds for g in groups for s in g}
    assert rewards == {0.0, 1.0}
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(Path(watch.steps[-1].weights.path) / "model.safetensors"))
    assert any(not torch.equal(before[name], after[name]) for name in before)
