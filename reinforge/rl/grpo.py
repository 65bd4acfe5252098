"""GRPO maths as pure functions: advantages, the clipped objective, KL, staleness.

Everything here is a function of tensors (or plain numbers) and returns new ones; nothing
holds state or touches a model. The learner composes them; the tests check them against
hand computations on the CPU.

Where this departs from the papers (DeepSeekMath's GRPO, arXiv 2402.03300; Dr. GRPO,
arXiv 2503.20783; DAPO, arXiv 2503.14476):

* Advantages are outcome-level (one number per sample, broadcast to its tokens), as in
  DeepSeekMath's outcome supervision. `AdvantageNorm.GROUP_STD` divides by the *population*
  std of the group (DeepSeekMath leaves the estimator unspecified; TRL uses the unbiased
  one). `AdvantageNorm.NONE` is Dr. GRPO: the centred reward, no division. The default,
  `AdvantageNorm.DOMAIN_STD`, is ours: centred within the group (the GRPO baseline) but scaled
  by the std of that *domain's* rewards over the whole batch, so that a domain with a small
  reward spread (F1 scores) and one with 0/1 rewards weigh alike without Dr. GRPO's
  objection to per-group std (questions that are nearly all-pass or all-fail get boosted).
  `scale_floor` keeps either scale from going below a floor: partial credit's crumbs (a
  wrong answer scored 0.06 against three scored 0) have a tiny std, and dividing by it
  would push toward that wrong answer as hard as a pass against a fail. A floor of 0.25
  leaves 0/1 groups of up to 16 samples as they were (one pass in 16: std 0.24).
* Samples whose outcome is `infra_error` are masked: they neither enter the group's mean or
  std nor receive an advantage (0) nor contribute tokens to the loss.
* Loss aggregation is token-level: the sum of per-token losses over every valid token of
  the batch divided by the number of those tokens (DAPO's "token-level policy gradient
  loss"), not DeepSeekMath's mean over tokens within a sample then over samples.
* The importance ratio is exp(logp_current - logp_behaviour), where the behaviour logprobs
  are those the rollout server reported when sampling (possibly several versions stale),
  as in PPO; clipping may be asymmetric (DAPO's clip-higher) with `clip_low`/`clip_high`.
* The KL penalty uses the k3 estimator exp(r - c) - (r - c) - 1 with r the reference and c
  the current logprob (DeepSeekMath eq. 4), added to the loss with coefficient `kl_coef`
  and aggregated token-level like the policy loss.
* "Valid token" means inside the sequence AND the policy's own: in multi-turn episodes the
  environment's text sits among the output tokens with a loss mask of 0 (and behaviour
  logprob 0.0); it is context, never a term of the loss, the ratio figures, the KL or the
  token count.
* Truncated importance sampling (TIS; verl and slime's fix for the inference/training
  mismatch, e.g. the rollout engine's int8 KV cache) is `tis_policy_terms`: the PPO ratio is
  taken to the learner's own old logprobs, and each token's term is multiplied by the
  detached weight min(exp(logp_old - logp_behaviour), cap). Our learner makes one optimizer
  step per batch, so its old logprobs are its current ones, detached (see there for what
  that does to the clip).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

import torch
from reinforge.engine.sampling import token_logprobs


class AdvantageNorm(str, enum.Enum):
    """How centred group rewards are scaled (see the module docstring)."""

    GROUP_STD = "group_std"
    DOMAIN_STD = "domain_std"
    NONE = "none"


def centred_rewards(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """r_i - mean(r_j over the valid j of the group); 0 for invalid samples.

    `rewards` and `valid` are 1-D, one entry per sample of ONE group.
    """
    if rewards.shape != valid.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and valid {tuple(valid.shape)} must be the same 1-D shape"
        )
    v = valid.to(rewards.dtype)
    n = v.sum()
    if n == 0:
        return torch.zeros_like(rewards)
    mean = (rewards * v).sum() / n
    return (rewards - mean) * v


def population_std(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The population standard deviation of the valid entries (0 when fewer than one)."""
    v = valid.to(values.dtype)
    n = v.sum()
    if n == 0:
        return values.new_zeros(())
    mean = (values * v).sum() / n
    return torch.sqrt((((values - mean) * v) ** 2).sum() / n)


def group_advantages(
    rewards: torch.Tensor,
    valid: torch.Tensor,
    *,
    norm: AdvantageNorm = AdvantageNorm.GROUP_STD,
    scale: torch.Tensor | float | None = None,
    eps: float = 1e-6,
    scale_floor: float = 0.0,
) -> torch.Tensor:
    """Advantages of ONE group of samples of the same prompt.

    GROUP_STD: (r - mean) / (std + eps) over the valid samples (DeepSeekMath GRPO).
    NONE: r - mean (Dr. GRPO). DOMAIN_STD: (r - mean) / (scale + eps), where `scale` is the
    domain's reward std over the batch (see `domain_reward_scales`). Either divisor is at
    least `scale_floor`. Invalid samples get 0.
    """
    centred = centred_rewards(rewards, valid)
    if norm is AdvantageNorm.NONE:
        return centred
    if norm is AdvantageNorm.GROUP_STD:
        divisor = population_std(rewards, valid)
    elif scale is None:
        raise ValueError("group_advantages: norm=domain_std needs the domain's `scale`")
    else:
        divisor = torch.as_tensor(scale, dtype=rewards.dtype)
    return centred / (divisor.clamp(min=scale_floor) + eps)


