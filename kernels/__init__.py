"""reinforge.kernels: the paged, quantized KV cache and its TVM kernels.

Modules (flat):
  * `paged_kv`: the contract (`PagedKVCache`, `allocate_cache`, `KVOps`, `get_kv_ops`), the
    cache formats, and `TorchKVOps`, the torch reference twin of every kernel;
  * `tvm_cpu`: the kernels in TVM script for `llvm` targets (quantize-on-append, gather,
    decode attention: 16-bit-integer versions for AVX-512 and AVX2 and a portable fp32 one,
    the best this CPU runs picked at run time (`runnable_paths`); int4 too);
  * `tvm_cuda`: the int8 kernels for the `cuda` target;
  * `tvm_build`: compile once, cache on disk by (kernel, shape, target incl. CPU model, TVM
    version, kernel source hash), load in milliseconds; the TVM thread pool setting;
  * `tvm_ops`: `TvmKVOps` (CPU) and `TvmCudaKVOps` (a prebuilt cuda module), the compiled
    implementations of `KVOps`;
  * `gpu_bundle`: packs TVM's runtime and the cuda kernels for an offline GPU host;
  * `cli`: `reinforge kernels build|info`.
"""

if __name__ == "kernels":  # pragma: no branch - only when run from the checkout root
    # The checkout root was on sys.path (`python -c ...` or a script there, without importing
    # reinforge first) and this folder was found as the top-level name `kernels`, which is
    # Hugging Face's distribution that transformers imports. Hand the name over to it.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _elsewhere = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None:
        del _sys.modules["kernels"]
        raise ModuleNotFoundError("No module named 'kernels' (this folder is reinforge.kernels)",
                                  name="kernels")
    _module = _util.module_from_spec(_spec)
    _sys.modules["kernels"] = _module  # the import statement returns what is here now
    _spec.loader.exec_module(_module)
