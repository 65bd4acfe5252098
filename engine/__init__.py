"""reinforge.engine — the embedded SGLang-compatible rollout server for CPUs.

Modules (flat): `model` (Llama/Qwen2 forward in float32), `linear` and `layer_ops` (its
products, RMSNorm and RoPE: TVM kernels or torch), `loader` (Hugging Face directories),
`tiny` (`reinforge model init`), `sampling` (SGLang's sampling params and the sampling maths),
`kvpool` (paged KV caches per layer + block allocator), `engine` (continuous batching loop),
`server` (the HTTP API on starlette/hypercorn), `cli` (`model init`, `serve`).
"""
