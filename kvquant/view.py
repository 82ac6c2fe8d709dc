"""`LayerView`: one layer's stored K/V as kvquant's attention reads it (pool tensors and regions of page ids,
in position order), returned by a cache layer's `update` in place of K/V tensors (`kvquant.cache`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codecs.base import Codec, Field
from .paging import Region, gather_region
from .plan import LayerPlan
from .scheme import Scheme

__all__ = ["LayerView"]

_NOT_KVQUANT_ATTENTION = (
    "a QuantizedCache layer reached an attention implementation that is not kvquant's; load the model "
    "with kvquant.load_model(), or call model.set_attn_implementation(kvquant.ATTN_IMPLEMENTATION)"
)


@dataclass(frozen=True)
class LayerView:
    """One layer's stored K/V as attention reads it: regions sink | body | recent, in position order.

    fp_k, fp_v: FP pool tensors (P, H_kv, fp_block_size, D); `sink` and `recent` index them.
    block_size: tokens per body page (FP pages may hold fewer: `kvquant.plan.LayerPlan`).
    key_pages / value_pages: the body pool's fields per codec {name: (P, heads_f, block_size // tokens_f,
    cols_f)}; `body` indexes both (K and V of a token share a page id).
    shape: (B, H_kv, T, D) of the tokens in the view; `start` is the position of the first one (non-zero only
    on sliding-window layers, which release what the model can no longer attend to), so token i sits at
    position start + i. When an eviction policy released positions after a sink
    (`FullLayer.evict_before`), the sink's tokens are numbered as if they sat just before the first token
    held after them.

    fresh_k/v (B, H_kv, n, D): the unquantized K/V of the n body tokens encoded by the update that made this
    view (positions fresh_start ..), or None. They are never stored: the view lives for one forward, so that
    the queries of a multi-token chunk see those tokens as the cache held them when each query would have
    been decoded (`kvquant.attention`), whatever the chunk size.
    """

    block_size: int
    fp_k: torch.Tensor
    fp_v: torch.Tensor
    sink: Region
    body: Region
    recent: Region
    key_codec: Codec
    value_codec: Codec
    key_pages: dict[str, torch.Tensor]
    value_pages: dict[str, torch.Tensor]
    scheme: Scheme
    backend: str
    shape: torch.Size
    start: int = 0
    fresh_k: torch.Tensor | None = None
    fresh_v: torch.Tensor | None = None
    fresh_start: int = 0
    kernel_registry: object | None = None  # KernelRegistry when LayerPaths.attend (kvquant.backend)
    plan: LayerPlan | None = None  # the layer's storage rule (which keys a query of a chunk saw quantized)
    salient: object | None = None  # kvquant.salient.SalientState of a salient=N/G layer (attention calls it)

    # An attention implementation other than kvquant's gets a LayerView where it expects a tensor; when
    # the cache had no config to check up front, fail with what to do rather than a bare TypeError.
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(_NOT_KVQUANT_ATTENTION)

    def __getitem__(self, index):
        raise TypeError(_NOT_KVQUANT_ATTENTION)

    def _materialize(self, fp: torch.Tensor, codec: Codec, pages: dict, dtype: torch.dtype) -> torch.Tensor:
        fp_field = {"x": Field(fp.shape[1], 1, fp.shape[3], fp.dtype)}
        parts = []
        if self.sink.length:
            parts.append(gather_region({"x": fp}, fp_field, self.sink)["x"].to(dtype))
        if self.body.length:
            # decode_at: a position-dependent codec (pre-RoPE keys) re-applies RoPE at the tokens' positions
            parts.append(
                codec.decode_at(gather_region(pages, codec.fields(), self.body), self.body.start, dtype)
            )
        if self.recent.length:
            parts.append(gather_region({"x": fp}, fp_field, self.recent)["x"].to(dtype))
        if not parts:
            return fp.new_zeros((self.shape[0], self.shape[1], 0, self.shape[3]), dtype=dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def keys(self, dtype: torch.dtype) -> torch.Tensor:
        """All keys of the view decoded, (B, H_kv, T, D): the reference path."""
        return self._materialize(self.fp_k, self.key_codec, self.key_pages, dtype)

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """All values of the view decoded, (B, H_kv, T, D): the reference path."""
        return self._materialize(self.fp_v, self.value_codec, self.value_pages, dtype)


@dataclass
class _Stored:
    """A layer's parts gathered into contiguous tensors, for tests and inspection (never on a hot path)."""

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    key_fields: dict[str, torch.Tensor]
    value_fields: dict[str, torch.Tensor]
    recent_k: torch.Tensor
    recent_v: torch.Tensor

