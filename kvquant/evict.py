"""Eviction policies by name (`none`, `lru`, `radix-lru`, `sliding:W`): they live beside the pools, in
`kvquant.paging.evict` (one class each, registered by `register`); this module keeps their import path."""

from __future__ import annotations

from .paging.evict import (
    LRU,
    POLICIES,
    EvictionPolicy,
    NoEviction,
    RadixLRU,
    SlidingWindow,
    make_policy,
    register,
)

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
