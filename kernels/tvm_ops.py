"""`TvmKVOps`: the `KVOps` contract backed by TVM kernels compiled for the host CPU.

Torch tensors go to the kernels zero-copy (DLPack). Modules are compiled per shape family
(KV heads, head_dim, block size; query heads for decode) on first use, cached on disk by
`tvm_build.build_or_load`, and kept in this object, so a process loads each one once.
`copy_blocks` is a page memcpy and uses torch indexing; float kinds never reach this class.
Shapes the kernels do not cover (head_dim not a multiple of 16, or of 32 for int4) run on the
torch twin, with one log line. Inputs are made contiguous; `out` must already be.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor

from reinforge.kernels import paged_kv as pk
from reinforge.kernels.tvm_build import (
    KernelSpec,
    LoadedModule,
    build_or_load,
    configure_threads,
    host_target,
)

log = logging.getLogger(__name__)


class TvmKVOps:
    """Compiled (llvm, host CPU) quantize-on-append, gather and decode attention."""

    name = "tvm-llvm"

    def __init__(
        self,
        kind: str,
        *,
        num_threads: int | None = None,
        cache_dir=None,
        decode_path: str | None = None,
        fallback: bool = False,
    ) -> None:
        """`decode_path` (tvm_cpu.DECODE_PATHS) forces one int8 decode kernel that this CPU
        runs (for tests and benchmarks; None: the best one, `tvm_cpu.runnable_paths`); an
        "avx2" path on an AVX-512 CPU is built for a Haswell, as an AVX2-only machine builds
        it. `fallback=True` (what get_kv_ops "auto" asks for) runs the torch twin, with a log
        line, for a shape family whose kernels fail to compile or load, instead of raising."""
        if kind not in pk.QUANTIZED_KINDS:
            raise ValueError(
                f"TvmKVOps: no TVM kernels for kind {kind!r} (have {pk.QUANTIZED_KINDS})"
            )
        self.kind = kind
        self.num_threads = configure_threads(num_threads)

        import tvm

        from reinforge.kernels.tvm_cpu import runnable_paths

        self.target = host_target()
        runnable = runnable_paths(self.target)
        self.decode_path = decode_path or runnable[0]
        """The int8 decode kernel built here (a shape it does not fit gets "portable")."""
        if self.decode_path not in runnable:
            raise ValueError(
                f"decode path {self.decode_path!r} does not run on this CPU (runs: {runnable})"
            )
        if self.decode_path == "avx2" and runnable[0] == "avx512":
            self.target = tvm.target.Target(
                {"kind": "llvm", "mcpu": "haswell", "num-cores": self.target.attrs["num-cores"]}
            )
        self._cache_dir = cache_dir
        self._fallback = fallback
        self._modules: dict[tuple, LoadedModule | None] = {}
        self._torch = pk.TorchKVOps()

    # ------------------------------------------------------------------ modules

    def supports(self, cache: pk.PagedKVCache) -> bool:
        """Whether compiled kernels cover this cache's shape (else the torch twin runs)."""
        from reinforge.kernels import tvm_cpu

        d = cache.head_dim
        ok = d % tvm_cpu.VW == 0 and (cache.kind != "int4" or d % pk.INT4_GROUP_SIZE == 0)
        ok = ok and (cache.kind != "int8" or cache.block_size in (8, 16, 32))
        if cache.num_blocks * cache.num_kv_heads * cache.block_size * d >= 2**31:
            ok = False  # the kernels index pages with int32
        key = ("supports", cache.kind, cache.num_kv_heads, d, cache.block_size)
        if not ok and key not in self._modules:
            self._modules[key] = None
            log.info("kv ops: no TVM kernel for %s head_dim=%d (%d blocks); using the torch twin",
                     cache.kind, d, cache.num_blocks)  # fmt: skip
        return ok

    def _module_or_none(self, cache: pk.PagedKVCache, num_q_heads: int | None = None) -> Any:
        key = ("failed", cache.kind, cache.num_kv_heads, cache.head_dim, cache.block_size,
               num_q_heads)  # fmt: skip
        if key in self._modules:
            return None
        try:
            return self.module(cache, num_q_heads)
        except Exception as exc:
            if not self._fallback:
                raise
            self._modules[key] = None
            log.warning("kv ops: TVM kernels for %s failed to build/load (%s: %s); using torch",
                        key[1:], type(exc).__name__, exc)  # fmt: skip
            return None

    def module(self, cache: pk.PagedKVCache, num_q_heads: int | None = None) -> Any:
        """The compiled module for this cache's shape family (and `num_q_heads` for decode)."""
        from reinforge.kernels import tvm_cpu

        h, d, bs = cache.num_kv_heads, cache.head_dim, cache.block_size
        if cache.kind != self.kind:
            raise ValueError(f"TvmKVOps({self.kind}) got a {cache.kind} cache")
        if d % tvm_cpu.VW:
            raise ValueError(f"TvmKVOps: head_dim must be a multiple of {tvm_cpu.VW}, got {d}")
        hq = num_q_heads or h
        key = (cache.kind, h, d, bs, hq)
        loaded = self._modules.get(key)
        if loaded is None:
            spec = KernelSpec(
                family=f"kv-{cache.kind}-llvm",
                params=tuple(
                    sorted({"hkv": h, "d": d, "bs": bs, "hq": hq, "path": self.decode_path}.items())
                ),
            )

            def make() -> dict[str, Any]:
                return tvm_cpu.make_all(cache.kind, hq, h, d, bs, path=self.decode_path)

            loaded = build_or_load(spec, self.target, make, cache_dir=self._cache_dir)
            self._modules[key] = loaded
        return loaded.module

    # ------------------------------------------------------------------ KVOps

    def append(self, cache: pk.PagedKVCache, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        pk.check_append_args(cache, k, v, slot_mapping)
        if not self.supports(cache):
            return self._torch.append(cache, k, v, slot_mapping)
        k, v, slot_mapping = k.contiguous(), v.contiguous(), slot_mapping.contiguous()
        _check_cpu("append", k=k)
        if k.shape[0] == 0:
            return
        mod = self._module_or_none(cache)
        if mod is None:
            return self._torch.append(cache, k, v, slot_mapping)
        if cache.kind == "int8":
            mod["quant_append_int8"](
                k, v, slot_mapping, cache.k_data, cache.v_data, cache.k_scale, cache.v_scale
            )
        else:
            mod["quant_append_int4"](
                k, v, slot_mapping, cache.k_data, cache.v_data,
                cache.k_scale, cache.v_scale, cache.k_zero, cache.v_zero,
            )  # fmt: skip

    def gather(
        self, cache: pk.PagedKVCache, block_ids: Tensor, seq_len: int
    ) -> tuple[Tensor, Tensor]:
        if not self.supports(cache):
            return self._torch.gather(cache, block_ids, seq_len)
        n = math.ceil(seq_len / cache.block_size)
        if block_ids.numel() < n:
            raise ValueError(
                f"gather: {block_ids.numel()} blocks cannot hold {seq_len} tokens "
                f"(block_size {cache.block_size})"
            )
        blocks = block_ids.to(torch.int32).contiguous()
        shape = (seq_len, cache.num_kv_heads, cache.head_dim)
        k_out = torch.empty(shape, dtype=torch.float32)
        v_out = torch.empty(shape, dtype=torch.float32)
        if seq_len == 0:
            return k_out, v_out
        mod = self._module_or_none(cache)
        if mod is None:
            return self._torch.gather(cache, block_ids, seq_len)
        if cache.kind == "int8":
            mod["gather_int8"](
                cache.k_data, cache.v_data, cache.k_scale, cache.v_scale, blocks, k_out, v_out
            )
        else:
            mod["gather_int4"](
                cache.k_data, cache.v_data, cache.k_scale, cache.v_scale,
                cache.k_zero, cache.v_zero, blocks, k_out, v_out,
            )  # fmt: skip
        return k_out, v_out

    def decode_attention(
        self,
        q: Tensor,
        cache: pk.PagedKVCache,
        block_table: Tensor,
        seq_lens: Tensor,
        sm_scale: float,
        out: Tensor,
    ) -> None:
        pk.check_decode_args(q, cache, block_table, seq_lens, out)
        if not self.supports(cache):
            return self._torch.decode_attention(q, cache, block_table, seq_lens, sm_scale, out)
        if not out.is_contiguous():
            raise ValueError("decode_attention: out must be contiguous (it is written in place)")
        q, block_table, seq_lens = q.contiguous(), block_table.contiguous(), seq_lens.contiguous()
        _check_cpu("decode_attention", q=q, out=out)
        if q.shape[0] == 0:
            return
        mod = self._module_or_none(cache, q.shape[1])
        if mod is None:
            return self._torch.decode_attention(q, cache, block_table, seq_lens, sm_scale, out)
        if cache.kind == "int8":
            mod["decode_int8"](
                q, cache.k_data, cache.v_data, cache.k_scale, cache.v_scale,
                block_table, seq_lens, out, float(sm_scale),
            )  # fmt: skip
        else:
            mod["decode_int4"](
                q, cache.k_data, cache.v_data, cache.k_scale, cache.v_scale,
                cache.k_zero, cache.v_zero, block_table, seq_lens, out, float(sm_scale),
            )  # fmt: skip

    def copy_blocks(self, cache: pk.PagedKVCache, src: Tensor, dst: Tensor) -> None:
        self._torch.copy_blocks(cache, src, dst)


def _check_cpu(where: str, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"{where}: {name} is on {t.device}; the llvm kernels need CPU tensors")


class TvmCudaKVOps:
    """int8 ops backed by a prebuilt TVM `cuda` module (see `tvm_build.build_cuda_module`);
    the cache and every tensor live on the GPU. Used by `bench/gpu_check.sh`."""

    name = "tvm-cuda"

    def __init__(self, module: Any) -> None:
        self.module = module
        self._torch = pk.TorchKVOps()

    def append(self, cache: pk.PagedKVCache, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        pk.check_append_args(cache, k, v, slot_mapping)
        if k.shape[0]:
            self.module["quant_append_int8"](
                k, v, slot_mapping, cache.k_data, cache.v_data, cache.k_scale, cache.v_scale
            )

    def gather(
        self, cache: pk.PagedKVCache, block_ids: Tensor, seq_len: int
    ) -> tuple[Tensor, Tensor]:
        shape = (seq_len, cache.num_kv_heads, cache.head_dim)
        k_out = torch.empty(shape, dtype=torch.float32, device=cache.device)
        v_out = torch.empty(shape, dtype=torch.float32, device=cache.device)
        if seq_len:
            self.module["gather_int8"](
                cache.k_data, cache.v_data, cache.k_scale, cache.v_scale,
                block_ids.to(torch.int32).contiguous(), k_out, v_out,
            )  # fmt: skip
        return k_out, v_out

    def decode_attention(
        self,
        q: Tensor,
        cache: pk.PagedKVCache,
        block_table: Tensor,
        seq_lens: Tensor,
        sm_scale: float,
        out: Tensor,
    ) -> None:
        pk.check_decode_args(q, cache, block_table, seq_lens, out)
        if q.shape[0]:
            self.module["decode_int8"](
                q, cache.k_data, cache.v_data, cache.k_scale, cache.v_scale,
                block_table, seq_lens, out, float(sm_scale),
            )  # fmt: skip

    def copy_blocks(self, cache: pk.PagedKVCache, src: Tensor, dst: Tensor) -> None:
        self._torch.copy_blocks(cache, src, dst)
