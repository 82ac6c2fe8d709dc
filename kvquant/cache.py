"""A quantized KV cache for Hugging Face transformers, stored in pages: one layer object per decoder layer,
of the class that matches what the layer stores (as transformers' cache_utils and vLLM's
`FullAttentionManager` / `SlidingWindowManager` separate them):

    FullLayer      a full-attention layer: sink | body | recent window, every position kept (an eviction
                   policy such as `sliding:W` may release positions after the sink: `evict_before`); prefixes
                   are shared across requests (`adopt_prefix`)
    SlidingLayer   a sliding-window layer (a model config's `layer_types`): no sink (the model's mask never
                   lets a query see a key behind its window), and the pages behind the window are released

Both share `QuantizedLayer` (`QuantizedLayer(scheme, sliding_window=...)` makes the right one). A layer's
tokens sit in position order as three regions of pages, kept by the store (`kvquant.paging.regions`):

    sink    the first `scheme.sink` tokens, unquantized               FP pages (P, H_kv, fp_block_size, D)
    body    encoded once by the spec's codec (packed codes, scales)   codec pages, K and V under one page id
    recent  the last tokens, unquantized: at least `scheme.window`,   FP pages (the same pool as the sink)
            plus any tokens whose token group is not complete yet

Tokens move from the window to the body in multiples of `scheme.tokens_per_flush` once more than `window`
tokens wait (`_BodyWriter`); nothing is ever requantized, and nothing decoded is written back. Appending
costs the same at any length: only the current page of each region is written. Every layer stores in a
`kvquant.paging.KVStore`: a shared one (prefix caching, a byte budget) or, without `store=`, a private store
with one holder, so there is one code path.

`update` returns a `LayerView` (`kvquant.view`): the pool tensors and block tables as stored, which
kvquant's attention function (`kvquant.attention`) reads: Triton kernels that walk the pages, or the
PyTorch reference (gather, decode, SDPA).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import quirks
from .backend import ATTN_IMPLEMENTATION, KernelHandle, LayerPaths, check_backend, layer_paths
from .codecs.base import Codec, Field
from .memory import KVShape
from .paging import BlockTable, KVStore, LayerTables, PagePool, Region, gather_region
from .plan import LayerPlan
from .salient import SalientState
from .scheme import Scheme, parse_scheme
from .view import LayerView, _Stored

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FullLayer",
    "LayerView",
    "QuantizedCache",
    "QuantizedLayer",
    "SlidingLayer",
]

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16  # tokens per page, as vLLM

_MATERIALIZE_COST = (
    "QuantizedLayer.keys / .values (and iterating a QuantizedCache) decode a whole layer from its pages into "
    "a new (B, H_kv, T, D) tensor on every access: full-precision memory and a decode per call. kvquant's "
    "attention never needs them; read them to inspect a cache, not inside a generation loop"
)


class _BodyWriter:
    """Moves the token groups that have left the window into the body, encoding them once: with the codecs
    (one call over K and V when they batch), or the Triton quantize+pack kernel where it serves both."""

    def __init__(self, plan: LayerPlan, paths: LayerPaths):
        self.plan = plan
        self.key_codec, self.value_codec = plan.key_codec, plan.value_codec
        self._encode = _kernel_encoder(paths)

    def flush(
        self, t: LayerTables, p1: int, q0: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Encode what leaves the window once the layer holds p1 tokens. k, v (B, H, n, D) hold positions
        q0 .. p1 - 1. Returns the FP K/V just encoded and their first position, or None."""
        body_end = t.body_end
        n = self.plan.quantized_end(p1) - body_end
        if n <= 0:
            return None
        if body_end < t.dropped:  # a sliding layer released them before they left the window: skip
            skip = min(n, t.dropped - body_end)
            t.body_len, body_end, n = t.body_len + skip, body_end + skip, n - skip
            if n <= 0:
                return None
        old = min(body_end + n, q0) - body_end  # of the n, those already in the recent pages
        fk, fv = k[:, :, : n - old], v[:, :, : n - old]
        if old > 0:
            held = t.read_window(body_end, old)  # (B, H, old, D) each
            fk, fv = torch.cat([held["k"], fk], dim=2), torch.cat([held["v"], fv], dim=2)
        self._append(t, fk, fv)
        return fk, fv, body_end

    def _append(self, t: LayerTables, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode k, v (B, H, n, D) into body pages at body tokens [body_len, body_len + n)."""
        start = t.body_len
        table, offset = t.body_slot(k.shape[2])
        kc, vc = self.key_codec, self.value_codec
        if self._encode is not None:  # the kernel encoder (it rotates `-rot` tokens as codec.encode does)
            for prefix, codec, x in (("k.", kc, k), ("v.", vc, v)):
                pages = {name: t.body_pool.tensors[prefix + name] for name in codec.fields()}
                self._encode(x, codec, pages, table, offset)
        else:
            t.body_pool.write(table, offset, _encode_pair(kc, vc, k, v, t.sink + start))
        t.body_len += k.shape[2]


class _BeamOps:
    """transformers' batch and beam operations: block tables are permuted and pages shared by reference
    count, never copied."""

    def _select_rows(self, indices: list[int]) -> None:
        if self.is_initialized:
            self.tables.select(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows([i for i in range(self.batch_size) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.batch_size)[torch.as_tensor(indices).cpu()].tolist())


class _Inspect:
    """What a layer holds, for code that reads it as transformers' DynamicLayer, tests and reports; none of
    it is on a hot path."""

    # ---- materialised K/V

    @property
    def keys(self) -> torch.Tensor | None:
        """Every key the layer holds, decoded from its pages: (B, H_kv, T, D) in the model's dtype, None
        before the first update. A new copy on every access (kvquant's attention reads the pages as stored
        and never needs it); on a sliding-window layer T counts the tokens still held."""
        return self._materialized("keys")

    @keys.setter
    def keys(self, value) -> None:
        self._refuse_write("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """Every value the layer holds, decoded: (B, H_kv, T, D), as `keys`."""
        return self._materialized("values")

    @values.setter
    def values(self, value) -> None:
        self._refuse_write("values", value)

    def _materialized(self, which: str) -> torch.Tensor | None:
        if not self.is_initialized:
            return None
        said = self.kernels._said  # one warning per cache: its layers share the handle
        if _MATERIALIZE_COST not in said:
            said.add(_MATERIALIZE_COST)
            logger.warning(_MATERIALIZE_COST)
        view = self.view()
        return view.keys(self.dtype) if which == "keys" else view.values(self.dtype)

    @staticmethod
    def _refuse_write(which: str, value) -> None:
        if value is not None:  # transformers' CacheLayerMixin.__init__ writes None; nothing else may write
            raise AttributeError(
                f"QuantizedLayer.{which} is decoded from the layer's pages and cannot be assigned; append "
                "with update(), remove with crop() or reset()"
            )

    def stored(self) -> _Stored:
        """The stored parts as contiguous tensors (a copy): FP sink, codec fields of the body, FP recent."""
        view = self.view()
        fp = {"x": Field(self.num_heads, 1, self.head_dim, self.dtype)}

        def fp_part(pool: torch.Tensor, region: Region) -> torch.Tensor:
            return gather_region({"x": pool}, fp, region)["x"]

        return _Stored(
            sink_k=fp_part(view.fp_k, view.sink),
            sink_v=fp_part(view.fp_v, view.sink),
            key_fields=gather_region(view.key_pages, self.key_codec.fields(), view.body),
            value_fields=gather_region(view.value_pages, self.value_codec.fields(), view.body),
            recent_k=fp_part(view.fp_k, view.recent),
            recent_v=fp_part(view.fp_v, view.recent),
        )

    # ---- counts (0 before the first update)

    @property
    def length(self) -> int:
        """Tokens per sequence seen (positions 0 .. length - 1)."""
        return self.tables.length if self.is_initialized else 0

    @property
    def body_len(self) -> int:
        """Tokens encoded into the body (positions sink .. sink + body_len - 1)."""
        return self.tables.body_len if self.is_initialized else 0

    @property
    def dropped(self) -> int:
        """Positions below this are released (a sliding layer, or an eviction policy after the sink)."""
        return self.tables.dropped if self.is_initialized else 0

    @property
    def batch_size(self) -> int:
        return self.tables.batch if self.is_initialized else 0

    @property
    def sink_len(self) -> int:
        return min(self.scheme.sink, self.length)

    @property
    def recent_len(self) -> int:
        return self.tables.recent_len if self.is_initialized else 0

    # ---- bytes and invariants

    def nbytes(self) -> int:
        """Bytes of the pages this layer's sequences hold (a partly filled page counts in full; a page
        shared by several sequences once)."""
        return self.tables.nbytes() if self.is_initialized else 0

    def reserved_bytes(self) -> int:
        """Bytes the layer's pools have preallocated, used or not."""
        if not self.is_initialized:
            return 0
        return self.tables.fp_pool.reserved_bytes + self.tables.body_pool.reserved_bytes

    def check(self) -> None:
        """Verify the pools' reference counts and free lists (`kvquant.paging.StoreError` if broken)."""
        if self.is_initialized:
            self.tables.fp_pool.check()
            self.tables.body_pool.check()

    # ---- the store's objects, for tests and inspection (kvquant's modules use `tables`' methods)

    @property
    def fp_pool(self) -> PagePool:
        return self.tables.fp_pool

    @property
    def body_pool(self) -> PagePool:
        return self.tables.body_pool

    @property
    def sink_t(self) -> BlockTable:
        return self.tables.sink_t

    @property
    def body_t(self) -> BlockTable:
        return self.tables.body_t

    @property
    def recent_t(self) -> BlockTable:
        return self.tables.recent_t


