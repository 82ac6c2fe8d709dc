"""The page store: preallocated pages of `block_size` tokens, addressed through block tables (vLLM's layout).

A `PagePool` holds one page format for one decoder layer: a set of named fields, each a tensor
(capacity, heads_f, block_size // tokens_f, cols_f) as a codec declares them (`kvquant.codec.Field`).
Pages are integer ids. Every page has a reference count; a page whose count drops to zero goes back to
the free list, and a pool that runs out of pages doubles its capacity (one copy, amortized), so appending
a token costs the same at 1k and at 128k tokens.

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

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .codec import Field

__all__ = ["BlockTable", "PagePool", "Region", "StoreError", "effective_block_size", "gather_region"]


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
    """Pages of one format (named fields) for one layer, preallocated and grown by doubling."""

    def __init__(
        self,
        fields: Mapping[str, Field],
        block_size: int,
        device: torch.device | str = "cpu",
        capacity: int = 4,
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
        capacity = max(int(capacity), 1)
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.zeros(
                (capacity, f.heads, block_size // f.tokens, f.cols), dtype=f.dtype, device=self.device
            )
            for name, f in self.fields.items()
        }
        self._refs = [0] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest id first

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
        """A free page with reference count 1 (its contents are whatever was there)."""
        if not self._free:
            self._grow(self.capacity * 2)
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for name, t in self.tensors.items():
            grown = torch.zeros((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device)
            grown[:old] = t
            self.tensors[name] = grown
        self._refs += [0] * (capacity - old)
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free

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
            f = self.fields[name]
            rows_per_page = self.block_size // f.tokens
            r = torch.arange(start // f.tokens, start // f.tokens + v.shape[2], device=table.device)
            pages = table[:, r // rows_per_page]  # (B, n_rows)
            dest = self.tensors[name]
            # advanced indices around a slice put their dims first: (B, n_rows, heads_f, cols_f)
            dest[pages.to(dest.device), :, (r % rows_per_page).to(dest.device)] = v.transpose(1, 2).to(dest.dtype)

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
        self._tensor: torch.Tensor | None = None

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
        """(B, num_pages) int64 on the pool's device; rebuilt only after the table changed."""
        if self._tensor is None:
            self._tensor = torch.tensor(self.rows, dtype=torch.int64, device=self.pool.device).reshape(
                self.batch, self.num_pages
            )
        return self._tensor

    def _changed(self) -> None:
        self._tensor = None

    def prepare(self, lo: int, hi: int) -> None:
        """Make logical pages [lo, hi) present and exclusively owned by each row: allocate missing pages at
        the end, copy shared ones (copy-on-write)."""
        if hi <= lo:
            return
        if self.num_pages == 0:
            self.first = lo
        if lo < self.first:
            raise StoreError(f"logical page {lo} was released (table starts at {self.first})")
        while self.end < hi:
            for row in self.rows:
                row.append(self.pool.allocate())
            self._changed()
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
        """Region tokens [start, start + length) as a `Region` (position: absolute position of token start)."""
        bs = self.pool.block_size
        if length <= 0:
            return Region(self.tensor()[:, :0], 0, 0, position)
        lo, hi = start // bs, -(-(start + length) // bs)
        if lo < self.first or hi > self.end:
            raise StoreError(f"tokens [{start}, {start + length}) are not all held (pages {self.first}..{self.end})")
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


def effective_block_size(block_size: int, *token_groups: int) -> int:
    """The smallest multiple of block_size that holds whole token groups of every codec."""
    return math.lcm(block_size, *token_groups)
