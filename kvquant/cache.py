"""A quantized KV cache for Hugging Face transformers, stored in pages: one `QuantizedLayer` per decoder
layer.

Each layer keeps its tokens in position order as three regions of pages (`kvquant.store`):

    sink    the first `scheme.sink` tokens, unquantized               FP pages (P, H_kv, block_size, D)
    body    encoded once by the spec's codec (packed codes, scales)   codec pages, K and V under one page id
    recent  the last tokens, unquantized: at least `scheme.window`,   FP pages (the same pool as the sink)
            plus any tokens whose token group is not complete yet

Body token i (position sink + i) sits in logical body page i // block_size; recent tokens use the same
logical numbering, so a page of the window is released as soon as all of its tokens have been encoded.
Tokens move from the window to the body in multiples of `scheme.tokens_per_flush` once more than `window`
tokens wait; nothing is ever requantized, and nothing decoded is written back. Appending costs the same at
any length: only the current page of each region is written.

`update` returns a `LayerView`: the pool tensors and block tables as stored. kvquant's attention function
(`kvquant.attention`) reads it: Triton kernels that walk the pages, or the PyTorch reference (gather,
decode, SDPA). A sliding-window layer (a model config's `layer_types`) keeps only the pages the model can
still attend to and releases the pages behind them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .backend import ATTN_IMPLEMENTATION, KernelHandle, check_backend, uses_kernels
from .codec import Codec, Field
from .codec_transforms import kernel_frame
from .memory import KVShape
from .plan import LayerPlan
from .scheme import Scheme, parse_scheme
from .store import BlockTable, KVStore, PagePool, Region, gather_region

__all__ = ["QuantizedCache", "QuantizedLayer", "LayerView", "DEFAULT_BLOCK_SIZE"]

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16  # tokens per page, as vLLM

_MATERIALIZE_COST = (
    "QuantizedLayer.keys / .values (and iterating a QuantizedCache) decode a whole layer from its pages into "
    "a new (B, H_kv, T, D) tensor on every access: full-precision memory and a decode per call. kvquant's "
    "attention never needs them; read them to inspect a cache, not inside a generation loop"
)


_NOT_KVQUANT_ATTENTION = (
    "a QuantizedCache layer reached an attention implementation that is not kvquant's; load the model "
    "with kvquant.load_model(), or call model.set_attn_implementation(kvquant.ATTN_IMPLEMENTATION)"
)


@dataclass(frozen=True)
class LayerView:
    """One layer's stored K/V as attention reads it: regions sink | body | recent, in position order.

    fp_k, fp_v: FP pool tensors (P, H_kv, block_size, D); `sink` and `recent` index them.
    key_pages / value_pages: the body pool's fields per codec {name: (P, heads_f, block_size // tokens_f,
    cols_f)}; `body` indexes both (K and V of a token share a page id).
    shape: (B, H_kv, T, D) of the tokens in the view; `start` is the position of the first one (non-zero only
    on sliding-window layers, which release what the model can no longer attend to), so token i sits at
    position start + i. When an eviction policy released positions after a sink
    (`QuantizedLayer.evict_before`), the sink's tokens are numbered as if they sat just before the first token
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
    kernel_registry: object | None = None  # kvquant.kernels.registry.KernelRegistry when kernels serve it
    plan: LayerPlan | None = None  # the layer's storage rule (which keys a query of a chunk saw quantized)

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


