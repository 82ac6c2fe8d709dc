"""Eviction policies for a shared page store under a byte budget, selectable by name.

    none        never evict: an allocation over the budget raises BudgetError at once
    lru         least recently used cached units first (deepest first among equals), a unit at a time, any
                unit whose pages only the prefix index holds (vLLM's free-block LRU)
    radix-lru   least recently used radix-tree leaves first, the unreferenced tail of a leaf at once
                (SGLang's RadixAttention); needs the radix index
    sliding:W   a running sequence keeps only its last W tokens plus its sink: pages behind are released
                after every forward (memory flat in length, as Mistral-style models); cached units are
                evicted as by `lru` when the budget is still short

A policy says what goes next. The store's budget (`kvquant.paging.budget.PageBudget`) asks it when an
allocation would exceed the budget, drops that unit from the index, and repeats. A policy frees only pages
whose one reference is the index's: a page a running sequence holds is never freed. When nothing can be
freed the budget raises `BudgetError`, naming the budget and what holds it.

The candidates are kept in eviction order as the index changes (vLLM's `FreeKVCacheBlockQueue`, SGLang's
eviction heap), never found by a scan: the index tells its listener when a unit is used, becomes evictable
(only the index holds its pages), stops being so (a running sequence adopted it) or leaves
(`kvquant.paging.index.IndexListener`), and the policy's `order` keeps a heap of them, so the next victim
costs O(log n). A policy declares its order by a `key` on units (smallest first), or builds its own
structure (`order`, as radix-lru keeps leaves); each built-in one keeps its scan as `victim_ref`, the twin
the tests compare it with. A policy with neither is asked `victim(index)` at every eviction (a scan).

A new policy is one class here, registered by `@register`:

    @register
    class FIFO(EvictionPolicy):
        name = "fifo"
        key = staticmethod(lambda unit: unit.serial)  # the unit cached first goes first
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .index import IndexListener

if TYPE_CHECKING:
    from .index import PrefixIndex, Unit

__all__ = [
    "LRU",
    "POLICIES",
    "EvictionOrder",
    "EvictionPolicy",
    "LeafOrder",
    "NoEviction",
    "RadixLRU",
    "SlidingWindow",
    "UnitOrder",
    "lru_key",
    "make_policy",
    "register",
]


class EvictionPolicy:
    """What the budget evicts next, and what a running sequence may drop as it grows.

    name: the policy's name; usage: how it is written when it takes an argument ("sliding:W"), with `hint`
    saying what the argument is; needs_index: the prefix index kind it walks, None for any; key: the order of
    evictable units (smallest first), or None for a policy that builds its own `order` or scans (`victim`)."""

    name: ClassVar[str] = ""
    usage: ClassVar[str] = ""
    hint: ClassVar[str] = ""
    needs_index: ClassVar[str | None] = None
    evicts: ClassVar[bool] = True  # False: the budget refuses at once ("no eviction policy")
    key: ClassVar[Callable[[Unit], object] | None] = None

    @classmethod
    def from_arg(cls, arg: str | None) -> EvictionPolicy | None:
        """The policy for `name[:arg]`, or None when the text is not this policy's form."""
        return cls() if arg is None else None

    def order(self, index: PrefixIndex) -> EvictionOrder | None:
        """This policy's candidates over `index`, kept in eviction order as it changes (the budget makes one
        per index, when it first evicts); None: the budget asks `victim` at every eviction instead."""
        return UnitOrder(index, type(self).key) if type(self).key is not None else None

    def victim(self, index: PrefixIndex) -> object | None:
        """For a policy without an order: the handle (`PrefixIndex.drop`) of what to evict next, found by
        looking at the index, or None when nothing is evictable."""
        return None

    def victim_ref(self, index: PrefixIndex) -> object | None:
        """The reference twin of `order(index).victim()`: the same handle, found by a scan (tests only)."""
        return self.victim(index)

    def on_step(self, cache) -> int:
        """After a forward of a running sequence (a `QuantizedCache`): pages it released (0 for cache-only
        policies)."""
        return 0

    def check_index(self, index: PrefixIndex | None) -> None:
        if self.needs_index is not None and (index is None or index.kind != self.needs_index):
            raise ValueError(
                f"the {self.name} policy evicts {self.needs_index}-tree leaves: use "
                f"prefix_cache={self.needs_index!r}"
            )

    def __str__(self) -> str:
        return self.name


_REGISTRY: dict[str, type[EvictionPolicy]] = {}


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Make a policy class selectable by its `name` (`make_policy`)."""
    _REGISTRY[cls.name] = cls
    return cls


# ------------------------------------------------------------------------------------ orders (no scans)


class _Heap:
    """Items by key, smallest first: a binary heap with lazy deletion. An item's live entry is the one last
    pushed for it; older ones are skipped when they surface, and the heap is rebuilt once they outnumber
    the live ones, so update / discard / first cost O(log n) amortized. Equal keys: the first queued."""

    def __init__(self) -> None:
        self._heap: list[list] = []  # [key, push count, item]
        self._live: dict[int, list] = {}  # id(item) -> its entry (the entry holds the item: ids stay unique)
        self._count = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def update(self, item: object, key: object | None) -> None:
        """Queue `item` under `key`, or take it out (key None)."""
        old = self._live.pop(id(item), None)
        if key is None:
            return
        if old is not None and old[0] == key:
            self._live[id(item)] = old  # still in the heap, in its place
            return
        entry = [key, next(self._count), item]
        self._live[id(item)] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def discard(self, item: object) -> None:
        self._live.pop(id(item), None)

    def first(self) -> object | None:
        heap = self._heap
        while heap:
            entry = heap[0]
            if self._live.get(id(entry[2])) is entry:
                return entry[2]
            heapq.heappop(heap)
        return None


class EvictionOrder(IndexListener):
    """A policy's eviction candidates over one index, kept in order as the index tells what changed."""

    def victim(self) -> object | None:
        """The handle (`PrefixIndex.drop`) of what to evict next, or None when nothing is evictable."""
        return None