class QuantizedLayer(_BeamOps, _Inspect, CacheLayerMixin):
    """One decoder layer's K/V in pages: sink (FP) | body (codec fields) | recent window (FP). The base of
    `FullLayer` and `SlidingLayer`; `QuantizedLayer(...)` makes the one `sliding_window` asks for.

    Args:
        scheme: the layer's scheme (a string is parsed).
        backend: "auto", "triton" or "torch" (`kvquant.backend`).
        block_size: tokens per page; raised to a multiple of every codec's token group (channel-wise specs).
        sliding_window: the model's window on a sliding-window layer (keys older than it are released), else
            None.
        capacity: tokens per sequence to preallocate codec pages for; FP pages are sized by what the sink and
            window can hold. Pools grow in bounded steps (1/32) beyond that, never doubling.
        store, layer_idx: take this layer's pools from a shared `kvquant.paging.KVStore` (several caches then
            share pages: prefixes, `kvquant.serving.prefix`); without one, a private store of its own.
    """

    is_compileable = False
    is_croppable = True

    def __new__(cls, *args, sliding_window: int | None = None, **kwargs):
        if cls is QuantizedLayer:
            cls = FullLayer if sliding_window is None else SlidingLayer
            if sliding_window is None and _salient(args, kwargs):
                cls = SalientLayer
        return super().__new__(cls)

    def __init__(
        self,
        scheme: Scheme | str,
        backend: str = "auto",
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        sliding_window: int | None = None,
        capacity: int = 256,
        store: KVStore | None = None,
        layer_idx: int | None = None,
        calib=None,
        rope=None,
        kernels: KernelHandle | None = None,
    ):
        super().__init__()
        scheme = parse_scheme(scheme)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if scheme.layers:
            raise ValueError("a layer takes its own uniform scheme: pass scheme.for_layer(layer_idx)")
        on_shared = store is not None and store.shared
        if on_shared and (layer_idx is None or not 0 <= layer_idx < len(store.layers)):
            raise ValueError(
                f"a layer on a shared store needs its layer_idx in [0, {len(store.layers)}), "
                f"got {layer_idx!r}"
            )
        self.scheme = scheme
        self.backend = check_backend(backend)
        self.requested_block_size = block_size
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.capacity = capacity
        self.store = store if store is not None else KVStore.private()
        self.layer_idx = layer_idx
        self.calib, self.rope = calib, rope  # codebooks (nuqN) and the model's RoPE (-prerope keys)
        self.kernels = kernels or KernelHandle()  # the cache's (shared by its layers), or the layer's own
        self.is_initialized = False

    # ---- set-up

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self._init_storage(b, h, d, key_states.dtype, key_states.device)

    def _init_storage(self, b: int, h: int, d: int, dtype: torch.dtype, device: torch.device) -> None:
        self.device, self.dtype = device, dtype
        self.num_heads, self.head_dim = h, d
        self.plan = LayerPlan.build(
            self.scheme,
            heads=h,
            head_dim=d,
            dtype=dtype,
            block_size=self.requested_block_size,
            sliding_window=self.sliding_window,
            layer=self.layer_idx,
            calib=self.calib,
            rope=self.rope,
        )
        self.key_codec, self.value_codec = self.plan.key_codec, self.plan.value_codec
        self.block_size = self.plan.block_size
        self.tables = self.store.tables_for(
            self.layer_idx, self.plan, b, capacity=self.capacity, dtype=dtype, device=device
        )
        # the one backend decision for this layer (kvquant.backend): appends and decode steps follow it
        self.paths = layer_paths(self.backend, self.device, self.key_codec, self.value_codec, d, self.kernels)
        self._writer = _BodyWriter(self.plan, self.paths)
        self.is_initialized = True

    # ---- transformers' CacheLayerMixin interface

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[LayerView, LayerView]:
        """Append new K/V (B, H_kv, t, D); return a view of everything stored (for K and for V)."""
        _check_states(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            self._check_same_shape(key_states)
        view_start = self.tables.dropped
        fresh = self._append(key_states, value_states)
        view = self.view(view_start, fresh)
        self._after_update()
        return view, view

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Write new K/V into sink, body (what leaves the window) and window; the FP K/V just encoded."""
        t = self.tables
        sink, p0 = t.sink, t.length
        p1 = p0 + k.shape[2]
        if p0 < sink:
            n = min(sink - p0, k.shape[2])
            t.write_sink(p0, k[:, :, :n], v[:, :, :n])
            k, v = k[:, :, n:], v[:, :, n:]
        q0 = p1 - k.shape[2]  # position of k[:, :, 0]
        fresh = self._writer.flush(t, p1, q0, k, v)
        # pages holding only encoded tokens go first, so the window never holds more than the plan's bound
        t.release_encoded_window()
        w0 = max(q0, t.body_end)
        if w0 < p1:
            t.write_window(w0, k[:, :, w0 - q0 :], v[:, :, w0 - q0 :])
        t.length = p1
        return fresh

    def _after_update(self) -> None:
        """What the layer releases once a forward's view is made (a sliding layer: what fell behind)."""

    def view(
        self, start: int | None = None, fresh: tuple[torch.Tensor, torch.Tensor, int] | None = None
    ) -> LayerView:
        """What is stored from position `start` (default: the first position held) as a LayerView."""
        t = self.tables
        start = t.dropped if start is None else start
        sink_region, body_region, recent_region, view_start = t.regions(start)
        kv_len = sink_region.length + body_region.length + recent_region.length
        fresh_k = fresh_v = None
        fresh_start = 0
        if fresh is not None:
            fk, fv, f0 = fresh
            cut = max(start - f0, 0)  # tokens a sliding layer no longer holds
            if cut < fk.shape[2]:
                fresh_k, fresh_v, fresh_start = fk[:, :, cut:], fv[:, :, cut:], f0 + cut
        return LayerView(
            block_size=self.block_size,
            fp_k=t.fp_pool.tensors["k"],
            fp_v=t.fp_pool.tensors["v"],
            sink=sink_region,
            body=body_region,
            recent=recent_region,
            key_codec=self.key_codec,
            value_codec=self.value_codec,
            key_pages={n: t.body_pool.tensors["k." + n] for n in self.key_codec.fields()},
            value_pages={n: t.body_pool.tensors["v." + n] for n in self.value_codec.fields()},
            scheme=self.scheme,
            backend=self.backend,
            shape=torch.Size((self.batch_size, self.num_heads, kv_len, self.head_dim)),
            start=view_start,
            fresh_k=fresh_k,
            fresh_v=fresh_v,
            fresh_start=fresh_start,
            kernel_registry=self.paths.registry if self.paths.attend else None,
            plan=self.plan,
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next forward: the view starts at the first position still held."""
        if not self.is_initialized:
            return query_length, 0
        return self.tables.mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.is_initialized:
            self.tables.clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last |tokens_to_remove| tokens (a negative number, as transformers' DynamicLayer)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as transformers does"
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        group = max(self.key_codec.token_group, self.value_codec.token_group)
        self.tables.crop(max(self.length + tokens_to_remove, 0), group)

    def offload(self):  # the pages stay where they are
        return None

    def prefetch(self):
        return None

    # ---- kvquant's own

    def evict_before(self, position: int) -> int:
        """Release the pages holding only positions in [sink, position) (an eviction policy such as
        `sliding:W`); pages released. Only full-attention layers release this way."""
        return 0

    def adopt_prefix(self, length: int, sink_pages, body_pages, recent_first: int, recent_pages) -> None:
        raise ValueError("prefixes are not shared across sliding-window layers (they release pages)")

    def _check_same_shape(self, k: torch.Tensor) -> None:
        b, h, _, d = k.shape
        if b != self.batch_size:
            raise ValueError(
                f"the batch size changed from {self.batch_size} to {b} without batch_select_indices / "
                "reorder_cache: pass a new cache (or call cache.reset()) for a new batch"
            )
        if (h, d) != (self.num_heads, self.head_dim):
            raise ValueError(
                f"this layer stores {self.num_heads} KV heads of head_dim {self.head_dim}, but got K of "
                f"shape {tuple(k.shape)}; one cache serves one model"
            )
        if k.dtype != self.dtype or k.device != self.device:
            raise ValueError(
                f"this layer stores {self.dtype} on {self.device}, got {k.dtype} on {k.device}; "
                "keep the model's dtype and device fixed for one cache"
            )

class FullLayer(QuantizedLayer):
    """A full-attention layer: sink | body | window, every position kept. A shared store's full layers take
    cached prefixes (`adopt_prefix`), and an eviction policy may release positions after the sink
    (`evict_before`)."""

    def __init__(self, scheme: Scheme | str, backend: str = "auto", *, sliding_window: None = None, **kwargs):
        if sliding_window is not None:
            raise ValueError(
                f"FullLayer is a full-attention layer; a layer with a window of {sliding_window} tokens is "
                "a SlidingLayer"
            )
        super().__init__(scheme, backend, **kwargs)

    def evict_before(self, position: int) -> int:
        """Release the pages that hold only positions in [sink, position): later forwards attend to the sink
        and the tokens from `dropped` on. Positions are kept (no re-rotation); the sink pages stay. Returns
        the pages released (over the batch)."""
        return self.tables.evict_before(position) if self.is_initialized else 0

    def adopt_prefix(
        self,
        length: int,
        sink_pages: list[int],
        body_pages: list[int],
        recent_first: int,
        recent_pages: list[int],
    ) -> None:
        """Start this empty one-sequence layer (on a shared store) at `length` tokens whose pages are shared:
        the state decode-exact decoding would reach after `length` tokens, so the next forward computes
        exactly what it would have (`kvquant.paging.regions.LayerTables.adopt`)."""
        if not self.store.shared:
            raise ValueError("adopt_prefix needs a layer on a shared KVStore (QuantizedCache(.., store=..))")
        if self.is_initialized and (self.length or self.batch_size != 1):
            raise ValueError(
                f"adopt_prefix needs an empty one-sequence layer; this one holds {self.length} "
                f"tokens of {self.batch_size} sequences"
            )
        shape = self.store.shape
        if not self.is_initialized:
            device = self.store.devices[self.layer_idx]
            self._init_storage(1, shape.num_kv_heads, shape.head_dim, self.store.dtype, device)
        self.tables.adopt(length, sink_pages, body_pages, recent_first, recent_pages)


class SalientLayer(FullLayer):
    """A full-attention layer whose scheme has salient=N/G (`kvquant.salient`): a `FullLayer` whose
    `SalientState` keeps the window's attention statistics and, once a forward's queries are counted, stores
    each flushed group's salient tokens beside the body (attention calls it through the view).
    `QuantizedLayer(...)` makes one for such a scheme."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp_prefill = False  # kvquant.salient.fp_prefill: this forward reads the prompt unquantized

    def _init_storage(self, b: int, h: int, d: int, dtype: torch.dtype, device: torch.device) -> None:
        super()._init_storage(b, h, d, dtype, device)
        self.salient = SalientState(self.plan, self.tables)

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        state, first = self.salient, self.tables.length
        state.fp_prefill = self.fp_prefill
        state.before_append(k.shape[2])
        fresh = super()._append(k, v)
        state.after_append(first, k, fresh)
        return fresh

    def view(self, start=None, fresh=None) -> LayerView:
        return dataclasses.replace(super().view(start, fresh), salient=self.salient)

    def reset(self) -> None:
        if self.is_initialized:
            self.salient.pending = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.length:
            raise ValueError(
                f"crop is not supported with salient={self.scheme.salient}: the window's attention "
                "statistics include the shares of the queries it would remove; start a new cache instead"
            )
        super().crop(tokens_to_remove)

    def _select_rows(self, indices: list[int]) -> None:
        if self.is_initialized:
            self.salient.resolve()  # choose before the rows are permuted (beams then share the pages)
        super()._select_rows(indices)

    def _materialized(self, which: str) -> torch.Tensor | None:
        """`keys` / `values`: decoded from the pages with the salient rows in place."""
        if not self.is_initialized:
            return None
        self.salient.resolve()
        view = self.view()
        fp = view.fp_k if which == "keys" else view.fp_v
        parts = [gather_region({"x": fp}, {"x": Field(self.num_heads, 1, self.head_dim, fp.dtype)}, r)["x"]
                 for r in (view.sink, view.recent)]
        if view.body.length:
            codec, pages = (view.key_codec, view.key_pages) if which == "keys" else (
                view.value_codec, view.value_pages)
            body = codec.decode_pages(pages, view.body, self.dtype)
            k, v = self.salient.patch(view.body, body.clone(), body.clone(), None, None)
            parts.insert(1, k if which == "keys" else v)
        return torch.cat([p.to(self.dtype) for p in parts], dim=2)


class SlidingLayer(QuantizedLayer):
    """A sliding-window layer: keeps only the pages its next query can attend to. No sinks: the model's
    mask never lets a query see a key behind its window, so sinks there would be dead bytes."""

    def __init__(self, scheme: Scheme | str, backend: str = "auto", *, sliding_window: int, **kwargs):
        if sliding_window is None or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        scheme = dataclasses.replace(parse_scheme(scheme), sink=0)
        super().__init__(scheme, backend, sliding_window=sliding_window, **kwargs)

    def _after_update(self) -> None:
        self.tables.slide()


def _salient(args: tuple, kwargs: dict) -> bool:
    """Whether QuantizedLayer(...)'s scheme (first argument) has salient=N/G (`kvquant.salient`)."""
    scheme = args[0] if args else kwargs.get("scheme")
    return scheme is not None and parse_scheme(scheme).salient is not None


def _check_states(key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    for name, t in (("key_states", key_states), ("value_states", value_states)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (B, H_kv, T, D), got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H_kv, T, D), got {tuple(t.shape)}")
    if key_states.shape != value_states.shape:
        raise ValueError(
            f"K and V must agree in (B, H_kv, T, D): K is {tuple(key_states.shape)}, "
            f"V is {tuple(value_states.shape)}"
        )


def _encode_pair(
    kc: Codec, vc: Codec, k: torch.Tensor, v: torch.Tensor, start: int
) -> dict[str, torch.Tensor]:
    """Body fields {"k.<field>", "v.<field>"} of K and V (B, H, n, D) at positions start... One encode call
    over (2B, ...) when both codecs give the same codes (`Codec.batches_with`: same spec, and the same tables
    for calibrated codecs): blocks never span sequences, so the codes are the same as two calls."""
    if kc.batches_with(vc):
        b = k.shape[0]
        both = kc.encode_at(torch.cat([k, v], dim=0), start)
        return {f"k.{n}": t[:b] for n, t in both.items()} | {f"v.{n}": t[b:] for n, t in both.items()}
    kf, vf = kc.encode_at(k, start), vc.encode_at(v, start)
    return {f"k.{n}": t for n, t in kf.items()} | {f"v.{n}": t for n, t in vf.items()}


def _load_calibration(path: str):
    from .calibration import load_calibration  # lazy: safetensors and json only when a scheme has calib=

    return load_calibration(path)


def _model_ropes(config) -> tuple:
    """The model's RoPE of each decoder layer (`kvquant.rope.Rope.for_layers`), for -prerope keys."""
    from .rope import Rope, RopeError

    try:
        return Rope.for_layers(config)
    except RopeError as e:
        raise ValueError(f"-prerope: {e}") from None


def _kernel_encoder(paths: LayerPaths):
    """The Triton quantize+pack-into-pages entry point when the layer's paths encode with it, else None."""
    if not paths.encode:
        return None
    from .kernels.dispatch import quantize_pack_into  # lazy: `import kvquant` never imports triton

    return functools.partial(quantize_pack_into, registry=paths.registry)


def _check_shared_store(store: KVStore, scheme: Scheme, config) -> None:
    """A cache may use `store` (scheme, model, what a shared store supports), or ValueError naming why."""
    if not store.shared:
        raise ValueError(
            "store= takes a shared KVStore(model.config, scheme); without it a cache makes its own "
            "private store"
        )
    if store.scheme != scheme:
        raise ValueError(
            f"the shared store holds scheme {str(store.scheme)!r}, not {str(scheme)!r}; "
            "one store serves one scheme"
        )
    if scheme.salient is not None:
        raise ValueError(
            f"scheme {str(scheme)!r}: salient= keeps per-request attention statistics and is not supported "
            "on a shared KVStore (prefix caching); use a private cache (no store=)"
        )
    if scheme.layers or scheme.calib is not None or scheme.prerope:
        # KVStore builds one codec pair from scheme.key/value for every layer, without tables or RoPE
        raise ValueError(
            f"scheme {str(scheme)!r}: per-layer specs, calibrated codebooks and pre-RoPE keys "
            "are not supported on a shared KVStore yet; use a private cache (no store=)"
        )
    if config is None:
        raise ValueError(
            "a cache on a shared store needs the model's config (QuantizedCache(scheme, "
            "model.config, store=store))"
        )
    if store.shape != KVShape.from_config(config):
        raise ValueError(
            f"the shared store was made for {store.shape}, not this model's {KVShape.from_config(config)}"
        )


@dataclass
class _Expect:
    """What the cache learned of the model from its config, checked when the model first writes."""

    attn_implementation: str | None = None
    checked: bool = field(default=False)


class QuantizedCache(Cache):
    """A transformers `Cache` whose layers store K/V in pages, the body encoded with `scheme`.

    Args:
        scheme: a `Scheme` or a scheme string (`"int4-g64"`, `"kivi-2"`, ...).
        config: the model's config; gives the number of layers, which layers are sliding-window, and checks
            head_dim and the attention implementation up front. Without it, layers are created as the model
            writes them (all full-attention).
        backend: "auto" (Triton kernels on CUDA when available, else PyTorch), "triton" or "torch".
        block_size: tokens per page (16, as vLLM); raised to a multiple of a channel-wise token group.
        capacity: tokens per sequence to preallocate codec pages for (FP pages: only what the scheme's sink
            and window can hold); the pools grow in bounded steps (1/32 of the pages in use) beyond it.
        store: a shared `kvquant.paging.KVStore` (same scheme and model) whose pools every layer uses, so that
            several caches (one per request) share pages: prefix caching and eviction under a byte budget
            (`kvquant.serving.prefix`, `kvquant.paging.evict`, `kvquant.serving`). Default: a private store
            with this cache as its one holder (`KVStore.private`), on the same code path.

    Use it as `model(ids, cache=cache)` or `model.generate(ids, cache=cache)`, on a model whose
    attention implementation is `kvquant.ATTN_IMPLEMENTATION` (`kvquant.load_model` sets it).
    """

    def __init__(
        self,
        scheme: Scheme | str,
        config=None,
        *,
        backend: str = "auto",
        block_size: int = DEFAULT_BLOCK_SIZE,
        capacity: int = 256,
        store: KVStore | None = None,
    ):
        self.scheme = parse_scheme(scheme)
        self.backend = check_backend(backend)
        self._expect = _Expect()
        if store is not None:
            _check_shared_store(store, self.scheme, config)
        self.store = store if store is not None else KVStore.private()
        self._fixed_layers = config is not None
        kwargs = dict(backend=backend, block_size=block_size, capacity=capacity, store=self.store)
        kwargs["kernels"] = KernelHandle()
        # codebooks of nuqN specs, loaded once per file (kvquant.calibration; no pickle)
        calib = _load_calibration(self.scheme.calib) if self.scheme.calib is not None else None
        if config is not None:
            shape = KVShape.from_config(config)
            self.scheme.check_head_dim(shape.head_dim)
            self.scheme.check_num_layers(shape.num_layers)
            if self.scheme.salient is not None and shape.sliding_layers:
                raise ValueError(
                    f"salient={self.scheme.salient} is not supported on sliding-window layers (this model's "
                    f"layers {list(shape.sliding_layers)} slide); drop salient= for this model"
                )
            positions = quirks.max_positions(config)
            if positions is not None:  # a token group the model can never fill
                self.scheme.check_positions(positions, page_size=block_size)
            if calib is not None:
                calib.check_model(shape, self.scheme)
            ropes = _model_ropes(config) if self.scheme.prerope else (None,) * shape.num_layers
            self._expect = _Expect(getattr(quirks.text_config(config), "_attn_implementation", None))
            layers = [
                QuantizedLayer(
                    self.scheme.for_layer(i),
                    sliding_window=shape.window_of(i),
                    layer_idx=i,
                    calib=calib,
                    rope=ropes[i],
                    **kwargs,
                )
                for i in range(shape.num_layers)
            ]
            super().__init__(layers=layers)
        else:
            if self.scheme.layers or self.scheme.prerope:
                raise ValueError(
                    f"scheme {str(self.scheme)!r} has per-layer specs or pre-RoPE keys: build the cache "
                    "with the model's config (QuantizedCache(scheme, model.config))"
                )
            super().__init__(
                layer_class_to_replicate=lambda: QuantizedLayer(
                    self.scheme, layer_idx=len(self.layers), calib=calib, **kwargs
                )
            )

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if (
            not isinstance(layer_idx, int)
            or layer_idx < 0
            or (self._fixed_layers and layer_idx >= len(self.layers))
        ):
            raise ValueError(
                f"layer_idx {layer_idx!r} is out of range: this cache was built for {len(self.layers)} "
                "layers (from the model's config); pass the config of the model that uses it"
            )
        if not self._expect.checked:
            self._check_model(key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_model(self, key_states: torch.Tensor) -> None:
        impl = self._expect.attn_implementation
        if impl is not None and impl != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"the model's attention implementation is {impl!r}, which cannot read a quantized cache; "
                f"load it with kvquant.load_model(), or call model.set_attn_implementation("
                f"kvquant.ATTN_IMPLEMENTATION)"
            )
        if isinstance(key_states, torch.Tensor) and key_states.dim() == 4:
            self.scheme.check_head_dim(key_states.shape[-1])
        self._expect.checked = True

    def nbytes(self) -> int:
        """Bytes of the pages every layer's sequences hold: codes, scales, zeros and FP tokens."""
        return sum(layer.nbytes() for layer in self.layers)

    def reserved_bytes(self) -> int:
        """Bytes preallocated by every layer's page pools (>= nbytes())."""
        return sum(layer.reserved_bytes() for layer in self.layers)

    def __iter__(self):
        """Per layer (keys, values, sliding_window), as transformers 5.x's DynamicCache yields them (so
        `DynamicCache(ddp_cache_data=cache)` rebuilds it unquantized): K/V decoded (B, H_kv, T, D), a copy
        each (`QuantizedLayer.keys`), and the window as a 0-d long tensor on sliding-window layers, else None.
        Like DynamicCache, the cache is not subscriptable: `cache.layers[i].keys` reads one layer."""
        for layer in self.layers:
            window = None
            if layer.sliding_window is not None:
                device = layer.device if layer.is_initialized else None
                window = torch.tensor(layer.sliding_window, dtype=torch.long, device=device)
            yield layer.keys, layer.values, window

    def __repr__(self) -> str:
        scheme, n, tokens = str(self.scheme), len(self.layers), self.get_seq_length()
        bs = next((lay.block_size for lay in self.layers if lay.is_initialized), None)
        return f"QuantizedCache(scheme={scheme!r}, layers={n}, tokens={tokens}, block_size={bs})"
