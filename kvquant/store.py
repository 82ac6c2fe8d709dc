"""The page store: preallocated pages of `block_size` tokens, addressed through block tables (vLLM's layout).

A `PagePool` holds one page format for one decoder layer: a set of named fields, each a tensor
(capacity, heads_f, block_size // tokens_f, cols_f) as a codec declares them (`kvquant.codec.Field`).
Pages are integer ids. Every page has a reference count; a page whose count drops to zero goes back to
the free list (the lowest id is handed out first). Pools hold what they report: page tensors are allocated
uninitialized (never zero-filled, so a page the cache has not written is not resident on the CPU), and a
pool that runs out grows to exactly what a write needs plus 1/16 of that (`GROWTH_DIVISOR`), never
doubling, so the reserve stays within one page and 6.25% of the pages in use; `trim()` gives back free
pages at the end.
Appending a token costs the same at 1k and at 128k tokens (amortized: a growth copies the pool once per
1/16 of its size).

A `BlockTable` is one region of one layer (sink, body or recent window) for every sequence of a batch:
page ids per sequence in position order. Column j holds logical page `first + j`; region token i lives in
logical page i // block_size at slot i % block_size. Tables share pages by reference count (beams,
prefixes); a write into a shared page copies it first (copy-on-write).

    pool = PagePool({"k": Field(3, 1, 64, torch.float16), "v": ...}, block_size=16, device="cpu")
    table = BlockTable(pool, batch=2)
    table.write(0, {"k": k, "v": v})            # k: (2, 3, t, 64), region tokens [0, t)
    table.gather(table.region(0, t))            # {"k": (2, 3, t, 64), "v": ...}

Invariants (tested): a page is free iff its count is zero; counts never go negative; a table never
holds a free page; `check()` verifies them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from .codec import Codec, Field
from .memory import KVShape
from .plan import LayerPlan
from .scheme import parse_scheme

__all__ = [
    "BlockTable",
    "BudgetError",
    "KVStore",
    "LayerPools",
    "PagePool",
    "Region",
    "StoreError",
    "gather_region",
]


GROWTH_DIVISOR = 16  # a pool grows by 1/16 of its pages in use (plus what the write needs), never doubling


class StoreError(RuntimeError):
    """A page store invariant would break (double free, a write into a freed page); a bug, not bad input."""


@dataclass(frozen=True)
class Region:
    """Tokens of one region as attention reads them: token r of sequence b is at page
    table[b, (offset + r) // block_size], slot (offset + r) % block_size. `length` is the same for every
    sequence; `start` is the absolute position of token 0 (for masks and decode-exact chunks)."""

    table: torch.Tensor  # (B, n_pages) int64 page ids
    offset: int
    length: int
    start: int = 0


class PagePool:
    """Pages of one format (named fields) for one layer, allocated uninitialized, grown in bounded steps."""

    def __init__(
        self,
        fields: Mapping[str, Field],
        block_size: int,
        device: torch.device | str = "cpu",
        capacity: int = 0,
        label: str = "",
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        for name, f in fields.items():
            if block_size % f.tokens:
                raise ValueError(
                    f"field {name!r} groups {f.tokens} tokens per row, which does not divide block_size "
                    f"{block_size}; use a block size that is a multiple of {f.tokens}"
                )
        self.fields = dict(fields)
        self.block_size = block_size
        self.device = torch.device(device)
        self.label = label
        capacity = max(int(capacity), 0)
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.empty(
                (capacity, f.heads, block_size // f.tokens, f.cols), dtype=f.dtype, device=self.device
            )
            for name, f in self.fields.items()
        }
        self._refs = [0] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest id first
        # called with this pool before a page is handed out: a shared `KVStore` enforces its byte budget
        # here (evicting, or raising BudgetError); None for a private pool
        self.on_allocate: Callable[[PagePool], None] | None = None

    # ---- sizes

    @property
    def capacity(self) -> int:
        return len(self._refs)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all fields."""
        return sum(f.nbytes(self.block_size) for f in self.fields.values())

    @property
    def reserved_bytes(self) -> int:
        """Bytes preallocated, used or not."""
        return self.capacity * self.page_bytes

    def __repr__(self) -> str:
        names = ", ".join(self.fields)
        return (
            f"PagePool({self.label or names}: block_size={self.block_size} tokens, {self.page_bytes} B/page, "
            f"{self.in_use}/{self.capacity} pages in use)"
        )

    # ---- pages

    def allocate(self) -> int:
        """A free page with reference count 1 (its contents are whatever was there: uninitialized, stale)."""
        if self.on_allocate is not None:
            self.on_allocate(self)
        if not self._free:
            self.reserve(1)
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def reserve(self, pages: int) -> None:
        """Make at least `pages` pages free, growing once: to the pages then in use plus a slack of
        ceil((in use + pages) / 16) pages (`GROWTH_DIVISOR`): one page at a time costs one copy of the pool
        per 1/16 of its size, and the reserve stays within 6.25% of the pages in use, rounded up."""
        short = pages - len(self._free)
        if short <= 0:
            return
        need = self.capacity + short
        self._resize(need + -(-(self.in_use + pages) // GROWTH_DIVISOR))

    def _resize(self, capacity: int) -> None:
        """Grow (or, with every page past `capacity` free, shrink) the page tensors; ids below stay put."""
        old = self.capacity
        if capacity == old:
            return
        keep = min(old, capacity)
        for name, t in self.tensors.items():
            resized = torch.empty((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)
            if keep:
                resized[:keep] = t[:keep]
            self.tensors[name] = resized
        if capacity > old:
            self._refs += [0] * (capacity - old)
            self._free = list(range(capacity - 1, old - 1, -1)) + self._free
        else:
            del self._refs[capacity:]
            self._free = [p for p in self._free if p < capacity]

    def trim(self) -> int:
        """Give back the free pages after the last page in use (the tensors shrink; ids in use stay).
        Returns the pages given back."""
        last = max((p for p, n in enumerate(self._refs) if n > 0), default=-1)
        freed = self.capacity - (last + 1)
        if freed > 0:
            self._resize(last + 1)
        return max(freed, 0)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def incref(self, page: int) -> None:
        if self._refs[page] <= 0:
            raise StoreError(f"incref of free page {page} in {self!r}")
        self._refs[page] += 1

    def decref(self, page: int) -> None:
        if self._refs[page] <= 0:
            raise StoreError(f"double free of page {page} in {self!r}")
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def copy(self, page: int) -> int:
        """A new page (count 1) holding the same contents: the copy in copy-on-write."""
        new = self.allocate()
        for t in self.tensors.values():
            t[new] = t[page]
        return new

    def check(self) -> None:
        """Raise StoreError when counts and the free list disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise StoreError(f"a page is on the free list twice in {self!r}")
        for page, n in enumerate(self._refs):
            if n < 0 or (n == 0) != (page in free):
                raise StoreError(f"page {page} has count {n} but free={page in free} in {self!r}")

    # ---- data

    def write(self, table: torch.Tensor, start: int, values: Mapping[str, torch.Tensor]) -> None:
        """Write region tokens [start, start + t) of every sequence: values[name] (B, heads_f, t // tokens_f,
        cols_f); table (B, n) maps logical pages (from 0) to page ids. start is a multiple of each field's
        `tokens`. The pages must be present and writable (`BlockTable.prepare`)."""
        for name, v in values.items():
            f, dest = self.fields[name], self.tensors[name]
            rows_per_page = self.block_size // f.tokens
            r0, n = start // f.tokens, v.shape[2]
            if v.dtype != dest.dtype:
                v = v.to(dest.dtype)
            if r0 // rows_per_page == (r0 + n - 1) // rows_per_page:  # one page per sequence: a slice write
                pages = table[:, r0 // rows_per_page]  # (B,)
                row = r0 % rows_per_page
                dest[pages, :, row : row + n] = v  # (B, heads_f, n, cols_f)
                continue
            r = torch.arange(r0, r0 + n, device=table.device)
            pages = table[:, r // rows_per_page]  # (B, n_rows)
            # advanced indices around a slice put their dims first: (B, n_rows, heads_f, cols_f)
            dest[pages, :, r % rows_per_page] = v.transpose(1, 2)

    def gather(self, region: Region, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The region's tokens as contiguous fields {name: (B, heads_f, rows, cols_f)} (a copy)."""
        names = list(names or self.fields)
        return gather_region({n: self.tensors[n] for n in names}, {n: self.fields[n] for n in names}, region)


def gather_region(
    pages: Mapping[str, torch.Tensor], fields: Mapping[str, Field], region: Region
) -> dict[str, torch.Tensor]:
    """Fields of a region's tokens, gathered from pool tensors pages[name] (P, heads_f, rows_per_page, cols)
    into contiguous (B, heads_f, length // tokens_f, cols) tensors (a copy): the reference path's read."""
    out = {}
    for name, pool in pages.items():
        tokens = fields[name].tokens
        t = pool[region.table.to(pool.device)]  # (B, n, heads_f, rows_per_page, cols)
        b, n, h, rpp, c = t.shape
        rows = t.permute(0, 2, 1, 3, 4).reshape(b, h, n * rpp, c)
        out[name] = rows[:, :, region.offset // tokens : (region.offset + region.length) // tokens]
    return out


class BlockTable:
    """One region of one layer for a batch of sequences: page ids per sequence in position order.

    Column j of every row is logical page `first + j` (pages in front may have been released, as a
    sliding-window layer does). All rows have the same number of columns."""

    def __init__(self, pool: PagePool, batch: int):
        self.pool = pool
        self.rows: list[list[int]] = [[] for _ in range(batch)]
        self.first = 0
        self._buf: torch.Tensor | None = (
            None  # (B, capacity) on the pool's device; columns [0, _synced) valid
        )
        self._synced = 0

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def num_pages(self) -> int:
        return len(self.rows[0]) if self.rows else 0

    @property
    def end(self) -> int:
        """One past the last logical page held."""
        return self.first + self.num_pages

    def pages(self) -> set[int]:
        return {p for row in self.rows for p in row}

    def tensor(self) -> torch.Tensor:
        """(B, num_pages) int64 on the pool's device (a view of a buffer that grows by doubling; appending a
        page writes one column, anything else rebuilds it)."""
        n = self.num_pages
        if self._buf is None or self._synced != n:
            cap = max(16, 2 * n)
            self._buf = torch.zeros((self.batch, cap), dtype=torch.int64, device=self.pool.device)
            if n:
                self._buf[:, :n] = torch.tensor(self.rows, dtype=torch.int64).reshape(self.batch, n)
            self._synced = n
        return self._buf[:, :n]

    def _changed(self) -> None:
        self._synced = -1

    def _appended(self) -> None:
        """Every row got one page at its end: write that column in place when the buffer is in sync."""
        n = self.num_pages
        if self._buf is not None and self._synced == n - 1 and n <= self._buf.shape[1]:
            self._buf[:, n - 1] = torch.tensor([row[-1] for row in self.rows], dtype=torch.int64)
            self._synced = n
        else:
            self._changed()

    def prepare(self, lo: int, hi: int) -> None:
        """Make logical pages [lo, hi) present and exclusively owned by each row: allocate missing pages at
        the end, copy shared ones (copy-on-write)."""
        if hi <= lo:
            return
        if self.num_pages == 0:
            self.first = lo
        if lo < self.first:
            raise StoreError(f"logical page {lo} was released (table starts at {self.first})")
        if self.end < hi:
            self.pool.reserve((hi - self.end) * self.batch)  # one growth for a long write, not many
        while self.end < hi:
            for row in self.rows:
                row.append(self.pool.allocate())
            self._appended()
        for row in self.rows:
            for j in range(lo - self.first, hi - self.first):
                if self.pool.refcount(row[j]) > 1:
                    new = self.pool.copy(row[j])
                    self.pool.decref(row[j])
                    row[j] = new
                    self._changed()

    def write(self, start: int, values: Mapping[str, torch.Tensor]) -> None:
        """Write region tokens [start, start + t) for every row (values as `PagePool.write` takes them)."""
        t = max(v.shape[2] * self.pool.fields[name].tokens for name, v in values.items())
        bs = self.pool.block_size
        self.prepare(start // bs, -(-(start + t) // bs))
        self.pool.write(self.tensor(), start - self.first * bs, values)

    def region(self, start: int, length: int, position: int = 0) -> Region:
        """Region tokens [start, start + length) as a `Region` (position: absolute position of token
        start)."""
        bs = self.pool.block_size
        if length <= 0:
            return Region(self.tensor()[:, :0], 0, 0, position)
        lo, hi = start // bs, -(-(start + length) // bs)
        if lo < self.first or hi > self.end:
            raise StoreError(
                f"tokens [{start}, {start + length}) are not all held (pages {self.first}..{self.end})"
            )
        return Region(self.tensor()[:, lo - self.first : hi - self.first], start - lo * bs, length, position)

    def gather(self, start: int, length: int, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        return self.pool.gather(self.region(start, length), names)

    def release_before(self, logical: int) -> None:
        """Drop logical pages < logical (decref); the table then starts at `logical` or later."""
        n = min(max(logical - self.first, 0), self.num_pages)
        if n == 0:
            return
        for row in self.rows:
            for page in row[:n]:
                self.pool.decref(page)
            del row[:n]
        self.first += n
        self._changed()

    def truncate(self, end: int) -> None:
        """Drop logical pages >= end."""
        keep = min(max(end - self.first, 0), self.num_pages)
        if keep == self.num_pages:
            return
        for row in self.rows:
            for page in row[keep:]:
                self.pool.decref(page)
            del row[keep:]
        if not self.num_pages:
            self.first = 0
        self._changed()

    def clear(self) -> None:
        self.truncate(self.first)
        self.first = 0

    def adopt(self, first: int, pages: list[int]) -> None:
        """An empty one-row table takes `pages` (logical pages first, first + 1, ...) by reference
        (incref): the pages of a cached prefix. A later write into one of them copies it first."""
        if self.batch != 1 or self.num_pages:
            raise StoreError(
                f"adopt needs an empty one-row table, this one has {self.batch} rows "
                f"and {self.num_pages} pages"
            )
        for page in pages:
            self.pool.incref(page)
        self.rows[0] = list(pages)
        self.first = first if pages else 0
        self._changed()

    def select(self, indices: list[int]) -> None:
        """Rows become [rows[i] for i in indices]; pages are shared by reference, never copied."""
        rows = [list(self.rows[i]) for i in indices]
        for row in rows:
            for page in row:
                self.pool.incref(page)
        for row in self.rows:
            for page in row:
                self.pool.decref(page)
        self.rows = rows
        self._changed()


# ------------------------------------------------------------------------------------------ shared store


class BudgetError(RuntimeError):
    """A shared store's byte budget is spent and nothing can be evicted; the message names the budget and
    what holds it."""


@dataclass(frozen=True)
class LayerPools:
    """One decoder layer's pools in a `KVStore`: FP pages (sink and window) and body pages (codec fields of
    K and V under one page id), with the codecs and the effective block size they were made for."""

    fp: PagePool
    body: PagePool
    key_codec: Codec
    value_codec: Codec
    block_size: int
    sliding_window: int | None
    fp_page_bytes: int  # bytes of one page at the store's accounting dtype (the budget's unit)
    body_page_bytes: int


class KVStore:
    """Page pools for every decoder layer of one model, shared by many `QuantizedCache` objects (one per
    request): pages of a common prefix are held once and shared by reference count.

        store = KVStore(model.config, "int4-g64", budget_bytes=64 << 20)
        cache = QuantizedCache("int4-g64", model.config, store=store)

    Bytes are counted at `accounting_dtype` (FP16 by default: what a deployment stores, whatever dtype the
    CPU computes in), so `held_bytes()` of one request equals `kvquant.memory.cache_bytes(..., dtype=fp16)`.
    With `budget_bytes`, every page allocation first checks the budget: over it, `evictor` (set by the
    serving layer: bytes needed -> bytes freed) frees unreferenced cached pages; when it frees nothing,
    `BudgetError` names the budget and each holder (`holders`: name -> bytes held).
    """

    def __init__(
        self,
        config,
        scheme,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        block_size: int = 16,
        capacity_tokens: int = 256,
        budget_bytes: int | None = None,
        accounting_dtype: torch.dtype | None = torch.float16,
    ):
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive (or None for no budget), got {budget_bytes}")
        self.scheme = parse_scheme(scheme)
        self.shape = KVShape.from_config(config)
        self.scheme.check_head_dim(self.shape.head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.budget_bytes = budget_bytes
        self.evictor: Callable[[int], int] | None = None
        self.evictor_label = "eviction"  # how the budget error names the evictor
        self.holders: dict[str, Callable[[], int]] = {}
        self.evicted_pages = 0  # pages (summed over layers) freed by the evictor
        self.peak_bytes = 0  # the most bytes held at any allocation
        acc = accounting_dtype or dtype
        h, d = self.shape.num_kv_heads, self.shape.head_dim
        self.layers: list[LayerPools] = []
        self.plans: list[LayerPlan] = []
        for i in range(self.shape.num_layers):
            window = self.shape.window_of(i)
            # per-layer specs as the cache's layers get them; codecs here only size the pages (a layer
            # encodes with its own, which carry calibration tables and RoPE)
            plan = LayerPlan.build(
                self.scheme.for_layer(i), heads=h, head_dim=d, dtype=dtype, block_size=block_size,
                sliding_window=window, layer=i,
            )
            bs = plan.block_size
            fp = PagePool(plan.fp_fields(), bs, self.device, plan.max_fp_pages, f"fp[{i}]")
            body_pages = plan.body_pages(capacity_tokens)
            body = PagePool(plan.body_fields(), bs, self.device, body_pages, f"body[{i}]")
            fp_b, body_b = plan.page_bytes(acc)
            for pool in (fp, body):
                pool.on_allocate = self._before_allocate
            self.plans.append(plan)
            self.layers.append(
                LayerPools(fp, body, plan.key_codec, plan.value_codec, bs, window, fp_b, body_b)
            )

    # ---- sizes

    @property
    def block_size(self) -> int:
        return self.layers[0].block_size

    @property
    def shareable(self) -> bool:
        """Whether prefixes can be shared: not across sliding-window layers, which release their pages."""
        return not self.shape.sliding_layers

    def pool_bytes(self, pool: PagePool) -> int:
        """Bytes of one page of `pool` at the accounting dtype."""
        for lp in self.layers:
            if pool is lp.fp:
                return lp.fp_page_bytes
            if pool is lp.body:
                return lp.body_page_bytes
        raise StoreError(f"{pool!r} is not a pool of this store")

    def held_bytes(self) -> int:
        """Bytes of the pages in use (reference count > 0) over every layer, at the accounting dtype."""
        return sum(
            lp.fp.in_use * lp.fp_page_bytes + lp.body.in_use * lp.body_page_bytes for lp in self.layers
        )

    def pages_in_use(self) -> int:
        return sum(lp.fp.in_use + lp.body.in_use for lp in self.layers)

    def reserved_bytes(self) -> int:
        """Bytes the pools have preallocated (at the compute dtype), used or not."""
        return sum(lp.fp.reserved_bytes + lp.body.reserved_bytes for lp in self.layers)

    def tables_bytes(self, tables_per_layer) -> int:
        """Bytes of the distinct pages that per-layer (fp tables, body tables) hold (accounting dtype)."""
        total = 0
        for lp, (fp_tables, body_tables) in zip(self.layers, tables_per_layer, strict=True):
            fp = set().union(*(t.pages() for t in fp_tables)) if fp_tables else set()
            body = set().union(*(t.pages() for t in body_tables)) if body_tables else set()
            total += len(fp) * lp.fp_page_bytes + len(body) * lp.body_page_bytes
        return total

    def check(self) -> None:
        for lp in self.layers:
            lp.fp.check()
            lp.body.check()

    def __repr__(self) -> str:
        budget = "no budget" if self.budget_bytes is None else f"budget {self.budget_bytes:,} B"
        return (
            f"KVStore({self.scheme}, {len(self.layers)} layers, block_size={self.block_size}, "
            f"{self.held_bytes():,} B held, {budget})"
        )

    # ---- the budget

    def _before_allocate(self, pool: PagePool) -> None:
        need = self.pool_bytes(pool)
        if self.budget_bytes is not None:
            while self.held_bytes() + need > self.budget_bytes:
                short = self.held_bytes() + need - self.budget_bytes
                freed = self.evictor(short) if self.evictor is not None else 0
                if freed <= 0:
                    raise BudgetError(self.budget_message(need))
        self.peak_bytes = max(self.peak_bytes, self.held_bytes() + need)

    def budget_message(self, need: int) -> str:
        held = self.held_bytes()
        parts = []
        for name, fn in self.holders.items():
            parts.append(f"{name}: {fn():,} B")
        holders = "; ".join(parts) if parts else f"{self.pages_in_use()} pages in use, no holder registered"
        why = "no eviction policy"
        if self.evictor is not None:
            why = f"{self.evictor_label}: every cached page is referenced"
        return (
            f"KV-cache budget of {self.budget_bytes:,} B is spent: {held:,} B held and a page of {need:,} B "
            f"is needed; held by {holders} (shared pages count in each holder). Nothing can be evicted "
            f"({why}): raise the budget, use a smaller scheme, or finish a request"
        )
