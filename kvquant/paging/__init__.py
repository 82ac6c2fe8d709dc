"""Paged KV storage: where the cache's pages live and how they are shared and evicted.

    pool.py     PagePool: pages of one format, reference counts, a free list, bounded growth; Region
    table.py    BlockTable: one region's page ids per sequence (copy-on-write, release, select)
    regions.py  LayerTables: one layer's sink | body | recent tables, the narrow interface layers, prefix
                caching and eviction use (nothing outside this package reads a block table)
    index.py    prefix indexes (hash chain, radix tree) over cached units of pages
    evict.py    eviction policies by name (none, lru, radix-lru, sliding:W), one class each
    budget.py   PageBudget: a store's byte budget, evicting in the policy's order as its pools allocate
    store.py    KVStore: every layer's pools, with the index, policy and budget beside them

Serving on top of it (engine, prefix caching, sessions) is `kvquant.serving`.
"""

from .budget import BudgetError, PageBudget
from .evict import EvictionPolicy, make_policy
from .index import PrefixIndex, make_index
from .pool import GROWTH_DIVISOR, PagePool, Region, StoreError, gather_region
from .regions import LayerTables
from .store import KVStore, LayerPools
from .table import BlockTable

__all__ = [
    "GROWTH_DIVISOR",
    "BlockTable",
    "BudgetError",
    "EvictionPolicy",
    "KVStore",
    "LayerPools",
    "LayerTables",
    "PageBudget",
    "PagePool",
    "PrefixIndex",
    "Region",
    "StoreError",
    "gather_region",
    "make_index",
    "make_policy",
]
