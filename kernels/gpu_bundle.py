"""Pack what a GPU host with no network needs to run the TVM `cuda` KV kernels.

The GPU host has Python, torch and the CUDA toolkit but no TVM, and cannot download it. The
full TVM wheel is ~300 MB (the compiler library alone 259 MB), so the bundle carries:

  * ``site/tvm``: TVM's Python package without the compiler library (TVM then imports in
    runtime-only mode), with ``libtvm_runtime.so`` (3.4 MB) and ``libtvm_runtime_cuda.so``;
  * ``wheels/``: the apache-tvm-ffi wheel for the GPU host's Python version (downloaded here);
  * ``kv_int8_cuda.so``: the kernels, built here for the GPU architecture.

On the GPU host the module's CUDA source is compiled on first use through
`register_cuda_compiler` (nvcc), then cached by the CUDA driver for the process.

    python -m reinforge.kernels.gpu_bundle OUT_DIR [--python-version 3.12] [--arch sm_90]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

_SKIP_DIRS = {"3rdparty", "include", "src", "lib64", "__pycache__", "web", "cmake"}
_RUNTIME_LIBS = ("libtvm_runtime.so", "libtvm_runtime_cuda.so", "libtvm_runtime_extra.so")


def copy_tvm_runtime(dest: Path) -> Path:
    """Copy TVM's Python package minus the compiler into ``dest/tvm``; return that path."""
    import tvm

    src = Path(tvm.__file__).parent
    out = dest / "tvm"
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        rel = Path(root).relative_to(src)
        for name in files:
            keep = name.endswith(".py") or name.endswith(".pyi")
            if rel == Path("lib"):
                keep = name in _RUNTIME_LIBS
            if keep:
                (out / rel).mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(root) / name, out / rel / name)
    return out


def download_ffi_wheel(dest: Path, python_version: str) -> Path:
    """Fetch the apache-tvm-ffi wheel matching this one's version for `python_version`."""
    from importlib.metadata import version

    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp",
           "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
           "--platform", "manylinux_2_24_x86_64", "--platform", "manylinux_2_17_x86_64",
           "-d", str(dest), f"apache-tvm-ffi=={version('apache-tvm-ffi')}"]  # fmt: skip
    subprocess.run(cmd, check=True)
    (wheel,) = dest.glob("apache_tvm_ffi-*.whl")
    return wheel


def register_cuda_compiler(arch: str | None = None) -> None:
    """Register `tvm_callback_cuda_compile` with nvcc (-> fatbin), which TVM's CUDA runtime
    calls to compile a module that carries CUDA source. For runtime-only TVM on a GPU host."""
    import tempfile

    import tvm_ffi

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        raise RuntimeError("register_cuda_compiler: nvcc not found on PATH or /usr/local/cuda")
    if arch is None:
        import torch

        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"

    def compile_cuda(code, *_):
        with tempfile.TemporaryDirectory() as tmp:
            src, out = Path(tmp) / "k.cu", Path(tmp) / "k.fatbin"
            src.write_text(str(code))
            subprocess.run([nvcc, "--fatbin", "-O3", f"-arch={arch}", "-o", str(out), str(src)],
                           check=True)  # fmt: skip
            return bytearray(out.read_bytes())

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)


def load_cuda_runtime() -> None:
    """Load libtvm_runtime_cuda.so (runtime-only TVM does not autoload it)."""
    import ctypes

    import tvm

    lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    ctypes.CDLL(str(lib), mode=getattr(os, "RTLD_GLOBAL", 0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args(argv)

    from reinforge.kernels.tvm_build import build_cuda_module

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    copy_tvm_runtime(out / "site")
    wheel = download_ffi_wheel(out / "wheels", args.python_version)
    mod = build_cuda_module(out / "kv_int8_cuda.so", num_q_heads=args.q_heads,
                            num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                            arch=args.arch)  # fmt: skip
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"bundle {out}: {size / 2**20:.1f} MiB ({wheel.name}, {mod.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
