"""`LayerTables`: one decoder layer's tokens for a batch of sequences, as three block tables over its pools.

    sink    positions [0, sink)                     FP pages     (none on a sliding layer)
    body    positions [sink, sink + body_len)       codec pages  K and V under one page id
    recent  positions [sink + body_len, length)     FP pages     the window (the same pool as the sink)

Body token i (position sink + i) sits in logical page i // block_size of the body table and in logical page
i // fp_block_size of the recent table (FP pages may be smaller than body pages: `kvquant.plan.LayerPlan`),
so a window page is released as soon as all of its tokens are encoded.
Positions below `dropped` after the sink are released (a sliding layer, or an eviction policy such as
`sliding:W`).

This is the store's side of a layer: the cache's layers (`kvquant.cache`) write and read through these
methods, and prefix caching (`kvquant.serving.prefix`) and eviction policies ask them for page ids and
releases.
No module outside the store reads the block tables themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from .pool import PagePool, Region
from .table import BlockTable

if TYPE_CHECKING:
    from ..plan import LayerPlan

__all__ = ["LayerTables"]


class LayerTables:
    """One layer's sink | body | recent tables for `batch` sequences over the pools `fp` and `body`.

    length: tokens per sequence (positions 0 .. length - 1); body_len: tokens encoded into the body;
    dropped: positions below it (after the sink) are released. `private`: the pools belong to this layer
    alone (a cache without a shared store), so releasing pages also gives their memory back (`trim`)."""

    def __init__(self, fp: PagePool, body: PagePool, plan: LayerPlan, batch: int, *, private: bool):
        self.fp_pool, self.body_pool, self.plan = fp, body, plan
        self.sink, self.block_size, self.fp_block_size = plan.sink, plan.block_size, plan.fp_block_size
        self.private = private
        self.sink_t = BlockTable(fp, batch)
        self.body_t = BlockTable(body, batch)
        self.recent_t = BlockTable(fp, batch)
        self.length = self.body_len = self.dropped = 0

    @property
    def batch(self) -> int:
        return self.sink_t.batch

    @property
    def body_end(self) -> int:
        """One past the last encoded position."""
        return self.sink + self.body_len

    @property
    def sink_len(self) -> int:
        return min(self.sink, self.length)

    @property
    def recent_len(self) -> int:
        return max(self.length - max(self.body_end, self.dropped), 0)

    # ---- appending

    def write_sink(self, position: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """FP K/V (B, H, n, D) of positions [position, position + n) < sink."""
        self.sink_t.write(position, {"k": k, "v": v})

    def write_window(self, position: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """FP K/V (B, H, n, D) of window positions [position, position + n)."""
        self.recent_t.write(position - self.sink, {"k": k, "v": v})

    def write_window_fields(self, position: int, values: Mapping[str, torch.Tensor]) -> None:
        """Some fields {name: (B, H, n, cols)} of window positions [position, position + n) (copy-on-write):
        a salient layer's statistics (`kvquant.salient`)."""
        self.recent_t.write(position - self.sink, values)

    def write_body_fields(self, start: int, values: Mapping[str, torch.Tensor]) -> None:
        """Some fields of body tokens [start, ...) already encoded (copy-on-write), as `PagePool.write` takes
        them: a salient layer's salient rows, written once its forward's queries are counted."""
        self.body_t.write(start, values)

    def read_window(self, position: int, n: int) -> Mapping[str, torch.Tensor]:
        """{"k", "v"} (B, H, n, D) of window positions [position, position + n) (a copy)."""
        return self.recent_t.gather(position - self.sink, n)

    def release_encoded_window(self) -> None:
        """Release window pages holding only encoded tokens (the window never exceeds the plan's bound)."""
        self.recent_t.release_before(self.body_len // self.fp_block_size)

    def body_slot(self, n: int) -> tuple[torch.Tensor, int]:
        """Body pages for tokens [body_len, body_len + n), present and exclusively owned (copy-on-write):
        (table (B, pages) of the body's held pages, offset of body token body_len in it)."""
        bs, start = self.block_size, self.body_len
        self.body_t.prepare(start // bs, -(-(start + n) // bs))
        return self.body_t.tensor(), start - self.body_t.first * bs

    # ---- reading

    def regions(self, start: int) -> tuple[Region, Region, Region, int]:
        """(sink, body, recent, view start) of what is held from position `start` on.

        Positions [sink, start) released by an eviction policy (`evict_before`): the sink stays, and its
        tokens are numbered as if they sat just before `start`, so index + view start is the position of
        every token after the sink and the sink is visible to every query."""
        sink, sink_n = self.sink, self.sink_len
        view_start = start - sink_n if start >= sink_n else start
        sink_region = self.sink_t.region(0, sink_n if start >= sink_n else sink_n - start)
        body_lo = max(start - sink, 0)
        body_region = self.body_t.region(body_lo, max(self.body_len - body_lo, 0), sink + body_lo)
        recent_lo = max(self.body_end, start)
        recent_region = self.recent_t.region(recent_lo - sink, max(self.length - recent_lo, 0), recent_lo)
        return sink_region, body_region, recent_region, view_start

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the next forward: the view starts at the first position still held."""
        kept_sink = self.sink_len if self.dropped else 0  # see regions()
        return self.length - self.dropped + kept_sink + query_length, self.dropped - kept_sink

    # ---- releasing

    def slide(self) -> None:
        """Release the pages holding only keys a sliding layer's next query can no longer attend to."""
        self.dropped = max(self.dropped, self.plan.dropped(self.length))
        # sliding layers have no sink: a page number is position // page size
        self.body_t.release_before(self.dropped // self.block_size)
        self.recent_t.release_before(self.dropped // self.fp_block_size)

    def evict_before(self, position: int) -> int:
        """Release the pages that hold only positions in [sink, position); the sink pages stay. Returns the
        pages released (over the batch)."""
        if self.length < self.sink:
            return 0
        page = max(min(position, self.length) - self.sink, 0) // self.block_size
        dropped = self.sink + page * self.block_size
        if dropped <= self.dropped:
            return 0
        before = len(self.body_t.pages()) + len(self.recent_t.pages())
        self.dropped = dropped
        self.body_t.release_before(page)
        self.recent_t.release_before(page * self.block_size // self.fp_block_size)
        return before - len(self.body_t.pages()) - len(self.recent_t.pages())

    def clear(self) -> None:
        for table in (self.sink_t, self.body_t, self.recent_t):
            table.clear()
        self.length = self.body_len = self.dropped = 0
        self._trim()

    def crop(self, keep: int, token_group: int) -> None:
        """Keep positions [0, keep) (keep <= length); token_group: the codecs' largest token group, which a
        cut through the body must not split."""
        if keep < self.dropped:
            raise ValueError(
                f"cannot crop to {keep} tokens: this sliding-window layer released positions below "
                f"{self.dropped}"
            )
        sink, bs, fbs = self.sink, self.block_size, self.fp_block_size
        if keep >= self.body_end:
            self.recent_t.truncate(-(-(keep - sink) // fbs))
        elif keep >= sink:
            body = keep - sink
            if body % token_group:
                raise ValueError(
                    f"cannot crop to {body} quantized tokens: that splits a channel-wise group of "
                    f"{token_group} tokens; crop fewer tokens or use a larger window"
                )
            self.recent_t.clear()
            self.body_t.truncate(-(-body // bs))
            self.body_len = body
        else:
            self.recent_t.clear()
            self.body_t.clear()
            self.body_len = 0
            self.sink_t.truncate(-(-keep // fbs))
        self.length = keep
        self._trim()

    def _trim(self) -> None:
        """Give free pages at the end of private pools back (a shared store's pages stay in its pools)."""
        if self.private:
            self.fp_pool.trim()
            self.body_pool.trim()

    def select(self, indices: list[int]) -> None:
        """Rows become [rows[i] for i in indices] (beams): pages are shared by reference, never copied."""
        for table in (self.sink_t, self.body_t, self.recent_t):
            table.select(indices)

    # ---- what is held

    def page_sets(self) -> tuple[set[int], set[int]]:
        """(FP page ids, body page ids) the sequences hold, each page once."""
        return self.sink_t.pages() | self.recent_t.pages(), self.body_t.pages()

    def nbytes(self) -> int:
        """Bytes of the pages held at the pools' dtype (a partly filled page counts in full)."""
        fp, body = self.page_sets()
        return len(fp) * self.fp_pool.page_bytes + len(body) * self.body_pool.page_bytes

    # ---- prefixes: the page ids a prefix index lists, and adopting them

    def sink_pages(self, unit: int) -> tuple[int, ...] | None:
        """Sequence 0's FP pages of sink unit `unit` (positions unit*bs .. up to the sink; bs the body page
        size), or None when not all held."""
        r, row = self.block_size // self.fp_block_size, self.sink_t.rows[0]
        lo, hi = unit * r, min((unit + 1) * r, -(-self.sink // self.fp_block_size))
        return tuple(row[lo:hi]) if lo < hi <= len(row) else None

    def body_page(self, j: int) -> int | None:
        """Sequence 0's body page j when it is held and all its tokens are encoded, else None."""
        t = self.body_t
        held = (j + 1) * self.block_size <= self.body_len and t.first <= j < t.end
        return t.rows[0][j - t.first] if held else None

    def window_pages(self, j: int) -> tuple[int, ...] | None:
        """Sequence 0's FP window pages of body page j's tokens that are still held: the last ones of the
        block_size // fp_block_size pages spanning them (the first may be released once encoded), or None
        when none is held or the last is not."""
        t, r = self.recent_t, self.block_size // self.fp_block_size
        lo, hi = max(j * r, t.first), (j + 1) * r
        return tuple(t.rows[0][lo - t.first : hi - t.first]) if lo < hi <= t.end else None

    def adopt(
        self,
        length: int,
        sink_pages: list[int],
        body_pages: list[int],
        recent_first: int,
        recent_pages: list[int],
    ) -> None:
        """Start these empty one-sequence tables at `length` tokens on shared pages (increfed): the state
        decode-exact decoding reaches after `length` tokens. sink_pages hold positions [0, sink) (FP pages);
        body_pages logical body pages 0..; recent_pages logical FP pages recent_first.. (FP copies of the
        window). A later write into a shared page (the partial body page) copies it first."""
        sink, bs, fbs = self.sink, self.block_size, self.fp_block_size
        body_len = self.plan.quantized_end(length) - min(sink, length)
        recent_end = length - min(sink, length)  # recent: body tokens [body_len, recent_end)
        want = (-(-min(sink, length) // fbs), -(-body_len // bs), -(-recent_end // fbs) - body_len // fbs)
        got = (len(sink_pages), len(body_pages), len(recent_pages))
        if got != want or (recent_pages and recent_first != body_len // fbs):
            raise ValueError(
                f"pages for {length} tokens do not cover sink | body | window: need {want} pages "
                f"(window from logical FP page {body_len // fbs}), got {got} (from {recent_first})"
            )
        self.sink_t.adopt(0, sink_pages)
        self.body_t.adopt(0, body_pages)
        self.recent_t.adopt(recent_first, recent_pages)
        self.length, self.body_len, self.dropped = length, body_len, 0
