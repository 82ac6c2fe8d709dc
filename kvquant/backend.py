"""Which path serves a call: the Triton kernels or the PyTorch reference. Nothing else decides it.

"auto"    the kernels on CUDA when triton is importable, else the reference
"triton"  the kernels always (on the CPU only under TRITON_INTERPRET=1)
"torch"   the reference always
"""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

if (
    TYPE_CHECKING
):  # this module stays importable without torch (CLIs check a backend name before heavy imports)
    import torch

__all__ = ["ATTN_IMPLEMENTATION", "BACKENDS", "KernelHandle", "check_backend", "kernel_fallback",
           "kernel_reads", "uses_kernels"]

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "kvquant"  # the name kvquant's attention is registered under in transformers
BACKENDS = ("auto", "triton", "torch")


def check_backend(backend: str) -> str:
    """The backend name, or a ValueError listing the known ones."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    return backend


def uses_kernels(backend: str, device: torch.device) -> bool:
    """Whether the Triton kernels serve this backend on this device."""
    if check_backend(backend) == "triton":
        return True
    return backend == "auto" and device.type == "cuda" and importlib.util.find_spec("triton") is not None


def kernel_reads(codec, device: torch.device) -> bool:
    """Whether the Triton decode kernel reads this codec's pages (per layer: each layer asks for its own K and
    V codecs). `kvquant.kernels.layouts.decode_frame`; imports no triton."""
    from .kernels.layouts import decode_frame

    return decode_frame(codec, device) is not None


def kernel_fallback(codec, device: torch.device) -> str | None:
    """The line to log (once per cache) for a codec the kernels do not fully serve, naming it and what takes
    the reference path (attention and appends, or appends only); None when the kernels serve it all."""
    from .kernels.layouts import describe_unserved

    return describe_unserved(codec, device)


class KernelHandle:
    """One cache's access to the Triton kernels: `kvquant.kernels` is imported on first use only, and the
    cache's layers share one `KernelRegistry` (the variants that could not be built here, each logged
    once)."""

    def __init__(self) -> None:
        self._registry = None
        self._said: set[str] = set()

    def note_once(self, message: str) -> None:
        """Log a fallback (a codec no kernel serves) once per cache, however many layers meet it."""
        if message not in self._said:
            self._said.add(message)
            logger.info(message)

    def registry(self):
        if self._registry is None:
            from .kernels.registry import KernelRegistry  # lazy: `import kvquant` never imports triton

            self._registry = KernelRegistry("kvquant cache")
        return self._registry
