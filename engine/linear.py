"""How the engine stores a projection's weight and multiplies by it: float32, bfloat16, or
int8 weight-only (one scale per output row).

Batch-1 decode reads every weight once per token, so its speed limit is the machine's read
bandwidth divided by the bytes of the weights: half of them in bfloat16, a quarter in int8.
Activations, norms, attention and logits stay float32; only the products with the big
matrices read the smaller weights. The price is a logprob error against the float32 policy
the learner trains, which `bench/engine.py` reports (the learner's TIS correction takes
the rest, as it does for the int8 KV cache).

    float32   F.linear, exactly the checkpoint (the default)
    bfloat16  the weight rounded to bf16
    int8      per-row symmetric int8 (scale = max|row| / 127)

Packed weights are multiplied by `Linear`: decode's few rows through TVM kernels that widen
each weight to fp32 in registers as it streams in (`kernels/tvm_gemv.py`), prefill's many
rows in torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("float32", "bfloat16", "int8")


@dataclass(frozen=True)
class Int8Weight:
    """A weight [out, in] as int8 rows and their float32 scales."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def numel(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * self.scale[:, None]


Weight = torch.Tensor | Int8Weight


def check_format(fmt: str) -> str:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    return fmt


def pack(w: torch.Tensor, fmt: str) -> Weight:
    """`w` (float32 [out, in]) stored in `fmt`."""
    if check_format(fmt) == "float32":
        return w
    if fmt == "bfloat16":
        return w.to(torch.bfloat16).contiguous()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    data = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return Int8Weight(data=data, scale=scale.contiguous())


def nbytes(w: Weight) -> int:
    """Bytes read per use: what the roofline of a decode step counts."""
    if isinstance(w, Int8Weight):
        return w.data.numel() + w.scale.numel() * 4
    return w.numel() * w.element_size()


GEMV_MAX_ROWS = 16
"""Up to this many activation rows (decode steps) a product streams packed weights through
the TVM kernels in one pass."""
GEMV_CHUNKED_MAX_ROWS = 64
"""Up to this many rows (a wide decode batch) the kernels run once per GEMV_MAX_ROWS rows:
four passes over int8 weights read what one pass over float32 reads, and widening the
matrix every step (about 1.8x slower than float32 at 32 sequences) is avoided. More rows
(prefill) widen the weight once and multiply in torch."""


class Linear:
    """x [N, in] float32 @ w.T (+ bias) -> [N, out] float32, whatever `w`'s format.

    float32 weights: torch (addmm fuses a residual add). Packed weights: the TVM kernels of
    `kernels/tvm_gemv.py` (compiled for this CPU per input width, cached on disk) for up to
    GEMV_MAX_ROWS rows, in chunks of that many up to GEMV_CHUNKED_MAX_ROWS; torch otherwise,
    and for every row count when the kernels cannot be built (`path` says which: "tvm-gemv"
    or "torch")."""

    def __init__(self, backend: str = "auto") -> None:
        if backend not in ("auto", "torch", "tvm"):
            raise ValueError(f"unknown kernel backend {backend!r}: 'auto', 'torch' or 'tvm'")
        self.backend = backend
        self._modules: dict[tuple[str, int], Any] = {}
        self._ones: dict[int, torch.Tensor] = {}
        self._block = 1  # the kernel's rows per task, once one is built
        self.path = "torch" if backend == "torch" else "tvm-gemv"

    def __call__(self, x: torch.Tensor, w: Weight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, torch.Tensor) and w.dtype == torch.float32:
            return F.linear(x, w, bias)
        y = self._packed(x, w)
        return y if bias is None else y.add_(bias)

    def add(self, base: torch.Tensor, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """base + x @ w.T."""
        if isinstance(w, torch.Tensor) and w.dtype == torch.float32:
            return torch.addmm(base, x, w.t())
        return self._packed(x, w).add_(base)

    def _packed(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        fmt = "int8" if isinstance(w, Int8Weight) else "bf16"
        out, width = w.shape
        rows = x.shape[0]
        if GEMV_MAX_ROWS < rows <= GEMV_CHUNKED_MAX_ROWS and self._kernel(fmt, width) is not None:
            return torch.cat([self._packed(x[i:i + GEMV_MAX_ROWS], w)
                              for i in range(0, rows, GEMV_MAX_ROWS)])
        kernel = self._kernel(fmt, width) if rows <= GEMV_MAX_ROWS else None
        main = out - out % self._block  # the kernel takes rows in blocks; torch the rest
        if kernel is None or not main:
            return _widened_product(x, w)
        y = torch.empty((x.shape[0], main), dtype=torch.float32)
        x = x.contiguous()
        if isinstance(w, Int8Weight):
            kernel(x, w.data[:main], w.scale[:main], y)
        else:
            if main not in self._ones:
                self._ones[main] = torch.ones(main)
            kernel(x, w[:main].view(torch.uint16), self._ones[main], y)
        if main < out:  # e.g. a vocabulary of 3635 rows: the last 3 in torch
            tail = _rows(w, main)
            tail = tail.dequantize() if isinstance(tail, Int8Weight) else tail.float()
            return torch.cat([y, F.linear(x, tail)], dim=1)
        return y

    def _kernel(self, fmt: str, width: int) -> Any:
        if self.path == "torch" or width % 16:  # tvm_gemv.VW: K in whole vectors
            return None
        key = (fmt, width)
        if key not in self._modules:
            self._modules[key] = self._build(fmt, width)
        return self._modules[key]

    def _build(self, fmt: str, width: int) -> Any:
        try:
            from reinforge.kernels.tvm_build import KernelSpec, build_or_load, host_target
            from reinforge.kernels.tvm_gemv import ROWS, make_gemv

            self._block = ROWS
            spec = KernelSpec(family=f"gemv-{fmt}", params=(("k", width),))
            mod = build_or_load(spec, host_target(), lambda: {f"gemv_{fmt}": make_gemv(fmt, width)})
            return mod.module[f"gemv_{fmt}"]
        except Exception as exc:
            if self.backend == "tvm":
                raise
            log.warning("linear: TVM gemv kernels unavailable (%s: %s); using torch",
                        type(exc).__name__, exc)
            self.path = "torch"
            return None


def _rows(w: Weight, start: int) -> Weight:
    if isinstance(w, Int8Weight):
        return Int8Weight(data=w.data[start:], scale=w.scale[start:])
    return w[start:]


def _widened_product(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x @ w.T in torch: int8 widened to float32, bf16 in a bf16 GEMM."""
    if isinstance(w, Int8Weight):
        return F.linear(x, w.dequantize())
    return F.linear(x.to(torch.bfloat16), w).float()
