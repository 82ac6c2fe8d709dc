"""What the cache and the attention function call when the backend selects the kernels.

    quantize_pack(x, spec)                              Body.append: quantize + pack new tokens
    fused_attention(query, view, attention_mask, scaling)   attention over a LayerView, or None

Both fall back rather than fail when a kernel cannot serve a call: `quantize_pack` to the reference
quantizer (the same bits), `fused_attention` to None, which tells `kvquant.attention` to use the PyTorch
reference path. Kernels run where Triton can: CUDA tensors, or any tensor under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import torch

from kvquant.quantize import QTensor, quantize
from kvquant.scheme import QuantSpec

from .decode_attention import decode_attention
from .quantize_pack import quantize_pack as _quantize_pack_kernel

__all__ = ["quantize_pack", "fused_attention"]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def quantize_pack(x: torch.Tensor, spec: QuantSpec) -> QTensor:
    """x (B, H_kv, T, D) -> QTensor, bit for bit `kvquant.quantize.quantize(x, spec)`."""
    if not _triton_runs_on(x.device):
        return quantize(x, spec)
    return _quantize_pack_kernel(x, spec)


def fused_attention(query: torch.Tensor, view, attention_mask: torch.Tensor | None, scaling: float | None):
    """Attention of query (B, H_q, q, D) over a `kvquant.cache.LayerView`; (B, q, H_q, D) or None.

    Served: decode (q == 1), fp16/bf16/fp32, head_dim a power of two >= 16, attention_mask None or bool
    (B or 1, 1, 1, >= T) with True = attend (transformers' sdpa_mask), any pattern; only its first T
    columns count (a mask sized for a longer buffer). Anything else (float masks, other shapes) returns
    None (the caller's reference path). The mask goes to the kernel as a view, never looked at here, so
    nothing syncs with the device. A sequence with no attended token gets zeros, as SDPA's math path gives.
    """
    if query.dim() != 4 or query.shape[2] != 1 or query.dtype not in _FLOAT:
        return None
    if not _triton_runs_on(query.device):
        return None
    b, h_q, _, d = query.shape
    if d < 16 or d & (d - 1):
        return None
    kv_len = view.shape[2]
    key_mask = None
    if attention_mask is not None:
        m = attention_mask
        if m.dtype != torch.bool or m.dim() != 4 or m.shape[1] != 1 or m.shape[2] != 1:
            return None  # an additive float mask, or rows for q > 1
        if m.shape[0] not in (1, b) or m.shape[3] < kv_len:
            return None
        key_mask = m[:, 0, 0, :kv_len].expand(b, kv_len)  # (B, T); stride 0 along B for a broadcast mask
    return decode_attention(
        query, view.sink_k, view.sink_v, view.key_body, view.value_body, view.recent_k, view.recent_v,
        scaling, key_mask,
    )
