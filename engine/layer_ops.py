"""The per-layer ops of the forward other than the products: RMSNorm and rotary embeddings.

In torch each is about ten small ops, and in a decode step of a small model (8 x 576 values)
their dispatch costs more than their arithmetic. `LayerOps` runs them as the one-call kernels of
`kernels/tvm_layer.py` (compiled for this CPU per width, cached on disk) and falls back to
the torch definitions below when the kernels cannot be built or a width does not fit
them (`path` says which: "tvm-layer" or "torch"). Both compute in float32; they agree to
float32 rounding (the sum of squares is taken in another order), not bit for bit.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from reinforge.engine.kernel_choice import KernelChoice

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in float32 (torch's fused op; the same maths as
    transformers)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, D] by cos/sin [N, D] (the rotate-half form of Llama/Qwen2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LayerOps(KernelChoice):
    """RMSNorm and RoPE for `Model`, through TVM kernels where they fit ("auto"), always
    ("tvm": a build failure raises) or never ("torch")."""

    def __init__(self, backend: str = "auto") -> None:
        super().__init__(backend, "tvm-layer")
        self._funcs: dict[tuple, Any] = {}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x [..., K] over its last dim."""
        k = x.shape[-1]
        f = self._kernel("rms_norm", k, eps)
        if f is None:
            return rms_norm(x, weight, eps)
        x = x.contiguous()
        y = torch.empty_like(x)
        f(x.view(-1, k), weight, y.view(-1, k))
        return y

    def rope_split(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
        num_kv_heads: int, head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [N, (Hq + 2 Hkv) * D] -> q [N, Hq, D] and k [N, Hkv, D] rotated by cos/sin
        [N, D], and v [N, Hkv, D]; each contiguous."""
        n = qkv.shape[0]
        f = self._kernel("rope_split", num_heads, num_kv_heads, head_dim)
        if f is None:
            qk_size = (num_heads + num_kv_heads) * head_dim
            qk = apply_rope(qkv[:, :qk_size].view(n, num_heads + num_kv_heads, head_dim),
                            cos, sin)
            v = qkv[:, qk_size:].reshape(n, num_kv_heads, head_dim)
            return (qk[:, :num_heads].contiguous(), qk[:, num_heads:].contiguous(),
                    v.contiguous())
        q = torch.empty((n, num_heads, head_dim), dtype=torch.float32)
        k = torch.empty((n, num_kv_heads, head_dim), dtype=torch.float32)
        v = torch.empty((n, num_kv_heads, head_dim), dtype=torch.float32)
        f(qkv.contiguous(), cos.contiguous(), sin.contiguous(), q, k, v)
        return q, k, v

    def _kernel(self, name: str, *params: Any) -> Any:
        """The compiled function `name` for these compile-time constants, or None (torch)."""
        if self.path == "torch":
            return None
        key = (name, *params)
        if key not in self._funcs:
            self._funcs[key] = self._build(name, params)
        return self._funcs[key]

    def _build(self, name: str, params: tuple) -> Any:
        try:
            from reinforge.kernels import tvm_layer
            from reinforge.kernels.tvm_build import KernelSpec, build_or_load, host_target
        except Exception as exc:  # TVM itself is missing or broken
            return self.unavailable("layer ops", exc)
        make = {"rms_norm": tvm_layer.make_rms_norm, "rope_split": tvm_layer.make_rope_split}[name]
        try:
            func = make(*params)
        except ValueError as exc:  # a width the kernel does not take: torch runs this one
            log.info("layer ops: %s; using torch for it", exc)
            return None
        except Exception as exc:
            return self.unavailable("layer ops", exc)
        try:
            spec = KernelSpec(family=f"layer-{name}",
                              params=tuple((f"p{i}", p) for i, p in enumerate(params)))
            return build_or_load(spec, host_target(), lambda: {name: func}).module[name]
        except Exception as exc:
            return self.unavailable("layer ops", exc)
