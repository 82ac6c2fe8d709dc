"""Eviction policies for a shared page store under a byte budget, selectable by name.

    none        never evict: an allocation over the budget raises BudgetError at once
    lru         least recently used cached units first (deepest first among equals), a unit at a time, any
                unit whose pages only the prefix index holds (vLLM's free-block LRU)
    radix-lru   least recently used radix-tree leaves first, the unreferenced tail of a leaf at once
                (SGLang's RadixAttention); needs the radix index
    sliding:W   a running sequence keeps only its last W tokens plus its sink: pages behind are released
                after every forward (memory flat in length, as Mistral-style models); cached units are
                evicted as by `lru` when the budget is still short

A policy says only what goes next (`victim`): the store's budget (`kvquant.paging.budget.PageBudget`) asks
it when an allocation would exceed the budget, drops that unit from the index, and repeats. A policy frees
only pages whose one reference is the index's: a page a running sequence holds is never freed. When nothing
can be freed the budget raises `BudgetError`, naming the budget and what holds it.

A new policy is one class here, registered by `@register`:

    @register
    class FIFO(EvictionPolicy):
        name = "fifo"
        def victim(self, index):
            return next((h for u, h in index.units() if index.evictable(u)), None)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from .index import PrefixIndex

__all__ = [
    "LRU",
    "POLICIES",
    "EvictionPolicy",
    "NoEviction",
    "RadixLRU",
    "SlidingWindow",
    "make_policy",
    "register",
]


class EvictionPolicy:
    """What the budget evicts next, and what a running sequence may drop as it grows.

    name: the policy's name; usage: how it is written when it takes an argument ("sliding:W"), with `hint`
    saying what the argument is; needs_index: the prefix index kind it walks, None for any."""

    name: ClassVar[str] = ""
    usage: ClassVar[str] = ""
    hint: ClassVar[str] = ""
    needs_index: ClassVar[str | None] = None
    evicts: ClassVar[bool] = True  # False: the budget refuses at once ("no eviction policy")

    @classmethod
    def from_arg(cls, arg: str | None) -> EvictionPolicy | None:
        """The policy for `name[:arg]`, or None when the text is not this policy's form."""
        return cls() if arg is None else None

    def victim(self, index: PrefixIndex) -> object | None:
        """The handle (`PrefixIndex.drop`) of what to evict next, or None when nothing is evictable."""
        return None

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


def _lru_unit(index: PrefixIndex):
    """The least recently used evictable unit, the deepest among equals."""
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

    def victim(self, index: PrefixIndex) -> object | None:
        return _lru_unit(index)


@register
class RadixLRU(EvictionPolicy):
    name = "radix-lru"
    needs_index = "radix"

    def victim(self, index: PrefixIndex) -> object | None:
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

    def victim(self, index: PrefixIndex) -> object | None:
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
