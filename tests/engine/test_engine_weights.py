"""Weights served in bfloat16 or int8: packing error bounds, the TVM products against torch
on the same packed weights (every row count, both sides of the kernel's row limits), and the
tiny policy served from packed weights against the float32 one."""

from __future__ import annotations

import pytest
import torch
from reinforge.engine.engine import Engine, EngineConfig
from reinforge.engine.linear import (
    GEMV_CHUNKED_MAX_ROWS,
    GEMV_MAX_ROWS,
    Int8Weight,
    Linear,
    check_format,
    nbytes,
    pack,
)
from reinforge.engine.loader import load_model
from reinforge.engine.model import decode_weight_bytes
from reinforge.engine.sampling import SamplingParams

from test_engine_model import PROMPTS, run_engine


def test_packing_error_stays_within_each_formats_rounding():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    q = pack(w, "int8")
    assert isinstance(q, Int8Weight) and q.data.dtype == torch.int8
    assert bool(((q.dequantize() - w).abs() <= q.scale[:, None] / 2 + 1e-7).all())
    b = pack(w, "bfloat16")
    assert b.dtype == torch.bfloat16
    assert bool(((b.float() - w).abs() <= w.abs() * 2.0**-8).all())
    assert pack(w, "float32") is w
    assert (nbytes(w), nbytes(b), nbytes(q)) == (64 * 96 * 4, 64 * 96 * 2, 64 * 96 + 64 * 4)
    with pytest.raises(ValueError, match="weight format must be one of"):
        check_format("fp8")


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
# rows: past GEMV_MAX_ROWS the kernels run in chunks; 3 and 6 end past the kernel's last
# whole tile of activation rows
@pytest.mark.parametrize("rows", [1, 3, 6, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1,
                                  2 * GEMV_MAX_ROWS + 8, GEMV_CHUNKED_MAX_ROWS,
                                  GEMV_CHUNKED_MAX_ROWS + 1])
def test_the_tvm_products_equal_torch_on_the_same_packed_weights(fmt, rows):
    gen = torch.Generator().manual_seed(rows)
    w = pack(torch.randn(258, 704, generator=gen), fmt)
    x = torch.randn(rows, 704, generator=gen)
    bias, base = torch.randn(258, generator=gen), torch.randn(rows, 258, generator=gen)
    widened = w.dequantize() if fmt == "int8" else w.float()
    tvm, ref = Linear("tvm"), Linear("torch")
    # Through the kernels (in chunks past GEMV_MAX_ROWS) x stays float32; bf16 prefill rounds
    # x too (a bf16 GEMM).
    exact = fmt == "int8" or rows <= GEMV_CHUNKED_MAX_ROWS
    for a, b in ((tvm(x, w, bias), x @ widened.t() + bias),
                 (tvm.add(base, x, w), base + x @ widened.t())):
        assert a.dtype == torch.float32 and a.shape == (rows, 258)
        near = 1e-4 if exact else 1e-2 * float(b.abs().max())
        torch.testing.assert_close(a, b, rtol=1e-4, atol=near)
    assert tvm.path == "tvm-gemv" and ref.path == "torch"
    y = tvm(x, w, bias)
    torch.testing.assert_close(ref(x, w, bias), y, rtol=0, atol=1e-2 * float(y.abs().max()))


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    return [tok.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("fmt, max_error", [("bfloat16", 0.2), ("int8", 0.5)])
def test_the_policy_served_from_packed_weights_stays_close_to_float32(
        tiny_model_dir, prompts, fmt, max_error):
    fp32 = load_model(tiny_model_dir)
    packed = load_model(tiny_model_dir, fmt)
    assert packed.weights.weight_format == fmt
    assert decode_weight_bytes(packed.weights) < decode_weight_bytes(fp32.weights) // 1.9
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    config = EngineConfig(kv_cache_dtype="float32", max_total_tokens=4096)
    ref = run_engine(Engine(fp32, config), prompts, greedy)
    got = run_engine(Engine(packed, config), prompts, greedy)
    # each output token scored by the float32 policy and by the packed one, teacher-forced
    errors = []
    for i, ids in enumerate(prompts):
        seq = torch.tensor(ids + got[i].output_ids)
        with torch.no_grad():
            a = torch.log_softmax(fp32.prefill(seq, all_logits=True), -1)
            b = torch.log_softmax(packed.prefill(seq, all_logits=True), -1)
        tokens = seq[len(ids):]
        pos = torch.arange(len(ids) - 1, len(seq) - 1)
        errors.append((a[pos, tokens] - b[pos, tokens]).abs().max())
        assert len(got[i].output_ids) == len(ref[i].output_ids) == 12
    assert 0.0 < float(max(errors)) < max_error
