"""What the cache and the attention function call when the backend selects the kernels.

    quantize_pack(x, spec)                              Body.append: quantize + pack new tokens
    fused_attention(query, view, attention_mask, scaling)   attention over a LayerView, or None

Both fall back rather than fail when a kernel cannot serve a call: `quantize_pack` to the reference
quantizer (the same bits), `fused_attention` to None, which tells `kvquant.attention` to use the PyTorch
reference path. Kernels run where Triton can: CUDA tensors, or any tensor under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import weakref

import torch

from kvquant.quantize import QTensor, quantize
from kvquant.scheme import QuantSpec

from .decode_attention import decode_attention
from .quantize_pack import quantize_pack as _quantize_pack_kernel

__all__ = ["quantize_pack", "fused_attention", "decode_ranges"]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def quantize_pack(x: torch.Tensor, spec: QuantSpec) -> QTensor:
    """x (B, H_kv, T, D) -> QTensor, bit for bit `kvquant.quantize.quantize(x, spec)`."""
    if not _triton_runs_on(x.device):
        return quantize(x, spec)
    return _quantize_pack_kernel(x, spec)


# The mask of one forward pass is one tensor shared by every layer: remember the last one's ranges so
# the check below (which needs a device->host sync) runs once per step, not once per layer.
_last_mask: tuple[weakref.ref, int, int, tuple | None] | None = None


def decode_ranges(
    attention_mask: torch.Tensor | None, batch: int, kv_len: int
) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """A decode mask -> (kv_start, kv_end), each (B,) int32, or (None, None) when every token is attended.

    attention_mask: None, or bool (B or 1, 1, 1, >= kv_len) with True = attend (transformers' sdpa_mask);
    only its first kv_len columns count, as in transformers' SDPA path. Returns None when the mask is
    not one contiguous run of True per sequence (or not of this form): the kernels cannot serve it.
    """
    global _last_mask
    if attention_mask is None:
        return None, None
    m = attention_mask
    if m.dtype != torch.bool or m.dim() != 4 or m.shape[1] != 1 or m.shape[2] != 1:
        return None
    if m.shape[0] not in (1, batch) or m.shape[3] < kv_len:
        return None
    cached = _last_mask
    if cached is not None and cached[0]() is m and cached[1] == m._version and cached[2] == kv_len:
        ranges = cached[3]
    else:
        rows = m[:, 0, 0, :kv_len].expand(batch, kv_len)  # (B, T)
        pos = torch.arange(kv_len, device=m.device)
        start = rows.int().argmax(dim=1)
        end = kv_len - rows.flip(1).int().argmax(dim=1)
        run = (pos[None] >= start[:, None]) & (pos[None] < end[:, None]) & rows.any(dim=1, keepdim=True)
        if not torch.equal(run, rows):  # the one sync
            ranges = None
        elif bool(rows.all()):
            ranges = (None, None)
        else:
            ranges = (start.to(torch.int32), end.to(torch.int32))
        _last_mask = (weakref.ref(m), m._version, kv_len, ranges)
    return ranges


def fused_attention(query: torch.Tensor, view, attention_mask: torch.Tensor | None, scaling: float | None):
    """Attention of query (B, H_q, q, D) over a `kvquant.cache.LayerView`; (B, q, H_q, D) or None.

    Served: decode (q == 1), fp16/bf16/fp32, head_dim a power of two >= 16, masks that give each sequence
    one contiguous valid range (left padding). Anything else returns None (the caller's reference path).
    """
    if query.dim() != 4 or query.shape[2] != 1 or query.dtype not in _FLOAT:
        return None
    if not _triton_runs_on(query.device):
        return None
    b, h_q, _, d = query.shape
    if d < 16 or d & (d - 1):
        return None
    kv_len = view.shape[2]
    ranges = decode_ranges(attention_mask, b, kv_len)
    if ranges is None:
        return None
    return decode_attention(
        query, view.sink_k, view.sink_v, view.key_body, view.value_body, view.recent_k, view.recent_v,
        scaling, *ranges,
    )
