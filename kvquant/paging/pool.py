"""Pages of one format: `PagePool` (preallocated pages of `block_size` tokens, reference counts, a free list,
growth in bounded steps) and `Region` (tokens of a block table as attention reads them).

A pool holds one page format for one decoder layer: named fields, each a tensor (capacity, heads_f,
block_size // tokens_f, cols_f) as a codec declares them (`codecs.base.Field`). Pages are integer ids with
a reference count; a page whose count drops to zero goes back to the free list (the lowest id is handed out
first). Page tensors are allocated uninitialized (never zero-filled, so a page not written is not resident
on the CPU), and a pool that runs out grows to what a write needs plus 1/32 of that (`GROWTH_DIVISOR`),
never doubling; `trim()` gives back free pages at the end. A pool of a budgeted store asks its `budget`
before every allocation (`kvquant.paging.budget`): eviction happens there, as the pool allocates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..codecs.base import (  # the reference path's read of a region (one copy of that code)
    Field,
    gather_region,
)

if TYPE_CHECKING:
    from .budget import PageBudget

__all__ = ["GROWTH_DIVISOR", "PagePool", "Region", "StoreError", "gather_region"]


GROWTH_DIVISOR = 32  # a pool grows by 1/32 of its pages in use (plus what the write needs), never doubling


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
        # the byte budget of the store these pools belong to (`kvquant.paging.budget.PageBudget`): asked
        # before a page is handed out, it evicts cached pages in its policy's order or refuses; None: no limit
        self.budget: PageBudget | None = None
        # told (page, count before, count after) at each incref / decref: the prefix index follows which of
        # its pages only it holds (`kvquant.paging.index`), so eviction never scans; None: nobody listens
        self.on_count: Callable[[int, int, int], None] | None = None

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
        if self.budget is not None:
            self.budget.admit(self)
        if not self._free:
            self.reserve(1)
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def reserve(self, pages: int) -> None:
        """Make at least `pages` pages free, growing once: to the pages then in use plus a slack of
        ceil((in use + pages) / 32) pages (`GROWTH_DIVISOR`): one page at a time costs one copy of the pool
        per 1/32 of its size, and the reserve stays within 3.2% of the pages in use, rounded up."""
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
        if self.on_count is not None:
            self.on_count(page, self._refs[page] - 1, self._refs[page])

    def decref(self, page: int) -> None:
        if self._refs[page] <= 0:
            raise StoreError(f"double free of page {page} in {self!r}")
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)
        if self.on_count is not None:
            self.on_count(page, self._refs[page] + 1, self._refs[page])

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
