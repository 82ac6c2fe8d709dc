"""Which path serves a call: the Triton kernels or the PyTorch reference. Nothing else decides it.

"auto"    the kernels on CUDA when triton is importable, else the reference
"triton"  the kernels always (on the CPU only under TRITON_INTERPRET=1; refused on the CPU without it)
"torch"   the reference always

A layer asks once, when it is built (`layer_paths`): which of its appends and decode steps the kernels
serve follows from the backend, the device, its two codecs and head_dim, none of which change afterwards.
The cache and `kvquant.attention` follow that answer; `kvquant.kernels.dispatch` trusts it (it keeps only
the checks of a call's own arguments: query shape and dtype, the mask's form).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if (
    TYPE_CHECKING
):  # this module stays importable without torch (CLIs check a backend name before heavy imports)
    import torch

__all__ = ["ATTN_IMPLEMENTATION", "BACKENDS", "KernelHandle", "LayerPaths", "check_backend",
           "kernel_fallback", "kernel_reads", "layer_paths", "uses_kernels"]

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "kvquant"  # the name kvquant's attention is registered under in transformers
BACKENDS = ("auto", "triton", "torch")


def check_backend(backend: str) -> str:
    """The backend name, or a ValueError listing the known ones."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    return backend


def uses_kernels(backend: str, device: torch.device) -> bool:
    """Whether the Triton kernels serve this backend on this device. "triton" on a device Triton cannot
    run on (the CPU without TRITON_INTERPRET=1) is refused, naming both ways out."""
    if check_backend(backend) == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(
                f"backend='triton' on {device.type}: Triton runs on CUDA devices, or on the CPU in its "
                "interpreter (set TRITON_INTERPRET=1 before triton is first imported); use backend='torch' "
                "or 'auto' for the PyTorch reference path"
            )
        return True
    return backend == "auto" and device.type == "cuda" and importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class LayerPaths:
    """The path a layer's calls take, decided once when the layer is built (`layer_paths`).

    encode: appends go through the Triton quantize+pack kernel (both codecs have its layout);
    attend: decode steps go to the fused decode kernel (it reads both codecs; head_dim a power of two >= 16);
    registry: the cache's `KernelRegistry` (variants that failed to build, levels on the device) when
        either is True, else None."""

    encode: bool = False
    attend: bool = False
    registry: object | None = None


REFERENCE = LayerPaths()


def layer_paths(backend: str, device: torch.device, key_codec, value_codec, head_dim: int,
                kernels: KernelHandle) -> LayerPaths:
    """Where this layer's appends and decode steps run. Logs once per cache what the kernels leave to the
    reference path for these codecs."""
    if not uses_kernels(backend, device):
        return REFERENCE
    from .codecs.transforms import kernel_frame

    codecs = (key_codec, value_codec)
    encode = all(kernel_frame(c, device) is not None for c in codecs)
    attend = head_dim >= 16 and not head_dim & (head_dim - 1)
    attend = attend and all(kernel_reads(c, device) for c in codecs)
    for codec in codecs:
        line = kernel_fallback(codec, device)  # names what the reference path serves, if any
        if line:
            kernels.note_once(line)
    if not (encode or attend):
        return REFERENCE
    return LayerPaths(encode=encode, attend=attend, registry=kernels.registry())


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
