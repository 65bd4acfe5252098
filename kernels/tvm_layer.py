"""TVM (tirx script) kernels for the small per-layer ops of the engine's forward, on CPU.

A decode step of a small model is mostly tiny tensors: RMSNorm over B x hidden, rotary
embeddings over B x heads x head_dim. torch runs each as about ten ops (F.rms_norm on a CPU
is a composite of pow, mean, add, rsqrt, mul and dtype copies; RoPE is a cat, a negation,
two multiplies and an add, then q, k and v are copied contiguous), and at these sizes an op
costs its dispatch, not its arithmetic. Each kernel here is one call.

    rms_norm:    y[n, :] = w * (x[n, :] * rsqrt(mean(x[n, :]^2) + eps))
    rope_split:  qkv [N, (Hq + 2 Hkv) * D] -> q [N, Hq, D] and k [N, Hkv, D] rotated by
                 cos/sin [N, D] (Llama's rotate-half form), v [N, Hkv, D] copied

Same maths as `engine.model`'s torch path; the sum of squares is taken in a different order
(a VW-lane accumulator, then a tree of halvings), so results agree to float32 rounding, not
bit for bit. The widths (hidden, head_dim) and eps are compile-time constants; the row count
is symbolic. Every buffer is declared 4-byte aligned: TVM otherwise assumes 64 and emits
aligned vector loads, and a norm weight read from a safetensors file is only 16-byte aligned
(an aligned load from it is a segfault, not an error).
"""

from __future__ import annotations

from tvm.script import tirx as T

from reinforge.kernels.tvm_cpu import VW


def make_rms_norm(k: int, eps: float):
    """rms_norm(x [N, K] f32, w [K] f32, y [N, K] f32); K a multiple of VW."""
    if k % VW:
        raise ValueError(f"rms_norm: width must be a multiple of {VW}, got {k}")
    K = k

    @T.prim_func
    def rms_norm(x_h: T.handle, w_h: T.handle, y_h: T.handle):
        T.func_attr({"global_symbol": "rms_norm", "tirx.noalias": True})
        N = T.int32()
        x = T.match_buffer(x_h, (N, K), "float32", align=4)
        w = T.match_buffer(w_h, (K,), "float32", align=4)
        y = T.match_buffer(y_h, (N, K), "float32", align=4)
        for n in T.serial(N):
            acc = T.alloc_buffer((VW,), "float32")
            for j in T.vectorized(VW):
                acc[j] = T.float32(0)
            for b in T.serial(K // VW):
                for j in T.vectorized(VW):
                    acc[j] = acc[j] + x[n, b * VW + j] * x[n, b * VW + j]
            for j in T.vectorized(8):
                acc[j] = acc[j] + acc[j + 8]
            for j in T.vectorized(4):
                acc[j] = acc[j] + acc[j + 4]
            for j in T.vectorized(2):
                acc[j] = acc[j] + acc[j + 2]
            r: T.let[T.float32] = T.rsqrt((acc[0] + acc[1]) / T.float32(K) + T.float32(eps))
            for b in T.serial(K // VW):
                for j in T.vectorized(VW):
                    y[n, b * VW + j] = w[b * VW + j] * (x[n, b * VW + j] * r)

    return rms_norm


def make_rope_split(hq: int, hkv: int, d: int):
    """rope_split(qkv [N, (Hq + 2 Hkv) D], cos [N, D], sin [N, D], q [N, Hq, D],
    k [N, Hkv, D], v [N, Hkv, D]), all f32; D a multiple of 2 VW."""
    if d % (2 * VW):
        raise ValueError(f"rope_split: head_dim must be a multiple of {2 * VW}, got {d}")
    HQ, HKV, D, HALF = hq, hkv, d, d // 2
    WIDTH = (hq + 2 * hkv) * d

    @T.macro
    def rotate(qkv, cos, sin, out, n, h, col):
        """Head h of row n, read from qkv at column `col`: out[n, h] = x * cos + rot(x) * sin,
        rot(x) = (-x[HALF:], x[:HALF])."""
        for j in T.vectorized(HALF):
            out[n, h, j] = qkv[n, col + j] * cos[n, j] - qkv[n, col + HALF + j] * sin[n, j]
        for j in T.vectorized(HALF):
            out[n, h, HALF + j] = (qkv[n, col + HALF + j] * cos[n, HALF + j]
                                   + qkv[n, col + j] * sin[n, HALF + j])

    @T.prim_func
    def rope_split(qkv_h: T.handle, cos_h: T.handle, sin_h: T.handle, q_h: T.handle,
                   k_h: T.handle, v_h: T.handle):
        T.func_attr({"global_symbol": "rope_split", "tirx.noalias": True})
        N = T.int32()
        qkv = T.match_buffer(qkv_h, (N, WIDTH), "float32", align=4)
        cos = T.match_buffer(cos_h, (N, D), "float32", align=4)
        sin = T.match_buffer(sin_h, (N, D), "float32", align=4)
        q = T.match_buffer(q_h, (N, HQ, D), "float32", align=4)
        k = T.match_buffer(k_h, (N, HKV, D), "float32", align=4)
        v = T.match_buffer(v_h, (N, HKV, D), "float32", align=4)
        for n in T.serial(N):
            for h in T.serial(HQ):
                rotate(qkv, cos, sin, q, n, h, h * D)
            for h in T.serial(HKV):
                rotate(qkv, cos, sin, k, n, h, (HQ + h) * D)
            for h in T.serial(HKV):
                for j in T.vectorized(D):
                    v[n, h, j] = qkv[n, (HQ + HKV + h) * D + j]

    return rope_split
