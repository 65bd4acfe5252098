"""TVM (tirx script) kernels for the products of decode with packed weights, on CPU.

    int8, bf16:  y[n, o] = scale[o] * sum_k x[n, k] * w[o, k]
    q8b, q4b:    y[n, o] = sum_k x[n, k] * (d[o, k // 32] * q[o, k] + m[o, k // 32])

int8 rows carry one fp32 scale per row; bf16 rows are read as raw 16-bit words (their
scales are ones). The block formats hold a checkpoint that is itself block-quantized (a
GGUF Q8_0 or Q4_1 import) exactly: per block of 32 weights a step d and an offset m, and
integer levels q (q8b: int8; q4b: two 4-bit levels a byte, GGUF's layout: byte j of a block
holds element j in its low nibble and element j + 16 in its high one). Each weight is
rebuilt as d * q + m before it is multiplied; with d an fp16 value, d * q is exact, so the
weight is bit for bit the float32 weight the checkpoint's loader computed.

Decode multiplies a few activation rows by every weight once per token, so the product is
bound by how fast the weights stream from memory: these kernels read each weight once per
call, widen it to fp32 in registers, and accumulate in fp32. torch's own paths widen the
whole matrix first (bf16 through oneDNN on a CPU without bf16 instructions) or run a slow
generic kernel (int8), which costs more than the bytes saved.

One parallel task per block of ROWS output rows. Activation rows go in tiles (TILES): each
weight vector (VW lanes) is widened once and multiplied into the tile x ROWS fp32
accumulator vectors of the tile, which walk K in VW-lane steps (independent FMA chains
hide their latency); the rows past the last whole tile go in smaller tiles. A tree of
halvings then sums each vector. K is a compile-time constant (a multiple of VW, of 32 for
the block formats); the rows and the activation count are symbolic (O a multiple of
ROWS). Each output is summed in the same order whatever the tiling.
"""

from __future__ import annotations

from tvm.script import tirx as T

from reinforge.kernels.tvm_cpu import VW
ROWS = 1
"""Output rows per task (and accumulators per activation row). Measured with 2 TVM threads,
int8, the five products of a SmolLM2-135M layer and its head: 1 row a task 1.80 ms at one
activation row, 4 rows 3.63 ms (one activation row: each task streams one weight row)."""
TILES = {"int8": 4, "bf16": 4, "q8b": 8, "q4b": 8}
"""Activation rows multiplied by each widened weight vector at once (tile x ROWS
accumulators in registers); the rows past the last whole tile go in one tile of half that,
then one at a time. Widening is most of a product's instructions: at 8 activation rows a
tile of 4 took 4.30 ms where one row at a time took 6.55 ms (same measurement). A block
format's weight costs one more multiply-add to widen, and a tile of 8 pays that back:
`python bench/gemv.py --json` (one TVM thread, the products of a SmolLM2-135M decode step at
8 rows; time with tiles of 8 over time with 4, two runs): q4b 0.914 and 0.912, q8b 0.949
and 0.955, int8 1.056 and 1.034, bf16 1.066 and 1.084."""
BLOCK = 32
"""Weights per (d, m) pair in the block formats (GGUF's Q8_0 and Q4_1 blocks)."""
FORMATS = ("int8", "bf16", "q8b", "q4b")
BLOCK_FORMATS = ("q8b", "q4b")


