"""reinforge.kernels: the paged, quantized KV cache and its TVM kernels.

Modules (flat):
  * `paged_kv`: the contract (`PagedKVCache`, `allocate_cache`, `KVOps`, `get_kv_ops`), the
    cache formats, and `TorchKVOps`, the torch reference twin of every kernel;
  * `tvm_cpu`: the kernels in TVM script for `llvm` targets (quantize-on-append, gather,
    decode attention: AVX-512 16-bit-integer version and a portable fp32 one; int4 too);
  * `tvm_cuda`: the int8 kernels for the `cuda` target;
  * `tvm_build`: compile once, cache on disk by (kernel, shape, target incl. CPU model, TVM
    version, kernel source hash), load in milliseconds; the TVM thread pool setting;
  * `tvm_ops`: `TvmKVOps` (CPU) and `TvmCudaKVOps` (a prebuilt cuda module), the compiled
    implementations of `KVOps`;
  * `gpu_bundle`: packs TVM's runtime and the cuda kernels for an offline GPU host;
  * `cli`: `reinforge kernels build|info`.
"""
