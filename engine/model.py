"""A decoder-only transformer of the Llama/Qwen2/Qwen3 family, written for inference on the CPU.

RMSNorm, rotary position embeddings (with the rope scaling of the checkpoint's config),
grouped-query attention with optional q/k/v biases and optional per-head q/k RMSNorm
(Qwen3), SwiGLU MLP, optionally tied embeddings.
The weights are plain tensors (no nn.Module), so a weight swap is one attribute assignment.
Products run through `linear.Linear`, RMSNorm and RoPE through `layer_ops.LayerOps` (TVM
kernels where they fit, torch otherwise).

Two forward paths share the per-layer maths:
  * `prefill_batch`: the new tokens of several sequences (whole prompts, or what follows a
    cached prefix); the caller stores their K/V in the paged cache and hands back each
    sequence's K/V as stored, over which attention runs in torch.
  * `decode`: one query token for each of B sequences; K/V are appended to the paged cache and
    attention reads the cache through the paged-KV ops (`reinforge.kernels.paged_kv`).

Invariant: both paths compute in float32 (bf16 checkpoints are upcast on load), so greedy
outputs and logprobs can be compared with transformers' float32 forward. The one exception
is opt-in: the projections' weights may be served in bfloat16 or int8 (`linear.py`,
`--weight-dtype`); their products are still returned in float32. (`lossless` weights are the
checkpoint's float32 values in the block form they came in: not an exception.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.nn.functional as F

from reinforge.engine.layer_ops import LayerOps, apply_rope
from reinforge.engine.linear import Linear, Weight, nbytes


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The architecture facts the engine needs, read from a Hugging Face config.json."""

    model_type: str
    """`qwen2`, `qwen3` or `llama` (others of the family load if their weights are named
    alike)."""
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
    qk_norm: bool = False
    """Qwen3: q and k are RMS-normalised per head (over head_dim) before RoPE."""


@dataclass
class LayerWeights:
    """One decoder layer's tensors, float32, contiguous (projections: in `weight_format`)."""

    input_norm: torch.Tensor
    qkv_proj: Weight
    """q_proj, k_proj, v_proj stacked along the output dim: [(Hq+2*Hkv)*D, hidden]."""
    qkv_bias: torch.Tensor | None
    """The q/k/v biases stacked likewise (Qwen2), or None (Llama without attention_bias)."""
    o_proj: Weight
    o_bias: torch.Tensor | None
    """Llama with attention_bias=True has an o_proj bias; Qwen2 has none."""
    post_norm: torch.Tensor
    gate_up_proj: Weight
    """gate_proj and up_proj stacked along the output dim: [2*intermediate, hidden]."""
    down_proj: Weight
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    """Qwen3's per-head RMSNorm weights of q and k ([head_dim]); None for Llama/Qwen2."""


