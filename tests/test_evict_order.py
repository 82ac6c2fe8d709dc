"""The eviction order kept beside the pool: on randomized workloads (requests that adopt a cached prefix and
cache the rest, releases, partial releases, lookups, FP upgrades, evictions under a budget) over both index
kinds, the incremental order names exactly the victims the scan (`victim_ref`) names, in the same order;
each unit's `pinned` count agrees with the reference counts; and an eviction never scans the index."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny_config

from kvquant.paging import KVStore
from kvquant.paging.budget import BudgetError
from kvquant.paging.evict import EvictionPolicy, LeafOrder, make_policy, register
from kvquant.paging.index import PageUnit

SCHEME = "int4-g32,window=16"
CASES = [("hash", "lru"), ("radix", "lru"), ("radix", "radix-lru"), ("hash", "sliding:16")]


def _versions(pu: PageUnit, store: KVStore):
    """(pool, page) of every page of a unit's versions."""
    out = []
    if pu.body is not None:
        out += list(zip((lp.body for lp in store.layers), pu.body, strict=True))
    if pu.fp is not None:  # FP pages per layer (several when FP pages are smaller than a body page)
        out += [(lp.fp, page) for lp, pages in zip(store.layers, pu.fp, strict=True) for page in pages]
    return out


class Workload:
    """Random requests on a budgeted store, with every eviction checked against the scan."""

    def __init__(self, kind: str, policy: str, seed: int, budget_units: int = 24):
        self.store = store = KVStore(make_tiny_config(), SCHEME, prefix_cache=kind, policy=policy)
        unit_bytes = sum(lp.body_page_bytes for lp in store.layers)
        store.budget.budget_bytes = budget_units * unit_bytes
        self.index, self.budget, self.policy = store.index, store.budget, store.policy
        self.rng = random.Random(seed)
        self.running: list[list] = []  # per running sequence: the (pool, page) references it holds
        self.victims: list = []
        self.fallbacks = 0  # radix-lru victims taken from inner units (no leaf had a free tail)
        evict_one = self.budget._evict_one

        def checked() -> bool:
            order = self.budget.order
            got, ref = order.victim(), self.policy.victim_ref(self.index)
            assert got == ref, (len(self.victims), got, ref)
            if isinstance(order, LeafOrder) and got is not None and order.leaves.first() is None:
                self.fallbacks += 1
            self.victims.append(ref)
            return evict_one()

        self.budget._evict_one = checked

    def _prompt(self) -> list[tuple[int, ...]]:
        return [(self.rng.randrange(3),) for _ in range(self.rng.randint(1, 8))]

    def _alloc(self, which: str, held: list) -> tuple:
        """A body page per layer, or one or two FP pages per layer (an FP copy spans the unit's FP pages
        still held), under the budget: it may evict, or raise with what it took already in held."""
        out = []
        n = self.rng.randint(1, 2)
        for lp in self.store.layers:
            pool = lp.body if which == "body" else lp.fp
            pages = []
            for _ in range(1 if which == "body" else n):
                pages.append(pool.allocate())
                held.append((pool, pages[-1]))
            out.append(pages[0] if which == "body" else tuple(pages))
        return tuple(out)

    def _new_pages(self, held: list) -> PageUnit:
        """A unit's pages as a new sequence computes them: body pages, sometimes an FP copy too."""
        body = self._alloc("body", held)
        if self.rng.random() < 0.3:
            return PageUnit(False, body, self._alloc("fp", held), self.rng.choice([0, 4, 8]))
        return PageUnit(False, body)

    def request(self) -> None:
        units = self._prompt()
        matched = self.index.match(units)
        held: list = []
        for u in matched:  # adopt the cached prefix (as `kvquant.serving.prefix.attach`)
            for pool, page in _versions(u.pages, self.store):
                pool.incref(page)
                held.append((pool, page))
        pages = [PageUnit(u.pages.sink, u.pages.body, u.pages.fp, u.pages.fp_from) for u in matched]
        try:
            while len(pages) < len(units):
                pages.append(self._new_pages(held))
            if self.rng.random() < 0.2 and matched:  # an FP copy of a cached unit, maybe fuller than its own
                k = self.rng.randrange(len(matched))
                pages[k] = PageUnit(False, pages[k].body, self._alloc("fp", held), self.rng.choice([0, 4]))
        except BudgetError:  # nothing left to evict: the request gives back what it took
            for pool, page in held:
                pool.decref(page)
            return
        self.index.insert(units, pages)
        self.running.append(held)

    def release(self, part: bool) -> None:
        held = self.running.pop(self.rng.randrange(len(self.running)))
        cut = len(held) // 2 if part else len(held)  # part: the front pages, as a sliding window drops them
        for pool, page in held[:cut]:
            pool.decref(page)
        if part:
            self.running.append(held[cut:])

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.45 or not self.running:
            self.request()
        elif r < 0.7:
            self.release(part=False)
        elif r < 0.8:
            self.release(part=True)
        elif r < 0.92:
            self.index.match(self._prompt())  # a lookup that adopts nothing: units used
        elif r < 0.99:
            self.budget._evict_one()
        else:
            self.index.clear()

    def check_pinned(self) -> None:
        for unit, _ in self.index.units():
            assert (unit.pinned == 0) == self.index.evictable(unit), unit


