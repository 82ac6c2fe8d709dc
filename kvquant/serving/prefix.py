"""Prefix caching on a shared page store: a new request reuses the pages of a prefix another request computed.

Positions are cut into *units* of one body page (`block_size` tokens, bs) per layer: sink units (positions
[0, sink), bs at a time) and body units (unit j holds positions sink + j*bs .. sink + (j+1)*bs - 1, logical
page j of the body, and the FP window pages that span the same positions: FP pages hold fp_block_size
tokens, which divides bs, in the numbering `kvquant.paging.regions.LayerTables` gives them). A unit is
cached only when all its positions are present. Per layer it may hold two versions of its tokens:

    body   the quantized page (codec fields of K and V), final once full: a token is encoded once
    fp     FP pages: the sink's, or the FP copy of the window's (what the window held when registered: its
           pages of the unit not yet released)

Reuse is decode-exact. A new request of n tokens starts at R = sink + j*bs (the largest R <= n - 1 the index
covers) in the state token-by-token decoding reaches after R tokens: sink FP, body = positions below
`plan.quantized_end(R)` quantized, window = the positions from there to R in FP (each layer's
`kvquant.plan.LayerPlan` says where the body ends). So it needs body versions for the units below
quantized_end(R) and FP versions for the units from there to R; for schemes without a window (`int4-g64`,
`fp16`) that is just the body pages, for windowed ones (`kivi-2`) the FP copies the source held when it
registered (register after a prefill chunk ends at the shared prefix's boundary). The rest of the prompt is
computed as usual. The body page holding the quantized/window boundary may be only partly used; the first
write into it copies it (copy-on-write). Given the same K/V for the shared positions (the same chunking up to
R), the attention inputs and logits after a hit are bit-identical to recomputing.

An FP copy is not always whole: tokens that leave the window inside the forward that brings them go
straight to the body and are never written to their FP window page, so that page holds FP values only from
some position on. Each FP version records that position (`PageUnit.fp_from`, from where the forwards that fed
the source ended: `register(..., forward_ends=)`, which `kvquant.serving.Engine` passes), and a hit uses it
only when every position its window reads lies at or after it. Without forward ends, only the source's
current window counts as written.

Two indexes behind one interface (`PrefixIndex`): `HashChainIndex` (vLLM: a unit's key hashes its parent's
key, its token ids, the scheme and block size) and `RadixIndex` (SGLang: a radix tree whose edges are runs
of units), in `kvquant.paging.index` with the store. The index holds one reference on every page it lists; the
store's budget drops them in its eviction policy's order (`kvquant.paging.budget`). This module moves pages
between caches and the index, through the layers' tables (`kvquant.paging.regions.LayerTables`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..paging.index import (
    INDEXES,
    HashChainIndex,
    PageUnit,
    PrefixIndex,
    RadixIndex,
    Unit,
    make_index,
    unit_tokens,
)

if TYPE_CHECKING:
    from ..cache import QuantizedCache, QuantizedLayer
    from ..paging.store import KVStore
    from ..plan import LayerPlan

__all__ = [
    "INDEXES",
    "Hit",
    "HashChainIndex",
    "PageUnit",
    "PrefixIndex",
    "RadixIndex",
    "Unit",
    "attach",
    "make_index",
    "register",
    "unit_tokens",
]

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------- caches <-> the index


def _layers(cache: QuantizedCache) -> list[QuantizedLayer]:
    if not cache.store.shared:
        raise ValueError(
            "prefix caching needs a cache on the shared store (QuantizedCache(..., store=store))"
        )
    return cache.layers


def _plans(layers: Sequence[QuantizedLayer], store: KVStore) -> list[LayerPlan]:
    """Each layer's storage plan: its own once it holds tokens, else the store's for that layer (the same
    rule: a cache on a store has the store's scheme, block size and no tables)."""
    return [lay.plan if lay.is_initialized else store.plans[i] for i, lay in enumerate(layers)]


def _fp_written_from(plan: LayerPlan, forward_ends: Sequence[int], lo: int, hi: int) -> int:
    """The first position of [lo, hi) from which every position up to hi was written to the FP window pages.
    A forward from q0 to p1 writes its tokens from max(q0, quantized_end(p1)) on; those before that left the
    window inside it and went straight to the body (`QuantizedLayer.update`). Only forwards ending after lo
    can touch the page: they are read from the last one back (a held window page is near the end)."""
    written_from = lo
    for n in range(len(forward_ends) - 1, -1, -1):
        p1 = forward_ends[n]
        if p1 <= lo:
            break
        q0 = forward_ends[n - 1] if n else 0
        hole_end = plan.quantized_end(p1)  # [q0, hole_end) of this forward: encoded, never FP in the window
        if q0 < hole_end and q0 < hi and hole_end > lo:
            written_from = max(written_from, hole_end)
    return written_from


def register(
    cache: QuantizedCache,
    ids: Sequence[int],
    index: PrefixIndex,
    *,
    forward_ends: Sequence[int] | None = None,
) -> int:
    """Index every complete unit a one-sequence cache holds now (ids: its token ids, at least as many as it
    holds; they are trusted: `kvquant.serving.Engine` checks them against what it ran); returns units added.
    Call it after a prefill chunk or a turn; units already cached are kept.

    forward_ends: where each forward that fed the cache ended, in order (an adopted prefix counts as one
    forward ending at its length); they tell which positions of the window pages hold FP values (see the
    module doc). Default: one forward of everything held, so only the current window counts."""
    layers = _layers(cache)
    first = layers[0]
    if not first.is_initialized or first.length == 0:
        return 0
    if first.batch_size != 1:
        raise ValueError(f"register takes a one-sequence cache, this one holds {first.batch_size}")
    length = first.length
    plans = _plans(layers, index.store)
    sink, bs = plans[0].sink, plans[0].block_size
    ids = list(ids)[:length]
    if len(ids) < length:
        raise ValueError(f"the cache holds {length} tokens but only {len(ids)} ids were given")
    ends = [length] if forward_ends is None else [int(e) for e in forward_ends]
    if not ends or ends[-1] != length or any(b <= a for a, b in zip([0, *ends], ends, strict=False)):
        raise ValueError(
            f"forward_ends must rise to the {length} tokens the cache holds (where each forward ended), "
            f"got {ends[:4]}{'...' if len(ends) > 4 else ''} ending at {ends[-1] if ends else None}"
        )
    tokens = unit_tokens(ids, sink, bs)
    pages: list[PageUnit] = []
    for u in range(len(tokens)):
        unit = _held_unit(layers, plans, ends, u)
        if unit is None:
            break  # released (an eviction policy), or no FP value of it held: the chain stops here
        pages.append(unit)
    return index.insert(tokens[: len(pages)], pages)


def _held_unit(
    layers: Sequence[QuantizedLayer], plans: Sequence[LayerPlan], ends: Sequence[int], u: int
) -> PageUnit | None:
    """Unit u's pages as sequence 0 holds them in every layer (asked of each layer's tables), or None when
    a layer lacks both versions of it."""
    sink, bs = plans[0].sink, plans[0].block_size
    n_sink = -(-sink // bs)
    if u < n_sink:
        got = [lay.tables.sink_pages(u) for lay in layers]
        return None if any(p is None for p in got) else PageUnit(True, fp=tuple(got))
    j = u - n_sink
    lo, hi = sink + j * bs, sink + (j + 1) * bs  # the unit's positions
    body: tuple[int, ...] | None = ()
    fp: tuple[tuple[int, ...], ...] | None = ()
    fp_from = 0
    for lay, plan in zip(layers, plans, strict=True):
        page = lay.tables.body_page(j) if body is not None else None
        body = None if page is None else (*body, page)
        window = lay.tables.window_pages(j) if fp is not None else None  # the unit's last FP pages
        written = _fp_written_from(plan, ends, lo, hi) if window is not None else hi
        if written < hi:
            fp += (window,)
            fp_from = max(fp_from, written, hi - len(window) * plan.fp_block_size)
        else:
            fp = None
    if body is None and fp is None:
        return None
    return PageUnit(False, body, fp, fp_from if fp is not None else 0)


@dataclass(frozen=True)
class Hit:
    """What a lookup gave a new request: `reused` leading tokens adopted from the index."""

    reused: int  # tokens whose K/V came from the index (0: a miss)
    units: int  # units adopted
    matched_units: int  # units the index held for this prompt (some may not be usable, see `attach`)


def _resume_pages(matched: Sequence[Unit], plan: LayerPlan, n_sink: int, j: int, layer: int):
    """The pages one layer adopts to resume decode-exactly after the sink and j body units, or None when the
    index lacks one: (body pages, first window page, window pages). The plan says where the body ends."""
    sink, bs, fbs = plan.sink, plan.block_size, plan.fp_block_size
    per_unit = bs // fbs  # FP pages spanning one unit
    r = sink + j * bs
    quantized_end = plan.quantized_end(r)
    body_len = quantized_end - sink
    body = []
    for k in range(-(-body_len // bs)):
        pages = matched[n_sink + k].pages.body
        if pages is None:
            return None
        body.append(pages[layer])
    first = body_len // fbs  # the window's first FP page
    window = []
    for k in range(body_len // bs, j):
        pu = matched[n_sink + k].pages
        # the window reads positions from max(page start, quantized_end) on: the copy must hold them
        if pu.fp is None or pu.fp_from > max(sink + k * bs, quantized_end):
            return None
        held = pu.fp[layer]  # the unit's last FP pages
        need = (k + 1) * per_unit - max(k * per_unit, first)
        if len(held) < need:
            return None
        window.extend(held[len(held) - need :])
    return body, first, window


def attach(cache: QuantizedCache, ids: Sequence[int], index: PrefixIndex) -> Hit:
    """Start an empty one-sequence cache at the longest cached prefix of `ids` it can resume from decode-
    exactly, leaving at least the last token to compute (see the module doc). Returns what was reused."""
    layers = _layers(cache)
    first = layers[0]
    if first.is_initialized and first.length:
        raise ValueError(f"attach needs an empty cache; this one holds {first.length} tokens")
    plans = _plans(layers, index.store)
    sink, bs = plans[0].sink, plans[0].block_size
    ids = list(ids)
    tokens = unit_tokens(ids[: max(len(ids) - 1, 0)], sink, bs)
    matched = index.match(tokens)
    n_sink = -(-sink // bs)
    if len(matched) < n_sink or (sink == 0 and not matched):
        return Hit(0, 0, len(matched))
    for j in range(len(matched) - n_sink, -1, -1):  # body units adopted: the largest that resumes exactly
        r = sink + j * bs
        if r == 0:
            break
        picks = [_resume_pages(matched, plan, n_sink, j, i) for i, plan in enumerate(plans)]
        if any(p is None for p in picks):
            continue
        for i, (layer, (body, window_first, window)) in enumerate(zip(layers, picks, strict=True)):
            sink_pages = [page for k in range(n_sink) for page in matched[k].pages.fp[i]]
            layer.adopt_prefix(r, sink_pages, body, window_first, window)
        return Hit(r, n_sink + j, len(matched))
    return Hit(0, 0, len(matched))