def domain_reward_scales(
    rewards: Sequence[float], valid: Sequence[bool], domains: Sequence[str]
) -> dict[str, float]:
    """Per domain: the population std of the valid rewards of that domain in the batch."""
    out: dict[str, float] = {}
    for domain in sorted(set(domains)):
        vals = [
            r for r, ok, d in zip(rewards, valid, domains, strict=True) if ok and d == domain
        ]
        if not vals:
            out[domain] = 0.0
            continue
        mean = sum(vals) / len(vals)
        out[domain] = (sum((r - mean) ** 2 for r in vals) / len(vals)) ** 0.5
    return out


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """The logprob of each target token, as the rollout server defines it
    (`engine.sampling.token_logprobs`: temperature-scaled, T = 1 for greedy sampling).

    `logits` [..., V] and `targets` [...] (same leading shape) -> [...].
    """
    logp = token_logprobs(logits, temperature)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class PolicyLossTerms(NamedTuple):
    """Per-token tensors of the clipped objective (all [B, T], zero where mask is 0)."""

    loss: torch.Tensor
    """-min(ratio * A, clip(ratio) * A), with grad."""
    ratio: torch.Tensor
    """exp(logp - logp_behaviour), detached (1 at padding)."""
    clipped: torch.Tensor
    """1.0 where the clipped term was chosen (its gradient is zero), else 0.0; detached."""


def clipped_policy_terms(
    logp: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> PolicyLossTerms:
    """PPO's clipped surrogate per token, to be aggregated by `token_mean`.

    ratio = exp(logp - logp_behaviour); loss = -min(ratio * A, clamp(ratio, 1 - clip_low,
    1 + clip_high) * A). With logp == logp_behaviour (on-policy) the ratio is exactly 1 and
    the gradient is -A * d logp (the REINFORCE gradient). `advantages` is [B] or [B, T].
    """
    if logp.shape != logp_behaviour.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, logp_behaviour {tuple(logp_behaviour.shape)} and "
            f"mask {tuple(mask.shape)} must have one shape"
        )
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip bounds must be >= 0, got low={clip_low} high={clip_high}")
    adv = advantages.unsqueeze(-1) if advantages.dim() == logp.dim() - 1 else advantages
    m = mask.to(logp.dtype)
    ratio = torch.exp((logp - logp_behaviour) * m)  # exactly 1 at padding
    unclipped = ratio * adv
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = clipped_ratio * adv
    loss = -torch.minimum(unclipped, clipped) * m
    chose_clipped = (clipped < unclipped).to(logp.dtype) * m
    return PolicyLossTerms(loss=loss, ratio=ratio.detach(), clipped=chose_clipped.detach())


class TisWeights(NamedTuple):
    """Per-token truncated importance weights (all [B, T], detached)."""

    weight: torch.Tensor
    """min(exp(logp_old - logp_behaviour), cap); 1 where mask is 0."""
    capped: torch.Tensor
    """1.0 where the weight was truncated at the cap, else 0.0 (0 where mask is 0)."""


def truncated_is_weights(
    logp_old: torch.Tensor, logp_behaviour: torch.Tensor, mask: torch.Tensor, *, cap: float
) -> TisWeights:
    """TIS weights from the rollout engine's logprobs to the learner's: min(exp(old - b), C).

    Only the top is truncated (as verl and slime do): a token the engine found likelier than
    the learner does is down-weighted without limit, one it found less likely is up-weighted
    at most C times. `cap` must be >= 1, or on-policy tokens would be down-weighted too.
    """
    if logp_old.shape != logp_behaviour.shape or logp_old.shape != mask.shape:
        raise ValueError(
            f"logp_old {tuple(logp_old.shape)}, logp_behaviour {tuple(logp_behaviour.shape)} "
            f"and mask {tuple(mask.shape)} must have one shape"
        )
    if cap < 1.0:
        raise ValueError(f"the TIS cap must be >= 1, got {cap}")
    m = mask.to(logp_old.dtype)
    raw = torch.exp((logp_old.detach() - logp_behaviour) * m)  # exactly 1 where masked
    return TisWeights(weight=torch.clamp(raw, max=cap), capped=(raw > cap).to(m.dtype) * m)


