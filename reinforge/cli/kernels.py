"""`reinforge kernels build|info`: prebuild the KV-cache kernels into the on-disk cache, and
say what this machine's target, thread count and cache are."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    """Add this package's sub-commands to the `reinforge` parser."""
    p = subparsers.add_parser("kernels", help="TVM KV-cache kernels: build, info")
    sub = p.add_subparsers(dest="kernels_command", metavar="ACTION", required=True)

    b = sub.add_parser("build", help="compile the kernels of one shape family (cached on disk)")
    b.add_argument("--kind", default="int8", choices=("int8", "int4"))
    b.add_argument("--q-heads", type=int, required=True, help="query heads (H_q)")
    b.add_argument("--kv-heads", type=int, required=True, help="KV heads (H_kv)")
    b.add_argument("--head-dim", type=int, required=True)
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--target", default="llvm", choices=("llvm", "cuda"),
                   help="llvm: this CPU, into the kernel cache; cuda: a module file")  # fmt: skip
    b.add_argument("--arch", default="sm_90", help="cuda only: the GPU architecture")
    b.add_argument("--out", default=None, help="cuda only: where to write the .so")
    b.add_argument("--threads", type=int, default=None)
    b.set_defaults(func=cmd_build)

    i = sub.add_parser("info", help="print TVM version, CPU target, threads and the cache")
    i.add_argument("--threads", type=int, default=None)
    i.set_defaults(func=cmd_info)


def _check_shape(args: argparse.Namespace) -> None:
    from reinforge.cli import UserError

    for name in ("q_heads", "kv_heads", "head_dim", "block_size"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be positive")
    if args.q_heads % args.kv_heads:
        raise UserError(f"--q-heads {args.q_heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.head_dim % 16:
        raise UserError(f"--head-dim must be a multiple of 16, got {args.head_dim}")


def cmd_build(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from reinforge.cli import UserError

    _check_shape(args)
    t0 = time.perf_counter()
    if args.target == "cuda":
        if args.kind != "int8":
            raise UserError("--target cuda has int8 kernels only")
        from reinforge.kernels.tvm_build import build_cuda_module, default_cache_dir

        out = Path(args.out) if args.out else default_cache_dir() / (
            f"kv-int8-cuda-{args.arch}-hq{args.q_heads}-hkv{args.kv_heads}"
            f"-d{args.head_dim}-bs{args.block_size}.so"
        )
        path = build_cuda_module(out, num_q_heads=args.q_heads, num_kv_heads=args.kv_heads,
                                 head_dim=args.head_dim, block_size=args.block_size,
                                 arch=args.arch)  # fmt: skip
        print(f"built {path} ({path.stat().st_size} bytes) in {time.perf_counter() - t0:.2f} s")
        return 0
    if args.out:
        raise UserError("--out is for --target cuda; llvm builds go to the kernel cache")
    from reinforge.kernels.paged_kv import allocate_cache
    from reinforge.kernels.tvm_ops import TvmKVOps

    ops = TvmKVOps(args.kind, num_threads=args.threads)
    cache = allocate_cache(kind=args.kind, num_blocks=1, block_size=args.block_size,
                           num_kv_heads=args.kv_heads, head_dim=args.head_dim)  # fmt: skip
    for hq in sorted({args.kv_heads, args.q_heads}):
        ops.module(cache, hq)
    for loaded in filter(None, ops._modules.values()):
        how = "built" if loaded.built else "cached"
        print(f"{how} {loaded.path} in {loaded.seconds * 1e3:.1f} ms")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from reinforge.kernels.tvm_build import (
        available_cpus,
        configure_threads,
        default_cache_dir,
        host_target,
    )

    threads = configure_threads(args.threads)
    import tvm

    from reinforge.kernels.tvm_cpu import has_avx512bw, runnable_paths

    target = host_target()
    cache = default_cache_dir()
    files = sorted(cache.glob("*.so")) if cache.exists() else []
    print(f"tvm {tvm.__version__}")
    print(f"target {target.attrs.get('mcpu', '?')} (avx512bw: {has_avx512bw(target)})")
    paths = runnable_paths(target)
    print(f"int8 decode path {paths[0]} (this CPU runs: {', '.join(paths)})")
    print(f"threads {threads} of {available_cpus()} CPUs")
    print(f"cache {cache} ({len(files)} modules)")
    for f in files:
        print(f"  {f.name} {f.stat().st_size} bytes")
    return 0
