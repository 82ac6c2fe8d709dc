"""What the cache and the attention function call when the backend selects the kernels.

    quantize_pack_into(x, codec, pages, table, start)    the store's body append: quantize + pack into pages
    quantize_pack(x, spec)                               the same, not paged (returns a QTensor)
    fused_attention(query, view, attention_mask, scaling)   decode attention over a layer view

Nothing here chooses a path: `kvquant.backend` does (`layer_paths` once per layer: the codecs and head_dim;
`call_attends` per decode step: the query and the mask), and the cache and `kvquant.attention` call these
only where it chose the kernels. They check their own arguments by the backend's rules and raise, naming
the problem, for a call the kernel does not serve (a codec it cannot read, a query of several tokens, a
float mask): that is a caller that did not ask the backend first, never a silent fallback. What remains
a fallback is a variant that cannot be built on the device (OutOfResources, a ptxas or compile error) or
whose first-use self-check failed: remembered by the `KernelRegistry` passed in (or the view's
`kernel_registry`, or a default one), logged once, never tried again, and answered None (the reference
path). Kernels run where Triton can: CUDA tensors, or any tensor under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvquant.backend import attend_unserved, call_unserved, triton_runs_on
from kvquant.codecs.quantize import QTensor, quantize
from kvquant.scheme import QuantSpec

from .decode_attention import decode_attention
from .pack_layouts import pack_frame
from .quantize_pack import quantize_pack as _quantize_pack_kernel
from .quantize_pack import quantize_pack_into as _quantize_pack_into_kernel
from .registry import KernelRegistry

__all__ = ["quantize_pack", "quantize_pack_into", "fused_attention", "KernelRegistry"]


def quantize_pack(x: torch.Tensor, spec: QuantSpec, *, registry: KernelRegistry | None = None) -> QTensor:
    """x (B, H_kv, T, D) -> QTensor, bit for bit `kvquant.codecs.quantize.quantize(x, spec)` (which it
    calls where Triton cannot run, `kvquant.backend.triton_runs_on`: no cache path calls this one)."""
    if not triton_runs_on(x.device):
        return quantize(x, spec)
    return _quantize_pack_kernel(x, spec, registry=registry)


def quantize_pack_into(x: torch.Tensor, codec, pages: Mapping[str, torch.Tensor], table: torch.Tensor,
                       start: int, *, registry: KernelRegistry | None = None) -> None:
    """Encode x (B, H_kv, t, D) with codec into the body pages at region tokens [start, start + t) of
    table (B, n_pages) int64 (see kvquant.kernels.quantize_pack.quantize_pack_into). Bit for bit
    `codec.encode(x)` written by index. Called where `kvquant.backend.layer_paths` chose it (x on a device
    Triton runs on, a codec the pack kernels serve: `kvquant.kernels.pack_layouts.pack_frame`). A rotated
    codec (`-rot` around one) is rotated here and packed by its inner codec's kernel."""
    frame = pack_frame(codec, x.device)
    if frame is not None:  # a rotation around a packed codec: rotate as codec.encode does, pack the inner's
        x, codec = frame.into(x, codec.dtype), frame.codec
    return _quantize_pack_into_kernel(x, codec, pages, table, start, registry=registry)


def fused_attention(query: torch.Tensor, view, attention_mask: torch.Tensor | None, scaling: float | None,
                    *, registry: KernelRegistry | None = None) -> torch.Tensor | None:
    """Decode attention of query (B, H_q, 1, D) over a paged layer view: (B, 1, H_q, D), or None when the
    registry refuses this variant (it cannot be built on the device, or its self-check failed).

    Called where `kvquant.backend` chose the kernel: `layer_paths` (the view's codecs and head_dim) and
    `call_attends` (this call's query and mask). A call outside what they allow raises ValueError naming
    the problem (`kvquant.backend.attend_unserved` / `call_unserved`); the kernel's launcher checks the
    rest of the arguments (pool shapes, block tables, every tensor on the query's device).
    The view (kvquant.cache.LayerView) is read through: fp_k, fp_v, sink, body, recent (regions with
    .table, .offset, .length), key_codec, value_codec, key_pages, value_pages, shape (B, H_kv, T, D), and
    optionally kernel_registry. attention_mask: None or bool (B or 1, 1, 1, >= T), True = attend, any
    pattern; only its first T columns count. The mask goes to the kernel as a view, never looked at here,
    so nothing syncs with the device. A sequence with no attended token gets zeros, as SDPA's math path.
    """
    kv_len = view.shape[2]
    _check_served(query, view, attention_mask, kv_len)
    key_mask = None if attention_mask is None else attention_mask[:, 0, 0, :kv_len]  # (B or 1, T)
    registry = registry or getattr(view, "kernel_registry", None)
    return decode_attention(
        query, view.fp_k, view.fp_v, view.key_pages, view.value_pages, view.key_codec, view.value_codec,
        view.sink, view.body, view.recent, scaling, key_mask, registry=registry,
    )


def _check_served(query: torch.Tensor, view, attention_mask: torch.Tensor | None, kv_len: int) -> None:
    """Raise ValueError for a call the decode kernel does not serve (the backend would have sent it to the
    reference path): the problem, and where the decision lives."""
    problem = call_unserved(query, attention_mask, kv_len)
    if problem is None and query.dim() == 4:
        problem = attend_unserved(view.key_codec, view.value_codec, query.shape[3], query.device)
    if problem is not None:
        raise ValueError(
            f"fused_attention: {problem}. The kernel serves only the calls kvquant.backend chose for it "
            "(layer_paths per layer: codecs and head_dim; call_attends per call: query and mask); "
            "send this call to kvquant.attention.reference_attention instead"
        )
