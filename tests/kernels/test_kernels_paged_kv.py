"""Contract suite for the paged KV cache ops: every backend against the torch reference and
against float attention on the unquantized K/V."""

from __future__ import annotations

import math

import pytest
import torch

from reinforge.kernels.paged_kv import (
    INT4_GROUP_SIZE,
    KV_KINDS,
    TorchKVOps,
    allocate_cache,
    dequantize_int4,
    dequantize_int8,
    get_kv_ops,
    quantize_int4,
    quantize_int8,
)
from reinforge.kernels.tvm_ops import TvmKVOps

BACKENDS = ("torch", "tvm")
# (H_q, H_kv, D): head_dim 64 and 128, GQA ratios 1, 4 and 8.
SHAPES = [(8, 8, 128), (16, 4, 128), (16, 2, 64), (8, 1, 64), (4, 4, 64)]
# Ragged lengths that straddle block boundaries (block_size 16).
SEQ_LENS = [1, 15, 16, 17, 33, 64, 100]


def ops_for(kind: str, backend: str):
    return get_kv_ops(kind, backend, num_threads=2)


def fill_cache(ops, kind, h_kv, d, seq_lens, *, block_size=16, seed=0, outlier=True):
    """Random K/V for each sequence written through `ops.append` to shuffled pages.
    Returns cache, block_table, seq_lens tensor and the original float K/V per sequence."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil(n / block_size) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 3
    cache = allocate_cache(kind=kind, num_blocks=num_blocks, block_size=block_size,
                           num_kv_heads=h_kv, head_dim=d)  # fmt: skip
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_table = perm[: len(seq_lens) * max_blocks].reshape(len(seq_lens), max_blocks).contiguous()
    kvs = []
    for b, n in enumerate(seq_lens):
        k = torch.randn(n, h_kv, d, generator=gen)
        v = torch.randn(n, h_kv, d, generator=gen)
        if outlier:  # a few large channels in K, as real models have
            k[..., 3] += 4.0
        pos = torch.arange(n)
        slots = block_table[b].long()[pos // block_size] * block_size + pos % block_size
        slots = slots.to(torch.int32)
        # write in two chunks (prefill, then more) with a skipped token in between
        half = n // 2
        skip = torch.tensor([-1], dtype=torch.int32)
        junk = torch.full((1, h_kv, d), 1e6)
        ops.append(cache, k[:half], v[:half], slots[:half])
        ops.append(cache, torch.cat([junk, k[half:]]), torch.cat([junk, v[half:]]),
                   torch.cat([skip, slots[half:]]))  # fmt: skip
        kvs.append((k, v))
    return cache, block_table, torch.tensor(seq_lens, dtype=torch.int32), kvs


def quant_error_bound(kind: str, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |x - dequant(quant(x))|: half a quantization step, plus fp32 slack."""
    if kind == "int8":
        step = x.abs().amax(-1, keepdim=True) / 127.0
        return step / 2 * (1 + 1e-5) + 1e-6
    if kind == "int4":
        g = x.reshape(*x.shape[:-1], -1, INT4_GROUP_SIZE)
        step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15.0
        return (step / 2 * (1 + 1e-5) + 1e-6).expand_as(g).reshape(x.shape)
    if kind == "bfloat16":
        return x.abs() * 2.0**-8
    return torch.zeros_like(x)


def fp64_attention(q, kvs, h_kv, sm_scale):
    """Float64 attention of each query row over its sequence's unquantized K/V."""
    b, hq, d = q.shape
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for i, (k, v) in enumerate(kvs):
        if k.shape[0] == 0:
            continue
        kk = k.double().repeat_interleave(hq // h_kv, dim=1)  # [L, Hq, D]
        vv = v.double().repeat_interleave(hq // h_kv, dim=1)
        s = torch.einsum("hd,lhd->hl", q[i].double(), kk) * sm_scale
        out[i] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), vv)
    return out


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_reference_quantizers_round_trip_within_half_a_step(kind):
    x = torch.randn(64, 4, 128) * torch.rand(64, 4, 1) * 10
    x[0, 0] = 0.0  # an all-zero row must not divide by zero
    if kind == "int8":
        back = dequantize_int8(*quantize_int8(x))
    else:
        back = dequantize_int4(*quantize_int4(x))
    assert torch.all((back - x).abs() <= quant_error_bound(kind, x))
    assert torch.all(back[0, 0] == 0)


def test_int4_packs_even_channel_in_low_nibble():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 31] = 15.0, 0.0, 7.0  # group min 0, max 15: codes equal values
    packed, scale, zero = quantize_int4(x)
    assert packed[0, 0].item() == 15 and packed[0, 15].item() == 7 << 4
    assert scale.item() == 1.0 and zero.item() == 0.0