class UnitOrder(EvictionOrder):
    """The evictable units of an index (`Unit.pinned == 0`: only the index holds their pages) by `key`."""

    def __init__(self, index: PrefixIndex, key: Callable[[Unit], object]):
        self.index, self.key, self.units = index, key, _Heap()
        for unit, _ in index.units():
            self.unit_changed(unit)

    def unit_changed(self, unit: Unit) -> None:
        self.units.update(unit, self.key(unit) if unit.pinned == 0 else None)

    def unit_removed(self, unit: Unit) -> None:
        self.units.discard(unit)

    def victim(self) -> object | None:
        unit = self.units.first()
        return None if unit is None else self.index.handle(unit)


def lru_key(unit: Unit) -> tuple[int, int, int]:
    """Least recently used first, the deepest among equals, then the first cached (the scan's order)."""
    return unit.last_used, -unit.depth, unit.serial


def _lru_unit(index: PrefixIndex):
    """The least recently used evictable unit, the deepest among equals (scan: `lru_key`'s reference)."""
    best = None
    for unit, handle in index.units():
        if index.evictable(unit):
            key = (unit.last_used, -unit.depth)
            if best is None or key < best[0]:
                best = (key, handle)
    return None if best is None else best[1]


@register
class NoEviction(EvictionPolicy):
    name = "none"
    evicts = False


@register
class LRU(EvictionPolicy):
    name = "lru"
    key = staticmethod(lru_key)

    def victim_ref(self, index: PrefixIndex) -> object | None:
        return _lru_unit(index)


class LeafOrder(UnitOrder):
    """radix-lru's order: leaves whose last unit is evictable, least recently used first (a leaf's use is
    its units' latest); the victim is such a leaf's whole unreferenced tail. With no such leaf, an inner
    evictable unit by `lru_key` (the units are kept too)."""

    def __init__(self, index: PrefixIndex):
        self.leaves = _Heap()
        super().__init__(index, lru_key)
        for node in index.nodes():
            self.node_changed(node)

    def unit_changed(self, unit: Unit) -> None:
        super().unit_changed(unit)
        node = unit.slot
        if node is not None and node.units and node.units[-1] is unit:  # a tail unit's state: its leaf's
            self.node_changed(node)

    def node_changed(self, node) -> None:
        tail_free = bool(node.units) and not node.children and node.units[-1].pinned == 0
        self.leaves.update(node, node.last_used if tail_free else None)

    def node_removed(self, node) -> None:
        self.leaves.discard(node)

    def victim(self) -> object | None:
        node = self.leaves.first()
        if node is None:  # no leaf has an unreferenced tail; an inner unit may still be free
            return super().victim()
        k = len(node.units)
        while k > 0 and node.units[k - 1].pinned == 0:
            k -= 1
        return node, k


@register
class RadixLRU(EvictionPolicy):
    name = "radix-lru"
    needs_index = "radix"

    def order(self, index: PrefixIndex) -> EvictionOrder | None:
        return LeafOrder(index)

    def victim_ref(self, index: PrefixIndex) -> object | None:
        best = None
        for last_used, (node, _) in index.leaves():
            k = len(node.units)
            while k > 0 and index.evictable(node.units[k - 1]):
                k -= 1
            if k < len(node.units) and (best is None or last_used < best[0]):
                best = (last_used, (node, k))
        if best is None:  # no leaf has an unreferenced tail; an inner unit may still be free
            return _lru_unit(index)
        return best[1]


@register
@dataclass
class SlidingWindow(EvictionPolicy):
    name: ClassVar[str] = "sliding"
    usage: ClassVar[str] = "sliding:W"
    hint: ClassVar[str] = "W tokens, e.g. sliding:256"
    window: int = 0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"sliding:W needs a window of at least 1 token, got {self.window}")
        self.name = f"sliding:{self.window}"  # the instance's name says its window (the class's: "sliding")

    @classmethod
    def from_arg(cls, arg: str | None) -> EvictionPolicy | None:
        return cls(int(arg)) if arg is not None and arg.isdecimal() else None

    key = staticmethod(lru_key)

    def victim_ref(self, index: PrefixIndex) -> object | None:
        return _lru_unit(index)

    def on_step(self, cache) -> int:
        return sum(layer.evict_before(layer.length - self.window) for layer in cache.layers)


POLICIES = tuple(cls.usage or cls.name for cls in _REGISTRY.values())


def make_policy(name: str | EvictionPolicy) -> EvictionPolicy:
    """A policy by name: none, lru, radix-lru, sliding:W (W tokens, e.g. sliding:256)."""
    if isinstance(name, EvictionPolicy):
        return name
    text = str(name).strip().lower()
    key, colon, arg = text.partition(":")
    cls = _REGISTRY.get(key)
    made = cls.from_arg(arg if colon else None) if cls is not None else None
    if made is None:
        known = ", ".join(c.usage or c.name for c in _REGISTRY.values())
        hints = "; ".join(c.hint for c in _REGISTRY.values() if c.hint)
        raise ValueError(f"unknown eviction policy {name!r}; known: {known} ({hints})")
    return made
