"""The on-disk kernel cache, the thread pool setting, the cuda build and the CLI."""

from __future__ import annotations

import pytest
import torch

from reinforge.kernels.paged_kv import allocate_cache
from reinforge.kernels.tvm_build import (
    KernelSpec,
    build_cuda_module,
    host_target,
)
from reinforge.kernels.tvm_ops import TvmKVOps


def small_cache():
    return allocate_cache(kind="int8", num_blocks=4, num_kv_heads=2, head_dim=64)


def test_a_second_process_view_loads_the_module_from_disk_instead_of_compiling(tmp_path):
    first = TvmKVOps("int8", num_threads=2, cache_dir=tmp_path)
    first.module(small_cache(), 4)
    (built,) = first._modules.values()
    assert built.built and built.path.exists() and built.path.parent == tmp_path

    second = TvmKVOps("int8", num_threads=2, cache_dir=tmp_path)
    second.module(small_cache(), 4)
    (loaded,) = second._modules.values()
    assert not loaded.built and loaded.path == built.path
    assert sorted(p.name for p in tmp_path.iterdir()) == [built.path.name]  # no temp files left


def test_a_corrupt_cache_file_is_rebuilt_not_loaded(tmp_path):
    ops = TvmKVOps("int8", num_threads=2, cache_dir=tmp_path / "a")
    ops.module(small_cache())
    (good,) = (tmp_path / "a").iterdir()
    (tmp_path / "b").mkdir()
    path = tmp_path / "b" / good.name  # (never overwrite a loaded .so in place: it is mmapped)
    path.write_bytes(b"not a shared object")
    again = TvmKVOps("int8", num_threads=2, cache_dir=tmp_path / "b")
    again.module(small_cache())
    (loaded,) = again._modules.values()
    assert loaded.built and loaded.path == path and path.stat().st_size > 1000


def test_cache_key_differs_by_cpu_model_shape_and_variant():
    import tvm

    spec = KernelSpec(family="kv-int8-llvm", params=(("d", 128), ("hkv", 8)))
    other_cpu = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    assert spec.key(host_target()) != spec.key(other_cpu)
    assert spec.key(other_cpu) == spec.key(tvm.target.Target({"kind": "llvm", "mcpu": "haswell"}))
    wider = KernelSpec(family="kv-int8-llvm", params=(("d", 64), ("hkv", 8)))
    assert wider.key(other_cpu) != spec.key(other_cpu)


def test_thread_count_is_configurable_after_import():
    # In a fresh process: TVM 0.27's pool can be lowered at any time but never raised
    # again after it was lowered (measured), so an earlier test's choice would leak.
    import subprocess
    import sys

    code = (
        "from reinforge.kernels.tvm_build import configure_threads\n"
        "import tvm\n"
        "assert configure_threads(2) == 2 == tvm.runtime.num_threads()\n"
        "assert configure_threads(1) == 1 == tvm.runtime.num_threads()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("path", ["portable", "avx2"])
def test_a_module_built_for_an_older_cpu_runs_here_and_agrees(tmp_path, path):
    """The decodes built where AVX-512BW is missing (fp32; AVX2 16-bit integer, built for a
    Haswell here) give the same answers."""
    from reinforge.kernels.paged_kv import TorchKVOps
    from reinforge.kernels.tvm_build import host_target
    from reinforge.kernels.tvm_cpu import runnable_paths

    if path not in runnable_paths(host_target()):
        pytest.skip(f"this CPU can't run the {path} decode kernel")
    ops = TvmKVOps("int8", num_threads=2, cache_dir=tmp_path, decode_path=path)
    cache = allocate_cache(kind="int8", num_blocks=8, num_kv_heads=2, head_dim=64)
    k, v = torch.randn(40, 2, 64), torch.randn(40, 2, 64)
    slots = torch.arange(40, dtype=torch.int32)
    ops.append(cache, k, v, slots)
    q = torch.randn(1, 4, 64)
    got, want = torch.empty_like(q), torch.empty_like(q)
    table = torch.arange(3, dtype=torch.int32)[None]
    seq = torch.tensor([40], dtype=torch.int32)
    ops.decode_attention(q, cache, table, seq, 0.125, got)
    TorchKVOps().decode_attention(q, cache, table, seq, 0.125, want)
    if path == "portable":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # q and the probabilities rounded to int16
        assert float((got - want).norm() / want.norm()) <= 1e-4


def test_the_cuda_target_builds_a_module_file_with_the_three_kernels(tmp_path):
    path = build_cuda_module(tmp_path / "kv_cuda.so", num_q_heads=16, num_kv_heads=4,
                             head_dim=128)  # fmt: skip
    blob = path.read_bytes()
    assert blob[:4] == b"\x7fELF"
    for kernel in (b"decode_int8_kernel", b"quant_append_int8_kernel", b"gather_int8_kernel"):
        assert kernel in blob
    assert b"__global__" in blob  # CUDA source, compiled on the GPU host at first use
    assert b"__syncthreads" in blob


def test_cli_info_and_build_report_the_cache(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, REINFORGE_KERNEL_CACHE=str(tmp_path))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "reinforge", "kernels", *args], env=env,
                              capture_output=True, text=True, timeout=300)

    built = cli("build", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64")
    assert built.returncode == 0 and "built" in built.stdout, built.stderr
    info = cli("info", "--threads", "2")
    assert info.returncode == 0, info.stderr
    assert "threads 2" in info.stdout and f"cache {tmp_path}" in info.stdout
    assert "kv-int8-llvm-" in info.stdout
    bad = cli("build", "--q-heads", "3", "--kv-heads", "2", "--head-dim", "64")
    assert bad.returncode == 2 and "not a multiple of --kv-heads 2" in bad.stderr


@pytest.mark.parametrize("bad", [{"head_dim": 40}, {"block_size": 3}])
def test_int8_cache_rejects_shapes_the_page_layout_cannot_hold(bad):
    args = {"kind": "int8", "num_blocks": 2, "num_kv_heads": 1, "head_dim": 64, "block_size": 16}
    args.update(bad)
    if "head_dim" in bad:
        cache = allocate_cache(**args)  # allowed by the layout ...
        with pytest.raises(ValueError, match="head_dim must be a multiple of 16"):
            TvmKVOps("int8", num_threads=2).module(cache)  # ... but not by the kernels
    else:
        with pytest.raises(ValueError, match="even block_size"):
            allocate_cache(**args)


def test_auto_backend_runs_the_twin_when_a_kernel_fails_to_build_and_tvm_backend_raises(
    tmp_path, monkeypatch, caplog
):
    from reinforge.kernels import tvm_cpu
    from reinforge.kernels.paged_kv import TorchKVOps, get_kv_ops

    def broken(*args, **kwargs):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(tvm_cpu, "make_all", broken)
    monkeypatch.setenv("REINFORGE_KERNEL_CACHE", str(tmp_path))
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    slots = torch.arange(3, dtype=torch.int32)
    auto, want = small_cache(), small_cache()
    get_kv_ops("int8", "auto", num_threads=2).append(auto, k, v, slots)
    TorchKVOps().append(want, k, v, slots)
    assert torch.equal(auto.k_data, want.k_data)
    assert "simulated compiler failure" in caplog.text
    with pytest.raises(RuntimeError, match="simulated compiler failure"):
        get_kv_ops("int8", "tvm", num_threads=2).append(small_cache(), k, v, slots)