class QuantizedLayer(CacheLayerMixin):
    """One decoder layer's K/V in pages: sink (FP) | body (codec fields) | recent window (FP).

    Args:
        scheme: the layer's scheme (a string is parsed).
        backend: "auto", "triton" or "torch" (`kvquant.backend`).
        block_size: tokens per page; raised to a multiple of every codec's token group (channel-wise specs).
        sliding_window: the model's window on a sliding-window layer (keys older than it are released), else
            None.
        capacity: tokens per sequence to preallocate codec pages for; FP pages are sized by what the sink and
            window can hold. Pools grow in bounded steps (1/16) beyond that, never doubling.
        store, layer_idx: take this layer's pools from a shared `kvquant.store.KVStore` (several caches then
            share pages: prefixes, `kvquant.prefix`) instead of making private ones.
    """

    is_compileable = False
    is_croppable = True

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
        if sliding_window is not None:
            if sliding_window < 1:
                raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
            # the model's mask never lets a query see a key behind its window: sinks there would be dead bytes
            scheme = dataclasses.replace(scheme, sink=0)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.scheme = scheme
        self.backend = check_backend(backend)
        self.requested_block_size = block_size
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.capacity = capacity
        if store is not None and (layer_idx is None or not 0 <= layer_idx < len(store.layers)):
            raise ValueError(
                f"a layer on a shared store needs its layer_idx in [0, {len(store.layers)}), "
                f"got {layer_idx!r}"
            )
        self.store, self.layer_idx = store, layer_idx
        if scheme.layers:
            raise ValueError("a layer takes its own uniform scheme: pass scheme.for_layer(layer_idx)")
        self.calib, self.rope = calib, rope  # codebooks (nuqN) and the model's RoPE (-prerope keys)
        self.kernels = kernels or KernelHandle()  # the cache's (shared by its layers), or the layer's own
        self.is_initialized = False
        self.length = self.body_len = self.dropped = 0

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
        if self.store is not None:
            self._take_store_pools()
        else:
            why = (
                ""
                if self.block_size == self.requested_block_size
                else (
                    f", raised from {self.requested_block_size} to hold whole token groups of "
                    f"{self.key_codec.token_group}/{self.value_codec.token_group} (K/V)"
                )
            )
            # sized by the plan: FP pages only for what the sink and window can ever hold, codec pages for
            # `capacity` tokens; both grow in bounded steps beyond that (kvquant.store.PagePool.reserve)
            fp_pages = self.plan.max_fp_pages * b
            body_pages = self.plan.body_pages(self.capacity) * b
            self.fp_pool = PagePool(self.plan.fp_fields(), self.block_size, self.device, fp_pages, "fp" + why)
            self.body_pool = PagePool(
                self.plan.body_fields(), self.block_size, self.device, body_pages, "body" + why
            )
        self.sink_t = BlockTable(self.fp_pool, b)
        self.body_t = BlockTable(self.body_pool, b)
        self.recent_t = BlockTable(self.fp_pool, b)
        self.length = 0  # tokens per sequence seen (positions 0 .. length - 1)
        self.body_len = 0  # tokens encoded into the body (positions sink .. sink + body_len - 1)
        self.dropped = 0  # positions below this are released (sliding-window layers only)
        self._registry = self.kernels.registry() if uses_kernels(self.backend, self.device) else None
        self._encode = _kernel_encoder(self.backend, self.device, self._registry)
        if self._registry is not None:
            for codec in (self.key_codec, self.value_codec):
                if kernel_frame(codec, self.device) is None:
                    self.kernels.note_once(
                        f"{codec.spec}: no Triton kernel reads this codec yet; the PyTorch reference path "
                        "serves its attention and appends"
                    )
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
        view_start = self.dropped
        k, v = key_states, value_states
        sink, p0 = self.scheme.sink, self.length
        p1 = p0 + k.shape[2]
        if p0 < sink:
            n = min(sink - p0, k.shape[2])
            self.sink_t.write(p0, {"k": k[:, :, :n], "v": v[:, :, :n]})
            k, v = k[:, :, n:], v[:, :, n:]
        q0 = p1 - k.shape[2]  # position of k[:, :, 0]
        fresh = self._flush(p1, q0, k, v)
        body_end = sink + self.body_len
        # pages holding only encoded tokens go first, so the window never holds more than the plan's bound
        self.recent_t.release_before((body_end - sink) // self.block_size)
        w0 = max(q0, body_end)
        if w0 < p1:
            self.recent_t.write(w0 - sink, {"k": k[:, :, w0 - q0 :], "v": v[:, :, w0 - q0 :]})
        self.length = p1
        view = self.view(view_start, fresh)
        if self.sliding_window is not None:
            self._slide()
        return view, view

    def _flush(
        self, p1: int, q0: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Encode the token groups that have left the window (once; they are never touched again).
        k, v hold positions q0 .. p1 - 1. Returns the FP K/V just encoded and their first position."""
        sink = self.scheme.sink
        body_end = sink + self.body_len
        n = self.plan.quantized_end(p1) - body_end
        if n <= 0:
            return None
        if body_end < self.dropped:  # a sliding layer released them before they left the window: skip
            skip = min(n, self.dropped - body_end)
            self.body_len, body_end, n = self.body_len + skip, body_end + skip, n - skip
            if n <= 0:
                return None
        old = min(body_end + n, q0) - body_end  # of the n, those already in the recent pages
        fk, fv = k[:, :, : n - old], v[:, :, : n - old]
        if old > 0:
            held = self.recent_t.gather(body_end - sink, old)  # (B, H, old, D) each
            fk, fv = torch.cat([held["k"], fk], dim=2), torch.cat([held["v"], fv], dim=2)
        self._append_body(fk, fv)
        return fk, fv, body_end

    def _append_body(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode k, v (B, H, n, D) into body pages at body tokens [body_len, body_len + n)."""
        bs, start = self.block_size, self.body_len
        self.body_t.prepare(start // bs, -(-(start + k.shape[2]) // bs))
        table, offset = self.body_t.tensor(), start - self.body_t.first * bs
        kc, vc = self.key_codec, self.value_codec
        served = self._encode is not None and all(kernel_frame(c, self.device) is not None for c in (kc, vc))
        if served:  # the kernel encoder (it rotates a `-rot` codec's tokens as codec.encode does)
            for prefix, codec, x in (("k.", kc, k), ("v.", vc, v)):
                pages = {name: self.body_pool.tensors[prefix + name] for name in codec.fields()}
                self._encode(x, codec, pages, table, offset)
        else:
            self.body_pool.write(table, offset, _encode_pair(kc, vc, k, v, self.scheme.sink + start))
        self.body_len += k.shape[2]

    def _slide(self) -> None:
        """Release the pages that hold only keys the model can no longer attend to (sliding layers)."""
        keep_from = self.length - self.sliding_window + 1  # the next query attends to positions >= this
        keep_page = max(keep_from, 0) // self.block_size  # sliding layers have no sink: page = position // bs
        self.dropped = max(self.dropped, keep_page * self.block_size)
        self.body_t.release_before(keep_page)
        self.recent_t.release_before(keep_page)

    def view(
        self, start: int | None = None, fresh: tuple[torch.Tensor, torch.Tensor, int] | None = None
    ) -> LayerView:
        """What is stored from position `start` (default: the first position held) as a LayerView."""
        start = self.dropped if start is None else start
        sink = self.scheme.sink
        body_end = sink + self.body_len
        sink_n = min(sink, self.length)
        # positions [sink, start) released by an eviction policy (`evict_before`): the sink stays, and the
        # view numbers its tokens as if they sat just before `start` (view_start), so index + view_start is
        # the position of every token after the sink, and the sink is visible to every query.
        view_start = start - sink_n if start >= sink_n else start
        sink_region = self.sink_t.region(0, sink_n if start >= sink_n else sink_n - start)
        body_lo = max(start - sink, 0)
        body_region = self.body_t.region(body_lo, max(self.body_len - body_lo, 0), sink + body_lo)
        recent_lo = max(body_end, start)
        recent_region = self.recent_t.region(recent_lo - sink, max(self.length - recent_lo, 0), recent_lo)
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
            fp_k=self.fp_pool.tensors["k"],
            fp_v=self.fp_pool.tensors["v"],
            sink=sink_region,
            body=body_region,
            recent=recent_region,
            key_codec=self.key_codec,
            value_codec=self.value_codec,
            key_pages={n: self.body_pool.tensors["k." + n] for n in self.key_codec.fields()},
            value_pages={n: self.body_pool.tensors["v." + n] for n in self.value_codec.fields()},
            scheme=self.scheme,
            backend=self.backend,
            shape=torch.Size((self.batch_size, self.num_heads, kv_len, self.head_dim)),
            start=view_start,
            fresh_k=fresh_k,
            fresh_v=fresh_v,
            fresh_start=fresh_start,
            kernel_registry=self._registry,
            plan=self.plan,
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next forward: the view starts at the first position still held."""
        kept_sink = min(self.scheme.sink, self.length) if self.dropped else 0  # see view()
        return self.length - self.dropped + kept_sink + query_length, self.dropped - kept_sink

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if not self.is_initialized:
            return
        for table in self._tables():
            table.clear()
        self.length = self.body_len = self.dropped = 0
        self._trim()

    def _trim(self) -> None:
        """Give free pages at the end of private pools back (a shared store's pages stay in its pools)."""
        if self.store is None:
            self.fp_pool.trim()
            self.body_pool.trim()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last |tokens_to_remove| tokens (a negative number, as transformers' DynamicLayer)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as transformers does"
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = max(self.length + tokens_to_remove, 0)
        if keep < self.dropped:
            raise ValueError(
                f"cannot crop to {keep} tokens: this sliding-window layer released positions below "
                f"{self.dropped}"
            )
        sink, bs = self.scheme.sink, self.block_size
        body_end = sink + self.body_len
        if keep >= body_end:
            self.recent_t.truncate(-(-(keep - sink) // bs))
        elif keep >= sink:
            body = keep - sink
            group = max(self.key_codec.token_group, self.value_codec.token_group)
            if body % group:
                raise ValueError(
                    f"cannot crop to {body} quantized tokens: that splits a channel-wise group of {group} "
                    "tokens; crop fewer tokens or use a larger window"
                )
            self.recent_t.clear()
            self.body_t.truncate(-(-body // bs))
            self.body_len = body
        else:
            self.recent_t.clear()
            self.body_t.clear()
            self.body_len = 0
            self.sink_t.truncate(-(-keep // bs))
        self.length = keep
        self._trim()

    def _select_rows(self, indices: list[int]) -> None:
        if not self.is_initialized:
            return
        for table in self._tables():
            table.select(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beams: block tables are permuted and pages shared by reference count, never copied."""
        self._select_rows([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows([i for i in range(self.batch_size) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.batch_size)[torch.as_tensor(indices).cpu()].tolist())

    def offload(self):  # the pages stay where they are
        return None

    def prefetch(self):
        return None

    # ---- kvquant's own

    def _tables(self) -> tuple[BlockTable, BlockTable, BlockTable]:
        return self.sink_t, self.body_t, self.recent_t

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

    @property
    def batch_size(self) -> int:
        return self.sink_t.batch if self.is_initialized else 0

    @property
    def sink_len(self) -> int:
        return min(self.scheme.sink, self.length)

    # ---- materialised K/V, for code that reads a layer as it would transformers' DynamicLayer

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

    @property
    def recent_len(self) -> int:
        return max(self.length - max(self.scheme.sink + self.body_len, self.dropped), 0)

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

    def nbytes(self) -> int:
        """Bytes of the pages this layer's sequences hold (a partly filled page counts in full; a page
        shared by several sequences once)."""
        if not self.is_initialized:
            return 0
        fp_pages = self.sink_t.pages() | self.recent_t.pages()
        return len(fp_pages) * self.fp_pool.page_bytes + len(self.body_t.pages()) * self.body_pool.page_bytes

    def reserved_bytes(self) -> int:
        """Bytes the layer's pools have preallocated, used or not."""
        if not self.is_initialized:
            return 0
        return self.fp_pool.reserved_bytes + self.body_pool.reserved_bytes

    def check(self) -> None:
        """Verify the pools' reference counts and free lists (`kvquant.store.StoreError` if broken)."""
        if self.is_initialized:
            self.fp_pool.check()
            self.body_pool.check()

    # ---- a shared store: prefixes and eviction (kvquant.prefix, kvquant.evict)

    def _take_store_pools(self) -> None:
        store, i = self.store, self.layer_idx
        lp = store.layers[i]
        shape = store.shape
        if (self.num_heads, self.head_dim) != (shape.num_kv_heads, shape.head_dim):
            raise ValueError(
                f"the shared store holds {shape.num_kv_heads} KV heads of head_dim {shape.head_dim}, but "
                f"layer {i} got {self.num_heads} of {self.head_dim}; one store serves one model"
            )
        if (self.dtype, self.device) != (store.dtype, store.device):
            raise ValueError(
                f"the shared store holds {store.dtype} on {store.device}, layer {i} got {self.dtype} on "
                f"{self.device}; make the store with the model's dtype and device"
            )
        if lp.sliding_window != self.sliding_window:
            raise ValueError(
                f"layer {i}: the store's sliding window {lp.sliding_window} is not the "
                f"layer's {self.sliding_window}"
            )
        fields = {f"k.{n}": f for n, f in self.key_codec.fields().items()}
        fields |= {f"v.{n}": f for n, f in self.value_codec.fields().items()}
        if fields != lp.body.fields or self.block_size != lp.block_size:
            raise ValueError(
                f"layer {i}: the shared store's body pages ({lp.block_size} tokens, {list(lp.body.fields)}) "
                "do not fit this layer's codecs; make the store with the cache's scheme and block size"
            )
        self.fp_pool, self.body_pool = lp.fp, lp.body  # the codecs stay the layer's (calibration, RoPE)

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
        exactly what it would have. sink_pages hold positions [0, sink); body_pages logical body pages 0..;
        recent_pages logical pages recent_first.. (FP copies of the window). The pages are increfed; a later
        write into a shared one (the partial body page) copies it first."""
        if self.store is None:
            raise ValueError("adopt_prefix needs a layer on a shared KVStore (QuantizedCache(.., store=..))")
        if self.sliding_window is not None:
            raise ValueError("prefixes are not shared across sliding-window layers (they release pages)")
        if self.is_initialized and (self.length or self.batch_size != 1):
            raise ValueError(
                f"adopt_prefix needs an empty one-sequence layer; this one holds {self.length} "
                f"tokens of {self.batch_size} sequences"
            )
        shape = self.store.shape
        if not self.is_initialized:
            self._init_storage(1, shape.num_kv_heads, shape.head_dim, self.store.dtype, self.store.device)
        sink = self.scheme.sink
        body_len = self.scheme.quantized_end(length) - min(sink, length)
        bs, recent_end = self.block_size, length - min(sink, length)  # recent: body tokens [body_len, end)
        want = (-(-min(sink, length) // bs), -(-body_len // bs), -(-recent_end // bs) - body_len // bs)
        got = (len(sink_pages), len(body_pages), len(recent_pages))
        if got != want or (recent_pages and recent_first != body_len // bs):
            raise ValueError(
                f"pages for {length} tokens do not cover sink | body | window: need {want} pages "
                f"(window from logical page {body_len // bs}), got {got} (from {recent_first})"
            )
        self.sink_t.adopt(0, sink_pages)
        self.body_t.adopt(0, body_pages)
        self.recent_t.adopt(recent_first, recent_pages)
        self.length, self.body_len, self.dropped = length, body_len, 0

    def evict_before(self, position: int) -> int:
        """Release the pages that hold only positions in [sink, position) (an eviction policy such as
        `sliding:W`): later forwards attend to the sink and the tokens from `dropped` on. Positions are kept
        (no re-rotation); the sink pages stay. Returns the pages released (over the batch)."""
        if not self.is_initialized or self.sliding_window is not None:
            return 0
        sink = min(self.scheme.sink, self.length)
        if self.length < self.scheme.sink:
            return 0
        page = max(min(position, self.length) - sink, 0) // self.block_size
        dropped = sink + page * self.block_size
        if dropped <= self.dropped:
            return 0
        before = len(self.body_t.pages()) + len(self.recent_t.pages())
        self.dropped = dropped
        self.body_t.release_before(page)
        self.recent_t.release_before(page)
        return before - len(self.body_t.pages()) - len(self.recent_t.pages())


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


def _model_rope(config):
    from .rope import Rope, RopeError

    try:
        return Rope.from_config(config)
    except RopeError as e:
        raise ValueError(f"-prerope: {e}") from None


def _kernel_encoder(backend: str, device: torch.device, registry):
    """The Triton quantize+pack-into-pages entry point when the backend selects kernels, else None."""
    if not uses_kernels(backend, device):
        return None
    from .kernels.dispatch import quantize_pack_into  # lazy: `import kvquant` never imports triton

    return functools.partial(quantize_pack_into, registry=registry)


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
            and window can hold); the pools grow in bounded steps (1/16 of the pages in use) beyond it.
        store: a shared `kvquant.store.KVStore` (same scheme and model) whose pools every layer uses, so that
            several caches (one per request) share pages: prefix caching and eviction under a byte budget
            (`kvquant.prefix`, `kvquant.evict`, `kvquant.serving`). Default: private pools per layer.

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
        self.store = store
        if store is not None:
            if store.scheme != self.scheme:
                raise ValueError(
                    f"the shared store holds scheme {str(store.scheme)!r}, not {str(self.scheme)!r}; "
                    "one store serves one scheme"
                )
            if self.scheme.layers or self.scheme.calib is not None or self.scheme.prerope:
                # KVStore builds one codec pair from scheme.key/value for every layer, without tables or RoPE
                raise ValueError(
                    f"scheme {str(self.scheme)!r}: per-layer specs, calibrated codebooks and pre-RoPE keys "
                    "are not supported on a shared KVStore yet; use a private cache (no store=)"
                )
            if config is None:
                raise ValueError(
                    "a cache on a shared store needs the model's config (QuantizedCache(scheme, "
                    "model.config, store=store))"
                )
            if store.shape != KVShape.from_config(config):
                raise ValueError(
                    f"the shared store was made for {store.shape}, not this model's "
                    f"{KVShape.from_config(config)}"
                )
        self._fixed_layers = config is not None
        kwargs = dict(backend=backend, block_size=block_size, capacity=capacity, kernels=KernelHandle())
        # codebooks of nuqN specs, loaded once per file (kvquant.calibration; no pickle)
        calib = _load_calibration(self.scheme.calib) if self.scheme.calib is not None else None
        if config is not None:
            shape = KVShape.from_config(config)
            self.scheme.check_head_dim(shape.head_dim)
            self.scheme.check_num_layers(shape.num_layers)
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            positions = getattr(text, "max_position_embeddings", None)
            if isinstance(positions, int) and positions > 0:  # a token group the model can never fill
                self.scheme.check_positions(positions, page_size=block_size)
            if calib is not None:
                calib.check_model(shape, self.scheme)
            rope = _model_rope(config) if self.scheme.prerope else None
            self._expect = _Expect(getattr(text, "_attn_implementation", None))
            layers = [
                QuantizedLayer(
                    self.scheme.for_layer(i),
                    sliding_window=shape.window_of(i),
                    store=store,
                    layer_idx=i,
                    calib=calib,
                    rope=rope,
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
