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

from .cache import LayerView, kernels_enabled

__all__ = ["ATTN_IMPLEMENTATION", "kvquant_attention", "register_attention", "use_kernels"]

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "kvquant"


def use_kernels(view: LayerView, query: torch.Tensor) -> bool:
    """Whether this call goes to the Triton kernels: forced by backend="triton", or "auto" on CUDA."""
    return kernels_enabled(view.backend, query.device)


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
        if use_kernels(key, query):
            from .kernels.dispatch import fused_attention  # lazy: `import kvquant` never imports triton

            out = fused_attention(query, key, attention_mask, scaling)
            if out is not None:
                return out, None
        key, value = key.keys(query.dtype), key.values(query.dtype)  # (B, H_kv, T, D)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def register_attention() -> None:
    """Register "kvquant" for attention and for mask creation (without the mask, padding would vanish)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvquant_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
