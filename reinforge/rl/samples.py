"""The loop's data between its steps, and the pure conversions from one step's output to
the next one's input: a rollout back to its task (for `verify`), a domain's verdict to a
scored rollout, and groups of scored rollouts to train samples with their advantages.

The actors (verifier, learner) and the reference loop (`reinforge.rl.loop`) call these, so
a sample is judged trainable and given its advantage by the same code everywhere.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import msgspec
from reinforge.core.messages import Check, Outcome, Rollout, ScoredRollout
from reinforge.rl.grpo import AdvantageNorm, domain_reward_scales, group_advantages

# ----------------------------------------------------------------------------- verify


def task_spec_of(rollout: Rollout) -> Any:
    """Rebuild the domain's TaskSpec from what the rollout carries."""
    from reinforge.envs.domain import TaskSpec

    return TaskSpec(
        task_id=rollout.task_id,
        domain=rollout.domain,
        tier=rollout.tier,
        prompt=rollout.prompt,
        spec=dict(rollout.spec),
    )


def scored_from_verdict(
    rollout: Rollout, verdict: Any, *, verifier_id: str, verify_s: float, attempts: int
) -> ScoredRollout:
    """The bus message for a domain Verdict (timings.verify_s filled in)."""
    reason = verdict.reason
    if verdict.outcome == "infra_error" and attempts > 1:
        reason = f"{reason} (infra_error on all {attempts} attempts)"
    timings = msgspec.structs.replace(rollout.timings, verify_s=verify_s)
    return ScoredRollout(
        rollout=msgspec.structs.replace(rollout, timings=timings),
        reward=float(verdict.reward),
        outcome=Outcome(verdict.outcome),
        checks=[Check(name=c.name, passed=c.passed, detail=c.detail) for c in verdict.checks],
        reason=reason,
        verifier_id=verifier_id,
        output=verdict.output,
    )


# ----------------------------------------------------------------------------- train


def sample_is_valid(s: ScoredRollout) -> bool:
    """Trainable: not an infra error, with token ids, one behaviour logprob per token, and a
    loss mask that is empty (single-turn: all policy tokens) or one 0/1 per token."""
    r = s.rollout
    return (
        s.outcome != Outcome.INFRA_ERROR
        and bool(r.prompt_ids)
        and bool(r.output_ids)
        and len(r.logprobs) == len(r.output_ids)
        and (not r.loss_mask or (len(r.loss_mask) == len(r.output_ids)
                                 and set(r.loss_mask) <= {0, 1}))
        and math.isfinite(s.reward)
    )


def loss_mask_of(r: Rollout) -> list[int]:
    """1 per policy token, 0 per environment token; the sampler leaves single-turn rollouts'
    mask empty, which means every output token is the policy's."""
    return list(r.loss_mask) if r.loss_mask else [1] * len(r.output_ids)


class TrainSample(msgspec.Struct, frozen=True, kw_only=True):
    """One sequence to train on, with its advantage."""

    rollout_id: str
    domain: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    advantage: float
    reward: float
    policy_version: int
    loss_mask: list[int]
    """Per output token: 1 = the policy's (trained), 0 = environment text (context only)."""


def prepare_samples(
    groups: list[list[ScoredRollout]], norm: AdvantageNorm, scale_floor: float = 0.0
) -> tuple[list[TrainSample], dict[str, float]]:
    """Advantages for the valid samples of groups (each with signal), their scale at least
    `scale_floor` (`grpo.group_advantages`); returns the samples to train on and figures
    (mean reward per domain, advantage stats, masked count)."""
    import torch

    flat = [s for g in groups for s in g]
    valid = [sample_is_valid(s) for s in flat]
    scales = domain_reward_scales(
        [s.reward for s in flat], valid, [s.rollout.domain for s in flat]
    )
    out: list[TrainSample] = []
    for group in groups:
        ok = [sample_is_valid(s) for s in group]
        rewards = torch.tensor([s.reward for s in group], dtype=torch.float64)
        adv = group_advantages(
            rewards, torch.tensor(ok), norm=norm, scale=scales.get(group[0].rollout.domain, 0.0),
            scale_floor=scale_floor,
        )
        out.extend(train_sample(s, a) for s, a, good in zip(group, adv.tolist(), ok, strict=True)
                   if good)
    figures: dict[str, float] = {"masked_samples": float(len(flat) - sum(valid))}
    by_domain: dict[str, list[float]] = collections.defaultdict(list)
    for s, good in zip(flat, valid, strict=True):
        if good:
            by_domain[s.rollout.domain].append(s.reward)
    for domain, rs in sorted(by_domain.items()):
        figures[f"reward_mean/{domain}"] = sum(rs) / len(rs)
    advs = [s.advantage for s in out]
    if advs:
        mean = sum(advs) / len(advs)
        figures["adv_mean"] = mean
        figures["adv_std"] = (sum((a - mean) ** 2 for a in advs) / len(advs)) ** 0.5
        figures["adv_abs_max"] = max(abs(a) for a in advs)
    return out, figures


def train_sample(s: ScoredRollout, advantage: float) -> TrainSample:
    r = s.rollout
    return TrainSample(
        rollout_id=r.rollout_id, domain=r.domain, prompt_ids=list(r.prompt_ids),
        output_ids=list(r.output_ids), logprobs=list(r.logprobs), advantage=advantage,
        reward=s.reward, policy_version=r.policy_version, loss_mask=loss_mask_of(r))


def anchor_samples(groups: list[list[ScoredRollout]]) -> list[TrainSample]:
    """The valid samples of groups without signal, as the trainer's anchors (advantage 0:
    they add only their KL to the reference, `Trainer.train_step`)."""
    return [train_sample(s, 0.0) for g in groups for s in g if sample_is_valid(s)]