@pytest.mark.parametrize("kind, policy", CASES)
def test_the_order_evicts_exactly_as_the_scan(kind, policy):
    total = fallbacks = 0
    for seed in range(20):
        w = Workload(kind, policy, seed)
        for _ in range(250):
            w.step()
            w.check_pinned()
        while w.budget._evict_one():  # drain: the rest in order
            pass
        w.check_pinned()
        assert w.victims[-1] is None and w.policy.victim_ref(w.index) is None
        for held in w.running:
            for pool, page in held:
                pool.decref(page)
        w.index.clear()
        w.store.check()
        assert w.store.pages_in_use() == 0
        total += len(w.victims)
        fallbacks += w.fallbacks
    assert total > 20 * 40  # the budget evicted throughout, not only at the drain
    if policy == "radix-lru":
        assert fallbacks > 0  # inner units were taken when no leaf had a free tail


def _filled(kind: str, policy: str, requests: int = 6) -> KVStore:
    """A budgeted store whose index holds `requests` finished prompts of four units."""
    store = KVStore(make_tiny_config(), SCHEME, prefix_cache=kind, policy=policy)
    for s in range(requests):
        units = [(s, j) for j in range(4)]
        pages = [PageUnit(False, tuple(lp.body.allocate() for lp in store.layers)) for _ in units]
        store.index.insert(units, pages)
        for pu in pages:  # finished: only the index holds them
            for pool, page in _versions(pu, store):
                pool.decref(page)
    return store


@pytest.mark.parametrize("kind, policy", CASES)
def test_an_eviction_never_scans_the_index(kind, policy, monkeypatch):
    store = _filled(kind, policy)
    assert store.budget.order is not None  # made once (a walk of the index), then kept as it changes
    index = type(store.index)

    def no_scan(self):
        raise AssertionError("the budget scanned the index")

    for name in ("units", "leaves", "nodes"):
        monkeypatch.setattr(index, name, no_scan, raising=False)
    monkeypatch.setattr(index, "evictable", lambda self, unit: no_scan(self))
    freed = 0
    while store.budget._evict_one():
        freed += 1
    assert freed >= (6 if policy == "radix-lru" else 24)  # radix-lru: a whole leaf at a time
    monkeypatch.undo()
    assert len(store.index) == 0 and store.pages_in_use() == 0


def test_a_policy_declared_by_a_key():
    """A policy is one class with a `key` (here: the unit cached first goes first); the budget keeps it."""

    @register
    class FirstCached(EvictionPolicy):
        name = "test-first-cached"
        key = staticmethod(lambda unit: unit.serial)

    try:
        store = _filled("hash", "test-first-cached")
        assert isinstance(make_policy("test-first-cached"), FirstCached)
        order = store.budget.order
        first = next(u for u, _ in store.index.units() if u.serial == 0)
        assert order.victim() == store.index.handle(first)
        assert store.budget._evict_one()
        assert len(store.index) == 20  # the first prompt's first unit and the three after it
        assert min(u.serial for u, _ in store.index.units()) == 4
    finally:
        from kvquant.paging import evict

        evict._REGISTRY.pop("test-first-cached")
