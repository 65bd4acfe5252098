"""How the engine's ops choose between TVM kernels and torch: one rule for all of them.

    auto   TVM kernels where they build; torch otherwise (said once, in a warning)
    tvm    TVM kernels, and a build failure raises (tests and benches that must measure them)
    torch  never TVM
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "tvm")


class KernelChoice:
    """Base of the ops that run TVM kernels (`linear.Linear`, `layer_ops.LayerOps`). `path`
    names what runs: `tvm_path` until a build fails, then "torch"."""

    def __init__(self, backend: str, tvm_path: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown kernel backend {backend!r}: 'auto', 'torch' or 'tvm'")
        self.backend = backend
        self.path = "torch" if backend == "torch" else tvm_path

    def unavailable(self, what: str, exc: Exception) -> None:
        """A kernel did not build: raise under "tvm", else switch to torch and say why."""
        if self.backend == "tvm":
            raise exc
        log.warning("%s: TVM kernels unavailable (%s: %s); using torch", what,
                    type(exc).__name__, exc)
        self.path = "torch"
