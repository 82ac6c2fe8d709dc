"""Prefix caching on a shared page store: a new request reuses the pages of a prefix another request computed.

Positions are cut into *units*, one page per layer each: sink units (positions [0, sink), `block_size` at a
time) and body units (unit j holds positions sink + j*bs .. sink + (j+1)*bs - 1, logical page j of the body
and of the FP window, which share their numbering in `kvquant.cache.QuantizedLayer`). A unit is cached only
when all its positions are present. Per layer it may hold two versions of its tokens:

    body   the quantized page (codec fields of K and V), final once full: a token is encoded once
    fp     an FP page: a sink page, or the FP copy of a window page (what the window held when registered)

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
of units). The index holds one reference on every page it lists; `kvquant.evict` drops them under a budget.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .cache import QuantizedCache, QuantizedLayer
from .plan import LayerPlan
from .store import KVStore

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

Tokens = tuple[int, ...]


@dataclass
class PageUnit:
    """The pages of one unit over all layers (page ids per layer), as the index holds them."""

    sink: bool
    body: tuple[int, ...] | None = None  # body page per layer (quantized, or dense for fp16 schemes)
    fp: tuple[int, ...] | None = None  # FP page per layer: a sink page, or the FP copy of a window page
    fp_from: int = 0  # the FP copy holds the unit's positions >= this, in every layer (sink copies: all)


@dataclass
class Unit:
    """A cached unit in an index: its pages, its place in the chain, and when it was last used."""

    tokens: Tokens
    pages: PageUnit
    depth: int  # units before it
    last_used: int = 0


def unit_tokens(ids: Sequence[int], sink: int, block_size: int) -> list[Tokens]:
    """The token ids of every complete unit of `ids`: sink units, then body units (see the module doc)."""
    ids = list(ids)
    if len(ids) < sink:
        return []
    units = [tuple(ids[i : min(i + block_size, sink)]) for i in range(0, sink, block_size)]
    for start in range(sink, len(ids) - block_size + 1, block_size):
        units.append(tuple(ids[start : start + block_size]))
    return units


class PrefixIndex(ABC):
    """Cached units of one `KVStore`, looked up by token ids. Holds one reference on each page it lists."""

    kind: str = ""

    def __init__(self, store: KVStore):
        if not store.shareable:
            raise ValueError(
                "prefix caching needs full-attention layers; this model has sliding-window layers "
                f"{list(store.shape.sliding_layers)}, which release pages the prefix would need"
            )
        self.store = store
        self._clock = itertools.count(1)
        self.lookups = self.hit_units = self.looked_units = 0

    def tick(self) -> int:
        return next(self._clock)

    @abstractmethod
    def match(self, units: Sequence[Tokens]) -> list[Unit]:
        """The cached units of the longest cached prefix of `units` (marks them used)."""

    @abstractmethod
    def insert(self, units: Sequence[Tokens], pages: Sequence[PageUnit]) -> int:
        """Cache a run of units from the first one (pages as a sequence holds them); returns units added or
        upgraded (a body or FP version added to a unit cached without it). Pages already cached under other
        ids are left to their sequence."""

    @abstractmethod
    def units(self) -> Iterator[tuple[Unit, object]]:
        """Every cached unit with a handle for `drop`."""

    @abstractmethod
    def drop(self, handle: object) -> None:
        """Forget the unit and every unit cached after it (they could no longer be reached)."""

    @abstractmethod
    def leaves(self) -> Iterator[tuple[int, object]]:
        """(last used, handle) of the tail units of every leaf run, for leaf-wise eviction."""

    def clear(self) -> None:
        for unit, handle in list(self.units()):
            if unit.depth == 0:
                self.drop(handle)

    def __len__(self) -> int:
        return sum(1 for _ in self.units())

    # ---- what the index holds

    def pages_per_layer(self) -> int:
        n = 0
        for unit, _ in self.units():
            n += (unit.pages.body is not None) + (unit.pages.fp is not None)
        return n

    def held_bytes(self) -> int:
        """Bytes of the pages the index lists (some also held by running sequences)."""
        body = sum(lp.body_page_bytes for lp in self.store.layers)
        fp = sum(lp.fp_page_bytes for lp in self.store.layers)
        return sum((u.pages.body is not None) * body + (u.pages.fp is not None) * fp for u, _ in self.units())

    def evictable(self, unit: Unit) -> bool:
        """Whether dropping the unit frees its pages: the index holds the only reference to each."""
        for pool, pages in self._pools(unit):
            if any(pool.refcount(p) != 1 for p in pages):
                return False
        return True

    def evictable_bytes(self) -> int:
        total = 0
        for unit, _ in self.units():
            if self.evictable(unit):
                total += sum(self.store.pool_bytes(pool) * len(pages) for pool, pages in self._pools(unit))
        return total

    def _pools(self, unit: Unit):
        pu = unit.pages
        if pu.body is not None:
            for lp, page in zip(self.store.layers, pu.body, strict=True):
                yield lp.body, (page,)
        if pu.fp is not None:
            for lp, page in zip(self.store.layers, pu.fp, strict=True):
                yield lp.fp, (page,)

    def _ref(self, pages: PageUnit, which: str) -> None:
        ids = getattr(pages, which)
        for lp, page in zip(self.store.layers, ids, strict=True):
            (lp.body if which == "body" else lp.fp).incref(page)

    def _unref(self, unit: Unit) -> None:
        for pool, pages in self._pools(unit):
            for p in pages:
                pool.decref(p)
        unit.pages = PageUnit(unit.pages.sink)

    def _merge(self, unit: Unit, pages: PageUnit) -> bool:
        """Add the versions `pages` has and `unit` lacks (increfed), and take its FP copy where it holds more
        positions than the cached one; whether anything was added or replaced."""
        added = False
        for which in ("body", "fp"):
            mine, theirs = getattr(unit.pages, which), getattr(pages, which)
            if theirs is None:
                continue
            fuller = which == "fp" and mine is not None and pages.fp_from < unit.pages.fp_from
            if mine is None or fuller:
                self._ref(pages, which)  # before the old version's decref: they may be the same pages
                if fuller:
                    for lp, page in zip(self.store.layers, mine, strict=True):
                        lp.fp.decref(page)
                setattr(unit.pages, which, theirs)
                if which == "fp":
                    unit.pages.fp_from = pages.fp_from
                added = True
        return added

    def _new_unit(self, tokens: Tokens, pages: PageUnit, depth: int, now: int) -> Unit:
        unit = Unit(tokens, PageUnit(pages.sink, fp_from=pages.fp_from), depth, now)
        self._merge(unit, pages)
        return unit

    @property
    def hit_rate(self) -> float:
        """Units found over units looked up, over every lookup so far."""
        return self.hit_units / self.looked_units if self.looked_units else 0.0


# -------------------------------------------------------------------------------------------- hash chain


class HashChainIndex(PrefixIndex):
    """vLLM's prefix cache: unit key = hash(parent key, token ids, scheme, block size); a lookup walks the
    keys of a request's units until the first miss."""

    kind = "hash"

    def __init__(self, store: KVStore):
        super().__init__(store)
        self._salt = f"{store.scheme}|bs={store.block_size}".encode()
        self._units: dict[bytes, Unit] = {}
        self._children: dict[bytes, set[bytes]] = {}
        self._parent: dict[bytes, bytes] = {}

    def _keys(self, units: Sequence[Tokens]) -> Iterator[bytes]:
        key = self._salt
        for tokens in units:
            key = hashlib.sha256(key + b"|" + ",".join(map(str, tokens)).encode()).digest()
            yield key

    def match(self, units: Sequence[Tokens]) -> list[Unit]:
        now, out = self.tick(), []
        for key, tokens in zip(self._keys(units), units, strict=False):
            unit = self._units.get(key)
            if unit is None or unit.tokens != tokens:
                break
            unit.last_used = now
            out.append(unit)
        self.lookups += 1
        self.hit_units += len(out)
        self.looked_units += len(units)
        return out

    def insert(self, units: Sequence[Tokens], pages: Sequence[PageUnit]) -> int:
        now, added, parent = self.tick(), 0, None
        for depth, (key, tokens, pu) in enumerate(zip(self._keys(units), units, pages, strict=False)):
            unit = self._units.get(key)
            if unit is None:
                self._units[key] = self._new_unit(tokens, pu, depth, now)
                if parent is not None:
                    self._children.setdefault(parent, set()).add(key)
                    self._parent[key] = parent
                added += 1
            else:
                added += self._merge(unit, pu)
                unit.last_used = now
            parent = key
        return added

    def units(self) -> Iterator[tuple[Unit, object]]:
        return ((u, k) for k, u in list(self._units.items()))

    def drop(self, handle: object) -> None:
        parent = self._parent.pop(handle, None)
        if parent is not None:
            self._children.get(parent, set()).discard(handle)
        stack = [handle]
        while stack:
            key = stack.pop()
            unit = self._units.pop(key, None)
            if unit is not None:
                self._unref(unit)
            self._parent.pop(key, None)
            stack.extend(self._children.pop(key, ()))

    def leaves(self) -> Iterator[tuple[int, object]]:
        return ((u.last_used, k) for k, u in list(self._units.items()) if not self._children.get(k))


