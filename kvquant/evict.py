"""Eviction policies for a shared page store under a byte budget, selectable by name.

    none        never evict: an allocation over the budget raises BudgetError at once
    lru         least recently used cached units first (deepest first among equals), a unit at a time, any
                unit whose pages only the prefix index holds (vLLM's free-block LRU)
    radix-lru   least recently used radix-tree leaves first, the unreferenced tail of a leaf at once
                (SGLang's RadixAttention); needs the radix index
    sliding:W   a running sequence keeps only its last W tokens plus its sink: pages behind are released
                after every forward (memory flat in length, as Mistral-style models); cached units are
                evicted as by `lru` when the budget is still short

A policy frees only pages whose one reference is the index's: a page a running sequence holds is never
freed (dropping the index's reference leaves it to that sequence). When nothing can be freed the store
raises `kvquant.store.BudgetError`, naming the budget and what holds it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from .cache import QuantizedCache
from .prefix import PrefixIndex

__all__ = ["EvictionPolicy", "LRU", "NoEviction", "POLICIES", "RadixLRU", "SlidingWindow", "make_policy"]

logger = logging.getLogger(__name__)

POLICIES = ("none", "lru", "sliding:W", "radix-lru")


class EvictionPolicy:
    """What to free when the store's budget is short, and what a running sequence may drop as it grows."""

    name: str = ""

    def on_step(self, cache: QuantizedCache) -> int:
        """After a forward of a running sequence: pages it released (0 for cache-only policies)."""
        return 0

    def evict(self, index: PrefixIndex | None, need_bytes: int) -> int:
        """Free at least need_bytes if possible; the bytes freed (0: nothing evictable)."""
        return 0

    def __str__(self) -> str:
        return self.name


class NoEviction(EvictionPolicy):
    name = "none"


def _freeing(index: PrefixIndex, need_bytes: int, pick) -> int:
    """Drop what `pick(index)` chooses until need_bytes are freed or it chooses nothing."""
    store = index.store
    before, pages_before = store.held_bytes(), store.pages_in_use()
    while before - store.held_bytes() < need_bytes:
        handle = pick(index)
        if handle is None:
            break
        index.drop(handle)
    store.evicted_pages += pages_before - store.pages_in_use()
    return before - store.held_bytes()


def _lru_unit(index: PrefixIndex):
    best = None
    for unit, handle in index.units():
        if index.evictable(unit):
            key = (unit.last_used, -unit.depth)
            if best is None or key < best[0]:
                best = (key, handle)
    return None if best is None else best[1]


class LRU(EvictionPolicy):
    name = "lru"

    def evict(self, index: PrefixIndex | None, need_bytes: int) -> int:
        return 0 if index is None else _freeing(index, need_bytes, _lru_unit)


class RadixLRU(EvictionPolicy):
    name = "radix-lru"

    def evict(self, index: PrefixIndex | None, need_bytes: int) -> int:
        if index is None:
            return 0
        if index.kind != "radix":
            raise ValueError(
                f"radix-lru evicts radix-tree leaves; it needs the radix index, not {index.kind!r}"
            )

        def pick(ix):
            best = None
            for last_used, (node, _) in ix.leaves():
                k = len(node.units)
                while k > 0 and ix.evictable(node.units[k - 1]):
                    k -= 1
                if k < len(node.units) and (best is None or last_used < best[0]):
                    best = (last_used, (node, k))
            if best is None:  # no leaf has an unreferenced tail; an inner unit may still be free
                return _lru_unit(ix)
            return best[1]

        return _freeing(index, need_bytes, pick)


@dataclass
class SlidingWindow(EvictionPolicy):
    window: int = 0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"sliding:W needs a window of at least 1 token, got {self.window}")
        self.name = f"sliding:{self.window}"

    def on_step(self, cache: QuantizedCache) -> int:
        return sum(layer.evict_before(layer.length - self.window) for layer in cache.layers)

    def evict(self, index: PrefixIndex | None, need_bytes: int) -> int:
        return 0 if index is None else _freeing(index, need_bytes, _lru_unit)


def make_policy(name: str | EvictionPolicy) -> EvictionPolicy:
    """A policy by name: none, lru, radix-lru, sliding:W (W tokens, e.g. sliding:256)."""
    if isinstance(name, EvictionPolicy):
        return name
    text = str(name).strip().lower()
    if text == "none":
        return NoEviction()
    if text == "lru":
        return LRU()
    if text == "radix-lru":
        return RadixLRU()
    m = re.fullmatch(r"sliding:(\d+)", text)
    if m:
        return SlidingWindow(int(m[1]))
    raise ValueError(
        f"unknown eviction policy {name!r}; known: none, lru, radix-lru, sliding:W "
        "(W tokens, e.g. sliding:256)"
    )
