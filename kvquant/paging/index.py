"""Prefix indexes over a shared page store: cached *units* (one page per layer each) looked up by token ids.

Positions are cut into units: sink units (positions [0, sink), `block_size` at a time) and body units (unit j
holds positions sink + j*bs .. sink + (j+1)*bs - 1: logical page j of the body and of the FP window). A unit
holds up to two versions of its tokens per layer: `body` (the quantized page, final once full) and `fp` (a
sink page, or the FP copy of a window page, whole from `fp_from` on). How units are filled from a cache and
adopted by one is `kvquant.serving.prefix` (register / attach).

Two indexes behind one interface (`PrefixIndex`): `HashChainIndex` (vLLM: a unit's key hashes its parent's
key, its token ids, the scheme and block size) and `RadixIndex` (SGLang: a radix tree whose edges are runs
of units). The index holds one reference on every page it lists; the store's budget
(`kvquant.paging.budget`) drops units in its eviction policy's order when an allocation would exceed it.

That order is kept as the index changes, never found by a scan (vLLM's free-block queue, SGLang's eviction
heap): the index follows the reference counts of the pages it lists (`PagePool.on_count`), so each unit knows
how many of its pages someone else also holds (`Unit.pinned`; 0: evicting it frees its pages), and it tells
its `listener` (an `IndexListener`, the policy's order in `kvquant.paging.evict`) when a unit is used, becomes
evictable or stops being so, or leaves, and, for the radix tree, when a node changes.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .pool import PagePool
    from .store import KVStore

__all__ = [
    "INDEXES",
    "HashChainIndex",
    "IndexListener",
    "PageUnit",
    "PrefixIndex",
    "RadixIndex",
    "Unit",
    "make_index",
    "unit_tokens",
]

Tokens = tuple[int, ...]


@dataclass
class PageUnit:
    """The pages of one unit over all layers (page ids per layer), as the index holds them."""

    sink: bool
    body: tuple[int, ...] | None = None  # body page per layer (quantized, or dense for fp16 schemes)
    # FP pages per layer: the sink's, or the FP copy of the window's (FP pages may be smaller than a body
    # page, so a unit spans several; a window copy holds the last of them: those not yet released)
    fp: tuple[tuple[int, ...], ...] | None = None
    fp_from: int = 0  # the FP copy holds the unit's positions >= this, in every layer (sink copies: all)


@dataclass
class Unit:
    """A cached unit in an index: its pages, its place in the chain, and when it was last used."""

    tokens: Tokens
    pages: PageUnit
    depth: int  # units before it
    last_used: int = 0
    # kept by the index for its eviction order (not part of the unit's value): how many of its pages someone
    # besides the index holds (0: evictable), its creation order, and its place (hash key, or radix node)
    pinned: int = field(default=0, repr=False, compare=False)
    serial: int = field(default=0, repr=False, compare=False)
    slot: object = field(default=None, repr=False, compare=False)


def unit_tokens(ids: Sequence[int], sink: int, block_size: int) -> list[Tokens]:
    """The token ids of every complete unit of `ids`: sink units, then body units (see the module doc)."""
    ids = list(ids)
    if len(ids) < sink:
        return []
    units = [tuple(ids[i : min(i + block_size, sink)]) for i in range(0, sink, block_size)]
    for start in range(sink, len(ids) - block_size + 1, block_size):
        units.append(tuple(ids[start : start + block_size]))
    return units


class IndexListener:
    """What an index tells as it changes (an eviction order keeps its candidates from this, without scans).
    Each is called once the index is consistent again; the default does nothing."""

    def unit_changed(self, unit: Unit) -> None:
        """The unit is new, was used (`last_used`), or became evictable or stopped being so (`pinned`)."""

    def unit_removed(self, unit: Unit) -> None:
        """The unit left the index."""

    def node_changed(self, node: _Node) -> None:
        """Radix tree: the node is new, or its units, children or use changed."""

    def node_removed(self, node: _Node) -> None:
        """Radix tree: the node left the tree."""


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
        self._serial = itertools.count()
        self.lookups = self.hit_units = self.looked_units = 0
        self.listener = IndexListener()  # the eviction order, once the budget first evicts
        # per pool: page -> the units listing it (one, in practice), to follow its reference count
        self._listed: dict[PagePool, dict[int, list[Unit]]] = {}
        for lp in store.layers:
            for pool in (lp.body, lp.fp):
                if pool.on_count is not None:
                    raise ValueError(f"{pool!r} already reports its counts to another prefix index")
                self._listed[pool] = listed = {}
                pool.on_count = functools.partial(self._count_changed, listed)

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

    @abstractmethod
    def handle(self, unit: Unit) -> object:
        """The unit's handle for `drop`, in O(1)."""

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
            n += (unit.pages.body is not None) + (len(unit.pages.fp[0]) if unit.pages.fp is not None else 0)
        return n

    def held_bytes(self) -> int:
        """Bytes of the pages the index lists (some also held by running sequences)."""
        body = sum(lp.body_page_bytes for lp in self.store.layers)
        total = 0
        for u, _ in self.units():
            pu = u.pages
            total += body if pu.body is not None else 0
            if pu.fp is not None:
                layers = zip(self.store.layers, pu.fp, strict=True)
                total += sum(lp.fp_page_bytes * len(pages) for lp, pages in layers)
        return total

    def evictable(self, unit: Unit) -> bool:
        """Whether dropping the unit frees its pages: the index holds the only reference to each (read from
        the counts; `unit.pinned == 0` says the same, kept as they change)."""
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
            for lp, pages in zip(self.store.layers, pu.fp, strict=True):
                yield lp.fp, pages

    def _version(self, pages: PageUnit, which: str) -> Iterator[tuple[PagePool, int]]:
        """(pool, page) of each layer's page of one version ("body" or "fp") of a unit."""
        ids = getattr(pages, which)
        if ids is None:
            return iter(())
        if which == "body":
            return zip((lp.body for lp in self.store.layers), ids, strict=True)
        return ((lp.fp, page) for lp, layer in zip(self.store.layers, ids, strict=True) for page in layer)

    def _ref(self, pages: PageUnit, which: str) -> None:
        for pool, page in self._version(pages, which):
            pool.incref(page)

    def _list(self, unit: Unit, which: str) -> None:
        """Follow the counts of a version the unit now holds (after the index's incref)."""
        for pool, page in self._version(unit.pages, which):
            self._listed[pool].setdefault(page, []).append(unit)
            unit.pinned += pool.refcount(page) != 1

    def _unlist(self, unit: Unit, which: str) -> None:
        """Stop following a version the unit gives up (before the index's decref)."""
        for pool, page in self._version(unit.pages, which):
            listed = self._listed[pool]
            owners = [u for u in listed[page] if u is not unit]
            if owners:
                listed[page] = owners
            else:
                del listed[page]
            unit.pinned -= pool.refcount(page) != 1

    def _count_changed(self, listed: dict[int, list[Unit]], page: int, before: int, after: int) -> None:
        """A page's count moved (`PagePool.on_count`): the units listing it are pinned while it is not 1."""
        if (before == 1) == (after == 1) or page not in listed:
            return
        step = 1 if before == 1 else -1
        for unit in listed[page]:
            unit.pinned += step
            if unit.pinned == (1 if step > 0 else 0):  # it stopped, or started, being evictable
                self.listener.unit_changed(unit)

    def _unref(self, unit: Unit) -> None:
        for which in ("body", "fp"):
            self._unlist(unit, which)
        for pool, pages in self._pools(unit):
            for p in pages:
                pool.decref(p)
        unit.pages = PageUnit(unit.pages.sink)
        self.listener.unit_removed(unit)

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
                    self._unlist(unit, which)
                    for lp, held in zip(self.store.layers, mine, strict=True):
                        for page in held:
                            lp.fp.decref(page)
                setattr(unit.pages, which, theirs)
                if which == "fp":
                    unit.pages.fp_from = pages.fp_from
                self._list(unit, which)
                added = True
        return added

    def _new_unit(self, tokens: Tokens, pages: PageUnit, depth: int, now: int) -> Unit:
        """A unit holding `pages` (increfed); the caller places it (`slot`) and tells the listener."""
        unit = Unit(tokens, PageUnit(pages.sink, fp_from=pages.fp_from), depth, now)
        unit.serial = next(self._serial)
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
            self.listener.unit_changed(unit)
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
                self._units[key] = unit = self._new_unit(tokens, pu, depth, now)
                unit.slot = key
                if parent is not None:
                    self._children.setdefault(parent, set()).add(key)
                    self._parent[key] = parent
                added += 1
            else:
                added += self._merge(unit, pu)
                unit.last_used = now
            self.listener.unit_changed(unit)
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

    def handle(self, unit: Unit) -> object:
        return unit.slot


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
                self.listener.unit_changed(child.units[k])
                out.append(child.units[k])
                k, i = k + 1, i + 1
            self.listener.node_changed(child)
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
        for unit in upper.units:
            unit.slot = upper
        self.listener.node_changed(upper)
        self.listener.node_changed(node)
        return upper

    def insert(self, units: Sequence[Tokens], pages: Sequence[PageUnit]) -> int:
        now, added, node, i = self.tick(), 0, self.root, 0
        n = min(len(units), len(pages))
        while i < n:
            child = node.children.get(units[i])
            if child is None:
                return added + self._add_node(node, units, pages, i, n, now)
            k = 0
            while k < len(child.units) and i < n and child.units[k].tokens == units[i]:
                added += self._merge(child.units[k], pages[i])
                child.units[k].last_used = now
                self.listener.unit_changed(child.units[k])
                k, i = k + 1, i + 1
            if k < len(child.units) and i < n:
                child = self._split(child, k)  # tells the listener of both parts
            else:
                self.listener.node_changed(child)
            node = child
        return added

    def _add_node(
        self, node: _Node, units: Sequence[Tokens], pages: Sequence[PageUnit], i: int, n: int, now: int
    ) -> int:
        """Hang units i..n-1 below `node` as one new edge; returns how many."""
        new = _Node([self._new_unit(units[j], pages[j], j, now) for j in range(i, n)], {}, node)
        node.children[units[i]] = new
        for unit in new.units:
            unit.slot = new
            self.listener.unit_changed(unit)
        self.listener.node_changed(new)
        if node is not self.root:
            self.listener.node_changed(node)  # no longer a leaf
        return len(new.units)

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
        below = self._below(node)
        for sub in [node, *below]:
            for u in sub.units[k if sub is node else 0 :]:
                self._unref(u)
        for sub in below:
            self.listener.node_removed(sub)
        node.children = {}
        node.units = node.units[:k]
        if node.units:
            self.listener.node_changed(node)  # a leaf now
            return
        parent = node.parent
        del parent.children[next(t for t, c in parent.children.items() if c is node)]
        self.listener.node_removed(node)
        if parent is not self.root:
            self.listener.node_changed(parent)  # it may be a leaf now

    def _below(self, node: _Node) -> list[_Node]:
        out, stack = [], list(node.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def leaves(self) -> Iterator[tuple[int, object]]:
        return ((node.last_used, (node, 0)) for node in list(self._walk()) if not node.children)

    def nodes(self) -> Iterator[_Node]:
        """Every node below the root."""
        return iter(list(self._walk()))

    def handle(self, unit: Unit) -> object:
        node = unit.slot  # an edge holds consecutive depths
        return node, unit.depth - node.units[0].depth


INDEXES: dict[str, type[PrefixIndex]] = {"hash": HashChainIndex, "radix": RadixIndex}


def make_index(kind: str, store: KVStore) -> PrefixIndex:
    """A prefix index by name ("hash" or "radix")."""
    try:
        return INDEXES[kind](store)
    except KeyError:
        raise ValueError(f"unknown prefix index {kind!r}; known: {', '.join(INDEXES)}") from None