# -------------------------------------------------------------------------------------------- radix tree


@dataclass(eq=False)
class _Node:
    """A radix-tree node: an edge of units (their token ids and pages) below its parent."""

    units: list[Unit] = field(default_factory=list)
    children: dict[Tokens, _Node] = field(default_factory=dict)  # by the first unit's token ids
    parent: _Node | None = None

    @property
    def last_used(self) -> int:
        return max((u.last_used for u in self.units), default=0)


class RadixIndex(PrefixIndex):
    """SGLang's RadixAttention index: a radix tree over runs of units; a lookup walks the edges, an insert
    splits an edge where a new request diverges."""

    kind = "radix"

    def __init__(self, store: KVStore):
        super().__init__(store)
        self.root = _Node()

    def match(self, units: Sequence[Tokens]) -> list[Unit]:
        now, out, node, i = self.tick(), [], self.root, 0
        while i < len(units):
            child = node.children.get(units[i])
            if child is None:
                break
            k = 0
            while k < len(child.units) and i < len(units) and child.units[k].tokens == units[i]:
                child.units[k].last_used = now
                out.append(child.units[k])
                k, i = k + 1, i + 1
            if k < len(child.units):
                break
            node = child
        self.lookups += 1
        self.hit_units += len(out)
        self.looked_units += len(units)
        return out

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut node's edge after k units; returns the upper part (node keeps the lower part)."""
        upper = _Node(node.units[:k], {node.units[k].tokens: node}, node.parent)
        node.parent.children[node.units[0].tokens] = upper
        node.units = node.units[k:]
        node.parent = upper
        return upper

    def insert(self, units: Sequence[Tokens], pages: Sequence[PageUnit]) -> int:
        now, added, node, i = self.tick(), 0, self.root, 0
        n = min(len(units), len(pages))
        while i < n:
            child = node.children.get(units[i])
            if child is None:
                new = [self._new_unit(units[j], pages[j], j, now) for j in range(i, n)]
                node.children[units[i]] = _Node(new, {}, node)
                return added + len(new)
            k = 0
            while k < len(child.units) and i < n and child.units[k].tokens == units[i]:
                added += self._merge(child.units[k], pages[i])
                child.units[k].last_used = now
                k, i = k + 1, i + 1
            if k < len(child.units) and i < n:
                child = self._split(child, k)
            node = child
        return added

    def _walk(self) -> Iterator[_Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def units(self) -> Iterator[tuple[Unit, object]]:
        return ((u, (node, k)) for node in list(self._walk()) for k, u in enumerate(node.units))

    def drop(self, handle: object) -> None:
        node, k = handle
        for sub in [node, *self._below(node)]:
            for u in sub.units[k if sub is node else 0 :]:
                self._unref(u)
        node.children = {}
        node.units = node.units[:k]
        if not node.units:
            del node.parent.children[next(t for t, c in node.parent.children.items() if c is node)]

    def _below(self, node: _Node) -> list[_Node]:
        out, stack = [], list(node.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def leaves(self) -> Iterator[tuple[int, object]]:
        return ((node.last_used, (node, 0)) for node in list(self._walk()) if not node.children)


INDEXES: dict[str, type[PrefixIndex]] = {"hash": HashChainIndex, "radix": RadixIndex}


def make_index(kind: str, store: KVStore) -> PrefixIndex:
    """A prefix index by name ("hash" or "radix")."""
    try:
        return INDEXES[kind](store)
    except KeyError:
        raise ValueError(f"unknown prefix index {kind!r}; known: {', '.join(INDEXES)}") from None


# ----------------------------------------------------------------------------------- caches <-> the index


def _layers(cache: QuantizedCache) -> list[QuantizedLayer]:
    if cache.store is None:
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
    n_sink = -(-sink // bs)
    for u in range(len(tokens)):
        if u < n_sink:
            rows = [lay.sink_t.rows[0] for lay in layers]
            if any(u >= len(r) for r in rows):
                break
            pages.append(PageUnit(True, fp=tuple(r[u] for r in rows)))
            continue
        j = u - n_sink
        lo, hi = sink + j * bs, sink + (j + 1) * bs  # the unit's positions
        body: tuple[int, ...] | None = ()
        fp: tuple[int, ...] | None = ()
        fp_from = 0
        for lay, plan in zip(layers, plans, strict=True):
            bt, rt = lay.body_t, lay.recent_t
            if body is not None and (j + 1) * bs <= lay.body_len and bt.first <= j < bt.end:
                body += (bt.rows[0][j - bt.first],)
            else:
                body = None
            held = fp is not None and rt.first <= j < rt.end
            written = _fp_written_from(plan, ends, lo, hi) if held else hi
            if written < hi:
                fp += (rt.rows[0][j - rt.first],)
                fp_from = max(fp_from, written)
            else:
                fp = None
        if body is None and fp is None:
            break  # released (an eviction policy), or no FP value of it held: the chain stops here
        pages.append(PageUnit(False, body, fp, fp_from if fp is not None else 0))
    return index.insert(tokens[: len(pages)], pages)


@dataclass(frozen=True)
class Hit:
    """What a lookup gave a new request: `reused` leading tokens adopted from the index."""

    reused: int  # tokens whose K/V came from the index (0: a miss)
    units: int  # units adopted
    matched_units: int  # units the index held for this prompt (some may not be usable, see `attach`)


def _resume_pages(matched: Sequence[Unit], plan: LayerPlan, n_sink: int, j: int, layer: int):
    """The pages one layer adopts to resume decode-exactly after the sink and j body units, or None when the
    index lacks one: (body pages, first window page, window pages). The plan says where the body ends."""
    sink, bs = plan.sink, plan.block_size
    r = sink + j * bs
    quantized_end = plan.quantized_end(r)
    body_len = quantized_end - sink
    body = []
    for k in range(-(-body_len // bs)):
        pages = matched[n_sink + k].pages.body
        if pages is None:
            return None
        body.append(pages[layer])
    window = []
    for k in range(body_len // bs, j):
        pu = matched[n_sink + k].pages
        # the window reads positions from max(page start, quantized_end) on: the copy must hold them
        if pu.fp is None or pu.fp_from > max(sink + k * bs, quantized_end):
            return None
        window.append(pu.fp[layer])
    return body, body_len // bs, window


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
            layer.adopt_prefix(r, [matched[k].pages.fp[i] for k in range(n_sink)], body, window_first, window)
        return Hit(r, n_sink + j, len(matched))
    return Hit(0, 0, len(matched))
