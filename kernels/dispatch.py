"""What the cache and the attention function call when the backend selects the kernels.

    quantize_pack_into(x, codec, pages, table, start)    the store's body append: quantize + pack into pages
    quantize_pack(x, spec)                               the same, not paged (returns a QTensor)
    fused_attention(query, view, attention_mask, scaling)   decode attention over a layer view, or None

The cache calls them only where `kvquant.backend.layer_paths` chose the kernels for a layer (decided once,
when the layer is built); they trust that choice and check only their own arguments. `fused_attention`
answers None for a call whose arguments it does not serve (a query of several tokens, a float mask, a codec
it cannot read), which tells `kvquant.attention` to use the PyTorch reference path. A variant that
cannot be built on the device (OutOfResources, a ptxas or compile error) is remembered by the
`KernelRegistry` passed in (or the view's `kernel_registry`, or a default one), logged once, and not tried
again. Kernels run where Triton can: CUDA tensors, or any tensor under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from kvquant.codecs.quantize import QTensor, quantize
from kvquant.codecs.transforms import kernel_frame
from kvquant.scheme import QuantSpec

from .decode_attention import decode_attention
from .layouts import decode_frame
from .quantize_pack import quantize_pack as _quantize_pack_kernel
from .quantize_pack import quantize_pack_into as _quantize_pack_into_kernel
from .registry import KernelRegistry

__all__ = ["quantize_pack", "quantize_pack_into", "fused_attention", "KernelRegistry"]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def quantize_pack(x: torch.Tensor, spec: QuantSpec, *, registry: KernelRegistry | None = None) -> QTensor:
    """x (B, H_kv, T, D) -> QTensor, bit for bit `kvquant.codecs.quantize.quantize(x, spec)` (which it
    calls where Triton cannot run: this one is not a cache path, so nothing decided it beforehand)."""
    if not _triton_runs_on(x.device):
        return quantize(x, spec)
    return _quantize_pack_kernel(x, spec, registry=registry)


def quantize_pack_into(x: torch.Tensor, codec, pages: Mapping[str, torch.Tensor], table: torch.Tensor,
                       start: int, *, registry: KernelRegistry | None = None) -> None:
    """Encode x (B, H_kv, t, D) with codec into the body pages at region tokens [start, start + t) of
    table (B, n_pages) int64 (see kvquant.kernels.quantize_pack.quantize_pack_into). Bit for bit
    `codec.encode(x)` written by index. Called where `kvquant.backend.layer_paths` chose it (x on a device
    Triton runs on, a codec with a kernel layout). A rotated codec (`-rot` around a codec with a kernel
    layout) is rotated here and packed by its inner codec's kernel."""
    frame = kernel_frame(codec, x.device)
    if frame is not None:  # a rotation around a kernel codec: rotate as codec.encode does, pack the inner's
        x, codec = frame.into(x, codec.dtype), frame.codec
    return _quantize_pack_into_kernel(x, codec, pages, table, start, registry=registry)


def fused_attention(query: torch.Tensor, view, attention_mask: torch.Tensor | None, scaling: float | None,
                    *, registry: KernelRegistry | None = None):
    """Attention of query (B, H_q, q, D) over a paged layer view; (B, q, H_q, D) or None.

    The view (kvquant.cache.LayerView) is read through: block_size, fp_k, fp_v, sink, body, recent
    (regions with .table, .offset, .length), key_codec, value_codec, key_pages, value_pages, shape
    (B, H_kv, T, D), and optionally kernel_registry.
    Served: decode (q == 1), fp16/bf16/fp32, head_dim a power of two >= 16, codecs that
    `kvquant.kernels.layouts.decode_frame` serves (a kernel layout, a codebook, or `-rot` around either),
    attention_mask None or bool (B or 1, 1, 1, >= T) with True = attend (transformers' sdpa_mask), any
    pattern; only its first T columns count. Anything else (float masks, other shapes, a variant that
    cannot be built here) returns None: the caller's reference path. The mask goes to the kernel as a
    view, never looked at here, so nothing syncs with the device.
    A sequence with no attended token gets zeros, as SDPA's math path gives.
    """
    if query.dim() != 4 or query.shape[2] != 1 or query.dtype not in _FLOAT:
        return None
    b, h_q, _, d = query.shape
    if d < 16 or d & (d - 1):
        return None
    if view.body is not None and view.body.length:
        for codec in (view.key_codec, view.value_codec):
            if decode_frame(codec, query.device) is None:
                return None
    kv_len = view.shape[2]
    key_mask = None
    if attention_mask is not None:
        m = attention_mask
        if m.dtype != torch.bool or m.dim() != 4 or m.shape[1] != 1 or m.shape[2] != 1:
            return None  # an additive float mask, or rows for q > 1
        if m.shape[0] not in (1, b) or m.shape[3] < kv_len:
            return None
        key_mask = m[:, 0, 0, :kv_len]  # (B or 1, T); a broadcast row is read with stride 0
    registry = registry or getattr(view, "kernel_registry", None)
    return decode_attention(
        query, view.fp_k, view.fp_v, view.key_pages, view.value_pages, view.key_codec, view.value_codec,
        view.sink, view.body, view.recent, scaling, key_mask, registry=registry,
    )