@dataclass
class Weights:
    """All tensors of the model, float32, contiguous."""

    embed_tokens: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Weight
    """Same tensor object as `embed_tokens` when embeddings are tied (and float32)."""
    weight_format: str = "float32"
    """How the projections and the LM head are stored (`linear.WEIGHT_FORMATS`)."""

    def matrices(self) -> list[Weight]:
        """The LM head and every projection: what a decode step multiplies by."""
        return [self.lm_head] + [m for layer in self.layers for m in (
            layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]


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


class Model:
    """The forward passes over `Weights`. Not thread-safe: one engine thread drives it."""

    def __init__(self, config: ModelConfig, weights: Weights, rope: Rope,
                 linear: Linear | None = None, ops: LayerOps | None = None) -> None:
        self.config = config
        self.weights = weights
        self.rope = rope
        self.linear = linear or Linear()
        self.ops = ops or LayerOps()
        self.sm_scale = 1.0 / math.sqrt(config.head_dim)

    # ----------------------------------------------------------------- shared per-layer maths

    def _qkv(
        self, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, Hq, D], k and v [N, Hkv, D], each contiguous; q and k rotated."""
        c = self.config
        x = self.ops.rms_norm(h, layer.input_norm, c.rms_norm_eps)
        qkv = self.linear(x, layer.qkv_proj, layer.qkv_bias)
        if layer.q_norm is None:
            return self.ops.rope_split(qkv, cos, sin, c.num_heads, c.num_kv_heads, c.head_dim)
        # Qwen3: q and k are normalised per head before they are rotated
        q_size = c.num_heads * c.head_dim
        kv_size = c.num_kv_heads * c.head_dim
        n = qkv.shape[0]
        qk = qkv[:, : q_size + kv_size].view(n, c.num_heads + c.num_kv_heads, c.head_dim)
        qk = torch.cat([self.ops.rms_norm(qk[:, : c.num_heads], layer.q_norm, c.rms_norm_eps),
                        self.ops.rms_norm(qk[:, c.num_heads :], layer.k_norm, c.rms_norm_eps)],
                       dim=1)
        qk = apply_rope(qk, cos, sin)
        v = qkv[:, q_size + kv_size :].reshape(n, c.num_kv_heads, c.head_dim)
        return qk[:, : c.num_heads].contiguous(), qk[:, c.num_heads :].contiguous(), v.contiguous()

    def _finish_layer(
        self, layer: LayerWeights, h: torch.Tensor, attn: torch.Tensor
    ) -> torch.Tensor:
        # The residual adds are fused into the GEMMs (addmm: h + a @ W^T) for float32 weights.
        c = self.config
        base = h if layer.o_bias is None else h + layer.o_bias
        h = self.linear.add(base, attn.reshape(h.shape[0], -1), layer.o_proj)
        x = self.ops.rms_norm(h, layer.post_norm, c.rms_norm_eps)
        gate_up = self.linear(x, layer.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate, inplace=True).mul_(up)
        return self.linear.add(h, act, layer.down_proj)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [N, hidden] -> logits [N, vocab], float32."""
        w = self.weights
        return self.linear(self.ops.rms_norm(h, w.final_norm, self.config.rms_norm_eps),
                           w.lm_head)

    # ----------------------------------------------------------------------------- prefill

    def prefill(self, token_ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """One sequence from position 0, attending over its fresh K/V: logits [L or 1, vocab]."""
        return self.prefill_batch([token_ids], all_logits=[all_logits])[0]

    def prefill_batch(
        self,
        prompts: list[torch.Tensor],
        all_logits: list[bool] | None = None,
        *,
        starts: list[int] | None = None,
        store: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
        | None = None,
    ) -> list[torch.Tensor]:
        """The new tokens of several sequences in one pass, each following `starts[i]` tokens
        already cached (default 0: whole prompts).

        The linear layers run on the new tokens concatenated; attention runs on them padded to
        the longest, over each sequence's keys padded likewise (causal mask plus key-padding
        mask). `store(layer, k, v)` keeps the fresh K/V of the new tokens ([sum L, Hkv, D], in
        order) and returns what attention reads: each sequence's K/V as stored, its cached
        tokens then its new ones, concatenated in order ([sum (start + L), Hkv, D]), so that
        a prompt attends over the same values whether its prefix was cached or not. Without
        `store`, attention reads the fresh K/V and every start must be 0. Returns per sequence
        the logits of every new position (if all_logits[i]) or of the last one ([1, vocab]).
        """
        c = self.config
        all_logits = all_logits or [False] * len(prompts)
        starts = starts or [0] * len(prompts)
        if any(starts) and store is None:
            raise ValueError("prefill_batch: cached tokens (starts) need `store`")
        lens = [int(p.shape[0]) for p in prompts]
        if min(lens) < 1:
            raise ValueError("prefill_batch: every prompt needs at least one token")
        tokens = torch.cat(prompts)
        positions = torch.cat([torch.arange(st, st + n) for st, n in zip(starts, lens)])
        lmax, total = max(lens), sum(lens)
        len_t, start_t = torch.tensor(lens), torch.tensor(starts)
        # pad_index[i, t] = flat index of new token t of sequence i, or `total` (a zero row).
        offsets = torch.tensor([0] + lens[:-1]).cumsum(0)
        ar = torch.arange(lmax)
        valid = ar[None, :] < len_t[:, None]  # [S, Lmax]
        pad_index = torch.where(
            valid, offsets[:, None] + ar[None, :], torch.full_like(ar[None, :], total)
        )
        # key_index[i, j] = flat index of key j of sequence i (its cached keys first), or the
        # zero row; query t (position starts[i] + t) sees the keys j <= starts[i] + t.
        key_lens = start_t + len_t
        key_total = int(key_lens.sum())
        ak = torch.arange(int(key_lens.max()))
        key_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), key_lens[:-1]]).cumsum(0)
        key_valid = ak[None, :] < key_lens[:, None]  # [S, Kmax]
        key_index = torch.where(
            key_valid, key_offsets[:, None] + ak[None, :], torch.full_like(ak[None, :], key_total)
        )
        causal = ak[None, None, :] <= (start_t[:, None, None] + ar[None, :, None])
        mask = (causal & key_valid[:, None, :])[:, None]  # [S, 1, Lmax(q), Kmax(k)]
        group = c.num_heads // c.num_kv_heads
        h = self.weights.embed_tokens[tokens]
        cos, sin = self.rope.cos_sin(positions)

        def padded(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])  # [N, H, D] -> [S, H, L, D]
            return x[index].transpose(1, 2)

        for i, layer in enumerate(self.weights.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            if store is not None:
                k, v = store(i, k, v)
            kh, vh = padded(k, key_index), padded(v, key_index)
            if group > 1:
                kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
            attn = F.scaled_dot_product_attention(
                padded(q, pad_index), kh, vh, attn_mask=mask, scale=self.sm_scale
            )
            h = self._finish_layer(layer, h, attn.transpose(1, 2)[valid])
        # one LM-head matmul over the rows wanted: every new position, or the last one
        ends = (offsets + len_t - 1).tolist()
        counts = [n if every else 1 for n, every in zip(lens, all_logits)]
        rows = [r for end, n in zip(ends, counts) for r in range(end - n + 1, end + 1)]
        return list(self.logits(h[rows]).split(counts))

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
            attn = attend(i, q, k, v)
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
        "weight_dtype": weights.weight_format,
        "decode_weight_bytes": decode_weight_bytes(weights),
    }


def decode_weight_bytes(weights: Weights) -> int:
    """Bytes one decode step reads of the weights (the projections and the LM head; the
    embedding rows looked up are negligible): batch-1 decode's roofline denominator."""
    return sum(nbytes(m) for m in weights.matrices())
