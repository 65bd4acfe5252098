"""TVM kernels for the int8 paged KV cache on NVIDIA GPUs (`cuda` target).

Same formats and call signatures as the CPU kernels in `tvm_cpu` (the interleaved int8 page
layout happens to suit GPUs too: for a fixed channel pair, consecutive tokens are adjacent
in K; for a fixed token, consecutive channels are 2 bytes apart in V, so both reads coalesce).

These are deliberately simple, and they are built here (no GPU on the development machines)
but only run on a GPU host by `bench/gpu_check.sh`:
  * `quant_append_int8`: one thread per (token, head) row;
  * `gather_int8`: one thread per output element;
  * `decode_int8`: one thread block per (sequence, query head), `D` threads; per 16-token
    page, thread ``(t, c)`` dots 16 channels of token ``t``, the partial sums meet in shared
    memory, every thread then runs the same online-softmax update, and thread ``d`` owns
    output channel ``d``. Not split over the sequence (no flash-decoding split-K).
"""

from __future__ import annotations

import math

from tvm.script import tirx as T

LOG2E = math.log2(math.e)
NEG_BIG = -1.0e30
ROW_THREADS = 128


def make_quant_append_int8(num_kv_heads: int, head_dim: int, block_size: int):
    H, D, BS = num_kv_heads, head_dim, block_size
    NT = ROW_THREADS

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
        for bx in T.thread_binding((N * H + NT - 1) // NT, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                amax = T.alloc_buffer((2,), "float32", scope="local")
                row: T.let[T.int32] = bx * NT + tx
                if row < N * H:
                    n: T.let[T.int32] = row // H
                    h: T.let[T.int32] = row % H
                    slot: T.let[T.int32] = slots[n]
                    if slot >= 0:
                        blk: T.let[T.int32] = slot // BS
                        off: T.let[T.int32] = slot % BS
                        amax[0] = T.float32(0)
                        amax[1] = T.float32(0)
                        for d in T.serial(D):
                            amax[0] = T.max(amax[0], T.abs(k[n, h, d]))
                            amax[1] = T.max(amax[1], T.abs(v[n, h, d]))
                        kinv: T.let[T.float32] = T.if_then_else(
                            amax[0] > T.float32(0), T.float32(127.0) / amax[0], T.float32(0)
                        )
                        vinv: T.let[T.float32] = T.if_then_else(
                            amax[1] > T.float32(0), T.float32(127.0) / amax[1], T.float32(0)
                        )
                        for d in T.serial(D):
                            kd[blk, h, d // 2, off, d % 2] = T.Cast("int8", T.max(T.min(
                                T.round(k[n, h, d] * kinv), T.float32(127)), T.float32(-127)))
                            vd[blk, h, off // 2, d, off % 2] = T.Cast("int8", T.max(T.min(
                                T.round(v[n, h, d] * vinv), T.float32(127)), T.float32(-127)))
                        ks[blk, h, off] = amax[0] / T.float32(127.0)
                        vs[blk, h, off] = amax[1] / T.float32(127.0)

    return quant_append_int8


