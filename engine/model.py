"""A decoder-only transformer of the Llama/Qwen2 family, written for inference on the CPU.

RMSNorm, rotary position embeddings (with the rope scaling of the checkpoint's config),
grouped-query attention with optional q/k/v biases, SwiGLU MLP, optionally tied embeddings.
The weights are plain tensors (no nn.Module), so a weight swap is one attribute assignment.

Two forward paths share the per-layer maths:
  * `prefill_batch`: whole prompts of several sequences; attention runs in torch over their
    fresh K/V. Returns the new K/V for the caller to store in the paged cache.
  * `decode`: one query token for each of B sequences; K/V are appended to the paged cache and
    attention reads the cache through the paged-KV ops (`reinforge.kernels.paged_kv`).

Invariant: both paths compute in float32 (bf16 checkpoints are upcast on load), so greedy
outputs and logprobs can be compared with transformers' float32 forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.nn.functional as F


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The architecture facts the engine needs, read from a Hugging Face config.json."""

    model_type: str
    """`qwen2` or `llama` (others of the family load if their weights are named alike)."""
    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    """Ids that end a sequence (config.json's `eos_token_id`, plus generation_config's)."""
    torch_dtype: str
    """The dtype the checkpoint was saved in (`float32`, `bfloat16`, ...); compute is float32."""


@dataclass
class LayerWeights:
    """One decoder layer's tensors, float32, contiguous."""

    input_norm: torch.Tensor
    qkv_proj: torch.Tensor
    """q_proj, k_proj, v_proj stacked along the output dim: [(Hq+2*Hkv)*D, hidden]."""
    qkv_bias: torch.Tensor | None
    """The q/k/v biases stacked likewise (Qwen2), or None (Llama without attention_bias)."""
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    """Llama with attention_bias=True has an o_proj bias; Qwen2 has none."""
    post_norm: torch.Tensor
    gate_up_proj: torch.Tensor
    """gate_proj and up_proj stacked along the output dim: [2*intermediate, hidden]."""
    down_proj: torch.Tensor


@dataclass
class Weights:
    """All tensors of the model, float32, contiguous."""

    embed_tokens: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    """Same tensor object as `embed_tokens` when embeddings are tied."""


