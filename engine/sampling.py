"""Sampling parameters (SGLang's names and checks) and the pure sampling maths.

`SamplingParams` mirrors `sglang/srt/sampling/sampling_params.py` for the keys this server
implements; `parse_sampling_params` rejects unknown keys with a message naming the key, as
SGLang's strict contract does. Seeds: SGLang's only seed key is `sampling_seed`; so is ours.
A bare `seed` is rejected exactly as SGLang rejects it (the message says to use
`sampling_seed`), so a sampler that works here works against SGLang. With a seed, sample j of
a request with `n` samples draws from its own generator seeded with ``seed + j`` (SGLang's
deterministic mode would repeat one sample n times, which is useless for GRPO groups).

Logprobs follow SGLang: ``log_softmax(logits / T)`` over the full vocabulary, computed
before top-k/top-p/min-p truncation; greedy (T < 1e-6) reports ``log_softmax(logits)``.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

GREEDY_TEMPERATURE = 1e-6
TOP_K_ALL = 1 << 30


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """One request's sampling settings (SGLang's keys, defaults and bounds)."""

    max_new_tokens: int = 128
    """New tokens at most; 0 scores the prompt only."""
    min_new_tokens: int = 0
    """Stop conditions (EOS, stop ids, stop strings) are ignored before this many tokens."""
    temperature: float = 1.0
    """Below 1e-6 means greedy."""
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    """-1 in a request means the whole vocabulary."""
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


_KEYS = set(SamplingParams.__struct_fields__)
# SGLang keys we accept but that change nothing here (penalties at their neutral value only).
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
_IGNORED = {"stream_interval", "logit_bias", "custom_params"}


def _num(where: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if isinstance(value, bool) or not ok:
        raise ValueError(
            f"{where} must be {'a number' if kind is float else 'an integer'}, got {value!r}"
        )
    return kind(value)


def parse_sampling_params(raw: Any, where: str = "sampling_params") -> SamplingParams:
    """Validate one JSON `sampling_params` object (None means all defaults).

    Raises ValueError naming the offending key, e.g. "sampling_params.top_p must be in (0, 1]".
    """
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        at = f"{where}.{key}"
        if key == "seed":
            raise ValueError(
                f"unknown field `seed` in {where}: use `sampling_seed` (SGLang's name)"
            )
        if key in _NEUTRAL:
            if value is not None and _num(at, value, float) != _NEUTRAL[key]:
                raise ValueError(
                    f"{at} is not supported by the embedded server (only {_NEUTRAL[key]})"
                )
            continue
        if key in _IGNORED:
            continue
        if key not in _KEYS:
            raise ValueError(f"unknown field `{key}` in {where}")
        if value is None:
            continue
        if key in ("max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed"):
            out[key] = _num(at, value, int)
        elif key in ("temperature", "top_p", "min_p"):
            out[key] = _num(at, value, float)
        elif key in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "no_stop_trim",
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{at} must be a boolean, got {value!r}")
            out[key] = value
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
                raise ValueError(
                    f"{at} must be a non-empty string or a list of them, got {value!r}"
                )
            if len(stops) > 32:
                raise ValueError(f"{at} has {len(stops)} strings; at most 32 are allowed")
            out[key] = tuple(stops)
        elif key == "stop_token_ids":
            if not isinstance(value, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in value
            ):
                raise ValueError(f"{at} must be a list of integers, got {value!r}")
            out[key] = tuple(value)
    if out.get("top_k") == -1:
        out["top_k"] = TOP_K_ALL
    p = SamplingParams(**out)
    checks = [
        (p.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
        (
            0 <= p.min_new_tokens <= p.max_new_tokens,
            "min_new_tokens must be in [0, max_new_tokens]",
        ),
        (p.temperature >= 0.0, "temperature must be >= 0"),
        (0.0 < p.top_p <= 1.0, "top_p must be in (0, 1]"),
        (p.top_k >= 1, "top_k must be -1 (all) or >= 1"),
        (0.0 <= p.min_p <= 1.0, "min_p must be in [0, 1]"),
        (p.n >= 1, "n must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"{where}.{message}")
    return p


# ----------------------------------------------------------------------------- the maths


def token_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) per row, T = 1 for greedy rows. logits [B,V], T [B] -> [B,V]."""
    t = torch.where(temperatures < GREEDY_TEMPERATURE, torch.ones_like(temperatures), temperatures)
    return torch.log_softmax(logits / t[:, None], dim=-1)


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
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).flatten()
    # u * total < total, so picked < V; a zero-probability token is never picked
    # (its cdf step is 0).
    picked.clamp_(max=probs.shape[1] - 1)
    if out is None:
        return picked
    out[sampled] = picked
    return out
