"""Sampling parameters (SGLang's names, defaults and bounds) and the pure sampling maths.

`SamplingParams` mirrors `sglang/srt/sampling/sampling_params.py` for the keys this server
implements. Its bounds are msgspec constraints, checked when a request is decoded
(engine/api.py, which also holds the SGLang keys accepted but unused); `__post_init__`
expands SGLang's shorthands and checks what the constraints cannot express, for every
instance. Seeds: SGLang's only seed key is `sampling_seed`; so is ours. With a seed, sample j
of a request with `n` samples draws from its own generator seeded with ``seed + j`` (SGLang's
deterministic mode would repeat one sample n times, which is useless for GRPO groups).

Logprobs follow SGLang: ``log_softmax(logits / T)`` over the full vocabulary, computed
before top-k/top-p/min-p truncation; greedy (T < 1e-6) reports ``log_softmax(logits)``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch
from msgspec import Meta

GREEDY_TEMPERATURE = 1e-6
TOP_K_ALL = 1 << 30

StopString = Annotated[str, Meta(min_length=1)]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """One request's sampling settings (SGLang's keys, defaults and bounds)."""

    max_new_tokens: Annotated[int, Meta(ge=0)] = 128
    """New tokens at most; 0 scores the prompt only."""
    min_new_tokens: Annotated[int, Meta(ge=0)] = 0
    """Stop conditions (EOS, stop ids, stop strings) are ignored before this many tokens."""
    temperature: Annotated[float, Meta(ge=0.0)] = 1.0
    """Below 1e-6 means greedy."""
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = TOP_K_ALL
    """-1 (stored as TOP_K_ALL) means the whole vocabulary; 0 is refused."""
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    stop: StopString | Annotated[tuple[StopString, ...], Meta(max_length=32)] = ()
    """One stop string or up to 32; always a tuple once constructed."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: Annotated[int, Meta(ge=1)] = 1
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        # SGLang's normalisation (frozen, hence force_setattr): -1 is every token, and one
        # stop string is a list of one.
        if self.top_k == -1:
            msgspec.structs.force_setattr(self, "top_k", TOP_K_ALL)
        if isinstance(self.stop, str):
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (all) or >= 1")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens must be in [0, max_new_tokens]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


# ----------------------------------------------------------------------------- the maths


def token_logprobs(logits: torch.Tensor, temperatures: torch.Tensor | float) -> torch.Tensor:
    """log_softmax(logits / T) in float32, T = 1 where sampling is greedy: reinforge's one
    definition of a logprob (the rollout server reports it, the learner recomputes it).

    logits [..., V]; temperatures a float or a tensor of logits' leading shape -> [..., V].
    """
    t = torch.as_tensor(temperatures, dtype=torch.float32, device=logits.device)
    t = torch.where(t < GREEDY_TEMPERATURE, torch.ones_like(t), t)
    if bool((t == 1).all()):  # x / 1 is x: skip a pass over [..., V] (RL samples at T = 1)
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log_softmax(logits.float() / t[..., None], dim=-1)


def truncation_mask(
    logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Boolean [B,V]: True where a token survives top-k, then top-p, then min-p (SGLang's order).

    top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p
    (the token that crosses the threshold is kept).
    """
    b, v = logprobs.shape
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    ranks = torch.arange(v, device=logprobs.device)[None, :]
    keep_sorted = ranks < top_k.clamp(max=v)[:, None]
    probs = sorted_lp.exp() * keep_sorted
    probs = probs / probs.sum(dim=-1, keepdim=True)
    mass_before = probs.cumsum(dim=-1) - probs
    keep_sorted &= mass_before < top_p[:, None]
    keep_sorted &= sorted_lp >= (sorted_lp[:, :1] + torch.log(min_p.clamp(min=1e-30))[:, None])
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted)
    keep.scatter_(1, order, keep_sorted)
    return keep


def sample_tokens(
    logprobs: torch.Tensor,
    greedy: torch.Tensor,
    keep: torch.Tensor | None,
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """Draw one token per row: argmax for greedy rows, else from exp(logprobs) restricted to
    `keep` (None = all), by inverse CDF (one uniform per row). Rows with
    a generator draw from it; the others share the global RNG in one batched call."""
    sampled = (~greedy).nonzero().flatten().tolist()
    if not sampled:
        return logprobs.argmax(dim=-1)
    out = logprobs.argmax(dim=-1) if len(sampled) < logprobs.shape[0] else None
    all_rows = len(sampled) == logprobs.shape[0]
    probs = logprobs.exp() if all_rows else logprobs[sampled].exp()
    if keep is not None:
        probs *= keep if all_rows else keep[sampled]
    u = torch.rand(len(sampled), 1)
    for i, row in enumerate(sampled):
        g = generators[row]
        if g is not None:
            u[i, 0] = torch.rand(1, generator=g)[0]
    cdf = probs.cumsum_(dim=-1)  # in place: one [rows, V] buffer fewer
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).flatten()
    # u * total < total, so picked < V; a zero-probability token is never picked
    # (its cdf step is 0).
    picked.clamp_(max=probs.shape[1] - 1)
    if out is None:
        return picked
    out[sampled] = picked
    return out