@dataclass
class Rope:
    """Inverse frequencies and the attention scaling of the config's rope type."""

    inv_freq: torch.Tensor  # [head_dim // 2]
    attention_scaling: float

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each [N, head_dim], for integer positions [N] (HF's convention)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32 (one fused torch op; same maths as transformers)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, D] by cos/sin [N, D] (the rotate-half form of Llama/Qwen2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Model:
    """The forward passes over `Weights`. Not thread-safe: one engine thread drives it."""

    def __init__(self, config: ModelConfig, weights: Weights, rope: Rope) -> None:
        self.config = config
        self.weights = weights
        self.rope = rope
        self.sm_scale = 1.0 / math.sqrt(config.head_dim)

    # ----------------------------------------------------------------- shared per-layer maths

    def _qkv(
        self, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        x = rms_norm(h, layer.input_norm, c.rms_norm_eps)
        qkv = F.linear(x, layer.qkv_proj, layer.qkv_bias)
        q_size = c.num_heads * c.head_dim
        kv_size = c.num_kv_heads * c.head_dim
        n = qkv.shape[0]
        qk = apply_rope(
            qkv[:, : q_size + kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin
        )
        v = qkv[:, q_size + kv_size :].reshape(n, c.num_kv_heads, c.head_dim)
        return qk[:, : c.num_heads], qk[:, c.num_heads :], v

    def _finish_layer(
        self, layer: LayerWeights, h: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        # The residual adds are fused into the GEMMs (addmm: h + a @ W^T).
        c = self.config
        base = h if layer.o_bias is None else h + layer.o_bias
        h = torch.addmm(base, attn.reshape(h.shape[0], -1), layer.o_proj.t())
        x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
        gate_up = F.linear(x, layer.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate, inplace=True).mul_(up)
        return torch.addmm(h, act, layer.down_proj.t())

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [N, hidden] -> logits [N, vocab], float32."""
        w = self.weights
        return F.linear(rms_norm(h, w.final_norm, self.config.rms_norm_eps), w.lm_head)

    # ----------------------------------------------------------------------------- prefill

    def prefill(
        self, token_ids: torch.Tensor, all_logits: bool = False
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """One sequence from position 0: (logits [L or 1, vocab], per layer (K, V) [L, Hkv, D])."""
        logits, kv = self.prefill_batch([token_ids], all_logits=[all_logits])
        return logits[0], kv

    def prefill_batch(
        self, prompts: list[torch.Tensor], all_logits: list[bool] | None = None
    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Several sequences, each from position 0, in one pass.

        The linear layers run on all tokens concatenated; attention runs on the prompts padded
        to the longest (causal mask plus key-padding mask). Returns per prompt the logits of
        every position (if all_logits[i]) or of the last one ([1, vocab]), and per layer the
        fresh (K, V) of all tokens concatenated in prompt order, [sum L, Hkv, D].
        """
        c = self.config
        all_logits = all_logits or [False] * len(prompts)
        lens = [int(p.shape[0]) for p in prompts]
        if min(lens) < 1:
            raise ValueError("prefill_batch: every prompt needs at least one token")
        tokens = torch.cat(prompts)
        positions = torch.cat([torch.arange(n) for n in lens])
        s, lmax, total = len(prompts), max(lens), sum(lens)
        # pad_index[i, t] = flat index of token t of prompt i, or `total` (a zero row) past its end.
        offsets = torch.tensor([0] + lens[:-1]).cumsum(0)
        ar = torch.arange(lmax)
        valid = ar[None, :] < torch.tensor(lens)[:, None]  # [S, Lmax]
        pad_index = torch.where(
            valid, offsets[:, None] + ar[None, :], torch.full_like(ar[None, :], total)
        )
        mask = (ar[None, :] <= ar[:, None])[None] & valid[:, None, :]  # [S, Lmax(q), Lmax(k)]
        mask = mask[:, None]  # broadcast over heads
        group = c.num_heads // c.num_kv_heads
        h = self.weights.embed_tokens[tokens]
        cos, sin = self.rope.cos_sin(positions)
        new_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in self.weights.layers:
            q, k, v = self._qkv(layer, h, cos, sin)
            new_kv.append((k, v))

            def padded(x: torch.Tensor) -> torch.Tensor:  # [N, H, D] -> [S, H, Lmax, D]
                x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
                return x[pad_index].transpose(1, 2)

            kh, vh = padded(k), padded(v)
            if group > 1:
                kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
            attn = F.scaled_dot_product_attention(
                padded(q), kh, vh, attn_mask=mask, scale=self.sm_scale
            )
            h = self._finish_layer(layer, h, attn.transpose(1, 2)[valid])
        ends = (offsets + torch.tensor(lens) - 1).tolist()
        logits = []
        for i in range(s):
            rows = (
                h[ends[i] - lens[i] + 1 : ends[i] + 1]
                if all_logits[i]
                else h[ends[i] : ends[i] + 1]
            )
            logits.append(rows)
        if not any(all_logits):
            last = self.logits(h[ends])
            return [last[i : i + 1] for i in range(s)], new_kv
        return [self.logits(x) for x in logits], new_kv

    # ------------------------------------------------------------------------------ decode

    def decode(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """One new token for each of B sequences -> logits [B, vocab].

        attend(layer_index, q [B,Hq,D], k [B,Hkv,D], v [B,Hkv,D]) stores k/v in the cache and
        returns the attention output [B,Hq,D] over everything cached for each sequence.
        """
        h = self.weights.embed_tokens[token_ids]
        cos, sin = self.rope.cos_sin(positions)
        for i, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            attn = attend(i, q.contiguous(), k.contiguous(), v.contiguous())
            h = self._finish_layer(layer, h, attn)
        return self.logits(h)


def describe(config: ModelConfig, weights: Weights) -> dict[str, Any]:
    """Parameter count and sizes, for /get_server_info and logs."""
    seen: set[int] = set()
    total = 0
    tensors = [weights.embed_tokens, weights.final_norm, weights.lm_head]
    for layer in weights.layers:
        tensors += [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
        tensors += [layer.input_norm, layer.post_norm]
        if layer.qkv_bias is not None:
            tensors.append(layer.qkv_bias)
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel()
    return {
        "num_parameters": total,
        "num_layers": config.num_layers,
        "vocab_size": config.vocab_size,
    }
