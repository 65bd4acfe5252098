"""rm-synthetic: open answers scored by a trained reward model (`reinforge rm train`).

The tasks are the synthetic preference task's prompts (`reinforge.rl.reward_model`: describe
a thing in 8 to 14 words, naming a given colour); the reference is a preferred answer. The
verifier scores a completion with the reward model given in its config (`reward_model =
DIR`), in its own process: the reward is sigmoid(score), the outcome `pass` from 0.5. A
reward model that is not configured, missing or broken gives `infra_error`, never a 0.

The hidden rule itself is reported as a check (`gold`) and never enters the reward: the
gold signal against which a policy that learns to please the reward model, not to follow
the rule, shows up.

Not a built-in (one tier, and it needs a model): a run attaches it by spec,
`rm-synthetic=reinforge.envs.domains.reward_model:RewardModelDomain` in the scheduler's
`domain_specs` and the sampler's `extra_domains`; the verifier's `reward_model = DIR`
attaches it with its model.

JSONL row schema: {"prompt": "..."} (optional "task_id", "tier", "reference").
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
from reinforge.envs.domain import Check, TaskSpec, Tier, Verdict, check_tier, infra_error
from reinforge.envs.tasksets import decode_row, load_jsonl


class PromptRow(msgspec.Struct, kw_only=True):
    prompt: str
    task_id: str | None = None
    tier: int = 0
    reference: str | None = None


class RewardModelDomain:
    """Answers scored by a reward model; the synthetic task's rule as the gold check."""

    name = "rm-synthetic"
    description = "open answers scored by a trained reward model (the synthetic preference task)"
    resource = "cpu"
    multi_turn = False
    tiers = (Tier(level=0, name="describe", description="describe a thing, naming its colour"),)

    def __init__(self, *, model_path: str = "") -> None:
        self.model_path = model_path
        self._lock = threading.Lock()
        self._loaded: tuple[Any, Any, int] | None = None

    def sample_task(self, rng: random.Random, tier: int) -> TaskSpec:
        from reinforge.rl.reward_model import synthetic_pairs

        check_tier(self, tier)
        (pair,) = synthetic_pairs(rng.getrandbits(32), 1)
        return TaskSpec(task_id=f"rm-synthetic-{rng.getrandbits(48):012x}", domain=self.name,
                        tier=tier, prompt=pair.prompt, spec={}, reference=pair.chosen)

    def task_from_row(self, row: Mapping[str, Any], *, where: str) -> TaskSpec:
        r = decode_row(row, PromptRow, where=where)
        return TaskSpec(task_id=r.task_id or f"rm-{where.rsplit(':', 1)[-1]}", domain=self.name,
                        tier=r.tier, prompt=r.prompt, spec={}, reference=r.reference,
                        source="jsonl")

    def load_tasks(self, path: str | Path) -> list[TaskSpec]:
        return load_jsonl(path, lambda row, where: self.task_from_row(row, where=where))

    def prompt(self, task: TaskSpec) -> str:
        return task.prompt

    async def verify(self, task: TaskSpec, completion: str) -> Verdict:
        import trio

        from reinforge.rl.reward_model import follows_rule

        if not self.model_path:
            return infra_error("no reward model configured (the verifier's `reward_model`)")
        try:
            score = await trio.to_thread.run_sync(self.score, task.prompt, completion)
        except Exception as exc:  # a missing or broken model is ours, not the answer's
            return infra_error(f"reward model {self.model_path}: {type(exc).__name__}: {exc}")
        reward = 1.0 / (1.0 + math.exp(-score))
        gold = follows_rule(task.prompt, completion)
        return Verdict(
            reward=reward, outcome="pass" if reward >= 0.5 else "fail",
            checks=[Check(name="rm_score", passed=reward >= 0.5, detail=f"{score:.4f}"),
                    Check(name="gold", passed=gold, detail="the hidden rule (not rewarded)")],
            reason=f"reward model score {score:.3f}")

    def score(self, prompt: str, completion: str) -> float:
        """The reward model's score of `completion` (its forward pass; loaded once)."""
        import torch

        from reinforge.rl.reward_model import encode, load_scorer, scores

        with self._lock:
            if self._loaded is None:
                tok, model, pad = load_scorer(self.model_path)
                self._loaded = (tok, model.eval(), pad)
            tok, model, pad = self._loaded
            with torch.no_grad():
                return float(scores(model, [encode(tok, prompt, completion)], pad)[0])
