"""Attention over a quantized layer, registered with transformers' AttentionInterface.

`QuantizedLayer.update` returns a `LayerView` in place of K/V tensors. The function registered here
as "kvquant" reads that view as it is stored:
  - Triton kernels (kvquant.kernels) when the backend asks for them, or on CUDA with "auto";
  - otherwise the PyTorch reference: dequantize, then transformers' SDPA path (GQA, masks, causality).
Given plain tensors (a DynamicCache, or no cache) it is transformers' SDPA attention unchanged, so a
model can keep this implementation whatever cache it is handed.
"""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .backend import ATTN_IMPLEMENTATION, uses_kernels
from .cache import LayerView

__all__ = ["ATTN_IMPLEMENTATION", "kvquant_attention", "register_attention"]

logger = logging.getLogger(__name__)


def kvquant_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H_q, q, D)
    key: torch.Tensor | LayerView,
    value: torch.Tensor | LayerView,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Returns (attn_output (B, q, H_q, D), None), as transformers' attention functions do."""
    if isinstance(key, LayerView):
        if uses_kernels(key.backend, query.device):
            from .kernels.dispatch import fused_attention  # lazy: `import kvquant` never imports triton

            out = fused_attention(query, key, attention_mask, scaling, registry=key.kernel_registry)
            if out is not None:
                return out, None
        view = key
        key, value = view.keys(query.dtype), view.values(query.dtype)  # (B, H_kv, T, D)
        if view.fresh_k is not None and query.shape[2] > 1:
            key, value, attention_mask = _as_decoded(query, view, key, value, attention_mask)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def _as_decoded(
    query: torch.Tensor,  # (B, H_q, q, D)
    view: LayerView,
    key: torch.Tensor,  # (B, H_kv, T, D) as stored
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # bool (B or 1, 1, q, >= T), True = attend; None = causal
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V and mask under which each query of a chunk sees every key as the cache held it when that query
    would have been decoded one token at a time.

    The update before this call quantized the tokens [f0, f1) (view.fresh_*; absolute positions, the view's
    keys start at position view.start). Query p (an absolute position) would have seen key j < f1 quantized
    only if j < scheme.quantized_end(p + 1); a later
    query in the same chunk may see more of them quantized than an earlier one. So the keys of [f0, f1)
    appear twice, unquantized in place and quantized appended after the end, and the mask lets each
    query attend to exactly one of the two copies. Without this, a query would see its own near past
    quantized although a decoder keeps it in the FP window, and results would depend on the chunk size.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    start = view.start
    f0 = view.fresh_start
    f1 = f0 + view.fresh_k.shape[2]
    pos = torch.arange(kv_len - q_len, kv_len, device=query.device) + start  # (q,) absolute query positions
    scheme = view.scheme
    ends = quantized_ends(scheme, pos + 1)  # (q,)
    j = torch.arange(f0, f1, device=query.device)
    quantized = j[None, :] < ends[:, None]  # (q, n): query p sees key j quantized
    f0, f1 = f0 - start, f1 - start  # as indices into the view's keys
    if bool(quantized.all()):
        return key, value, attention_mask  # every query sees [f0, f1) as stored
    if attention_mask is None:
        allowed = torch.arange(kv_len, device=query.device)[None, :] + start <= pos[:, None]  # causal (q, T)
        allowed = allowed[None, None]  # (1, 1, q, T)
    else:
        allowed = attention_mask[..., :kv_len]
    in_place = allowed.clone()
    in_place[..., f0:f1] &= ~quantized
    appended = allowed[..., f0:f1] & quantized
    fp_key, fp_value = key.clone(), value.clone()
    fp_key[:, :, f0:f1] = view.fresh_k.to(key.dtype)
    fp_value[:, :, f0:f1] = view.fresh_v.to(value.dtype)
    key = torch.cat([fp_key, key[:, :, f0:f1]], dim=2)  # (B, H_kv, T + n, D)
    value = torch.cat([fp_value, value[:, :, f0:f1]], dim=2)
    return key, value, torch.cat([in_place, appended], dim=-1)


def quantized_ends(scheme, num_tokens: torch.Tensor) -> torch.Tensor:
    """`scheme.quantized_end(n)` for every n of an integer tensor, at once (the same formula)."""
    sink = num_tokens.clamp(max=scheme.sink)
    step = scheme.tokens_per_flush
    return sink + (num_tokens - sink - scheme.window).clamp(min=0) // step * step


def register_attention() -> None:
    """Register "kvquant" for attention and for mask creation (without the mask, padding would vanish)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvquant_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
