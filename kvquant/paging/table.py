"""`BlockTable`: one region of one layer (sink, body or recent window) for every sequence of a batch, as page
ids per sequence in position order (vLLM's block table). Column j holds logical page `first + j`; region
token i lives in logical page i // block_size at slot i % block_size. Tables share pages by reference count
(beams, prefixes); a write into a shared page copies it first (copy-on-write).

    pool = PagePool({"k": Field(3, 1, 64, torch.float16), "v": ...}, block_size=16, device="cpu")
    table = BlockTable(pool, batch=2)
    table.write(0, {"k": k, "v": v})            # k: (2, 3, t, 64), region tokens [0, t)
    table.gather(0, t)                          # {"k": (2, 3, t, 64), "v": ...}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .pool import PagePool, Region, StoreError

__all__ = ["BlockTable"]


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
