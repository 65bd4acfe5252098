"""Compile TVM kernels once, cache the shared objects on disk, load them in milliseconds.

The cache key covers everything that changes the binary: the kernel family and its
compile-time constants, the target (as JSON, so the CPU model and its features are in it:
an AVX-512 build must not load on an older CPU), the TVM version and a hash of the kernel
source modules (editing a kernel invalidates its entries). Files are written to a temporary
name and renamed into place, so concurrent builders never see a partial file.

Thread count: TVM's pool defaults to half the hardware threads on x86 (it assumes
hyper-threading). `configure_threads` sets it explicitly, before or after `import tvm`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CACHE_ENV = "REINFORGE_KERNEL_CACHE"
_SOURCE_MODULES = (
    "tvm_cpu.py", "tvm_cuda.py", "tvm_gemv.py", "tvm_layer.py", "tvm_build.py", "paged_kv.py"
)


def default_cache_dir() -> Path:
    """`$REINFORGE_KERNEL_CACHE`, else ``~/.cache/reinforge/kernels``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "reinforge" / "kernels"


# TVM pins its pool threads (the calling thread included) to cores by default; that
# shrinks this process's CPU affinity for torch and for later thread-count choices, and
# fights torch's own pool. Unpinned unless the user says otherwise.
os.environ.setdefault("TVM_BIND_THREADS", "0")
_CPUS_AT_IMPORT = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
# TVM sizes its pool once, at import (default: half the cores on x86), and can lower it
# later but never raise it: start at every usable CPU, and let configure_threads() lower.
os.environ.setdefault("TVM_NUM_THREADS", str(len(_CPUS_AT_IMPORT) or os.cpu_count() or 1))


def available_cpus() -> int:
    """CPUs this process may use, as they were before TVM could pin any thread."""
    return len(_CPUS_AT_IMPORT) or os.cpu_count() or 1


def configure_threads(num_threads: int | None) -> int:
    """Set TVM's CPU thread pool to `num_threads` (default: every CPU this process may use)
    and return the count in effect. Before `import tvm` this sets TVM_NUM_THREADS; after, it
    reconfigures the running pool. TVM 0.27 can lower a running pool but not raise it again
    (measured): the first count a process uses is its ceiling."""

    n = num_threads or available_cpus()
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    import tvm

    if tvm.runtime.num_threads() != n:
        # mode -3: n threads sharing the given CPUs; modes 0/1 can only lower the count.
        cpu_list = [str(c) for c in (_CPUS_AT_IMPORT or range(n))]
        tvm.get_global_func("runtime.config_threadpool")(-3, n, cpu_list)
    return int(tvm.runtime.num_threads())


def host_target() -> Any:
    """The llvm target for this CPU, by name. Never "native": with the wheel's default triple
    TVM rejects it and falls back to a generic CPU (no AVX-512)."""
    import tvm

    cpu = tvm.target.codegen.llvm_get_system_cpu()
    return tvm.target.Target({"kind": "llvm", "mcpu": cpu, "num-cores": available_cpus()})


def cuda_target(arch: str = "sm_90") -> Any:
    import tvm

    return tvm.target.Target({"kind": "cuda", "arch": arch}, host=host_target())


def _sources_digest() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in _SOURCE_MODULES:
        p = here / name
        if p.exists():
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """One compiled module: `family` names the kernel set, `params` its compile-time constants."""

    family: str
    """e.g. "int8-llvm"; the file name starts with it."""
    params: tuple[tuple[str, Any], ...]
    """Sorted (name, value) pairs: heads, head_dim, block size..."""

    def key(self, target: Any) -> str:
        import tvm

        blob = json.dumps(
            {
                "family": self.family,
                "params": [list(p) for p in self.params],
                "target": str(target.export() if hasattr(target, "export") else target),
                "tvm": tvm.__version__,
                "machine": platform.machine(),
                "sources": _sources_digest(),
            },
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class LoadedModule:
    module: Any
    """The tvm.runtime.Module; index it by function name."""
    path: Path
    built: bool
    """True when this call compiled it; False when it came from the disk cache."""
    seconds: float


def build_or_load(
    spec: KernelSpec,
    target: Any,
    make_funcs: Callable[[], dict[str, Any]],
    *,
    cache_dir: Path | None = None,
) -> LoadedModule:
    """Load the module for `spec` from the disk cache, or compile `make_funcs()` (name ->
    PrimFunc) for `target`, export it to the cache and load that."""
    import tvm

    t0 = time.perf_counter()
    root = cache_dir or default_cache_dir()
    path = root / f"{spec.family}-{spec.key(target)}.so"
    if path.exists():
        try:
            mod = tvm.runtime.load_module(str(path))
            return LoadedModule(mod, path, False, time.perf_counter() - t0)
        except Exception as exc:  # a broken/foreign file: rebuild over it
            log.warning("kernel cache: %s did not load (%s); rebuilding", path, exc)
    funcs = make_funcs()
    irmod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    ex = tvm.compile(irmod, target=target)
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{spec.family}-", suffix=".so", dir=root)
    os.close(fd)
    try:
        ex.export_library(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    mod = tvm.runtime.load_module(str(path))
    log.info("kernel cache: built %s in %.2f s", path.name, time.perf_counter() - t0)
    return LoadedModule(mod, path, True, time.perf_counter() - t0)


def build_cuda_module(
    path: Path,
    *,
    kind: str = "int8",
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    arch: str = "sm_90",
) -> Path:
    """Compile the `cuda` kernels for one shape family and export them to `path` (a .so).

    This TVM wheel has no CUDA compiler inside, so the module carries CUDA C source; a TVM
    runtime with CUDA compiles it on first use through the `tvm_callback_cuda_compile` hook
    (NVRTC or nvcc on the GPU host). The host side is built for generic x86-64, so the file
    loads on any x86-64 GPU host.
    """
    import tvm

    from reinforge.kernels import tvm_cuda

    funcs = tvm_cuda.make_all(kind, num_q_heads, num_kv_heads, head_dim, block_size)
    irmod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    target = tvm.target.Target(
        {"kind": "cuda", "arch": arch}, host={"kind": "llvm", "mcpu": "x86-64"}
    )
    ex = tvm.compile(irmod, target=target)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ex.export_library(str(path))
    return path


def cuda_source(module: Any) -> str:
    """The CUDA C source carried by a compiled/exported cuda module (for inspection)."""
    mod = getattr(module, "mod", module)
    return "\n".join(imp.inspect_source() for imp in mod.imports)
