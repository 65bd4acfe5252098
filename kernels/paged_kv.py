"""One layer's paged KV cache, quantized on write, and the operations on it.

Layout (every kind): a cache is `num_blocks` pages of `block_size` token slots. A token's
slot is ``block * block_size + offset``; a sequence owns an ordered list of blocks (its row
of the block table). Pages are head-major, ``[num_blocks, H_kv, <one head's page>]``, so one
page of all heads is one contiguous run of memory. Inside one head's page, float and int4
kinds store tokens in order (``[block_size, D]``); int8 interleaves pairs so that the CPU
kernels can use 16-bit integer dot products (``vpmaddwd``/``vpdpwssd``) with tokens in vector
lanes: K as ``[D // 2, block_size, 2]`` (channel pairs, then tokens) and V as
``[block_size // 2, D, 2]`` (token pairs, then channels). `token_major` undoes this.

Kinds (`KV_KINDS`):
  * ``float32`` / ``bfloat16``: unquantized, for exact-parity tests of the engine.
  * ``int8`` (the default quantized kind): symmetric, one fp32 scale per (token, head):
    ``scale = absmax / 127``, ``code = clamp(round(x / scale), -127, 127)``. Dequantization
    error per element is at most ``scale / 2`` (plus fp32 rounding).
  * ``int4`` (aggressive): asymmetric per (token, head, group of `INT4_GROUP_SIZE` channels):
    ``scale = (max - min) / 15``, ``zero = min``, ``code = clamp(round((x - zero) / scale),
    0, 15)``; two codes per byte, the even channel in the low nibble. Error per element is at
    most ``scale / 2``. Keys are quantized per token here, not per channel as in KIVI: a
    per-channel key format needs a full-precision residual window to stay streaming, which
    this cache does not have.

`KVOps` is the contract the engine codes against; `TorchKVOps` is the reference twin (plain
torch, CPU or GPU) and `reinforge.kernels.tvm_ops.TvmKVOps` the compiled one. `get_kv_ops`
picks one.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

log = logging.getLogger(__name__)

KV_KINDS = ("float32", "bfloat16", "int8", "int4")
QUANTIZED_KINDS = ("int8", "int4")
INT4_GROUP_SIZE = 32
"""Channels per int4 scale/zero group (along head_dim)."""

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(eq=False)
class PagedKVCache:
    """ONE layer's K and V pages. Tensors are contiguous and may live on any device.

    `k_data`/`v_data`: ``[num_blocks, H_kv, block_size, D]`` (float32, bfloat16); int8 K
    ``[num_blocks, H_kv, D // 2, block_size, 2]`` and V ``[num_blocks, H_kv, block_size // 2,
    D, 2]`` (see the module docstring; `token_major` gives the plain view); or
    ``[num_blocks, H_kv, block_size, D // 2]`` uint8 for int4 (two codes per byte).
    `k_scale`/`v_scale`: int8 ``[num_blocks, H_kv, block_size]`` fp32; int4 ``[num_blocks, H_kv,
    block_size, D // INT4_GROUP_SIZE]`` fp32; None for float kinds.
    `k_zero`/`v_zero`: int4 only, same shape as the scales (the group minimum).
    """

    kind: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    k_data: Tensor
    v_data: Tensor
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None
    k_zero: Tensor | None = None
    v_zero: Tensor | None = None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def device(self) -> torch.device:
        return self.k_data.device

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor of the cache (data, then scales and zeros if any), in a fixed order."""
        ts = [self.k_data, self.v_data]
        for t in (self.k_scale, self.v_scale, self.k_zero, self.v_zero):
            if t is not None:
                ts.append(t)
        return tuple(ts)

    def bytes_per_token(self) -> int:
        """Bytes one token costs in this layer: K and V, all KV heads, scales/zeros included."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors()) // self.block_size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def allocate_cache(
    *,
    kind: str,
    num_blocks: int,
    block_size: int = 16,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str = "cpu",
) -> PagedKVCache:
    """Allocate a zeroed cache of `num_blocks` pages. Checks the shape against the kind."""
    if kind not in KV_KINDS:
        raise ValueError(f"unknown KV cache kind {kind!r}: expected one of {KV_KINDS}")
    for name, value in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"allocate_cache: {name} must be a positive int, got {value!r}")
    if kind == "int4" and head_dim % INT4_GROUP_SIZE:
        raise ValueError(
            f"allocate_cache: int4 needs head_dim a multiple of {INT4_GROUP_SIZE}, got {head_dim}"
        )
    page = (num_blocks, num_kv_heads, block_size)

    def zeros(*shape: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    if kind in _FLOAT_DTYPES:
        dt = _FLOAT_DTYPES[kind]
        return PagedKVCache(
            kind, num_blocks, block_size, num_kv_heads, head_dim,
            k_data=zeros(*page, head_dim, dtype=dt), v_data=zeros(*page, head_dim, dtype=dt),
        )  # fmt: skip
    if kind == "int8":
        if block_size % 2 or head_dim % 2:
            raise ValueError(
                f"allocate_cache: int8 needs even block_size and head_dim, got {block_size}, "
                f"{head_dim}"
            )
        h, bs, d = num_kv_heads, block_size, head_dim
        return PagedKVCache(
            kind, num_blocks, block_size, num_kv_heads, head_dim,
            k_data=zeros(num_blocks, h, d // 2, bs, 2, dtype=torch.int8),
            v_data=zeros(num_blocks, h, bs // 2, d, 2, dtype=torch.int8),
            k_scale=zeros(*page, dtype=torch.float32),
            v_scale=zeros(*page, dtype=torch.float32),
        )  # fmt: skip
    groups = head_dim // INT4_GROUP_SIZE
    return PagedKVCache(
        kind, num_blocks, block_size, num_kv_heads, head_dim,
        k_data=zeros(*page, head_dim // 2, dtype=torch.uint8),
        v_data=zeros(*page, head_dim // 2, dtype=torch.uint8),
        k_scale=zeros(*page, groups, dtype=torch.float32),
        v_scale=zeros(*page, groups, dtype=torch.float32),
        k_zero=zeros(*page, groups, dtype=torch.float32),
        v_zero=zeros(*page, groups, dtype=torch.float32),
    )  # fmt: skip


class KVOps(Protocol):
    """The operations on a `PagedKVCache`. Implementations: `TorchKVOps`, `TvmKVOps`."""

    name: str

    def append(self, cache: PagedKVCache, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Quantize and write `k`, `v` (float32 ``[N, H_kv, D]``) to the slots in `slot_mapping`
        (int32 ``[N]``, ``block * block_size + offset``; -1 skips the token)."""
        ...

    def decode_attention(
        self,
        q: Tensor,
        cache: PagedKVCache,
        block_table: Tensor,
        seq_lens: Tensor,
        sm_scale: float,
        out: Tensor,
    ) -> None:
        """One query token per sequence against its cached K/V, read in place.

        `q` float32 ``[B, H_q, D]`` (H_q a multiple of H_kv; query head ``h`` reads KV head
        ``h // (H_q // H_kv)``), `block_table` int32 ``[B, max_blocks]``, `seq_lens` int32
        ``[B]``; writes float32 ``[B, H_q, D]`` into `out`. A sequence of length 0 gets zeros.
        """
        ...

    def gather(self, cache: PagedKVCache, block_ids: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
        """Dequantize one sequence: float32 K, V ``[seq_len, H_kv, D]`` from its blocks."""
        ...

    def copy_blocks(self, cache: PagedKVCache, src: Tensor, dst: Tensor) -> None:
        """Copy whole pages ``src[i] -> dst[i]`` (data, scales, zeros): copy-on-write sharing."""
        ...


# ----------------------------------------------------------------------------- checks


def check_append_args(cache: PagedKVCache, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    shape = (k.shape[0], cache.num_kv_heads, cache.head_dim)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != shape:
            raise ValueError(f"append: {name} has shape {tuple(t.shape)}, expected {shape}")
        if t.dtype != torch.float32:
            raise TypeError(f"append: {name} must be float32, got {t.dtype}")
    if slot_mapping.dtype != torch.int32 or tuple(slot_mapping.shape) != (k.shape[0],):
        raise ValueError(
            f"append: slot_mapping must be int32 [{k.shape[0]}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )


def check_decode_args(
    q: Tensor, cache: PagedKVCache, block_table: Tensor, seq_lens: Tensor, out: Tensor
) -> None:
    if q.dim() != 3 or q.shape[2] != cache.head_dim or q.shape[1] % cache.num_kv_heads:
        raise ValueError(
            f"decode_attention: q has shape {tuple(q.shape)}, expected [B, H_q, {cache.head_dim}]"
            f" with H_q a multiple of num_kv_heads={cache.num_kv_heads}"
        )
    if q.dtype != torch.float32 or out.dtype != torch.float32:
        raise TypeError(f"decode_attention: q and out must be float32, got {q.dtype}, {out.dtype}")
    if out.shape != q.shape:
        raise ValueError(f"decode_attention: out has shape {tuple(out.shape)}, q {tuple(q.shape)}")
    b = q.shape[0]
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(
            f"decode_attention: block_table must be int32 [{b}, max_blocks], got "
            f"{block_table.dtype} {tuple(block_table.shape)}"
        )
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (b,):
        raise ValueError(
            f"decode_attention: seq_lens must be int32 [{b}], got {seq_lens.dtype} "
            f"{tuple(seq_lens.shape)}"
        )


# ----------------------------------------------------------------------------- reference maths


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 over the last dim: int8 codes ``x.shape`` and fp32 scales
    ``x.shape[:-1]``."""
    amax = x.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(x * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, amax / 127.0


def dequantize_int8(codes: Tensor, scale: Tensor) -> Tensor:
    return codes.to(torch.float32) * scale[..., None]


def quantize_int4(x: Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric per-group uint4 over the last dim, packed two per byte (even = low nibble).

    Returns packed uint8 ``[..., D // 2]``, scale and zero fp32 ``[..., D // group_size]``.
    """
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    lo = g.amin(dim=-1)
    rng = g.amax(dim=-1) - lo
    inv = torch.where(rng > 0, 15.0 / rng, torch.zeros_like(rng))
    codes = torch.round((g - lo[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
    codes = codes.reshape(x.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, rng / 15.0, lo


def dequantize_int4(packed: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    lo_nib = (packed & 15).to(torch.float32)
    hi_nib = (packed >> 4).to(torch.float32)
    codes = torch.stack((lo_nib, hi_nib), dim=-1).reshape(*packed.shape[:-1], -1)
    groups = scale.shape[-1]
    g = codes.reshape(*codes.shape[:-1], groups, -1)
    return (g * scale[..., None] + zero[..., None]).reshape(codes.shape)


def token_major(kind: str, which: str, data: Tensor) -> Tensor:
    """Pages ``[..., H_kv, <page>]`` of K (`which`="k") or V as ``[..., H_kv, block_size, D]``
    (int4: ``D // 2`` packed bytes). Only int8 pages are interleaved; others pass through."""
    if kind != "int8":
        return data
    if which == "k":  # [.., D/2, BS, 2] -> [.., BS, D/2, 2] -> [.., BS, D]
        x = data.transpose(-3, -2)
        return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
    x = data.transpose(-2, -1)  # [.., BS/2, D, 2] -> [.., BS/2, 2, D] -> [.., BS, D]
    return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])


def write_int8_tokens(data: Tensor, which: str, blk: Tensor, off: Tensor, codes: Tensor) -> None:
    """Store int8 `codes` ``[N, H_kv, D]`` at (block, offset) pairs of an interleaved page."""
    n, h, d = codes.shape
    if which == "k":  # element (t, d) at [d // 2, t, d % 2]
        data[blk, :, :, off] = codes.reshape(n, h, d // 2, 2)
    else:  # element (t, d) at [t // 2, d, t % 2]
        data[blk, :, off // 2, :, off % 2] = codes


def dequantize_pages(cache: PagedKVCache, which: str, blocks: Tensor) -> Tensor:
    """Float32 ``[*blocks.shape, H_kv, block_size, D]`` of K (`which`="k") or V for `blocks`."""
    data = token_major(cache.kind, which, getattr(cache, f"{which}_data")[blocks])
    if cache.kind in _FLOAT_DTYPES:
        return data.to(torch.float32)
    scale = getattr(cache, f"{which}_scale")[blocks]
    if cache.kind == "int8":
        return dequantize_int8(data, scale)
    return dequantize_int4(data, scale, getattr(cache, f"{which}_zero")[blocks])


class TorchKVOps:
    """Reference twin in plain torch (works on any device). Readable first, not fast."""

    name = "torch"

    def append(self, cache: PagedKVCache, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        check_append_args(cache, k, v, slot_mapping)
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        if slots.numel() == 0:
            return
        if int(slots.max()) >= cache.num_slots:
            raise IndexError(
                f"append: slot {int(slots.max())} out of range for {cache.num_slots} slots"
            )
        blk, off = slots // cache.block_size, slots % cache.block_size
        for which, x in (("k", k[keep]), ("v", v[keep])):
            data = getattr(cache, f"{which}_data")
            if cache.kind in _FLOAT_DTYPES:
                data[blk, :, off] = x.to(data.dtype)
            elif cache.kind == "int8":
                codes, scale = quantize_int8(x)
                write_int8_tokens(data, which, blk, off, codes)
                getattr(cache, f"{which}_scale")[blk, :, off] = scale
            else:
                packed, scale, zero = quantize_int4(x)
                data[blk, :, off] = packed
                getattr(cache, f"{which}_scale")[blk, :, off] = scale
                getattr(cache, f"{which}_zero")[blk, :, off] = zero

    def gather(self, cache: PagedKVCache, block_ids: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
        n = math.ceil(seq_len / cache.block_size)
        if block_ids.numel() < n:
            raise ValueError(
                f"gather: {block_ids.numel()} blocks cannot hold {seq_len} tokens "
                f"(block_size {cache.block_size})"
            )
        blocks = block_ids[:n].long()
        out = []
        for which in ("k", "v"):
            x = dequantize_pages(cache, which, blocks)  # [n, H, bs, D]
            x = x.permute(0, 2, 1, 3).reshape(n * cache.block_size, cache.num_kv_heads, -1)
            out.append(x[:seq_len].contiguous())
        return out[0], out[1]

    def decode_attention(
        self,
        q: Tensor,
        cache: PagedKVCache,
        block_table: Tensor,
        seq_lens: Tensor,
        sm_scale: float,
        out: Tensor,
    ) -> None:
        check_decode_args(q, cache, block_table, seq_lens, out)
        b, hq, d = q.shape
        hkv, bs = cache.num_kv_heads, cache.block_size
        max_len = int(seq_lens.max()) if b else 0
        n = math.ceil(max_len / bs)
        if n == 0:
            out.zero_()
            return
        blocks = block_table[:, :n].long().clamp(min=0)
        k = dequantize_pages(cache, "k", blocks)  # [B, n, H, bs, D]
        v = dequantize_pages(cache, "v", blocks)
        k = k.permute(0, 2, 1, 3, 4).reshape(b, hkv, n * bs, d)
        v = v.permute(0, 2, 1, 3, 4).reshape(b, hkv, n * bs, d)
        qg = q.reshape(b, hkv, hq // hkv, d)
        scores = torch.einsum("bhgd,bhtd->bhgt", qg, k) * sm_scale
        pos = torch.arange(n * bs, device=q.device)
        masked = pos[None, :] >= seq_lens[:, None].to(pos.dtype)  # [B, T]
        scores.masked_fill_(masked[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # empty rows -> zeros
        out.copy_(torch.einsum("bhgt,bhtd->bhgd", probs, v).reshape(b, hq, d))

    def copy_blocks(self, cache: PagedKVCache, src: Tensor, dst: Tensor) -> None:
        if src.shape != dst.shape or src.dim() != 1:
            raise ValueError(
                f"copy_blocks: src and dst must be 1-D of one length, got {tuple(src.shape)}, "
                f"{tuple(dst.shape)}"
            )
        src, dst = src.long(), dst.long()
        for t in cache.tensors():
            t[dst] = t[src]


def get_kv_ops(kind: str, backend: str = "auto", *, num_threads: int | None = None) -> KVOps:
    """The ops for a cache `kind`: "torch" (reference twin), "tvm" (compiled for the host CPU,
    raises if it cannot compile/load) or "auto" (tvm when it compiles and loads, else torch,
    with a log line saying why). `num_threads` sets TVM's thread pool (default: every CPU this
    process may run on). Float kinds have no TVM kernels: both "tvm" and "auto" give torch."""
    if kind not in KV_KINDS:
        raise ValueError(f"unknown KV cache kind {kind!r}: expected one of {KV_KINDS}")
    if backend not in ("auto", "torch", "tvm"):
        raise ValueError(f"unknown kernel backend {backend!r}: expected 'auto', 'torch' or 'tvm'")
    if backend == "torch":
        return TorchKVOps()
    if kind in _FLOAT_DTYPES:
        log.info("kv ops: kind %s has no TVM kernels (unquantized); using the torch twin", kind)
        return TorchKVOps()
    try:
        from reinforge.kernels.tvm_ops import TvmKVOps

        return TvmKVOps(kind, num_threads=num_threads, fallback=backend == "auto")
    except Exception as exc:
        if backend == "tvm":
            raise
        log.warning("kv ops: TVM kernels unavailable for %s (%s: %s); using torch", kind,
                    type(exc).__name__, exc)  # fmt: skip
        return TorchKVOps()
