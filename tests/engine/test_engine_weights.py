"""Weights served in bfloat16, int8 or lossless blocks: packing error bounds, the blocks
found exactly in what GGUF's quantizers give, the TVM products against torch on the same
packed weights (every row count, both sides of the kernel's row limits), and the tiny policy
served from packed weights against the float32 one."""

from __future__ import annotations

import pytest
import torch
from reinforge.engine.engine import Engine, EngineConfig
from reinforge.engine.linear import (
    GEMV_CHUNKED_MAX_ROWS,
    GEMV_MAX_ROWS,
    BlockWeight,
    Int8Weight,
    Linear,
    check_format,
    find_blocks,
    nbytes,
    pack,
)
from reinforge.engine.loader import load_model
from reinforge.engine.model import decode_weight_bytes
from reinforge.engine.sampling import SamplingParams

from gguf_helpers import roundtrip, write_gguf
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


@pytest.mark.parametrize("quant, kind, bytes_per_weight", [("Q4_1", "q4", 0.75),
                                                            ("Q8_0", "q8", 1.25)])
def test_lossless_packing_finds_gguf_blocks_and_gives_back_every_bit(quant, kind,
                                                                     bytes_per_weight):
    gen = torch.Generator().manual_seed(1)
    w = roundtrip(torch.randn(48, 256, generator=gen) * 0.05, quant)
    packed = pack(w, "lossless")
    assert isinstance(packed, BlockWeight) and packed.kind == kind
    assert packed.shape == w.shape and packed.numel() == w.numel()
    assert torch.equal(packed.dequantize(), w)
    assert nbytes(packed) == w.numel() * bytes_per_weight


def test_lossless_packing_keeps_anything_else_in_float32():
    gen = torch.Generator().manual_seed(2)
    trained = torch.randn(48, 256, generator=gen)
    assert pack(trained, "lossless") is trained
    # one weight moved off its block's levels (a step of training) past the first rows
    w = roundtrip(torch.randn(48, 256, generator=gen), "Q4_1")
    w[40, 7] += 1e-3
    assert find_blocks(w) is None and pack(w, "lossless") is w
    # other GGUF quantizations, and rows that are not whole blocks
    assert find_blocks(roundtrip(torch.randn(16, 256, generator=gen), "Q5_1")) is None
    assert find_blocks(torch.zeros(4, 48)) is None


@pytest.mark.parametrize("fmt", ["int8", "bfloat16", "Q4_1", "Q8_0"])
# rows: past GEMV_MAX_ROWS the kernels run in chunks; 3, 6 and 13 end past the kernel's last
# whole tile of activation rows (13: a tile of 8, one of 4 and a row, in the block formats)
@pytest.mark.parametrize("rows", [1, 3, 6, 13, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1,
                                  2 * GEMV_MAX_ROWS + 8, GEMV_CHUNKED_MAX_ROWS,
                                  GEMV_CHUNKED_MAX_ROWS + 1])
def test_the_tvm_products_equal_torch_on_the_same_packed_weights(fmt, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(258, 704, generator=gen)
    w = pack(roundtrip(w, fmt), "lossless") if fmt.startswith("Q") else pack(w, fmt)
    x = torch.randn(rows, 704, generator=gen)
    bias, base = torch.randn(258, generator=gen), torch.randn(rows, 258, generator=gen)
    widened = w.float() if fmt == "bfloat16" else w.dequantize()
    tvm, ref = Linear("tvm"), Linear("torch")
    # Through the kernels (in chunks past GEMV_MAX_ROWS) x stays float32; bf16 prefill rounds
    # x too (a bf16 GEMM).
    exact = fmt != "bfloat16" or rows <= GEMV_CHUNKED_MAX_ROWS
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


def test_a_q4_1_gguf_import_served_lossless_decodes_as_its_float32_weights(
        tiny_model_dir, prompts, tmp_path):
    from reinforge.engine.importer import import_gguf

    import_gguf(write_gguf(tiny_model_dir, tmp_path / "tiny-q4_1.gguf", quant="Q4_1"),
                tmp_path / "imported")
    fp32 = load_model(tmp_path / "imported")
    blocks = load_model(tmp_path / "imported", "lossless")
    assert {m.kind for m in blocks.weights.matrices()} == {"q4"}  # the head too (tied)
    assert decode_weight_bytes(blocks.weights) == decode_weight_bytes(fp32.weights) * 0.75 / 4
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    config = EngineConfig(kv_cache_dtype="float32", max_total_tokens=4096)
    ref = run_engine(Engine(fp32, config), prompts, greedy)
    got = run_engine(Engine(blocks, config), prompts, greedy)
    for i in range(len(prompts)):
        a, b = ref[i], got[i]
        assert a.output_ids == b.output_ids and len(a.output_ids) == 16
        # the same float32 weights, summed in another order
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-4