@pytest.mark.parametrize("kind", KV_KINDS)
def test_bytes_per_token_counts_data_and_scales(kind):
    cache = allocate_cache(kind=kind, num_blocks=2, num_kv_heads=8, head_dim=128)
    expected = {"float32": 2 * 8 * 128 * 4, "bfloat16": 2 * 8 * 128 * 2,
                "int8": 2 * 8 * (128 + 4), "int4": 2 * 8 * (64 + 2 * 4 * 4)}  # fmt: skip
    assert cache.bytes_per_token() == expected[kind]
    assert cache.nbytes() == cache.bytes_per_token() * cache.num_slots


def test_allocate_cache_rejects_unknown_kind_and_bad_head_dim():
    with pytest.raises(ValueError, match="unknown KV cache kind 'fp8'"):
        allocate_cache(kind="fp8", num_blocks=1, num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="int4 needs head_dim a multiple of 32"):
        allocate_cache(kind="int4", num_blocks=1, num_kv_heads=1, head_dim=48)


# ----------------------------------------------------------------------------- contract


def backend_kinds():
    for backend in BACKENDS:
        for kind in KV_KINDS:
            yield pytest.param(backend, kind, id=f"{backend}-{kind}")


@pytest.mark.parametrize("backend,kind", list(backend_kinds()))
@pytest.mark.parametrize("h_kv,d", [(4, 128), (2, 64)])
def test_cache_round_trips_ragged_sequences_through_shuffled_pages(backend, kind, h_kv, d):
    ops = ops_for(kind, backend)
    cache, table, lens, kvs = fill_cache(ops, kind, h_kv, d, SEQ_LENS)
    for b, (k, v) in enumerate(kvs):
        k_back, v_back = ops.gather(cache, table[b], int(lens[b]))
        assert k_back.shape == k.shape and k_back.dtype == torch.float32
        assert torch.all((k_back - k).abs() <= quant_error_bound(kind, k)), f"K of seq {b}"
        assert torch.all((v_back - v).abs() <= quant_error_bound(kind, v)), f"V of seq {b}"


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_tvm_append_writes_the_reference_codes_and_scales(kind):
    caches = []
    for backend in BACKENDS:
        cache, *_ = fill_cache(ops_for(kind, backend), kind, 4, 128, SEQ_LENS, seed=3)
        caches.append(cache)
    ref, tvm = caches
    for name in ("k_data", "v_data"):
        a, b = getattr(ref, name), getattr(tvm, name)
        if kind == "int8":
            diff = (a.int() - b.int()).abs()
        else:  # compare both nibbles
            diff = torch.maximum(((a & 15).int() - (b & 15).int()).abs(),
                                 ((a >> 4).int() - (b >> 4).int()).abs())  # fmt: skip
        # round-half ties may go either way after one-ulp product differences
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-4, name
    for a, b in zip(ref.tensors()[2:], tvm.tensors()[2:], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hq,h_kv,d", SHAPES)
def test_int8_decode_attention_is_within_1e_2_of_float_attention_on_unquantized_kv(
    backend, hq, h_kv, d
):
    ops = ops_for("int8", backend)
    cache, table, lens, kvs = fill_cache(ops, "int8", h_kv, d, SEQ_LENS)
    q = torch.randn(len(SEQ_LENS), hq, d, generator=torch.Generator().manual_seed(1))
    out = torch.full_like(q, float("nan"))
    sm_scale = 1 / math.sqrt(d)
    ops.decode_attention(q, cache, table, lens, sm_scale, out)
    ref = fp64_attention(q, kvs, h_kv, sm_scale)
    assert rel_err(out, ref) <= 1e-2
    for b in range(len(SEQ_LENS)):  # per sequence too, so one short row can't hide
        assert rel_err(out[b], ref[b]) <= 1.5e-2, f"sequence {b} (len {SEQ_LENS[b]})"


# The integer int8 kernels (AVX-512, AVX2) round q and the probabilities to int16 (rel.
# ~2e-5 each); the portable and int4 kernels compute in fp32 like the twin.
TWIN_TOLERANCE = {"int8-avx512": 1e-4, "int8-avx2": 1e-4, "int8-portable": 2e-6, "int4": 2e-6}


@pytest.mark.parametrize("variant", ["int8-avx512", "int8-avx2", "int8-portable", "int4"])
@pytest.mark.parametrize("hq,h_kv,d", [(8, 8, 128), (16, 2, 64), (32, 4, 128)])
def test_tvm_decode_attention_matches_the_torch_twin_on_the_same_cache(variant, hq, h_kv, d):
    from reinforge.kernels.tvm_build import host_target
    from reinforge.kernels.tvm_cpu import runnable_paths

    kind, _, path = variant.partition("-")
    if path and path not in runnable_paths(host_target()):
        pytest.skip(f"this CPU can't run the {path} decode kernel")
    torch_ops = TorchKVOps()
    tvm_ops = TvmKVOps(kind, num_threads=2, decode_path=path or None)
    cache, table, lens, _ = fill_cache(torch_ops, kind, h_kv, d, SEQ_LENS, seed=5)
    q = torch.randn(len(SEQ_LENS), hq, d)
    want, got = torch.empty_like(q), torch.empty_like(q)
    torch_ops.decode_attention(q, cache, table, lens, 0.1, want)
    tvm_ops.decode_attention(q, cache, table, lens, 0.1, got)
    assert rel_err(got, want) <= TWIN_TOLERANCE[variant]


@pytest.mark.parametrize("kind,bound", [("float32", 1e-6), ("bfloat16", 1e-2), ("int4", 0.2)])
def test_other_kinds_decode_close_to_float_attention(kind, bound):
    ops = ops_for(kind, "auto")
    cache, table, lens, kvs = fill_cache(ops, kind, 2, 64, SEQ_LENS, outlier=False)
    q = torch.randn(len(SEQ_LENS), 8, 64)
    out = torch.empty_like(q)
    ops.decode_attention(q, cache, table, lens, 0.125, out)
    assert rel_err(out, fp64_attention(q, kvs, 2, 0.125)) <= bound


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sequence_attends_to_nothing_and_gets_zeros(backend):
    ops = ops_for("int8", backend)
    cache, table, _, _ = fill_cache(ops, "int8", 2, 64, [5, 20])
    lens = torch.tensor([0, 20], dtype=torch.int32)
    q = torch.randn(2, 4, 64)
    out = torch.full_like(q, float("nan"))
    ops.decode_attention(q, cache, table, lens, 0.125, out)
    assert torch.all(out[0] == 0) and torch.all(torch.isfinite(out[1]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KV_KINDS)
def test_copy_blocks_duplicates_pages_for_copy_on_write(backend, kind):
    ops = ops_for(kind, backend)
    cache, table, lens, _ = fill_cache(ops, kind, 2, 64, [40])
    used = table[0, :3]
    fresh = torch.tensor(
        [b for b in range(cache.num_blocks) if b not in set(table[0].tolist())][:3],
        dtype=torch.int64,
    )
    ops.copy_blocks(cache, used.long(), fresh)
    k1, v1 = ops.gather(cache, used, 40)
    k2, v2 = ops.gather(cache, fresh.to(torch.int32), 40)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_reject_mismatched_shapes_with_a_message_naming_the_argument(backend):
    ops = ops_for("int8", backend)
    cache = allocate_cache(kind="int8", num_blocks=4, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="append: k has shape"):
        ops.append(cache, torch.zeros(3, 4, 64), torch.zeros(3, 2, 64),
                   torch.zeros(3, dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match="slot_mapping must be int32"):
        ops.append(cache, torch.zeros(3, 2, 64), torch.zeros(3, 2, 64),
                   torch.zeros(3, dtype=torch.int64))  # fmt: skip
    q = torch.zeros(1, 3, 64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads=2"):
        ops.decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int32), 1.0, q.clone())  # fmt: skip


def test_get_kv_ops_picks_the_compiled_backend_for_quantized_kinds_and_torch_for_float():
    assert get_kv_ops("int8", "auto").name == "tvm-llvm"
    assert get_kv_ops("float32", "auto").name == "torch"
    assert get_kv_ops("int8", "torch").name == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'"):
        get_kv_ops("int8", "cuda")


def test_tvm_ops_fall_back_to_the_twin_for_head_dims_the_kernels_do_not_cover():
    ops, twin = ops_for("int8", "tvm"), TorchKVOps()
    cache, table, lens, kvs = fill_cache(ops, "int8", 2, 40, [20, 33])
    ref_cache, *_ = fill_cache(twin, "int8", 2, 40, [20, 33])
    assert all(torch.equal(a, b) for a, b in zip(cache.tensors(), ref_cache.tensors(), strict=True))
    q = torch.randn(2, 4, 40)
    got, want = torch.empty_like(q), torch.empty_like(q)
    ops.decode_attention(q, cache, table, lens, 0.2, got)
    twin.decode_attention(q, cache, table, lens, 0.2, want)
    assert torch.equal(got, want)


def test_tvm_ops_accept_strided_views_of_k_v_and_q():
    ops, twin = ops_for("int8", "tvm"), TorchKVOps()
    qkv = torch.randn(5, 3, 2, 64)  # [N, (q|k|v), H, D]: slices are not contiguous
    k, v = qkv[:, 1], qkv[:, 2]
    assert not k.is_contiguous()
    slots = torch.arange(5, dtype=torch.int32)
    a = allocate_cache(kind="int8", num_blocks=2, num_kv_heads=2, head_dim=64)
    b = allocate_cache(kind="int8", num_blocks=2, num_kv_heads=2, head_dim=64)
    ops.append(a, k, v, slots)
    twin.append(b, k, v, slots)
    assert torch.equal(a.k_data, b.k_data) and torch.equal(a.v_scale, b.v_scale)
    q = qkv[:1, 0]
    got, want = torch.empty(1, 2, 64), torch.empty(1, 2, 64)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    ops.decode_attention(q, a, table, lens, 0.125, got)
    twin.decode_attention(q, b, table, lens, 0.125, want)
    assert rel_err(got, want) <= 1e-4