def tis_policy_terms(
    logp: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    logp_old: torch.Tensor | None = None,
) -> tuple[PolicyLossTerms, TisWeights]:
    """The clipped surrogate with truncated importance sampling, per token.

    loss = w * -min(r * A, clamp(r, 1 - clip_low, 1 + clip_high) * A), with
    r = exp(logp - logp_old) the PPO ratio to the learner's old policy and
    w = min(exp(logp_old - logp_behaviour), cap) the detached TIS weight (verl's and slime's
    formulation). Where this departs: the learner has no old logprobs of its own apart from
    this forward pass, and it makes one optimizer step per batch, so logp_old is `logp`
    detached. Hence r == 1 with gradient d logp, the clip never binds (`clipped` is all 0),
    and the gradient is -w * A * d logp: the whole gap between the rollout engine and the
    learner (KV-cache quantization, and for stale samples the policy's drift too) is
    corrected by w truncated at `cap`, instead of being clipped at 1 +- clip as if the policy
    had moved. Without truncation or clipping this is the same gradient as
    `clipped_policy_terms`; they differ where that one clips and where w reaches the cap.

    Several optimizer steps on one batch (PPO epochs, minibatches) pass `logp_old`: the
    learner's logprobs before the first step, so r moves away from 1 and clips as in PPO.
    """
    old = logp.detach() if logp_old is None else logp_old
    terms = clipped_policy_terms(logp, old, advantages, mask, clip_low=clip_low,
                                 clip_high=clip_high)
    tis = truncated_is_weights(old, logp_behaviour, mask, cap=cap)
    return terms._replace(loss=terms.loss * tis.weight.to(terms.loss.dtype)), tis


def abs_logprob_gaps(
    logp: torch.Tensor, logp_behaviour: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """|logp - logp_behaviour| in nats for each token where mask is 1, as a 1-D tensor."""
    if logp.shape != logp_behaviour.shape or logp.shape != mask.shape:
        raise ValueError(
            f"logp {tuple(logp.shape)}, logp_behaviour {tuple(logp_behaviour.shape)} and "
            f"mask {tuple(mask.shape)} must have one shape"
        )
    return (logp.detach() - logp_behaviour).abs()[mask.bool()]


class GapSummary(NamedTuple):
    mean_nats: float
    max_nats: float
    share_over: float
    """Share of the tokens whose gap exceeds the threshold (strictly)."""


def summarise_gaps(gaps_nats: torch.Tensor, threshold_nats: float) -> GapSummary:
    """Mean, max and share above `threshold_nats` of logprob gaps (all 0 without tokens)."""
    if gaps_nats.numel() == 0:
        return GapSummary(0.0, 0.0, 0.0)
    return GapSummary(mean_nats=float(gaps_nats.mean()), max_nats=float(gaps_nats.max()),
                      share_over=float((gaps_nats > threshold_nats).double().mean()))


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token KL(current || reference) estimate exp(ref - cur) - (ref - cur) - 1 (>= 0)."""
    delta = (logp_ref - logp) * mask.to(logp.dtype)
    return (torch.exp(delta) - delta - 1.0) * mask.to(logp.dtype)


def token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: int | None = None):
    """sum(values * mask) / num_tokens (default: mask.sum()), token-level as in DAPO.

    Pass the whole batch's token count as `num_tokens` when summing over micro-batches, so
    that the accumulated gradient equals that of one big batch.
    """
    m = mask.to(values.dtype)
    denom = float(num_tokens) if num_tokens is not None else float(m.sum())
    if denom <= 0:
        return (values * m).sum() * 0.0
    return (values * m).sum() / denom


def staleness(learner_version: int, policy_version: int) -> int:
    """How many versions behind the learner a rollout was generated (>= 0 normally)."""
    return learner_version - policy_version


def segment_staleness(learner_version: int,
                      rollouts: Sequence[Sequence[tuple[int, int]]]) -> dict[str, float]:
    """Staleness by segment: each rollout as its (policy_version, policy tokens) segments (one
    for a single-turn rollout, one per turn for a multi-turn one, whose turns may come from
    several versions). `staleness_token_mean` weighs each segment by its tokens;
    `partial_rollouts` counts rollouts whose segments span more than one version."""
    tokens = sum(n for segs in rollouts for _, n in segs)
    weighted = sum(staleness(learner_version, v) * n for segs in rollouts for v, n in segs)
    return {
        "staleness_token_mean": weighted / tokens if tokens else 0.0,
        "partial_rollouts": float(sum(len({v for v, _ in segs}) > 1 for segs in rollouts)),
    }


def is_too_stale(learner_version: int, policy_versions: Sequence[int], max_staleness: int) -> bool:
    """A group is dropped when any of its samples is more than `max_staleness` versions old,
    or claims a version newer than the learner's (a mislabelled or foreign rollout)."""
    return any(
        staleness(learner_version, v) > max_staleness or v > learner_version
        for v in policy_versions
    )
