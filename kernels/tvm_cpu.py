"""TVM (tirx script) kernels for the paged KV cache on CPU (`llvm` targets).

Each ``make_*`` function returns a PrimFunc specialised on the compile-time constants of one
shape family (heads, head_dim, block size); token counts, batch size and the number of blocks
stay symbolic, so one compiled function serves every batch. The formats are documented in
`reinforge.kernels.paged_kv`; the torch twin there is the reference each kernel is tested
against.

Design notes (each measured on the development machines):
  * scalars are ``T.let`` (a plain assignment becomes a heap-allocated 0-d buffer per
    iteration) and scratch arrays are small constant `T.alloc_buffer`s (stack allocas);
  * ``T.exp2`` is a scalar libm call, so softmax uses `_exp2`, a vectorisable polynomial;
  * horizontal sums/maxima are written as tree halving over a `VW`-lane scratch vector;
  * decode attention runs one task per (sequence, chunk of KV heads), walks the sequence's
    pages in order, reads each page of K and V once for every query head of its GQA group,
    and prefetches the next page while working on the current one.
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

VW = 16
"""fp32 vector width in lanes (one AVX-512 register)."""

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_BIG = -1.0e30


def _exp2(x):
    """2**x for x <= 0 in fp32 from `nearbyint` and bit tricks (rel. error ~2e-7), so that
    LLVM can vectorise it; inputs below -126 flush to ~1e-38."""
    xc = T.max(x, T.float32(-126.0))
    n = T.round(xc)
    f = xc - n  # in [-0.5, 0.5]
    p = T.float32(1.0 / 720.0) * (LN2**6)
    p = p * f + T.float32((LN2**5) / 120.0)
    p = p * f + T.float32((LN2**4) / 24.0)
    p = p * f + T.float32((LN2**3) / 6.0)
    p = p * f + T.float32((LN2**2) / 2.0)
    p = p * f + T.float32(LN2)
    p = p * f + T.float32(1.0)
    two_n = T.reinterpret("float32", T.shift_left(T.Cast("int32", n) + 127, 23))
    return p * two_n


def _round_clamp_i8(x):
    return T.Cast("int8", T.max(T.min(T.round(x), T.float32(127.0)), T.float32(-127.0)))


def make_quant_append_int8(num_kv_heads: int, head_dim: int, block_size: int):
    """quant_append_int8(k, v, slot_mapping, k_data, v_data, k_scale, v_scale)."""
    H, D, BS = num_kv_heads, head_dim, block_size
    assert D % VW == 0, "head_dim must be a multiple of 16"

    @T.macro
    def quant_row(x, data, scale, n, h, blk, off, is_k):
        red = T.alloc_buffer((VW,), "float32")
        for j in T.vectorized(VW):
            red[j] = T.float32(0)
        for c in T.serial(D // VW):
            for j in T.vectorized(VW):
                red[j] = T.max(red[j], T.abs(x[n, h, c * VW + j]))
        for j in T.vectorized(8):
            red[j] = T.max(red[j], red[j + 8])
        for j in T.vectorized(4):
            red[j] = T.max(red[j], red[j + 4])
        for j in T.vectorized(2):
            red[j] = T.max(red[j], red[j + 2])
        amax: T.let[T.float32] = T.max(red[0], red[1])
        inv: T.let[T.float32] = T.if_then_else(
            amax > T.float32(0), T.float32(127.0) / amax, T.float32(0)
        )
        if is_k:  # element (t, d) at [d // 2, t, d % 2]
            for dp in T.serial(D // 2):
                for e in T.vectorized(2):
                    data[((blk * H + h) * (D // 2) + dp) * (BS * 2) + off * 2 + e] = (
                        _round_clamp_i8(x[n, h, dp * 2 + e] * inv)
                    )
        else:  # element (t, d) at [t // 2, d, t % 2]
            for d in T.vectorized(D):
                data[((blk * H + h) * (BS // 2) + off // 2) * (D * 2) + d * 2 + off % 2] = (
                    _round_clamp_i8(x[n, h, d] * inv)
                )
        scale[blk, h, off] = amax / T.float32(127.0)

    @T.prim_func
    def quant_append_int8(
        k_h: T.handle,
        v_h: T.handle,
        slot_h: T.handle,
        kd_h: T.handle,
        vd_h: T.handle,
        ks_h: T.handle,
        vs_h: T.handle,
    ):
        T.func_attr({"global_symbol": "quant_append_int8", "tirx.noalias": True})
        N = T.int32()
        NB = T.int32()
        k = T.match_buffer(k_h, (N, H, D), "float32")
        v = T.match_buffer(v_h, (N, H, D), "float32")
        slots = T.match_buffer(slot_h, (N,), "int32")
        kd = T.match_buffer(kd_h, (NB, H, D // 2, BS, 2), "int8")
        vd = T.match_buffer(vd_h, (NB, H, BS // 2, D, 2), "int8")
        ks = T.match_buffer(ks_h, (NB, H, BS), "float32")
        vs = T.match_buffer(vs_h, (NB, H, BS), "float32")
        kflat = T.decl_buffer((NB * H * BS * D,), "int8", data=kd.data)
        vflat = T.decl_buffer((NB * H * BS * D,), "int8", data=vd.data)
        for nh in T.parallel(N * H):
            n: T.let[T.int32] = nh // H
            h: T.let[T.int32] = nh % H
            slot: T.let[T.int32] = slots[n]
            if slot >= 0:
                blk: T.let[T.int32] = slot // BS
                off: T.let[T.int32] = slot % BS
                quant_row(k, kflat, ks, n, h, blk, off, True)
                quant_row(v, vflat, vs, n, h, blk, off, False)

    return quant_append_int8


def make_gather_int8(num_kv_heads: int, head_dim: int, block_size: int):
    """gather_int8(k_data, v_data, k_scale, v_scale, block_ids, k_out, v_out): dequantize the
    first L tokens of one sequence (L = k_out.shape[0]) from its blocks."""
    H, D, BS = num_kv_heads, head_dim, block_size

    @T.prim_func
    def gather_int8(
        kd_h: T.handle,
        vd_h: T.handle,
        ks_h: T.handle,
        vs_h: T.handle,
        blk_h: T.handle,
        ko_h: T.handle,
        vo_h: T.handle,
    ):
        T.func_attr({"global_symbol": "gather_int8", "tirx.noalias": True})
        NB = T.int32()
        NBLK = T.int32()
        L = T.int32()
        kd = T.match_buffer(kd_h, (NB, H, D // 2, BS, 2), "int8")
        vd = T.match_buffer(vd_h, (NB, H, BS // 2, D, 2), "int8")
        ks = T.match_buffer(ks_h, (NB, H, BS), "float32")
        vs = T.match_buffer(vs_h, (NB, H, BS), "float32")
        blocks = T.match_buffer(blk_h, (NBLK,), "int32")
        ko = T.match_buffer(ko_h, (L, H, D), "float32")
        vo = T.match_buffer(vo_h, (L, H, D), "float32")
        for th in T.parallel(L * H):
            t: T.let[T.int32] = th // H
            h: T.let[T.int32] = th % H
            blk: T.let[T.int32] = blocks[t // BS]
            off: T.let[T.int32] = t % BS
            kscale: T.let[T.float32] = ks[blk, h, off]
            vscale: T.let[T.float32] = vs[blk, h, off]
            for dp in T.serial(D // 2):
                for e in T.vectorized(2):
                    ko[t, h, dp * 2 + e] = T.Cast("float32", kd[blk, h, dp, off, e]) * kscale
            for d in T.vectorized(D):
                vo[t, h, d] = T.Cast("float32", vd[blk, h, off // 2, d, off % 2]) * vscale

    return gather_int8


def make_decode_int8_portable(
    num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, heads_per_task: int
):
    """decode_int8(q, k_data, v_data, k_scale, v_scale, block_table, seq_lens, out, sm_scale).

    One parallel task per (sequence, chunk of `heads_per_task` KV heads). Online softmax at
    page granularity in base 2: scores are ``(q * sm_scale * log2 e) . k_code * k_scale``;
    the V scale is folded into the probabilities.
    """
    HQ, H, D, BS, HPT = num_q_heads, num_kv_heads, head_dim, block_size, heads_per_task
    G = HQ // H
    NCH = H // HPT
    QT = HPT * G  # query heads per task
    assert HQ % H == 0 and H % HPT == 0 and D % VW == 0
    assert BS in (8, 16, 32), "block_size must be 8, 16 or 32"
    LINES = HPT * BS * D // 64  # cache lines of one page chunk (int8)

    @T.prim_func
    def decode_int8_portable(
        q_h: T.handle,
        kd_h: T.handle,
        vd_h: T.handle,
        ks_h: T.handle,
        vs_h: T.handle,
        bt_h: T.handle,
        sl_h: T.handle,
        o_h: T.handle,
        sm_scale: T.float32,
    ):
        T.func_attr({"global_symbol": "decode_int8_portable", "tirx.noalias": True})
        B = T.int32()
        NB = T.int32()
        MB = T.int32()
        q = T.match_buffer(q_h, (B, HQ, D), "float32")
        kd = T.match_buffer(kd_h, (NB, H, D // 2, BS, 2), "int8")
        vd = T.match_buffer(vd_h, (NB, H, BS // 2, D, 2), "int8")
        ks = T.match_buffer(ks_h, (NB, H, BS), "float32")
        vs = T.match_buffer(vs_h, (NB, H, BS), "float32")
        bt = T.match_buffer(bt_h, (B, MB), "int32")
        seq_lens = T.match_buffer(sl_h, (B,), "int32")
        out = T.match_buffer(o_h, (B, HQ, D), "float32")
        kflat = T.decl_buffer((NB * H * BS * D,), "int8", data=kd.data)
        vflat = T.decl_buffer((NB * H * BS * D,), "int8", data=vd.data)
        for task in T.parallel(B * NCH):
            b: T.let[T.int32] = task // NCH
            h0: T.let[T.int32] = (task % NCH) * HPT
            seq_len: T.let[T.int32] = seq_lens[b]
            npages: T.let[T.int32] = (seq_len + BS - 1) // BS
            qs = T.alloc_buffer((QT, D), "float32")
            acc = T.alloc_buffer((QT, D), "float32")
            m = T.alloc_buffer((QT,), "float32")
            lsum = T.alloc_buffer((QT,), "float32")
            s = T.alloc_buffer((BS,), "float32")
            red = T.alloc_buffer((VW,), "float32")
            for i in T.serial(QT):
                m[i] = T.float32(NEG_BIG)
                lsum[i] = T.float32(0)
                for d in T.vectorized(D):
                    acc[i, d] = T.float32(0)
                    qs[i, d] = q[b, h0 * G + i, d] * (sm_scale * T.float32(LOG2E))
            for pg in T.serial(npages):
                blk: T.let[T.int32] = bt[b, pg]
                nvalid: T.let[T.int32] = T.min(BS, seq_len - pg * BS)
                if pg + 1 < npages:
                    nxt: T.let[T.int32] = ((bt[b, pg + 1] * H + h0) * BS) * D
                    for li in T.serial(LINES):
                        T.evaluate(
                            T.call_llvm_intrin(
                                "void", "llvm.prefetch.p0",
                                T.address_of(kflat[nxt + li * 64]), 0, 3, 1,
                            )
                        )  # fmt: skip
                        T.evaluate(
                            T.call_llvm_intrin(
                                "void", "llvm.prefetch.p0",
                                T.address_of(vflat[nxt + li * 64]), 0, 3, 1,
                            )
                        )  # fmt: skip
                for hh in T.serial(HPT):
                    h: T.let[T.int32] = h0 + hh
                    for g in T.serial(G):
                        i: T.let[T.int32] = hh * G + g
                        for t in T.serial(BS):
                            for j in T.vectorized(VW):
                                red[j] = T.float32(0)
                            for c in T.serial(D // VW):
                                for j in T.vectorized(VW):
                                    red[j] = red[j] + qs[i, c * VW + j] * T.Cast(
                                        "float32", kd[blk, h, c * (VW // 2) + j // 2, t, j % 2]
                                    )
                            for j in T.vectorized(8):
                                red[j] = red[j] + red[j + 8]
                            for j in T.vectorized(4):
                                red[j] = red[j] + red[j + 4]
                            for j in T.vectorized(2):
                                red[j] = red[j] + red[j + 2]
                            s[t] = T.if_then_else(
                                t < nvalid, (red[0] + red[1]) * ks[blk, h, t], T.float32(NEG_BIG)
                            )
                        for j in T.vectorized(VW):
                            red[j] = T.float32(NEG_BIG)
                        for t in T.serial(BS):
                            red[t % VW] = T.max(red[t % VW], s[t])
                        for j in T.vectorized(8):
                            red[j] = T.max(red[j], red[j + 8])
                        for j in T.vectorized(4):
                            red[j] = T.max(red[j], red[j + 4])
                        for j in T.vectorized(2):
                            red[j] = T.max(red[j], red[j + 2])
                        m_new: T.let[T.float32] = T.max(m[i], T.max(red[0], red[1]))
                        corr: T.let[T.float32] = _exp2(m[i] - m_new)
                        for t in T.vectorized(BS):
                            s[t] = T.Select(t < nvalid, _exp2(s[t] - m_new), T.float32(0))
                        for j in T.vectorized(VW):
                            red[j] = T.float32(0)
                        for t in T.serial(BS):
                            red[t % VW] = red[t % VW] + s[t]
                        for j in T.vectorized(8):
                            red[j] = red[j] + red[j + 8]
                        for j in T.vectorized(4):
                            red[j] = red[j] + red[j + 4]
                        for j in T.vectorized(2):
                            red[j] = red[j] + red[j + 2]
                        lsum[i] = lsum[i] * corr + red[0] + red[1]
                        m[i] = m_new
                        for t in T.vectorized(BS):
                            s[t] = s[t] * vs[blk, h, t]
                        for d in T.vectorized(D):
                            acc[i, d] = acc[i, d] * corr
                        for t in T.serial(BS):
                            for d in T.vectorized(D):
                                acc[i, d] = acc[i, d] + s[t] * T.Cast(
                                    "float32", vd[blk, h, t // 2, d, t % 2]
                                )
            for i in T.serial(QT):
                inv_l: T.let[T.float32] = T.if_then_else(
                    lsum[i] > T.float32(0), T.float32(1) / lsum[i], T.float32(0)
                )
                for d in T.vectorized(D):
                    out[b, h0 * G + i, d] = acc[i, d] * inv_l

    return decode_int8_portable


def _pack_i16_pair(lo, hi):
    """Two fp32 values already in int16 range, rounded, packed into one int32 (lo first)."""
    return T.bitwise_or(
        T.bitwise_and(T.Cast("int32", T.round(lo)), 65535),
        T.shift_left(T.Cast("int32", T.round(hi)), 16),
    )


PMADDWD = {16: "llvm.x86.avx512.pmaddw.d.512", 8: "llvm.x86.avx2.pmadd.wd"}
"""`vpmaddwd` by int32 lanes: 16 (AVX-512BW, zmm) or 8 (AVX2, ymm)."""
DECODE_PATHS = ("avx512", "avx2", "portable")
"""The int8 decode kernels, best first: `decode_path` picks the best the CPU runs."""


def _pmaddwd(a, b, lanes: int = 16):
    """int32 lanes i: a[2i] * b[2i] + a[2i+1] * b[2i+1], `lanes` of them from 2 x `lanes`
    int16 (LLVM fuses the add into `vpdpwssd` where AVX-512 VNNI exists)."""
    return T.call_llvm_pure_intrin(f"int32x{lanes}", PMADDWD[lanes], a, b)


def _pair_dots(flat, offset, pair, lanes: int):
    """`lanes` int32 dot products: the int8 pairs at flat[offset : offset + 2 * lanes] (widened
    to int16) with one int16 pair, `pair` (packed in an int32), broadcast to every lane."""
    i16 = f"int16x{2 * lanes}"
    return _pmaddwd(
        T.Cast(i16, flat[T.ramp(offset, 1, 2 * lanes)]),
        T.reinterpret(i16, T.broadcast(pair, lanes)),
        lanes,
    )


def make_decode_int8_avx512(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    heads_per_task: int,
    *,
    lanes: int = 16,
    prefetch_ahead: int = 4,
    prefetch_locality: int = 2,
    prefetch_every_lines: int = 1,
):
    """decode_int8 for AVX-512BW CPUs (`lanes=16`) and AVX2 ones (`lanes=8`: each 16-lane
    step below is two 8-lane halves): the dot products run on 16-bit integers.

    Each head's share of the page `prefetch_ahead` pages later is prefetched (LLVM locality
    `prefetch_locality`, 2 = L2) while this one is processed; 4 / 2 measured best here.
    q is quantized per head to int16 (relative error ~2e-5, far below the int8 cache's), so
    ``q . k`` for the 16 tokens of a page is 64 `vpmaddwd`/`vpdpwssd` over the channel-pair
    interleaved K page, with tokens in lanes (no horizontal sums). Per page the probabilities
    times the V scales are quantized to int16 against their maximum, and ``p . V`` is again
    `vpmaddwd` over the token-pair interleaved V page, with channels in lanes. Softmax, the
    running max/sum and the output accumulator stay fp32.
    """
    HQ, H, D, BS, HPT = num_q_heads, num_kv_heads, head_dim, block_size, heads_per_task
    G = HQ // H
    NCH = H // HPT
    QT = HPT * G
    DP = D // 2
    TP = BS // 2
    NC = D // 16
    assert BS == 16, "the AVX-512 decode kernel needs block_size 16"
    assert HQ % H == 0 and H % HPT == 0 and D % 32 == 0
    PAGE = BS * D  # bytes of one head's page
    AHEAD, LOCALITY, PF_EVERY = prefetch_ahead, prefetch_locality, prefetch_every_lines
    KU = max(1, 4 // G)  # independent K accumulators per query head
    assert lanes in PMADDWD
    L, HALVES = lanes, 16 // lanes

    @T.prim_func
    def decode_int8(
        q_h: T.handle,
        kd_h: T.handle,
        vd_h: T.handle,
        ks_h: T.handle,
        vs_h: T.handle,
        bt_h: T.handle,
        sl_h: T.handle,
        o_h: T.handle,
        sm_scale: T.float32,
    ):
        T.func_attr({"global_symbol": "decode_int8", "tirx.noalias": True})
        B = T.int32()
        NB = T.int32()
        MB = T.int32()
        q = T.match_buffer(q_h, (B, HQ, D), "float32")
        kd = T.match_buffer(kd_h, (NB, H, DP, BS, 2), "int8")
        vd = T.match_buffer(vd_h, (NB, H, TP, D, 2), "int8")
        ks = T.match_buffer(ks_h, (NB, H, BS), "float32")
        vs = T.match_buffer(vs_h, (NB, H, BS), "float32")
        bt = T.match_buffer(bt_h, (B, MB), "int32")
        seq_lens = T.match_buffer(sl_h, (B,), "int32")
        out = T.match_buffer(o_h, (B, HQ, D), "float32")
        kflat = T.decl_buffer((NB * H * PAGE,), "int8", data=kd.data)
        vflat = T.decl_buffer((NB * H * PAGE,), "int8", data=vd.data)
        for task in T.parallel(B * NCH):
            b: T.let[T.int32] = task // NCH
            h0: T.let[T.int32] = (task % NCH) * HPT
            seq_len: T.let[T.int32] = seq_lens[b]
            npages: T.let[T.int32] = (seq_len + BS - 1) // BS
            qp = T.alloc_buffer((QT, DP), "int32")  # q as packed int16 pairs
            qsc = T.alloc_buffer((QT,), "float32")  # int score -> log2-domain logit
            acc = T.alloc_buffer((QT, D), "float32")
            m = T.alloc_buffer((QT,), "float32")
            lsum = T.alloc_buffer((QT,), "float32")
            si = T.alloc_buffer((G, KU, BS), "int32")
            s = T.alloc_buffer((BS,), "float32")
            pp = T.alloc_buffer((G, TP), "int32")  # p * v_scale as packed int16 pairs
            psc = T.alloc_buffer((G,), "float32")
            vi = T.alloc_buffer((G, NC, 16), "int32")
            red = T.alloc_buffer((VW,), "float32")
            for i in T.serial(QT):
                for j in T.vectorized(VW):
                    red[j] = T.float32(0)
                for c in T.serial(D // VW):
                    for j in T.vectorized(VW):
                        red[j] = T.max(red[j], T.abs(q[b, h0 * G + i, c * VW + j]))
                for j in T.vectorized(8):
                    red[j] = T.max(red[j], red[j + 8])
                for j in T.vectorized(4):
                    red[j] = T.max(red[j], red[j + 4])
                for j in T.vectorized(2):
                    red[j] = T.max(red[j], red[j + 2])
                qmax: T.let[T.float32] = T.max(red[0], red[1])
                qinv: T.let[T.float32] = T.if_then_else(
                    qmax > T.float32(0), T.float32(32767.0) / qmax, T.float32(0)
                )
                qsc[i] = qmax / T.float32(32767.0) * sm_scale * T.float32(LOG2E)
                for dp in T.vectorized(DP):
                    qp[i, dp] = _pack_i16_pair(
                        q[b, h0 * G + i, dp * 2] * qinv, q[b, h0 * G + i, dp * 2 + 1] * qinv
                    )
                m[i] = T.float32(NEG_BIG)
                lsum[i] = T.float32(0)
                for d in T.vectorized(D):
                    acc[i, d] = T.float32(0)
            for pg in T.serial(npages):
                blk: T.let[T.int32] = bt[b, pg]
                nvalid: T.let[T.int32] = T.min(BS, seq_len - pg * BS)
                for hh in T.serial(HPT):
                    h: T.let[T.int32] = h0 + hh
                    base: T.let[T.int32] = (blk * H + h) * PAGE
                    if pg + AHEAD < npages:  # this head's part of a later page
                        nxt: T.let[T.int32] = (bt[b, pg + AHEAD] * H + h) * PAGE
                        for li in T.serial(PAGE // 64 // PF_EVERY):
                            T.evaluate(
                                T.call_llvm_intrin(
                                    "void", "llvm.prefetch.p0",
                                    T.address_of(kflat[nxt + li * 64 * PF_EVERY]), 0, LOCALITY, 1,
                                )
                            )  # fmt: skip
                            T.evaluate(
                                T.call_llvm_intrin(
                                    "void", "llvm.prefetch.p0",
                                    T.address_of(vflat[nxt + li * 64 * PF_EVERY]), 0, LOCALITY, 1,
                                )
                            )  # fmt: skip
                    # scores of the 16 tokens for the G query heads, tokens in lanes; KU
                    # independent accumulators per head hide the dot-product latency
                    for g in T.unroll(G):
                        for u in T.unroll(KU):
                            si[g, u, T.ramp(0, 1, 16)] = T.broadcast(T.int32(0), 16)
                    for dq in T.serial(DP // KU):
                        for u in T.unroll(KU):
                            for g in T.unroll(G):
                                for hf in T.unroll(HALVES):
                                    si[g, u, T.ramp(hf * L, 1, L)] = si[
                                        g, u, T.ramp(hf * L, 1, L)
                                    ] + _pair_dots(
                                        kflat,
                                        base + (dq * KU + u) * 32 + hf * 2 * L,
                                        qp[hh * G + g, dq * KU + u],
                                        L,
                                    )
                    for g in T.serial(G):
                        i: T.let[T.int32] = hh * G + g
                        for u in T.serial(1, KU):
                            for t in T.vectorized(BS):
                                si[g, 0, t] = si[g, 0, t] + si[g, u, t]
                        # T.Select, not if_then_else: both sides are safe to evaluate, and
                        # a select vectorises where a guarded load is split into branches
                        for t in T.vectorized(BS):
                            s[t] = T.Select(
                                t < nvalid,
                                T.Cast("float32", si[g, 0, t]) * qsc[i] * ks[blk, h, t],
                                T.float32(NEG_BIG),
                            )
                        for j in T.vectorized(8):
                            red[j] = T.max(s[j], s[j + 8])
                        for j in T.vectorized(4):
                            red[j] = T.max(red[j], red[j + 4])
                        for j in T.vectorized(2):
                            red[j] = T.max(red[j], red[j + 2])
                        m_new: T.let[T.float32] = T.max(m[i], T.max(red[0], red[1]))
                        corr: T.let[T.float32] = _exp2(m[i] - m_new)
                        for t in T.vectorized(BS):
                            s[t] = T.Select(t < nvalid, _exp2(s[t] - m_new), T.float32(0))
                        for j in T.vectorized(8):
                            red[j] = s[j] + s[j + 8]
                        for j in T.vectorized(4):
                            red[j] = red[j] + red[j + 4]
                        for j in T.vectorized(2):
                            red[j] = red[j] + red[j + 2]
                        lsum[i] = lsum[i] * corr + red[0] + red[1]
                        m[i] = m_new
                        for d in T.vectorized(D):
                            acc[i, d] = acc[i, d] * corr
                        for t in T.vectorized(BS):
                            s[t] = s[t] * vs[blk, h, t]
                        for j in T.vectorized(8):
                            red[j] = T.max(s[j], s[j + 8])
                        for j in T.vectorized(4):
                            red[j] = T.max(red[j], red[j + 4])
                        for j in T.vectorized(2):
                            red[j] = T.max(red[j], red[j + 2])
                        pmax: T.let[T.float32] = T.max(red[0], red[1])
                        pinv: T.let[T.float32] = T.if_then_else(
                            pmax > T.float32(0), T.float32(32767.0) / pmax, T.float32(0)
                        )
                        psc[g] = pmax / T.float32(32767.0)
                        for tp in T.vectorized(TP):
                            pp[g, tp] = _pack_i16_pair(s[tp * 2] * pinv, s[tp * 2 + 1] * pinv)
                    # p . V, channels in lanes: the NC channel chunks are independent
                    # accumulators, so token pairs run down NC * G parallel chains
                    for g in T.unroll(G):
                        for c in T.unroll(NC):
                            vi[g, c, T.ramp(0, 1, 16)] = T.broadcast(T.int32(0), 16)
                    for tp in T.serial(TP):
                        for c in T.unroll(NC):
                            for g in T.unroll(G):
                                for hf in T.unroll(HALVES):
                                    vi[g, c, T.ramp(hf * L, 1, L)] = vi[
                                        g, c, T.ramp(hf * L, 1, L)
                                    ] + _pair_dots(
                                        vflat, base + tp * (D * 2) + c * 32 + hf * 2 * L, pp[g, tp], L
                                    )
                    for g in T.serial(G):
                        for d in T.vectorized(D):
                            acc[hh * G + g, d] = acc[hh * G + g, d] + (
                                T.Cast("float32", vi[g, d // 16, d % 16]) * psc[g]
                            )
            for i in T.serial(QT):
                inv_l: T.let[T.float32] = T.if_then_else(
                    lsum[i] > T.float32(0), T.float32(1) / lsum[i], T.float32(0)
                )
                for d in T.vectorized(D):
                    out[b, h0 * G + i, d] = acc[i, d] * inv_l

    return decode_int8


def _nibble(byte, hi):
    """Code `hi` (0: low nibble, even channel; 1: high nibble) of a packed uint8, as fp32."""
    return T.Cast("float32", T.bitwise_and(T.shift_right(byte, T.Cast("uint8", hi * 4)),
                                           T.uint8(15)))  # fmt: skip


def make_quant_append_int4(num_kv_heads: int, head_dim: int, block_size: int, group_size: int):
    """quant_append_int4(k, v, slot_mapping, k_data, v_data, k_scale, v_scale, k_zero, v_zero)."""
    H, D, BS, GS = num_kv_heads, head_dim, block_size, group_size
    NG = D // GS
    assert GS % VW == 0 and D % GS == 0

    @T.macro
    def quant_row(x, data, scale, zero, n, h, blk, off):
        lo = T.alloc_buffer((VW,), "float32")
        hi = T.alloc_buffer((VW,), "float32")
        gz = T.alloc_buffer((NG,), "float32")
        ginv = T.alloc_buffer((NG,), "float32")
        for gi in T.serial(NG):
            for j in T.vectorized(VW):
                lo[j] = x[n, h, gi * GS + j]
                hi[j] = x[n, h, gi * GS + j]
            for c in T.serial(1, GS // VW):
                for j in T.vectorized(VW):
                    lo[j] = T.min(lo[j], x[n, h, gi * GS + c * VW + j])
                    hi[j] = T.max(hi[j], x[n, h, gi * GS + c * VW + j])
            for j in T.vectorized(8):
                lo[j] = T.min(lo[j], lo[j + 8])
                hi[j] = T.max(hi[j], hi[j + 8])
            for j in T.vectorized(4):
                lo[j] = T.min(lo[j], lo[j + 4])
                hi[j] = T.max(hi[j], hi[j + 4])
            for j in T.vectorized(2):
                lo[j] = T.min(lo[j], lo[j + 2])
                hi[j] = T.max(hi[j], hi[j + 2])
            for j in T.vectorized(1):
                lo[j] = T.min(lo[j], lo[j + 1])
                hi[j] = T.max(hi[j], hi[j + 1])
            rng: T.let[T.float32] = hi[0] - lo[0]
            gz[gi] = lo[0]
            ginv[gi] = T.if_then_else(rng > T.float32(0), T.float32(15.0) / rng, T.float32(0))
            scale[blk, h, off, gi] = rng / T.float32(15.0)
            zero[blk, h, off, gi] = lo[0]
        for dp in T.vectorized(D // 2):
            c0: T.let = T.max(T.min(T.round((x[n, h, dp * 2] - gz[dp * 2 // GS])
                                            * ginv[dp * 2 // GS]), T.float32(15)), T.float32(0))
            c1: T.let = T.max(T.min(T.round((x[n, h, dp * 2 + 1] - gz[dp * 2 // GS])
                                            * ginv[dp * 2 // GS]), T.float32(15)), T.float32(0))
            data[blk, h, off, dp] = T.Cast(
                "uint8", T.Cast("int32", c0) + T.shift_left(T.Cast("int32", c1), 4)
            )  # fmt: skip

    @T.prim_func
    def quant_append_int4(
        k_h: T.handle,
        v_h: T.handle,
        slot_h: T.handle,
        kd_h: T.handle,
        vd_h: T.handle,
        ks_h: T.handle,
        vs_h: T.handle,
        kz_h: T.handle,
        vz_h: T.handle,
    ):
        T.func_attr({"global_symbol": "quant_append_int4", "tirx.noalias": True})
        N = T.int32()
        NB = T.int32()
        k = T.match_buffer(k_h, (N, H, D), "float32")
        v = T.match_buffer(v_h, (N, H, D), "float32")
        slots = T.match_buffer(slot_h, (N,), "int32")
        kd = T.match_buffer(kd_h, (NB, H, BS, D // 2), "uint8")
        vd = T.match_buffer(vd_h, (NB, H, BS, D // 2), "uint8")
        ks = T.match_buffer(ks_h, (NB, H, BS, NG), "float32")
        vs = T.match_buffer(vs_h, (NB, H, BS, NG), "float32")
        kz = T.match_buffer(kz_h, (NB, H, BS, NG), "float32")
        vz = T.match_buffer(vz_h, (NB, H, BS, NG), "float32")
        for nh in T.parallel(N * H):
            n: T.let[T.int32] = nh // H
            h: T.let[T.int32] = nh % H
            slot: T.let[T.int32] = slots[n]
            if slot >= 0:
                blk: T.let[T.int32] = slot // BS
                off: T.let[T.int32] = slot % BS
                quant_row(k, kd, ks, kz, n, h, blk, off)
                quant_row(v, vd, vs, vz, n, h, blk, off)

    return quant_append_int4


def make_gather_int4(num_kv_heads: int, head_dim: int, block_size: int, group_size: int):
    """gather_int4(k_data, v_data, k_scale, v_scale, k_zero, v_zero, block_ids, k_out, v_out)."""
    H, D, BS, GS = num_kv_heads, head_dim, block_size, group_size
    NG = D // GS

    @T.prim_func
    def gather_int4(
        kd_h: T.handle,
        vd_h: T.handle,
        ks_h: T.handle,
        vs_h: T.handle,
        kz_h: T.handle,
        vz_h: T.handle,
        blk_h: T.handle,
        ko_h: T.handle,
        vo_h: T.handle,
    ):
        T.func_attr({"global_symbol": "gather_int4", "tirx.noalias": True})
        NB = T.int32()
        NBLK = T.int32()
        L = T.int32()
        kd = T.match_buffer(kd_h, (NB, H, BS, D // 2), "uint8")
        vd = T.match_buffer(vd_h, (NB, H, BS, D // 2), "uint8")
        ks = T.match_buffer(ks_h, (NB, H, BS, NG), "float32")
        vs = T.match_buffer(vs_h, (NB, H, BS, NG), "float32")
        kz = T.match_buffer(kz_h, (NB, H, BS, NG), "float32")
        vz = T.match_buffer(vz_h, (NB, H, BS, NG), "float32")
        blocks = T.match_buffer(blk_h, (NBLK,), "int32")
        ko = T.match_buffer(ko_h, (L, H, D), "float32")
        vo = T.match_buffer(vo_h, (L, H, D), "float32")
        for th in T.parallel(L * H):
            t: T.let[T.int32] = th // H
            h: T.let[T.int32] = th % H
            blk: T.let[T.int32] = blocks[t // BS]
            off: T.let[T.int32] = t % BS
            for d in T.vectorized(D):
                ko[t, h, d] = (_nibble(kd[blk, h, off, d // 2], d % 2) * ks[blk, h, off, d // GS]
                               + kz[blk, h, off, d // GS])  # fmt: skip
            for d in T.vectorized(D):
                vo[t, h, d] = (_nibble(vd[blk, h, off, d // 2], d % 2) * vs[blk, h, off, d // GS]
                               + vz[blk, h, off, d // GS])  # fmt: skip

    return gather_int4


def make_decode_int4(
    num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, group_size: int
):
    """decode_int4(q, k_data, v_data, k_scale, v_scale, k_zero, v_zero, block_table, seq_lens,
    out, sm_scale): straightforward fp32 version (one task per sequence and KV head; each K
    row is dequantized into a scratch row, then dotted), not tuned."""
    HQ, H, D, BS, GS = num_q_heads, num_kv_heads, head_dim, block_size, group_size
    G = HQ // H
    NG = D // GS
    assert HQ % H == 0 and D % VW == 0

    @T.prim_func
    def decode_int4(
        q_h: T.handle,
        kd_h: T.handle,
        vd_h: T.handle,
        ks_h: T.handle,
        vs_h: T.handle,
        kz_h: T.handle,
        vz_h: T.handle,
        bt_h: T.handle,
        sl_h: T.handle,
        o_h: T.handle,
        sm_scale: T.float32,
    ):
        T.func_attr({"global_symbol": "decode_int4", "tirx.noalias": True})
        B = T.int32()
        NB = T.int32()
        MB = T.int32()
        q = T.match_buffer(q_h, (B, HQ, D), "float32")
        kd = T.match_buffer(kd_h, (NB, H, BS, D // 2), "uint8")
        vd = T.match_buffer(vd_h, (NB, H, BS, D // 2), "uint8")
        ks = T.match_buffer(ks_h, (NB, H, BS, NG), "float32")
        vs = T.match_buffer(vs_h, (NB, H, BS, NG), "float32")
        kz = T.match_buffer(kz_h, (NB, H, BS, NG), "float32")
        vz = T.match_buffer(vz_h, (NB, H, BS, NG), "float32")
        bt = T.match_buffer(bt_h, (B, MB), "int32")
        seq_lens = T.match_buffer(sl_h, (B,), "int32")
        out = T.match_buffer(o_h, (B, HQ, D), "float32")
        for task in T.parallel(B * H):
            b: T.let[T.int32] = task // H
            h: T.let[T.int32] = task % H
            seq_len: T.let[T.int32] = seq_lens[b]
            npages: T.let[T.int32] = (seq_len + BS - 1) // BS
            qs = T.alloc_buffer((G, D), "float32")
            acc = T.alloc_buffer((G, D), "float32")
            m = T.alloc_buffer((G,), "float32")
            lsum = T.alloc_buffer((G,), "float32")
            s = T.alloc_buffer((G, BS), "float32")
            row = T.alloc_buffer((D,), "float32")
            red = T.alloc_buffer((VW,), "float32")
            for g in T.serial(G):
                m[g] = T.float32(NEG_BIG)
                lsum[g] = T.float32(0)
                for d in T.vectorized(D):
                    acc[g, d] = T.float32(0)
                    qs[g, d] = q[b, h * G + g, d] * (sm_scale * T.float32(LOG2E))
            for pg in T.serial(npages):
                blk: T.let[T.int32] = bt[b, pg]
                nvalid: T.let[T.int32] = T.min(BS, seq_len - pg * BS)
                for t in T.serial(BS):
                    for d in T.vectorized(D):
                        row[d] = (_nibble(kd[blk, h, t, d // 2], d % 2) * ks[blk, h, t, d // GS]
                                  + kz[blk, h, t, d // GS])  # fmt: skip
                    for g in T.serial(G):
                        for j in T.vectorized(VW):
                            red[j] = T.float32(0)
                        for c in T.serial(D // VW):
                            for j in T.vectorized(VW):
                                red[j] = red[j] + qs[g, c * VW + j] * row[c * VW + j]
                        for j in T.vectorized(8):
                            red[j] = red[j] + red[j + 8]
                        for j in T.vectorized(4):
                            red[j] = red[j] + red[j + 4]
                        for j in T.vectorized(2):
                            red[j] = red[j] + red[j + 2]
                        for j in T.vectorized(1):
                            red[j] = red[j] + red[j + 1]
                        s[g, t] = T.if_then_else(t < nvalid, red[0], T.float32(NEG_BIG))
                for g in T.serial(G):
                    mx = T.alloc_buffer((1,), "float32")
                    mx[0] = m[g]
                    for t in T.serial(BS):
                        mx[0] = T.max(mx[0], s[g, t])
                    m_new: T.let[T.float32] = mx[0]
                    corr: T.let[T.float32] = _exp2(m[g] - m_new)
                    for t in T.vectorized(BS):
                        s[g, t] = T.Select(t < nvalid, _exp2(s[g, t] - m_new), T.float32(0))
                    mx[0] = T.float32(0)
                    for t in T.serial(BS):
                        mx[0] = mx[0] + s[g, t]
                    lsum[g] = lsum[g] * corr + mx[0]
                    m[g] = m_new
                    for d in T.vectorized(D):
                        acc[g, d] = acc[g, d] * corr
                for t in T.serial(BS):
                    for d in T.vectorized(D):
                        row[d] = (_nibble(vd[blk, h, t, d // 2], d % 2) * vs[blk, h, t, d // GS]
                                  + vz[blk, h, t, d // GS])  # fmt: skip
                    for g in T.serial(G):
                        for d in T.vectorized(D):
                            acc[g, d] = acc[g, d] + s[g, t] * row[d]
            for g in T.serial(G):
                inv_l: T.let[T.float32] = T.if_then_else(
                    lsum[g] > T.float32(0), T.float32(1) / lsum[g], T.float32(0)
                )
                for d in T.vectorized(D):
                    out[b, h * G + g, d] = acc[g, d] * inv_l

    return decode_int4


def has_avx512bw(target) -> bool:
    from tvm.target import codegen

    return bool(codegen.llvm_cpu_has_features(["avx512bw"], target))


def runnable_paths(target) -> list[str]:
    """The decode paths this CPU runs, best first."""
    from tvm.target import codegen

    have = {f: bool(codegen.llvm_cpu_has_features([f], target)) for f in ("avx512bw", "avx2")}
    return [p for p, ok in (("avx512", have["avx512bw"]), ("avx2", have["avx2"])) if ok] + [
        "portable"
    ]


def int8_decode_path(path: str, head_dim: int, block_size: int) -> str:
    """The path a shape family really gets: the integer kernels need block_size 16 and an even
    number of 16-channel pairs (int32 sums of int16 x int8 stay exact up to head_dim 256)."""
    fits = block_size == 16 and head_dim % 32 == 0 and head_dim <= 256
    return path if fits else "portable"


def make_all(
    kind: str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    *,
    path: str,
):
    """Every kernel of one shape family for `kind`, as a name -> PrimFunc dict. `path` (one of
    DECODE_PATHS) picks the int8 decode: 16-bit integer dot products on zmm (avx512) or ymm
    (avx2) registers, or fp32 (portable); see `int8_decode_path`."""
    if path not in DECODE_PATHS:
        raise ValueError(f"decode path must be one of {DECODE_PATHS}, got {path!r}")
    if kind == "int8":
        path = int8_decode_path(path, head_dim, block_size)
        if path == "portable":
            decode = make_decode_int8_portable(
                num_q_heads, num_kv_heads, head_dim, block_size, num_kv_heads
            )
        else:
            decode = make_decode_int8_avx512(
                num_q_heads, num_kv_heads, head_dim, block_size, num_kv_heads,
                lanes=16 if path == "avx512" else 8,
            )  # fmt: skip
        return {
            "quant_append_int8": make_quant_append_int8(num_kv_heads, head_dim, block_size),
            "gather_int8": make_gather_int8(num_kv_heads, head_dim, block_size),
            "decode_int8": decode,
        }
    if kind == "int4":
        from reinforge.kernels.paged_kv import INT4_GROUP_SIZE as gs

        return {
            "quant_append_int4": make_quant_append_int4(num_kv_heads, head_dim, block_size, gs),
            "gather_int4": make_gather_int4(num_kv_heads, head_dim, block_size, gs),
            "decode_int4": make_decode_int4(
                num_q_heads, num_kv_heads, head_dim, block_size, gs
            ),
        }
    raise ValueError(f"no CPU kernels for kind {kind!r}")


def make_read_sum(num_tasks: int):
    """read_sum(x int8 [N], out float32 [num_tasks, VW]): sums x in `num_tasks` contiguous
    chunks, 64 bytes at a time; a read-bandwidth probe (N a multiple of 64 * num_tasks)."""
    NT = num_tasks

    @T.prim_func
    def read_sum(x_h: T.handle, o_h: T.handle):
        T.func_attr({"global_symbol": "read_sum", "tirx.noalias": True})
        N = T.int32()
        x = T.match_buffer(x_h, (N,), "int8")
        out = T.match_buffer(o_h, (NT, 64), "int32")
        for task in T.parallel(NT):
            chunk: T.let[T.int32] = N // NT
            acc = T.alloc_buffer((64,), "int32")
            for j in T.vectorized(64):
                acc[j] = 0
            for i in T.serial(chunk // 64):
                for j in T.vectorized(64):
                    acc[j] = acc[j] + T.Cast("int32", x[task * chunk + i * 64 + j])
            for j in T.vectorized(64):
                out[task, j] = acc[j]

    return read_sum
