"""Benchmark: int8 paged KV-cache kernels (TVM, llvm) against the torch twin, one run.

Decode attention at batch 8, 8 KV heads, head_dim 128, contexts 1k and 4k, and the
quantize-on-append path at one decode step (8 tokens). Pages are shuffled (as after
allocator churn), and each timed call reads a different copy of the cache (`--rotate`
copies, > 256 MB together at 4k), so the 4k figures come from DRAM, not the last-level
cache, while 1k (17 MB a call) may stay cache-resident.

Bytes moved = K and V codes and scales of every cached token + q + out (+ block table);
`read_gbps` is this machine's read bandwidth over a 1 GiB array, measured in the same run
with a vectorised TVM reduction (before and after the kernels; the higher median is kept).
Medians of `--repeat` calls after warm-up; `*_best` fields are the fastest call.

    python bench/kv_kernels.py --json      # last line: one JSON object
    python bench/kv_kernels.py --json --device cuda --cuda-module kv_int8_cuda.so  # GPU host

On `--device cuda` the TVM kernels come from a prebuilt module (bench/gpu_check.sh), the
torch twin runs on the GPU, and `read_gbps` is torch's `sum` over a 4 GiB tensor.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time


SYNC = [lambda: None]  # replaced by torch.cuda.synchronize on --device cuda
CLOCK = [time.perf_counter]  # time.thread_time with --clock cpu
READ_BEST_GBPS = [float("nan")]  # the read probe's best call, next to its median


def median_s(fn, repeat: int, warmup: int = 2) -> float:
    return timings_s(fn, repeat, warmup)[0]


def timings_s(fn, repeat: int, warmup: int = 2) -> tuple[float, float]:
    """(median, best) wall seconds of `repeat` calls after `warmup`."""
    sync = SYNC[0]
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    clock = CLOCK[0]
    for _ in range(repeat):
        t0 = clock()
        fn()
        sync()
        ts.append(clock() - t0)
    return statistics.median(ts), min(ts)


def gpu_read_bandwidth_gbps(size_bytes: int = 4 << 30, repeat: int = 10) -> float:
    import torch

    x = torch.ones(size_bytes // 4, dtype=torch.float32, device="cuda")
    out = torch.empty((), dtype=torch.float32, device="cuda")
    t, best = timings_s(lambda: torch.sum(x, out=out), repeat)
    READ_BEST_GBPS[0] = size_bytes / best / 1e9
    return size_bytes / t / 1e9


def read_bandwidth_gbps(num_threads: int, size_bytes: int = 1 << 30, repeat: int = 7) -> float:
    import torch
    import tvm

    from reinforge.kernels import tvm_build, tvm_cpu

    ex = tvm.compile(
        tvm.IRModule({"read_sum": tvm_cpu.make_read_sum(num_threads)}),
        target=tvm_build.host_target(),
    )
    f = ex["read_sum"]
    x = torch.ones(size_bytes, dtype=torch.int8)
    out = torch.zeros(num_threads, 64, dtype=torch.int32)
    t, best = timings_s(lambda: f(x, out), repeat)
    if int(out.sum()) != size_bytes:
        raise RuntimeError("read probe summed the wrong value")
    READ_BEST_GBPS[0] = size_bytes / best / 1e9
    return size_bytes / t / 1e9


def bench_decode(ops_tvm, ops_torch, ctx: int, args, torch_mod) -> dict:
    torch = torch_mod
    from reinforge.kernels.paged_kv import allocate_cache

    b, hkv, hq, d, bs = args.batch, args.kv_heads, args.q_heads, args.head_dim, 16
    dev = args.device
    per_seq = math.ceil(ctx / bs)
    per_copy = b * per_seq
    rotate = args.rotate
    gen = torch.Generator().manual_seed(0)
    cache = allocate_cache(kind="int8", num_blocks=per_copy * rotate, block_size=bs,
                           num_kv_heads=hkv, head_dim=d, device=dev)  # fmt: skip
    # Copy 0 holds gaussian K/V (the accuracy check), copy 1 the same K with an outlier
    # channel (+3, as real keys have); the others repeat copy 0. Pages are shuffled.
    k = torch.randn(b * ctx, hkv, d, generator=gen).to(dev)
    v = torch.randn(b * ctx, hkv, d, generator=gen).to(dev)
    k_outlier = k.clone()
    k_outlier[..., 5] += 3.0
    tables = []
    for r in range(rotate):
        perm = torch.randperm(per_copy, generator=gen).to(torch.int32) + r * per_copy
        table = perm.reshape(b, per_seq).contiguous().to(dev)
        tables.append(table)
        pos = torch.arange(ctx, device=dev)
        slots = (table.long()[:, pos // bs] * bs + pos % bs).reshape(-1).to(torch.int32)
        ops_tvm.append(cache, k_outlier if r == 1 else k, v, slots)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, d, generator=gen).to(dev)
    out_tvm, out_torch = torch.empty_like(q), torch.empty_like(q)
    sm = 1 / math.sqrt(d)

    state = {"i": 0}

    def run(ops, out):
        def call():
            t = tables[state["i"] % rotate]
            state["i"] += 1
            ops.decode_attention(q, cache, t, seq_lens, sm, out)

        return call

    t_tvm, best_tvm = timings_s(run(ops_tvm, out_tvm), args.repeat)
    t_torch, best_torch = timings_s(run(ops_torch, out_torch), max(3, args.repeat // 4), warmup=1)

    def rel_err_vs_fp64(table, kf):
        ops_tvm.decode_attention(q, cache, table, seq_lens, sm, out_tvm)
        kk = kf.double().reshape(b, ctx, hkv, d).repeat_interleave(hq // hkv, dim=2)
        vv = v.double().reshape(b, ctx, hkv, d).repeat_interleave(hq // hkv, dim=2)
        s = torch.einsum("bhd,blhd->bhl", q.double(), kk) * sm
        ref = torch.einsum("bhl,blhd->bhd", torch.softmax(s, -1), vv)
        return ((out_tvm.double() - ref).norm() / ref.norm()).item()

    rel_outlier = rel_err_vs_fp64(tables[1], k_outlier) if rotate > 1 else float("nan")
    rel = rel_err_vs_fp64(tables[0], k)
    ops_torch.decode_attention(q, cache, tables[0], seq_lens, sm, out_torch)
    parity = ((out_tvm - out_torch).norm() / out_torch.norm()).item()

    kv_bytes = b * ctx * cache.bytes_per_token()
    moved = kv_bytes + 2 * q.numel() * 4 + tables[0].numel() * 4 + b * 4
    bf16_bytes = 2 * hkv * d * 2
    return {
        "ctx": ctx,
        "kv_mb": kv_bytes / 2**20,
        "tvm_ms": t_tvm * 1e3,
        "tvm_best_ms": best_tvm * 1e3,
        "torch_ref_ms": t_torch * 1e3,
        "torch_ref_best_ms": best_torch * 1e3,
        "tvm_gbps": moved / t_tvm / 1e9,
        "tvm_best_gbps": moved / best_tvm / 1e9,
        "torch_ref_gbps": moved / t_torch / 1e9,
        "tvm_vs_torch": t_torch / t_tvm,
        "kv_bytes_ratio": cache.bytes_per_token() / bf16_bytes,
        "rel_err_vs_fp64_unquantized": rel,
        "rel_err_outlier_channel_keys": rel_outlier,
        "rel_err_tvm_vs_torch_twin": parity,
    }


def bench_append(ops_tvm, ops_torch, args, torch_mod) -> dict:
    torch = torch_mod
    from reinforge.kernels.paged_kv import allocate_cache

    n, hkv, d, dev = args.batch, args.kv_heads, args.head_dim, args.device
    cache = allocate_cache(kind="int8", num_blocks=4096, num_kv_heads=hkv, head_dim=d, device=dev)
    k, v = torch.randn(n, hkv, d, device=dev), torch.randn(n, hkv, d, device=dev)
    slots = (torch.randperm(4096)[:n] * 16 + 7).to(torch.int32).to(dev)
    t_tvm = median_s(lambda: ops_tvm.append(cache, k, v, slots), args.repeat * 20)
    t_torch = median_s(lambda: ops_torch.append(cache, k, v, slots), args.repeat * 5)
    moved = 2 * k.numel() * 4 + n * cache.bytes_per_token() + n * 4
    ref = allocate_cache(kind="int8", num_blocks=4096, num_kv_heads=hkv, head_dim=d, device=dev)
    ops_torch.append(ref, k, v, slots)
    codes_equal = torch.equal(ref.k_data, cache.k_data) and torch.equal(ref.v_data, cache.v_data)
    # round-trip error of what was written: gather each token's page back (dequantize)
    fresh = allocate_cache(kind="int8", num_blocks=4096, num_kv_heads=hkv, head_dim=d, device=dev)
    ops_tvm.append(fresh, k, v, slots)
    errs, norms = 0.0, 0.0
    for i in range(n):
        blk = slots[i : i + 1].long() // 16
        kb, vb = ops_tvm.gather(fresh, blk.to(torch.int32), 16)
        errs += float((kb[7] - k[i]).square().sum() + (vb[7] - v[i]).square().sum())
        norms += float(k[i].square().sum() + v[i].square().sum())
    return {
        "tokens": n,
        "tvm_us": t_tvm * 1e6,
        "torch_ref_us": t_torch * 1e6,
        "tvm_gbps": moved / t_tvm / 1e9,
        "torch_ref_gbps": moved / t_torch / 1e9,
        "tvm_vs_torch": t_torch / t_tvm,
        "codes_equal_torch": codes_equal,
        "kv_bytes_ratio": cache.bytes_per_token() / (2 * hkv * d * 2),
        "rel_err_roundtrip": math.sqrt(errs / norms),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON lines")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--rotate", type=int, default=4, help="cache copies cycled through")
    p.add_argument("--threads", type=int, default=None, help="TVM and torch threads")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="cpu: this thread's CPU time (needs --threads 1); other tenants' load "
                   "then only slows memory, not the count")  # fmt: skip
    p.add_argument("--cuda-module", default=None, help="prebuilt TVM cuda module (.so)")
    p.add_argument("--decode-path", default=None, choices=("avx512", "avx2", "portable"),
                   help="the int8 decode kernel (CPU; default: the best this CPU runs)")
    args = p.parse_args(argv)

    from reinforge.kernels.tvm_build import available_cpus, configure_threads

    threads = args.threads or available_cpus()
    if args.clock == "cpu":
        if threads != 1 or args.device != "cpu":
            p.error("--clock cpu needs --threads 1 on --device cpu (kernels then run inline)")
        CLOCK[0] = time.thread_time
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if args.device == "cuda":
        import torch
        import tvm

        from reinforge.kernels import gpu_bundle
        from reinforge.kernels.paged_kv import TorchKVOps
        from reinforge.kernels.tvm_ops import TvmCudaKVOps

        if not args.cuda_module:
            p.error("--device cuda needs --cuda-module (see bench/gpu_check.sh)")
        gpu_bundle.load_cuda_runtime()
        gpu_bundle.register_cuda_compiler()
        SYNC[0] = torch.cuda.synchronize
        ops_tvm = TvmCudaKVOps(tvm.runtime.load_module(args.cuda_module))
        ops_torch = TorchKVOps()
        read = gpu_read_bandwidth_gbps()
        target_name = torch.cuda.get_device_name()
        decode_path = "cuda"
    else:
        configure_threads(threads)
        import torch

        torch.set_num_threads(threads)
        from reinforge.kernels.paged_kv import get_kv_ops
        from reinforge.kernels.tvm_cpu import int8_decode_path
        from reinforge.kernels.tvm_ops import TvmKVOps

        ops_tvm = TvmKVOps("int8", num_threads=threads, decode_path=args.decode_path)
        ops_torch = get_kv_ops("int8", "torch")
        read = read_bandwidth_gbps(threads)
        target_name = ops_tvm.target.attrs.get("mcpu", "?")
        decode_path = int8_decode_path(ops_tvm.decode_path, args.head_dim, 16)

    decode = [bench_decode(ops_tvm, ops_torch, ctx, args, torch) for ctx in args.contexts]
    append = bench_append(ops_tvm, ops_torch, args, torch)
    # the machine is shared: probe again after the kernels and keep the higher figure, so
    # the bandwidth fraction is not flattered by a probe that ran during a noisy moment
    best_before = READ_BEST_GBPS[0]
    read_again = gpu_read_bandwidth_gbps() if args.device == "cuda" else read_bandwidth_gbps(threads)
    read = max(read, read_again)
    READ_BEST_GBPS[0] = max(best_before, READ_BEST_GBPS[0])
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for rec in decode:
        rec["tvm_vs_bandwidth"] = rec["tvm_gbps"] / read
        rec["torch_vs_bandwidth"] = rec["torch_ref_gbps"] / read
        line = {"bench": "decode_int8", "decode_path": decode_path, "read_gbps": read, **rec}
        print(json.dumps(line) if args.json else line, flush=True)
    append["read_gbps"] = read
    append["tvm_vs_bandwidth"] = append["tvm_gbps"] / read  # latency-bound: 8 tokens
    print(json.dumps({"bench": "append_int8_decode_step", **append}) if args.json else append)
    top = decode[-1]
    summary = {
        "bench": "kv_kernels",
        "threads": threads,
        "clock": args.clock,
        "load_avg_start_end": [round(load_start, 2), round(load_end, 2)],
        "device": args.device,
        "target": str(target_name),
        "decode_path": decode_path,
        "ctx": top["ctx"],
        "batch": args.batch,
        "kv_heads": args.kv_heads,
        "q_heads": args.q_heads,
        "head_dim": args.head_dim,
        "tvm_gbps": round(top["tvm_gbps"], 2),
        "torch_ref_gbps": round(top["torch_ref_gbps"], 2),
        "read_gbps": round(read, 2),
        "tvm_vs_torch": round(top["tvm_vs_torch"], 2),
        "tvm_vs_bandwidth": round(top["tvm_vs_bandwidth"], 3),
        "kv_bytes_ratio": round(top["kv_bytes_ratio"], 4),
        "rel_err": top["rel_err_vs_fp64_unquantized"],
        "rel_err_outlier_channel_keys": top["rel_err_outlier_channel_keys"],
        "rel_err_tvm_vs_torch_twin": top["rel_err_tvm_vs_torch_twin"],
        "tvm_ms": round(top["tvm_ms"], 3),
        "tvm_best_ms": round(top["tvm_best_ms"], 3),
        "read_best_gbps": round(READ_BEST_GBPS[0], 2),
        "tvm_vs_bandwidth_best": round(top["tvm_best_gbps"] / READ_BEST_GBPS[0], 3),
        "torch_ref_ms": round(top["torch_ref_ms"], 3),
        "append_tvm_us": round(append["tvm_us"], 2),
        "append_torch_ref_us": round(append["torch_ref_us"], 2),
        "append_tvm_vs_torch": round(append["tvm_vs_torch"], 2),
        "append_tvm_gbps": round(append["tvm_gbps"], 3),
        "append_rel_err_roundtrip": append["rel_err_roundtrip"],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
