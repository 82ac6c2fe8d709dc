"""The page store, as `kvquant.paging` holds it (this module keeps the import path of its names):

    PagePool, Region, gather_region   pages of one format (`kvquant.paging.pool`)
    BlockTable                        one region's page ids per sequence (`kvquant.paging.table`)
    LayerTables                       one layer's sink | body | recent tables (`kvquant.paging.regions`)
    KVStore, LayerPools               every layer's pools, with the prefix index, eviction policy and byte
                                      budget beside them (`kvquant.paging.store`, `kvquant.paging.budget`)

Invariants (tested): a page is free iff its count is zero; counts never go negative; a table never holds a
free page; `check()` verifies them.
"""

from __future__ import annotations

from .paging.budget import BudgetError, PageBudget
from .paging.pool import GROWTH_DIVISOR, PagePool, Region, StoreError, gather_region
from .paging.regions import LayerTables
from .paging.store import KVStore, LayerPools
from .paging.table import BlockTable

__all__ = [
    "GROWTH_DIVISOR",
    "BlockTable",
    "BudgetError",
    "KVStore",
    "LayerPools",
    "LayerTables",
    "PageBudget",
    "PagePool",
    "Region",
    "StoreError",
    "gather_region",
]
