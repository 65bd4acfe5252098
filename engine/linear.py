"""How the engine stores a projection's weight and multiplies by it: float32, bfloat16,
int8 weight-only (one scale per output row), or the block quantization the checkpoint's
values already hold (lossless).

Batch-1 decode reads every weight once per token, so its speed limit is the machine's read
bandwidth divided by the bytes of the weights: half of them in bfloat16, a quarter in int8.
Activations, norms, attention and logits stay float32; only the products with the big
matrices read the smaller weights. The price is a logprob error against the float32 policy
the learner trains, which `bench/engine.py` reports (the learner's TIS correction takes
the rest, as it does for the int8 KV cache).

    float32   F.linear, exactly the checkpoint (the default)
    bfloat16  the weight rounded to bf16
    int8      per-row symmetric int8 (scale = max|row| / 127)
    lossless  a matrix whose float32 values are exactly a GGUF Q4_1 or Q8_0 block
              quantization (as `reinforge model import` writes them) kept in that form:
              4-bit or 8-bit levels, a step and an offset per block of 32; the products
              equal float32's up to summation order. Any other matrix (a trained version)
              stays float32.

Packed weights are multiplied by `Linear`: decode's few rows through TVM kernels that widen
each weight to fp32 in registers as it streams in (`kernels/tvm_gemv.py`), prefill's many
rows by a float32 GEMM in torch over the weight widened once (int8 and blocks: by a kernel)
or a bf16 GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from reinforge.engine.kernel_choice import KernelChoice

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "lossless")
BLOCK = 32
"""Weights per (step, offset) pair of a block format (GGUF's Q8_0 and Q4_1 blocks)."""


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


@dataclass(frozen=True)
class BlockWeight:
    """A weight [out, in] as integer levels q and, per block of BLOCK weights along a row, a
    step d and an offset m: w = d * q + m, exactly (d is an fp16 value, so d * q is).

    kind "q4": `data` uint8 [out, in / 2], two levels a byte (byte j of a block holds its
    element j in the low nibble and element j + 16 in the high one, GGUF's layout);
    kind "q8": `data` int8 [out, in]. `dm` float32 [out, in / BLOCK * 2]: d, m of each block.
    """

    kind: str
    data: torch.Tensor
    dm: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.dm.shape[1] // 2 * BLOCK))

    def numel(self) -> int:
        return self.shape.numel()

    def levels(self) -> torch.Tensor:
        """q as float32 [out, in]."""
        if self.kind == "q8":
            return self.data.float()
        out = self.data.shape[0]
        blocks = self.data.view(out, -1, BLOCK // 2)
        return torch.stack([blocks & 15, blocks >> 4], dim=-2).reshape(out, -1).float()

    def dequantize(self) -> torch.Tensor:
        out = self.data.shape[0]
        dm = self.dm.view(out, -1, 2)
        q = self.levels().view(out, -1, BLOCK)
        return (q * dm[..., :1] + dm[..., 1:]).view(out, -1)


Weight = torch.Tensor | Int8Weight | BlockWeight


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
    if fmt == "lossless":
        blocks = find_blocks(w)
        return w if blocks is None else blocks
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    data = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return Int8Weight(data=data, scale=scale.contiguous())


def find_blocks(w: torch.Tensor, kinds: tuple[str, ...] = ("q4", "q8")) -> BlockWeight | None:
    """`w` as a BlockWeight if its values are exactly one: Q4_1's ("q4": 16 levels up from
    the block's minimum, which quantizing hit at both ends) or Q8_0's ("q8": levels
    -127..127 around zero, the largest |w| at level ±127); None for anything else."""
    out, width = w.shape
    if width % BLOCK or not out:
        return None
    if out > 8:  # its first rows tell which kind to try, or that none fits (a trained matrix)
        head = find_blocks(w[:8], kinds)
        if head is None:
            return None
        kinds = (head.kind,)
    b = w.reshape(out, width // BLOCK, BLOCK)
    lo = b.amin(dim=-1, keepdim=True)
    if "q4" in kinds:
        found = _levels(b, lo, (b.amax(dim=-1, keepdim=True) - lo) / 15, 0, 15)
        if found is not None:
            q, dm = found
            q = q.to(torch.uint8).view(out, -1, 2, BLOCK // 2)
            return BlockWeight("q4", (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(out, -1), dm)
    if "q8" in kinds:
        zero = torch.zeros_like(lo)
        found = _levels(b, zero, b.abs().amax(dim=-1, keepdim=True) / 127, -127, 127)
        if found is not None:
            q, dm = found
            return BlockWeight("q8", q.to(torch.int8).reshape(out, width), dm)
    return None


def _levels(b: torch.Tensor, m: torch.Tensor, step: torch.Tensor, qmin: int,
            qmax: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Integer levels q in [qmin, qmax] and fp16 steps d with d * q + m == b exactly, per
    block (b [out, blocks, BLOCK]); d is `step` rounded to fp16 or one of its neighbours
    (the quantizer rounded its own step). None if a block has no such d."""
    d16 = step.to(torch.float16)
    neighbours = (d16, torch.nextafter(d16, torch.full_like(d16, torch.inf)),
                  torch.nextafter(d16, torch.full_like(d16, -torch.inf)))
    found = torch.zeros_like(m, dtype=torch.bool)
    d_found, q_found = torch.zeros_like(m), torch.zeros_like(b)
    for d in (n.float() for n in neighbours):
        q = torch.where(d > 0, (b - m) / d, 0.0).round_().clamp_(qmin, qmax)
        ok = ((q * d + m) == b).all(dim=-1, keepdim=True) & torch.isfinite(d)
        new = ok & ~found
        d_found, q_found = torch.where(new, d, d_found), torch.where(new, q, q_found)
        found |= ok
    if not bool(found.all()):
        return None
    dm = torch.cat([d_found, m], dim=-1).reshape(b.shape[0], -1).contiguous()
    return q_found, dm


def nbytes(w: Weight) -> int:
    """Bytes read per use: what the roofline of a decode step counts."""
    if isinstance(w, Int8Weight):
        return w.data.numel() + w.scale.numel() * 4
    if isinstance(w, BlockWeight):
        return w.data.numel() + w.dm.numel() * 4
    return w.numel() * w.element_size()


GEMV_MAX_ROWS = 16
"""Up to this many activation rows (decode steps) a product streams packed weights through
the TVM kernels in one pass."""
GEMV_CHUNKED_MAX_ROWS = 64
"""Up to this many rows (a wide decode batch) the kernels run once per GEMV_MAX_ROWS rows:
four passes over int8 weights read what one pass over float32 reads, and widening the
matrix every step (about 1.8x slower than float32 at 32 sequences) is avoided. More rows
(prefill) widen the weight once and multiply in torch."""


class Linear(KernelChoice):
    """x [N, in] float32 @ w.T (+ bias) -> [N, out] float32, whatever `w`'s format.

    float32 weights: torch (addmm fuses a residual add). Packed weights: the TVM kernels of
    `kernels/tvm_gemv.py` (compiled for this CPU per input width, cached on disk) for up to
    GEMV_MAX_ROWS rows, in chunks of that many up to GEMV_CHUNKED_MAX_ROWS; a torch GEMM
    otherwise (over the weight widened by the dequant kernel), and torch alone for every row
    count when the kernels cannot be built (`path` says which: "tvm-gemv" or "torch")."""

    def __init__(self, backend: str = "auto") -> None:
        super().__init__(backend, "tvm-gemv")
        self._modules: dict[tuple[str, int], Any] = {}
        self._ones: dict[int, torch.Tensor] = {}
        self._block = 1  # the kernel's rows per task, once one is built

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
        fmt = _kernel_format(w)
        out, width = w.shape
        rows = x.shape[0]
        if GEMV_MAX_ROWS < rows <= GEMV_CHUNKED_MAX_ROWS and self._kernel(fmt, width) is not None:
            return torch.cat([self._packed(x[i:i + GEMV_MAX_ROWS], w)
                              for i in range(0, rows, GEMV_MAX_ROWS)])
        kernel = self._kernel(fmt, width) if rows <= GEMV_MAX_ROWS else None
        main = out - out % self._block  # the kernel takes rows in blocks; torch the rest
        if kernel is None or not main:
            return self._widened_product(x, w)
        y = torch.empty((x.shape[0], main), dtype=torch.float32)
        x = x.contiguous()
        head = w if main == out else _rows(w, 0, main)  # slicing a weight per call costs time
        if isinstance(head, Int8Weight):
            kernel.gemv(x, head.data, head.scale, y)
        elif isinstance(head, BlockWeight):
            kernel.gemv(x, head.data, head.dm, y)
        else:
            if main not in self._ones:
                self._ones[main] = torch.ones(main)
            kernel.gemv(x, head.view(torch.uint16), self._ones[main], y)
        if main < out:  # e.g. a vocabulary of 3635 rows: the last 3 in torch
            tail = _rows(w, main)
            tail = tail.float() if isinstance(tail, torch.Tensor) else tail.dequantize()
            return torch.cat([y, F.linear(x, tail)], dim=1)
        return y

    def _widened_product(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """x @ w.T for many rows: int8 and block weights widened to a float32 matrix (by the
        dequant kernel in one pass when it is built: bit for bit torch's), bf16 in a bf16
        GEMM."""
        if isinstance(w, torch.Tensor):
            return F.linear(x.to(torch.bfloat16), w).float()
        kernel = self._kernel(_kernel_format(w), w.shape[1])
        if kernel is None:
            return F.linear(x, w.dequantize())
        full = torch.empty(w.shape, dtype=torch.float32)
        kernel.dequant(w.data, w.scale if isinstance(w, Int8Weight) else w.dm, full)
        return F.linear(x, full)

    def _kernel(self, fmt: str, width: int) -> Kernels | None:
        if self.path == "torch" or width % 16:  # tvm_gemv.VW: K in whole vectors (block
            # formats: in whole blocks, which find_blocks guarantees)
            return None
        key = (fmt, width)
        if key not in self._modules:
            self._modules[key] = self._build(fmt, width)
        return self._modules[key]

    def _build(self, fmt: str, width: int) -> Kernels | None:
        try:
            from reinforge.kernels.tvm_build import KernelSpec, build_or_load, host_target
            from reinforge.kernels.tvm_gemv import ROWS, make_dequant, make_gemv

            self._block = ROWS
            spec = KernelSpec(family=f"gemv-{fmt}", params=(("k", width),))

            def funcs() -> dict[str, Any]:
                made = {f"gemv_{fmt}": make_gemv(fmt, width)}
                if fmt != "bf16":  # bf16 prefill runs a bf16 GEMM instead
                    made[f"dequant_{fmt}"] = make_dequant(fmt, width)
                return made

            mod = build_or_load(spec, host_target(), funcs).module
            return Kernels(mod[f"gemv_{fmt}"], None if fmt == "bf16" else mod[f"dequant_{fmt}"])
        except Exception as exc:
            return self.unavailable("linear", exc)


class Kernels(NamedTuple):
    """The compiled functions of one weight format and input width."""

    gemv: Any
    dequant: Any  # None for bf16


def _kernel_format(w: Weight) -> str:
    if isinstance(w, Int8Weight):
        return "int8"
    if isinstance(w, BlockWeight):
        return "q4b" if w.kind == "q4" else "q8b"
    return "bf16"


def _rows(w: Weight, start: int, stop: int | None = None) -> Weight:
    """Output rows start:stop of `w`, in its format."""
    if isinstance(w, Int8Weight):
        return Int8Weight(data=w.data[start:stop], scale=w.scale[start:stop])
    if isinstance(w, BlockWeight):
        return BlockWeight(w.kind, w.data[start:stop], w.dm[start:stop])
    return w[start:stop]

