"""Which path serves a call: the Triton kernels or the PyTorch reference. Nothing else decides it.

"auto"    the kernels on CUDA when triton is importable, else the reference
"triton"  the kernels always (on the CPU only under TRITON_INTERPRET=1; refused on the CPU without it)
"torch"   the reference always

A layer asks once, when it is built (`layer_paths`): which of its appends and decode steps the kernels
serve follows from the backend, the device, its two codecs and head_dim, none of which change afterwards.
A decode step of a layer whose steps the kernel serves asks once more, for what only the call knows
(`call_attends`: one query token in a float dtype the kernel computes in, a mask of the form it reads); a
prefill chunk or an additive float mask takes the reference. The cache and `kvquant.attention` follow
these answers; `kvquant.kernels.dispatch` trusts them: it checks its arguments against the same rules
(`attend_unserved`, `call_unserved`) and raises, naming the problem, where a caller did not ask first.
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

__all__ = ["ATTN_IMPLEMENTATION", "BACKENDS", "KernelHandle", "LayerPaths", "attend_unserved",
           "call_attends", "call_unserved", "check_backend", "kernel_fallback", "kernel_reads", "layer_paths",
           "triton_runs_on", "uses_kernels"]

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "kvquant"  # the name kvquant's attention is registered under in transformers
BACKENDS = ("auto", "triton", "torch")


def check_backend(backend: str) -> str:
    """The backend name, or a ValueError listing the known ones."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    return backend


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on this device: CUDA, or any device under TRITON_INTERPRET=1."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def uses_kernels(backend: str, device: torch.device) -> bool:
    """Whether the Triton kernels serve this backend on this device. "triton" on a device Triton cannot
    run on (the CPU without TRITON_INTERPRET=1) is refused, naming both ways out."""
    if check_backend(backend) == "triton":
        if not triton_runs_on(device):
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
    from .kernels.pack_layouts import pack_frame

    codecs = (key_codec, value_codec)
    encode = all(pack_frame(c, device) is not None for c in codecs)
    attend = attend_unserved(key_codec, value_codec, head_dim, device) is None
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


def attend_unserved(key_codec, value_codec, head_dim: int, device: torch.device) -> str | None:
    """What keeps the fused decode kernel from a layer's decode steps (its head_dim, or a codec it cannot
    read), or None when it serves them. `layer_paths` decides by it; the dispatch checks its calls by it."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    for side, codec in (("key", key_codec), ("value", value_codec)):
        if not kernel_reads(codec, device):
            return f"the decode kernel cannot read the {side} codec {codec}"
    return None


def call_unserved(query: torch.Tensor, attention_mask: torch.Tensor | None, kv_len: int) -> str | None:
    """What keeps the fused decode kernel from this call of a layer it serves, or None when it serves it:
    query (B, H_q, 1, D) in fp16/bf16/fp32 (one token: a decode step), attention_mask None or bool
    (B or 1, 1, 1, >= kv_len) with True = attend (transformers' sdpa_mask; an additive float mask, or rows
    for several queries, take the reference). Reads shapes and dtypes only: nothing syncs with the device."""
    import torch

    if query.dim() != 4 or query.shape[2] != 1:
        return f"query must be (B, H_q, 1, D), one token per sequence, got {tuple(query.shape)}"
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"query must be fp16, bf16 or fp32, got {query.dtype}"
    m = attention_mask
    if m is None:
        return None
    if m.dtype != torch.bool:
        return f"attention_mask must be bool (True = attend), got {m.dtype} (an additive mask)"
    if m.dim() != 4 or m.shape[1] != 1 or m.shape[2] != 1:
        return f"attention_mask must be (B or 1, 1, 1, >= T) for one query token, got {tuple(m.shape)}"
    if m.shape[0] not in (1, query.shape[0]) or m.shape[3] < kv_len:
        return (f"attention_mask {tuple(m.shape)} does not cover batch {query.shape[0]} and "
                f"{kv_len} stored tokens")
    return None


def call_attends(query: torch.Tensor, attention_mask: torch.Tensor | None, kv_len: int) -> bool:
    """Whether this call of a layer whose decode steps the kernel serves (`LayerPaths.attend`) goes to the
    fused kernel (`call_unserved` has nothing against it); else the reference path serves it."""
    return call_unserved(query, attention_mask, kv_len) is None


def kernel_fallback(codec, device: torch.device) -> str | None:
    """The line to log (once per cache) for a codec the kernels do not fully serve, naming it and what takes
    the reference path (attention, appends, or both); None when the kernels serve it all. Attention:
    `kvquant.kernels.layouts` (its line, when the decode kernel does not read the codec); appends:
    `kvquant.kernels.pack_layouts.pack_frame`."""
    from .kernels.layouts import decode_frame, describe_unserved
    from .kernels.pack_layouts import pack_frame

    reads, packs = decode_frame(codec, device) is not None, pack_frame(codec, device) is not None
    if reads and packs:
        return None
    if not reads and not packs:
        return describe_unserved(codec, device)
    if reads:
        return (f"{codec.spec}: decode attention runs in the Triton kernel; appends take the codec's PyTorch "
                "encoder (no quantize+pack kernel for it yet; the same bits)")
    return (f"{codec.spec}: appends are quantized and packed by the Triton kernel; no Triton kernel reads "
            "this codec yet, so the PyTorch reference path serves its attention")


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