def _layout(fmt: str, k: int) -> tuple[int, str, int]:
    """Weight vectors per (d, m) pair (1: a per-row scale instead), and w's dtype and width."""
    if fmt not in FORMATS:
        raise ValueError(f"gemv format must be one of {FORMATS}, got {fmt!r}")
    step = BLOCK if fmt in BLOCK_FORMATS else VW
    if k % step:
        raise ValueError(f"gemv_{fmt}: K must be a multiple of {step}, got {k}")
    wdtype, wcols = {"int8": ("int8", k), "bf16": ("uint16", k), "q8b": ("int8", k),
                     "q4b": ("uint8", k // 2)}[fmt]
    return (BLOCK // VW if fmt in BLOCK_FORMATS else 1), wdtype, wcols


def _widen(fmt: str, w, s, o, b, h, j):
    """Lane j of the h-th weight vector of block b in row o, as fp32 (before a per-row scale;
    a block format's d and m applied). Blocks are VW lanes for int8 and bf16, BLOCK else."""
    if fmt == "int8":
        return T.Cast("float32", w[o, b * VW + j])
    if fmt == "bf16":
        return T.reinterpret("float32", T.shift_left(T.Cast("uint32", w[o, b * VW + j]),
                                                     T.uint32(16)))
    if fmt == "q8b":
        q = T.Cast("float32", w[o, b * BLOCK + h * VW + j])
    else:
        byte = T.Cast("int32", w[o, b * VW + j])
        q = T.Cast("float32", T.bitwise_and(T.shift_right(byte, h * 4), 15))
    return q * s[o, 2 * b] + s[o, 2 * b + 1]


def make_dequant(fmt: str, k: int):
    """dequant_<fmt>(w, s, out [O, K] f32): the weights as float32 (int8 times its row's
    scale), for prefill's many rows, which a float32 GEMM multiplies faster. One pass over
    the weights; the same values as `Linear`'s torch fallback."""
    K = k
    H, wdtype, wcols = _layout(fmt, k)
    name = f"dequant_{fmt}"

    @T.prim_func
    def dequant(w_h: T.handle, s_h: T.handle, out_h: T.handle):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        NOUT = T.int32()
        w = T.match_buffer(w_h, (NOUT, wcols), wdtype)
        if H == 1:
            s = T.match_buffer(s_h, (NOUT,), "float32")
        else:
            s = T.match_buffer(s_h, (NOUT, 2 * (K // BLOCK)), "float32")
        out = T.match_buffer(out_h, (NOUT, K), "float32")
        for o in T.parallel(NOUT):
            for b in T.serial(K // (VW * H)):
                for h in T.unroll(H):
                    for j in T.vectorized(VW):
                        if H == 1:
                            out[o, b * VW + j] = _widen(fmt, w, s, o, b, h, j) * s[o]
                        else:
                            out[o, (b * H + h) * VW + j] = _widen(fmt, w, s, o, b, h, j)

    return dequant


def make_gemv(fmt: str, k: int, rows: int = ROWS, tile: int | None = None):
    """gemv_<fmt>(x [N, K] f32, w, s, y [N, O] f32) with, by format:
    int8 w [O, K] int8, s [O] f32; bf16 w [O, K] uint16, s [O] f32 (ones);
    q8b w [O, K] int8, q4b w [O, K / 2] uint8, each s [O, K / 16] f32 (d, m of each block)."""
    H, wdtype, wcols = _layout(fmt, k)  # H: weight vectors per (d, m) pair
    K, R = k, rows
    NT = tile or TILES[fmt]
    NT2 = max(NT // 2, 1)
    name = f"gemv_{fmt}"

    @T.macro
    def product(x, w, s, y, acc, wide, n0, nt, o0):
        """y[n0:n0+nt, o0:o0+R] from the nt x R accumulators `acc`."""
        for a in T.unroll(nt):
            for r in T.unroll(R):
                for j in T.vectorized(VW):
                    acc[a, r, j] = T.float32(0)
        for b in T.serial(K // (VW * H)):
            for h in T.unroll(H):
                for r in T.unroll(R):
                    for j in T.vectorized(VW):
                        wide[r, j] = _widen(fmt, w, s, o0 + r, b, h, j)
                for a in T.unroll(nt):
                    for r in T.unroll(R):
                        for j in T.vectorized(VW):
                            acc[a, r, j] = (acc[a, r, j]
                                            + x[n0 + a, (b * H + h) * VW + j] * wide[r, j])
        for a in T.unroll(nt):
            for r in T.unroll(R):
                for j in T.vectorized(8):
                    acc[a, r, j] = acc[a, r, j] + acc[a, r, j + 8]
                for j in T.vectorized(4):
                    acc[a, r, j] = acc[a, r, j] + acc[a, r, j + 4]
                for j in T.vectorized(2):
                    acc[a, r, j] = acc[a, r, j] + acc[a, r, j + 2]
                if H == 1:
                    y[n0 + a, o0 + r] = (acc[a, r, 0] + acc[a, r, 1]) * s[o0 + r]
                else:
                    y[n0 + a, o0 + r] = acc[a, r, 0] + acc[a, r, 1]

    @T.prim_func
    def gemv(x_h: T.handle, w_h: T.handle, s_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        N = T.int32()
        NOUT = T.int32()
        x = T.match_buffer(x_h, (N, K), "float32")
        w = T.match_buffer(w_h, (NOUT, wcols), wdtype)
        if H == 1:
            s = T.match_buffer(s_h, (NOUT,), "float32")
        else:
            s = T.match_buffer(s_h, (NOUT, 2 * (K // BLOCK)), "float32")
        y = T.match_buffer(y_h, (N, NOUT), "float32")
        for ob in T.parallel(NOUT // R):
            wide = T.alloc_buffer((R, VW), "float32")
            tacc = T.alloc_buffer((NT, R, VW), "float32")
            for t in T.serial(N // NT):  # whole tiles of NT activation rows
                product(x, w, s, y, tacc, wide, t * NT, NT, ob * R)
            hacc = T.alloc_buffer((NT2, R, VW), "float32")
            for t in T.serial((N - N // NT * NT) // NT2):  # then a tile of NT / 2
                product(x, w, s, y, hacc, wide, N // NT * NT + t * NT2, NT2, ob * R)
            acc = T.alloc_buffer((1, R, VW), "float32")
            for n in T.serial(N - N // NT * NT - (N - N // NT * NT) // NT2 * NT2):  # then rows
                product(x, w, s, y, acc, wide, N // NT * NT + (N - N // NT * NT) // NT2 * NT2 + n,
                        1, ob * R)

    return gemv
