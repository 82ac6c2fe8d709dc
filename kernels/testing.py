"""Kernel checks for tests and benchmarks: random decode queries and the decode kernel against its `_ref`
twin within the flash-attention bound, over the stand-in paged layers of `kvquant.kernels.paged` (whose
names this module re-exports: tests build layers from here)."""

from __future__ import annotations

import torch

from .paged import PagedLayer, Region, demo_levels, make_paged_layer, with_demo_levels

__all__ = ["DECODE_ATOL", "PagedLayer", "Region", "check_decode", "demo_levels", "make_paged_layer",
           "random_query", "with_demo_levels"]

# tolerance added to the flash-attention bound |out - ref32| <= 2 |ref_same_dtype - ref32| + atol
DECODE_ATOL = {torch.float16: 2e-4, torch.bfloat16: 2e-3, torch.float32: 2e-5}


def random_query(layer: PagedLayer, gqa: int, dtype, device, seed: int = 7) -> torch.Tensor:
    """(B, H_kv * gqa, 1, D) decode queries for a paged test layer."""
    b, h_kv, _, d = layer.shape
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h_kv * gqa, 1, d, generator=g).to(dtype).to(device)


def check_decode(layer: PagedLayer, q: torch.Tensor, dtype, **kw) -> None:
    """The decode kernel over `layer` against its `_ref` twin, within the flash-attention bound."""
    from .decode_attention import decode_attention, decode_attention_ref

    args = layer.decode_args()
    out = decode_attention(q, *args, **kw)
    kw.pop("num_splits", None)
    ref32 = decode_attention_ref(q, *args, upcast=True, **kw)
    ref = decode_attention_ref(q, *args, **kw)
    assert out is not None and out.shape == ref32.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref32).abs().max().item()
    bound = 2 * (ref.float() - ref32).abs().max().item() + DECODE_ATOL[dtype]
    assert err <= bound, f"error {err:.3g} > bound {bound:.3g}"
