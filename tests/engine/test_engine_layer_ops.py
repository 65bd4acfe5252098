"""RMSNorm and RoPE as one-call TVM kernels (`engine/layer_ops.py`) against their torch
definitions: every row count a forward passes them, the Qwen3 per-head norm's 3-D views,
and widths the kernels do not take (torch runs those, exactly)."""

from __future__ import annotations

import pytest
import torch
from reinforge.engine.layer_ops import LayerOps, apply_rope, rms_norm


@pytest.mark.parametrize("rows", [1, 8, 13, 167])
@pytest.mark.parametrize("width", [64, 576])
def test_the_rms_norm_kernel_equals_torch_to_float32_rounding(rows, width):
    gen = torch.Generator().manual_seed(rows * width)
    x, w = torch.randn(rows, width, generator=gen) * 3, torch.randn(width, generator=gen)
    ops = LayerOps("tvm")
    got = ops.rms_norm(x, w, 1e-6)
    assert ops.path == "tvm-layer" and got.shape == x.shape
    torch.testing.assert_close(got, rms_norm(x, w, 1e-6), rtol=2e-6, atol=2e-6)


def test_the_rms_norm_kernel_takes_a_per_head_view():
    # Qwen3's q norm: the q heads of a [N, Hq + Hkv, D] view, over head_dim
    gen = torch.Generator().manual_seed(0)
    qk = torch.randn(5, 12, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    got = LayerOps("tvm").rms_norm(qk[:, :9], w, 1e-6)
    assert got.shape == (5, 9, 64) and got.is_contiguous()
    torch.testing.assert_close(got, rms_norm(qk[:, :9], w, 1e-6), rtol=2e-6, atol=2e-6)


def split_in_torch(qkv, cos, sin, hq, hkv, d):
    n = qkv.shape[0]
    qk = apply_rope(qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d), cos, sin)
    return qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d :].view(n, hkv, d)


@pytest.mark.parametrize("rows", [1, 8, 115])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32)])
def test_the_rope_kernel_rotates_q_and_k_and_copies_v_as_torch_does(rows, heads):
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen)
    angles = torch.rand(rows, d // 2, generator=gen) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ops = LayerOps("tvm")
    got = ops.rope_split(qkv, cos, sin, hq, hkv, d)
    assert ops.path == "tvm-layer"
    for a, b in zip(got, split_in_torch(qkv, cos, sin, hq, hkv, d)):
        assert a.is_contiguous() and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2], qkv[:, (hq + hkv) * d :].view(rows, hkv, d))


def test_widths_the_kernels_do_not_take_run_in_torch_exactly():
    gen = torch.Generator().manual_seed(1)
    ops = LayerOps("tvm")
    x, w = torch.randn(3, 40, generator=gen), torch.randn(40, generator=gen)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))
    qkv = torch.randn(3, 4 * 48, generator=gen)  # head_dim 48: not a multiple of 32
    cos, sin = torch.rand(3, 48, generator=gen), torch.rand(3, 48, generator=gen)
    for a, b in zip(ops.rope_split(qkv, cos, sin, 2, 1, 48),
                    split_in_torch(qkv, cos, sin, 2, 1, 48)):
        assert torch.equal(a, b)
    assert ops.path == "tvm-layer"  # the other widths still use the kernels


def test_the_torch_backend_runs_the_torch_definitions():
    ops = LayerOps("torch")
    x, w = torch.randn(2, 64), torch.randn(64)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))
    assert ops.path == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend"):
        LayerOps("cuda")


def test_the_kernels_read_tensors_that_are_not_64_byte_aligned():
    # a norm weight loaded from safetensors sits 16 bytes into a page; a kernel that assumed
    # TVM's default 64-byte alignment crashed the process on it
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(4 + 8 * 256 + 4 + 256, generator=gen)
    x, w = base[4:4 + 8 * 256].view(8, 256), base[8 + 8 * 256:]
    assert x.data_ptr() % 64 and w.data_ptr() % 64
    ops = LayerOps("tvm")
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6),
                               rtol=2e-6, atol=2e-6)
    qkv = base[4:4 + 2 * 512].view(2, 512)
    cos, sin = base[8:8 + 128].view(2, 64), base[12:12 + 128].view(2, 64)
    for a, b in zip(ops.rope_split(qkv, cos, sin, 4, 2, 64),
                    split_in_torch(qkv, cos, sin, 4, 2, 64)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
