"""TVM (tirx script) kernels for the products of decode with int8 and bf16 weights, on CPU.

    y[n, o] = scale[o] * sum_k x[n, k] * w[o, k]

with w int8 rows (one fp32 scale per row) or bf16 rows (read as raw 16-bit words; their
scales are ones).

Decode multiplies a few activation rows by every weight once per token, so the product is
bound by how fast the weights stream from memory: these kernels read each weight once per
call, widen it to fp32 in registers (int8: sign-extend and convert; bf16: a 16-bit shift),
and accumulate in fp32. torch's own paths widen the whole matrix first (bf16 through oneDNN
on a CPU without bf16 instructions) or run a slow generic kernel (int8), which costs more
than the bytes saved.

One parallel task per block of ROWS output rows. Activation rows go in tiles of TILE: each
weight vector (VW lanes) is widened once and multiplied into the TILE x ROWS fp32
accumulator vectors of the tile, which walk K in VW-lane steps (independent FMA chains
hide their latency); the rows past the last whole tile go one at a time. A tree of
halvings then sums each vector. K is a compile-time constant (a multiple of VW); the rows
and the activation count are symbolic (O a multiple of ROWS). Each output is summed in the
same order whatever the tiling.
"""

from __future__ import annotations

from tvm.script import tirx as T

VW = 16
"""fp32 lanes of one AVX-512 register (two AVX2 registers: LLVM splits the vectors)."""
ROWS = 1
"""Output rows per task (and accumulators per activation row). Measured with 2 TVM threads,
int8, the five products of a SmolLM2-135M layer and its head: 1 row a task 1.80 ms at one
activation row, 4 rows 3.63 ms (one activation row: each task streams one weight row)."""
TILE = 4
"""Activation rows multiplied by each widened weight vector at once (TILE x ROWS
accumulators in registers); rows past the last whole tile go one at a time. Widening is
most of a product's instructions: at 8 activation rows a tile of 4 took 4.30 ms where one
row at a time took 6.55 ms (same measurement)."""
FORMATS = ("int8", "bf16")


def _widen(fmt: str, w):
    if fmt == "int8":
        return T.Cast("float32", w)
    return T.reinterpret("float32", T.shift_left(T.Cast("uint32", w), T.uint32(16)))


def make_gemv(fmt: str, k: int, rows: int = ROWS, tile: int = TILE):
    """gemv_<fmt>(x [N, K] f32, w [O, K] int8|uint16, scale [O] f32, y [N, O] f32)."""
    if fmt not in FORMATS:
        raise ValueError(f"gemv format must be one of {FORMATS}, got {fmt!r}")
    if k % VW:
        raise ValueError(f"gemv: K must be a multiple of {VW}, got {k}")
    K, R, NT = k, rows, tile
    wdtype = "int8" if fmt == "int8" else "uint16"
    name = f"gemv_{fmt}"

    @T.prim_func
    def gemv(x_h: T.handle, w_h: T.handle, s_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": name, "tirx.noalias": True})
        N = T.int32()
        NOUT = T.int32()
        x = T.match_buffer(x_h, (N, K), "float32")
        w = T.match_buffer(w_h, (NOUT, K), wdtype)
        s = T.match_buffer(s_h, (NOUT,), "float32")
        y = T.match_buffer(y_h, (N, NOUT), "float32")
        for ob in T.parallel(NOUT // R):
            # Whole tiles of NT activation rows: each weight vector is widened once and
            # multiplied into NT x R accumulators.
            tacc = T.alloc_buffer((NT, R, VW), "float32")
            wide = T.alloc_buffer((R, VW), "float32")
            for t in T.serial(N // NT):
                for a in T.unroll(NT):
                    for r in T.unroll(R):
                        for j in T.vectorized(VW):
                            tacc[a, r, j] = T.float32(0)
                for c in T.serial(K // VW):
                    for r in T.unroll(R):
                        for j in T.vectorized(VW):
                            wide[r, j] = _widen(fmt, w[ob * R + r, c * VW + j])
                    for a in T.unroll(NT):
                        for r in T.unroll(R):
                            for j in T.vectorized(VW):
                                tacc[a, r, j] = (tacc[a, r, j]
                                                 + x[t * NT + a, c * VW + j] * wide[r, j])
                for a in T.unroll(NT):
                    for r in T.unroll(R):
                        for j in T.vectorized(8):
                            tacc[a, r, j] = tacc[a, r, j] + tacc[a, r, j + 8]
                        for j in T.vectorized(4):
                            tacc[a, r, j] = tacc[a, r, j] + tacc[a, r, j + 4]
                        for j in T.vectorized(2):
                            tacc[a, r, j] = tacc[a, r, j] + tacc[a, r, j + 2]
                        y[t * NT + a, ob * R + r] = (tacc[a, r, 0] + tacc[a, r, 1]) * s[ob * R + r]
            # The rows past the last whole tile, one at a time.
            acc = T.alloc_buffer((R, VW), "float32")
            for n in T.serial(N - N // NT * NT):
                for r in T.unroll(R):
                    for j in T.vectorized(VW):
                        acc[r, j] = T.float32(0)
                for c in T.serial(K // VW):
                    for r in T.unroll(R):
                        for j in T.vectorized(VW):
                            acc[r, j] = acc[r, j] + x[N // NT * NT + n, c * VW + j] * _widen(
                                fmt, w[ob * R + r, c * VW + j])
                for r in T.unroll(R):
                    for j in T.vectorized(8):
                        acc[r, j] = acc[r, j] + acc[r, j + 8]
                    for j in T.vectorized(4):
                        acc[r, j] = acc[r, j] + acc[r, j + 4]
                    for j in T.vectorized(2):
                        acc[r, j] = acc[r, j] + acc[r, j + 2]
                    y[N // NT * NT + n, ob * R + r] = (acc[r, 0] + acc[r, 1]) * s[ob * R + r]

    return gemv