def make_gather_int8(num_kv_heads: int, head_dim: int, block_size: int):
    H, D, BS = num_kv_heads, head_dim, block_size
    NT = ROW_THREADS

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
        for bx in T.thread_binding((L * H * D + NT - 1) // NT, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                i: T.let[T.int32] = bx * NT + tx
                if i < L * H * D:
                    t: T.let[T.int32] = i // (H * D)
                    h: T.let[T.int32] = i // D % H
                    d: T.let[T.int32] = i % D
                    blk: T.let[T.int32] = blocks[t // BS]
                    off: T.let[T.int32] = t % BS
                    kc: T.let[T.float32] = T.Cast("float32", kd[blk, h, d // 2, off, d % 2])
                    vc: T.let[T.float32] = T.Cast("float32", vd[blk, h, off // 2, d, off % 2])
                    ko[t, h, d] = kc * ks[blk, h, off]
                    vo[t, h, d] = vc * vs[blk, h, off]

    return gather_int8


def make_decode_int8(num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
    HQ, H, D, BS = num_q_heads, num_kv_heads, head_dim, block_size
    G = HQ // H
    CG = D // 16  # channel groups of 16 per token
    assert BS == 16 and D % 16 == 0 and HQ % H == 0
    NT = D  # = BS * CG threads

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
        kd = T.match_buffer(kd_h, (NB, H, D // 2, BS, 2), "int8")
        vd = T.match_buffer(vd_h, (NB, H, BS // 2, D, 2), "int8")
        ks = T.match_buffer(ks_h, (NB, H, BS), "float32")
        vs = T.match_buffer(vs_h, (NB, H, BS), "float32")
        bt = T.match_buffer(bt_h, (B, MB), "int32")
        seq_lens = T.match_buffer(sl_h, (B,), "int32")
        out = T.match_buffer(o_h, (B, HQ, D), "float32")
        for bx in T.thread_binding(B * HQ, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                qs = T.alloc_buffer((D,), "float32", scope="shared")
                part = T.alloc_buffer((BS, CG), "float32", scope="shared")
                s = T.alloc_buffer((BS,), "float32", scope="shared")
                st = T.alloc_buffer((4,), "float32", scope="local")  # m, l, acc, dot
                b: T.let[T.int32] = bx // HQ
                hq: T.let[T.int32] = bx % HQ
                h: T.let[T.int32] = hq // G
                seq_len: T.let[T.int32] = seq_lens[b]
                qs[tx] = q[b, hq, tx] * sm_scale * T.float32(LOG2E)
                st[0] = T.float32(NEG_BIG)
                st[1] = T.float32(0)
                st[2] = T.float32(0)
                T.tvm_storage_sync("shared")
                for pg in T.serial((seq_len + BS - 1) // BS):
                    blk: T.let[T.int32] = bt[b, pg]
                    nvalid: T.let[T.int32] = T.min(BS, seq_len - pg * BS)
                    t: T.let[T.int32] = tx // CG
                    cg: T.let[T.int32] = tx % CG
                    st[3] = T.float32(0)
                    for j in T.serial(16):
                        st[3] = st[3] + qs[cg * 16 + j] * T.Cast(
                            "float32", kd[blk, h, cg * 8 + j // 2, t, j % 2]
                        )
                    part[t, cg] = st[3]
                    T.tvm_storage_sync("shared")
                    if tx < BS:
                        st[3] = T.float32(0)
                        for c in T.serial(CG):
                            st[3] = st[3] + part[tx, c]
                        s[tx] = T.if_then_else(
                            tx < nvalid, st[3] * ks[blk, h, tx], T.float32(NEG_BIG)
                        )
                    T.tvm_storage_sync("shared")
                    # every thread runs the same softmax update on the 16 shared scores
                    st[3] = st[0]
                    for j in T.serial(BS):
                        st[3] = T.max(st[3], s[j])
                    corr: T.let[T.float32] = T.exp2(st[0] - st[3])
                    st[0] = st[3]
                    st[1] = st[1] * corr
                    st[2] = st[2] * corr
                    for j in T.serial(BS):
                        if j < nvalid:
                            p: T.let[T.float32] = T.exp2(s[j] - st[0])
                            st[1] = st[1] + p
                            st[2] = st[2] + p * vs[blk, h, j] * T.Cast(
                                "float32", vd[blk, h, j // 2, tx, j % 2]
                            )
                    T.tvm_storage_sync("shared")
                out[b, hq, tx] = T.if_then_else(
                    st[1] > T.float32(0), st[2] / st[1], T.float32(0)
                )

    return decode_int8


def make_all(kind: str, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
    if kind != "int8":
        raise ValueError(f"no CUDA kernels for kind {kind!r} (int8 only)")
    return {
        "quant_append_int8": make_quant_append_int8(num_kv_heads, head_dim, block_size),
        "gather_int8": make_gather_int8(num_kv_heads, head_dim, block_size),
        "decode_int8": make_decode_int8(num_q_heads, num_kv_heads, head_dim, block_size),
    }
