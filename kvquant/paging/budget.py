"""A store's byte budget, enforced where pages are allocated (vLLM's `BlockPool` evicts as it allocates).

Every pool of a budgeted `KVStore` asks `PageBudget.admit` before it hands out a page. Over the budget, the
budget evicts: it takes the next unit of the prefix index to drop from its policy's order
(`kvquant.paging.evict`: the evictable units, kept in order as the index changes, so a victim costs
O(log n), never a scan), drops it (the index's references go, so pages only the index held are freed), and
repeats until the page fits. When nothing is evictable, `BudgetError` names the budget and what holds it.
Nothing calls back up into serving: the index, the order and the policy live beside the pools, in the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .evict import EvictionOrder, EvictionPolicy
    from .index import PrefixIndex
    from .pool import PagePool
    from .store import KVStore

__all__ = ["BudgetError", "PageBudget"]


class BudgetError(RuntimeError):
    """A shared store's byte budget is spent and nothing can be evicted; the message names the budget and
    what holds it."""


class PageBudget:
    """The byte budget of one store (None: no limit, only the peak is tracked), the prefix index whose
    unreferenced units may be evicted under it, and the policy that orders them."""

    def __init__(
        self,
        store: KVStore,
        budget_bytes: int | None,
        policy: EvictionPolicy,
        index: PrefixIndex | None,
    ):
        self.store = store
        self.budget_bytes = budget_bytes
        self.policy = policy
        self.index = index
        self.evicted_pages = 0  # pages (summed over layers) freed by eviction
        self.peak_bytes = 0  # the most bytes held at any allocation
        self._order: EvictionOrder | None = None
        self._ordered = False  # the order is made (and listens to the index) when the budget first evicts

    @property
    def evicts(self) -> bool:
        return self.index is not None and self.policy.evicts

    def admit(self, pool: PagePool) -> None:
        """Make room for one page of `pool` under the budget (evicting), or raise BudgetError."""
        store = self.store
        need = store.pool_bytes(pool)
        if self.budget_bytes is not None:
            while store.held_bytes() + need > self.budget_bytes:
                if not self._evict_one():
                    raise BudgetError(self.message(need))
        self.peak_bytes = max(self.peak_bytes, store.held_bytes() + need)

    @property
    def order(self) -> EvictionOrder | None:
        """The policy's eviction order over the index (None: the policy scans, `EvictionPolicy.victim`)."""
        if not self._ordered and self.evicts:
            self._order = self.policy.order(self.index)
            if self._order is not None:
                self.index.listener = self._order
            self._ordered = True
        return self._order

    def _evict_one(self) -> bool:
        """Drop the policy's next unit from the index; whether there was one."""
        if not self.evicts:
            return False
        order = self.order
        handle = order.victim() if order is not None else self.policy.victim(self.index)
        if handle is None:
            return False
        before = self.store.pages_in_use()
        self.index.drop(handle)
        self.evicted_pages += before - self.store.pages_in_use()
        return True

    def message(self, need: int) -> str:
        store = self.store
        held = store.held_bytes()
        parts = [f"{name}: {fn():,} B" for name, fn in store.holders.items()]
        holders = "; ".join(parts) if parts else f"{store.pages_in_use()} pages in use, no holder registered"
        why = "no eviction policy"
        if self.evicts:
            why = f"policy {self.policy} over the {self.index.kind} prefix cache: every cached page is "
            why += "referenced"
        return (
            f"KV-cache budget of {self.budget_bytes:,} B is spent: {held:,} B held and a page of {need:,} B "
            f"is needed; held by {holders} (shared pages count in each holder). Nothing can be evicted "
            f"({why}): raise the budget, use a smaller scheme, or finish a request"
        )
