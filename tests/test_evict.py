"""Eviction under a byte budget: policies by name, LRU order, radix leaves, pages of running requests never
freed, the budget error, and sliding:W (memory flat; attention = the full model masked to sink + window)."""

from __future__ import annotations

import pytest
import torch
from serving_checks import Engines, ids
from tiny_models import make_tiny_model
from transformers import DynamicCache

from kvquant import memory
from kvquant.paging import BudgetError
from kvquant.paging.evict import LRU, RadixLRU, SlidingWindow, make_policy
from kvquant.serving.prefix import unit_tokens

SCHEME = "int4-g32"
N = 48  # tokens per request: three pages


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=4)


@pytest.fixture
def engines(model):
    made = Engines(model)
    yield made
    made.check_released()


def test_policies_by_name():
    assert isinstance(make_policy("lru"), LRU)
    assert isinstance(make_policy("radix-lru"), RadixLRU)
    p = make_policy("sliding:256")
    assert isinstance(p, SlidingWindow) and p.window == 256 and str(p) == "sliding:256"
    assert str(make_policy("none")) == "none"
    with pytest.raises(
        ValueError, match=r"unknown eviction policy 'fifo'; known: none, lru, radix-lru, sliding:W"
    ):
        make_policy("fifo")
    with pytest.raises(ValueError, match="at least 1 token"):
        make_policy(SlidingWindow(0))


def test_radix_lru_needs_the_radix_index(engines):
    with pytest.raises(ValueError, match="prefix_cache='radix'"):
        engines(SCHEME, prefix_cache="hash", policy="radix-lru")


def _request_bytes(model) -> int:
    return memory.cache_bytes(model.config, SCHEME, N, dtype=torch.float16)


def _snapshot(cache) -> list[torch.Tensor]:
    return [
        torch.cat([layer.view().keys(torch.float32), layer.view().values(torch.float32)])
        for layer in cache.layers
    ]


def _cached_units(engine, prompt) -> int:
    return len(engine.index.match(unit_tokens(prompt, 0, 16)))


@pytest.mark.parametrize("policy, index", [("lru", "hash"), ("lru", "radix"), ("radix-lru", "radix")])
def test_eviction_frees_least_recent_and_never_a_referenced_page(engines, model, policy, index):
    budget = int(3.5 * _request_bytes(model))
    engine = engines(SCHEME, prefix_cache=index, policy=policy, budget_bytes=budget)
    a, b, c, d = (ids(N, s) for s in (31, 32, 33, 34))
    for p in (a, b):  # finished: only the index holds their pages
        cache = engine.open()
        engine.prefill(cache, p)
        engine.close(cache, p)
    running = engine.open("running")
    engine.prefill(running, c)
    before = _snapshot(running)
    pages = [(lay.body_pool, p) for lay in running.layers for p in lay.body_t.pages()]
    late = engine.open("late")
    engine.prefill(late, d)  # A + B + C + D > 3.5 requests: A (the oldest) goes first
    assert engine.store.evicted_pages > 0
    assert engine.store.peak_bytes <= budget
    assert all(pool.refcount(p) >= 1 for pool, p in pages)  # the running request's pages: never freed
    for x, y in zip(_snapshot(running), before, strict=True):
        assert torch.equal(x, y)
    assert _cached_units(engine, b) == 3  # B was used after A: untouched
    left = _cached_units(engine, a)
    assert left < 3  # A (the least recent) lost units
    if policy == "radix-lru":
        assert left == 0  # radix-lru drops A's whole leaf at once
    engine.close(running)
    engine.close(late)


def test_lru_evicts_deepest_units_first(engines, model):
    budget = int(3.5 * _request_bytes(model))
    engine = engines(SCHEME, prefix_cache="radix", policy="lru", budget_bytes=budget)
    a, b, c, d = (ids(N, s) for s in (41, 42, 43, 44))
    for p in (a, b):
        cache = engine.open()
        engine.prefill(cache, p)
        engine.close(cache, p)
    held = [engine.open() for _ in range(2)]
    for cache, p in zip(held, (c, d), strict=True):
        engine.prefill(cache, p)
    # half a request's pages had to go: A's tail, its first unit stays reachable
    assert 1 <= _cached_units(engine, a) < 3
    for cache in held:
        engine.close(cache)


