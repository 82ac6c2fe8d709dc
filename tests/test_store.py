"""The page store: pool invariants (counts, free list, doubling), block tables (writes across pages, gather,
copy-on-write, release, truncate, select), and the cache's use of them (beams share pages, append is O(1))."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

import kvquant
from kvquant.codecs.base import Field
from kvquant.paging import BlockTable, PagePool, StoreError

FP = Field(heads=2, tokens=1, cols=8, dtype=torch.float32)
STAT = Field(heads=2, tokens=4, cols=8, dtype=torch.float32)  # one row per 4 tokens (channel-wise stats)


def _pool(capacity: int = 2, block_size: int = 8) -> PagePool:
    return PagePool({"x": FP, "s": STAT}, block_size, capacity=capacity)


def _x(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, 2, t, 8, generator=torch.Generator().manual_seed(seed))


def test_allocate_free_and_counts():
    pool = _pool(capacity=2)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (0, 1) and pool.in_use == 2
    c = pool.allocate()  # full: doubles
    assert pool.capacity == 4 and c == 2
    pool.incref(a)
    pool.decref(a)
    assert pool.refcount(a) == 1
    pool.decref(a)
    assert pool.refcount(a) == 0 and pool.in_use == 2
    with pytest.raises(StoreError, match="double free of page 0"):
        pool.decref(a)
    with pytest.raises(StoreError, match="incref of free page 0"):
        pool.incref(a)
    pool.check()
    assert pool.allocate() == a  # reused from the free list


def test_growth_keeps_contents():
    pool = _pool(capacity=1)
    table = BlockTable(pool, batch=1)
    x = _x(1, 20)
    table.write(0, {"x": x})
    assert pool.capacity >= 3
    assert torch.equal(table.gather(0, 20, ["x"])["x"], x)


def test_block_size_must_hold_whole_token_groups():
    with pytest.raises(ValueError, match="groups 4 tokens per row, which does not divide block_size 6"):
        PagePool({"s": STAT}, block_size=6)


@pytest.mark.parametrize("chunks", [[20], [1] * 20, [3, 9, 8], [8, 8, 4]], ids=str)
def test_writes_in_any_chunks_read_back(chunks):
    pool = _pool()
    table = BlockTable(pool, batch=3)
    x = _x(3, 20)
    start = 0
    for n in chunks:
        table.write(start, {"x": x[:, :, start : start + n]})
        start += n
    assert table.num_pages == 3  # 20 tokens in pages of 8
    assert torch.equal(table.gather(0, 20, ["x"])["x"], x)
    assert torch.equal(table.gather(5, 11, ["x"])["x"], x[:, :, 5:16])  # a region starting mid-page
    assert len(table.pages()) == 9  # every sequence its own pages
    table.clear()
    assert pool.in_use == 0
    pool.check()


def test_rows_of_a_token_grouped_field():
    pool = _pool()
    table = BlockTable(pool, batch=1)
    s = _x(1, 5)  # 5 rows of 4 tokens = 20 tokens
    table.write(0, {"s": s[:, :, :2]})  # tokens 0..7: rows 0, 1 (page 0)
    table.write(8, {"s": s[:, :, 2:5]})  # tokens 8..19: rows 2, 3 (page 1), 4 (page 2)
    assert torch.equal(table.gather(0, 20, ["s"])["s"], s)


def test_select_shares_pages_and_copy_on_write():
    pool = _pool()
    table = BlockTable(pool, batch=2)
    x = _x(2, 12)
    table.write(0, {"x": x})  # each row: a full page and a partly filled one
    table.select([1, 1, 0])  # beams: row 1 twice
    assert table.batch == 3 and len(table.pages()) == 4  # 2 pages of row 1 shared, row 0 kept
    shared = table.rows[0][1]
    assert pool.refcount(shared) == 2 and table.rows[1][1] == shared
    y = _x(3, 1, seed=1)
    table.write(12, {"x": y})  # every row writes its partly filled page: the shared one is copied first
    assert table.rows[0][1] != table.rows[1][1]
    assert table.rows[0][0] == table.rows[1][0]  # the full page stays shared
    got = table.gather(0, 13, ["x"])["x"]
    want = torch.cat([x[[1, 1, 0]], y], dim=2)
    assert torch.equal(got, want)
    table.clear()
    assert pool.in_use == 0
    pool.check()


def test_release_and_truncate():
    pool = _pool()
    table = BlockTable(pool, batch=1)
    x = _x(1, 30)
    table.write(0, {"x": x})
    table.release_before(2)  # pages 0, 1 go
    assert table.first == 2 and pool.in_use == 2
    assert torch.equal(table.gather(16, 14, ["x"])["x"], x[:, :, 16:])
    with pytest.raises(StoreError, match="not all held"):
        table.region(8, 10)
    table.truncate(3)
    assert table.num_pages == 1 and pool.in_use == 1
    table.clear()
    assert pool.in_use == 0
    pool.check()


def test_beam_search_shares_pages_and_counts_return_to_zero():
    model = make_tiny_model(seed=2, num_hidden_layers=1)
    ids = torch.randint(1, 5000, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = kvquant.QuantizedCache("int4-g32,window=4", model.config)
    with torch.no_grad():
        model.generate(ids, cache=cache, max_new_tokens=4, num_beams=3, do_sample=False)
    layer = cache.layers[0]
    layer.check()
    # 3 beams over a 40-token prompt: the prompt's full body pages are shared, not copied three times
    per_beam_pages = -(-layer.body_len // layer.block_size)
    assert len(layer.body_t.pages()) < 3 * per_beam_pages
    assert cache.nbytes() < 3 * kvquant.memory.cache_bytes(
        model.config, cache.scheme, 44, dtype=torch.float32
    )
    cache.reset()
    assert layer.fp_pool.in_use == layer.body_pool.in_use == 0
    layer.check()


def test_append_writes_only_the_current_page():
    """Appending one token touches one page per region whatever the length: the pool tensors are written
    in place (same storage), and no page but the current one changes."""
    model = make_tiny_model(seed=2, num_hidden_layers=1)
    cache = kvquant.QuantizedCache("int8", model.config, capacity=512)
    layer = cache.layers[0]
    k = torch.randn(1, 2, 300, 64)
    layer.update(k, k)
    codes = layer.body_pool.tensors["k.codes"]
    before, ptr = codes.clone(), codes.data_ptr()
    layer.update(k[:, :, :1], k[:, :, :1])
    after = layer.body_pool.tensors["k.codes"]
    assert after.data_ptr() == ptr  # preallocated: no reallocation, no concatenation
    changed = (after != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert changed == [layer.body_t.rows[0][-1]]


@torch.no_grad()
def test_a_private_cache_is_a_store_with_one_holder():
    """Without store=, the cache's layers take their tables from a private KVStore (the same path as a
    shared one): pools sized for the batch when a layer first writes, memory given back on reset."""
    model = make_tiny_model(seed=2)
    cache = kvquant.QuantizedCache("int4-g32", model.config)
    assert not cache.store.shared and all(layer.store is cache.store for layer in cache.layers)
    model(torch.randint(1, 500, (2, 40), generator=torch.Generator().manual_seed(0)), cache=cache)
    for i, layer in enumerate(cache.layers):
        assert layer.tables.private and layer.tables.batch == 2
        assert layer.tables.body_pool is cache.store._own[i].body  # the store's pools, made for this layer
    before = cache.reserved_bytes()
    cache.reset()
    cache.store.check()
    assert cache.nbytes() == 0 and cache.reserved_bytes() < before  # trimmed: a private store gives back
    with pytest.raises(ValueError, match="takes a shared KVStore"):
        kvquant.QuantizedCache("int4-g32", model.config, store=cache.store)


def test_no_module_outside_the_store_reads_block_tables():
    """kvquant's modules outside kvquant/paging ask a layer's tables (`LayerTables`) through its methods;
    none reaches into a block table (`.rows`, or an attribute of sink_t / body_t / recent_t)."""
    import re
    from pathlib import Path

    root = Path(kvquant.__file__).resolve().parent
    reach = re.compile(r"\b(sink_t|body_t|recent_t)\.\w|\.rows\b")
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted(root.glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if reach.search(line)
    ]
    assert not found, "\n".join(found)