def test_budget_error_names_the_budget_and_holders(engines, model):
    budget = int(1.5 * _request_bytes(model))
    engine = engines(SCHEME, prefix_cache="radix", policy="lru", budget_bytes=budget)
    first = engine.open("request A")
    engine.prefill(first, ids(N, 51))
    second = engine.open("request B")
    with pytest.raises(BudgetError) as e:
        engine.prefill(second, ids(N, 52))
    msg = str(e.value)
    assert f"budget of {budget:,} B is spent" in msg
    assert (
        "request A: " in msg
        and "prefix cache: " in msg
        and "policy lru over the radix prefix cache: every cached page is referenced" in msg
    )
    assert engine.store.peak_bytes <= budget
    assert second.get_seq_length() == 0  # the failed prefill released what it had taken
    engine.close(first)
    engine.close(second)
    bare = engines(SCHEME, prefix_cache=None, budget_bytes=budget)
    c1, c2 = bare.open(), bare.open()
    bare.prefill(c1, ids(N, 53))
    with pytest.raises(BudgetError, match="no eviction policy"):
        bare.prefill(c2, ids(N, 54))
    bare.close(c1)
    bare.close(c2)


def test_nothing_fails_while_something_is_evictable(engines, model):
    """A budget of 1.2 requests runs 6 requests one after another: each evicts the previous one's pages."""
    budget = int(1.2 * _request_bytes(model))
    for policy in ("lru", "radix-lru"):
        engine = engines(SCHEME, prefix_cache="radix", policy=policy, budget_bytes=budget)
        for s in range(6):
            cache = engine.open()
            p = ids(N, 60 + s)
            engine.prefill(cache, p)
            engine.close(cache, p)
        assert engine.store.peak_bytes <= budget and engine.store.evicted_pages > 0


@torch.no_grad()
def test_sliding_window_is_flat_and_attends_to_sink_and_window(engines, model):
    """fp16 with a 4-token sink under sliding:16: pages per layer stay bounded, and every step's logits equal
    the full model with the released positions masked out (sink kept, positions unchanged)."""
    scheme = "fp16,sink=4"
    engine = engines(scheme, prefix_cache=None, policy="sliding:16")
    cache = engine.open()
    prompt, steps = ids(20, 71), ids(40, 72)
    pre = engine.prefill(cache, prompt)
    ref_cache = DynamicCache(config=model.config)
    ref = model(torch.tensor([prompt]), cache=ref_cache).logits[0, -1]
    torch.testing.assert_close(pre.logits, ref, atol=1e-5, rtol=0)
    layer = cache.layers[0]
    for n, t in enumerate(steps):
        length = len(prompt) + n + 1
        mask = torch.ones(1, length, dtype=torch.long)
        mask[0, 4 : layer.dropped] = 0  # what the sequence released before this step
        got = engine.step(cache, t)
        want = model(torch.tensor([[t]]), cache=ref_cache, attention_mask=mask).logits[0, -1]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert len(layer.sink_t.pages() | layer.recent_t.pages() | layer.body_t.pages()) <= 4
    assert layer.dropped > 4 and layer.sink_len == 4
    engine.close(cache)


def test_a_new_policy_is_one_class(engines, model):
    """A policy is one registered class: its `victim` is all the budget needs. Here: evict the unit cached
    first among those only the index holds (FIFO by depth order of insertion)."""
    from kvquant.paging import evict

    @evict.register
    class OldestFirst(evict.EvictionPolicy):
        name = "test-oldest-first"

        def victim(self, index):
            units = [(u.depth, h) for u, h in index.units() if index.evictable(u)]
            return min(units, key=lambda x: x[0])[1] if units else None

    try:
        assert isinstance(make_policy("test-oldest-first"), OldestFirst)
        budget = int(2.5 * _request_bytes(model))
        engine = engines(SCHEME, prefix_cache="hash", policy="test-oldest-first", budget_bytes=budget)
        for s in range(4):
            cache = engine.open()
            p = ids(N, 80 + s)
            engine.prefill(cache, p)
            engine.close(cache, p)
        assert engine.store.evicted_pages > 0 and engine.store.peak_bytes <= budget
        assert _cached_units(engine, ids(N, 83)) == 3  # the last request: untouched
    finally:
        evict._REGISTRY.pop("test-oldest-first")


@torch.no_grad()
def test_the_store_evicts_as_it_allocates(model):
    """No engine: a KVStore with a prefix index, a policy and a budget evicts inside its pools' allocation
    (nothing is injected from serving); the running cache's pages are never the ones freed."""
    from kvquant import QuantizedCache
    from kvquant.paging import KVStore
    from kvquant.serving.prefix import register

    budget = int(2.5 * _request_bytes(model))
    store = KVStore(model.config, SCHEME, budget_bytes=budget, prefix_cache="radix", policy="lru")
    for s in range(4):
        cache = QuantizedCache(SCHEME, model.config, store=store)
        p = ids(N, 90 + s)
        model(torch.tensor([p]), cache=cache)
        assert register(cache, p, store.index) == 3
        cache.reset()  # finished: only the index holds its pages
    assert store.evicted_pages > 0 and store.peak_bytes <= budget
    assert store.held_bytes() <= budget
    store.index.clear()
    store.check()
    assert store.pages_in_use() == 0
