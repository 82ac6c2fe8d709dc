"""Saliency-aware mixed precision (`salient=N/G`, MiKV / ZipCache style): of every G consecutive tokens
that leave the FP window together, the N that the queries attended to most keep more precision.

What is stored (`kvquant.plan.LayerPlan.salient_fields`, counted by `nbytes()` and `kvquant.memory` like
every field):

    body page   the body codec's fields for every token (salient ones too: the codes are written at the
                flush, before the choice), and per G tokens N rows of the salient spec's K and V fields
                ("s.k.*", "s.v.*", fp16 by default) with each row's index in its group ("s.idx", uint8)
    FP page     beside K and V, each token's attention statistic "a" (fp32, one per KV head)

What attention reads: the body with the salient rows in place of their tokens' decoded codes
(`SalientState.patch`); a query that saw a token unquantized still reads its FP copy (decode-exact chunks,
`kvquant.attention`).

**The statistic, and why it is chunking-invariant.** Query p (at position p) sees key j unquantized when j
is in the sink or quantized_end(p + 1) <= j <= p (its FP window, `LayerPlan.quantized_end`). Its *share*
of key j is softmax over those FP keys only (sink and window, never the body) of its scores, summed over the
query heads of j's KV head. Token j's statistic is the sum of the shares it got from every query that saw it
unquantized; at the flush its score is that sum divided by the number of such queries, L - 1 - j (L: the
length whose update flushes j; ZipCache's normalized attention, which does not favour a group's first
tokens), and each KV head keeps the N of each group with the highest scores (ties: the earlier token).
Normalizing over the FP keys alone is what makes the rule exact under any chunking: the share needs only the
query and FP keys, which are the same whether the queries come one at a time or in a chunk, so a chunk adds
every query's shares at once, then chooses for the groups its update flushed (their last FP query is in the
chunk or before it), then attends. The full softmax would need each query's normalizer over the body as
that query saw it, i.e. the choices made for earlier groups by earlier queries of the same chunk: a chunk
would have to be processed in flush-step epochs. The share and the full probability differ by one factor per
query, so one query ranks keys alike under both; they differ in how queries are weighted. In float64
chunked and token-by-token runs agree to rounding (`tests/test_salient.py`); sums are accumulated in a
different order, so a tie within 1e-16 could rank differently (never seen).

`rule=stride` keeps tokens 0, G/N, 2G/N, ... of each group: the same bytes and the same window, no
statistics (a control that tells the choice from the extra bits).

Modes: `cache` (decode-exact, above) and `prefill`: `fp_prefill(cache)` runs a prompt's forward with FP
attention among its tokens (every key read unquantized) while the statistics follow the same rule, so the
prompt's queries choose its salient tokens. Not supported: sliding-window layers (refused by the plan), a
shared store with prefixes (refused by the cache), crop (the window's statistics hold the removed queries'
shares), fake mode (`kvquant.eval.fakequant`: no cache to keep statistics in), Triton kernels (the
reference path serves every salient layer; docs/research.md says what a kernel needs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .codecs.base import page_rows
from .plan import LayerPlan, salient_stat_dtype

if TYPE_CHECKING:
    from .paging import LayerTables
    from .view import LayerView

__all__ = ["SalientState", "fp_prefill", "fp_queries", "needs_prompt_queries"]

_ROW_TILE = 256  # query rows per block of the statistics (each reads a band of FP keys about a window wide)


@dataclass
class _Pending:
    """Tokens the last update encoded, waiting for the queries of its forward before their salient tokens
    are chosen: FP copies k, v (B, H, n, D) of positions start .., n a multiple of G, and their statistics
    stats (B, H, n) (float64) so far."""

    k: torch.Tensor
    v: torch.Tensor
    start: int
    stats: torch.Tensor


def fp_queries(plan: LayerPlan, positions: torch.Tensor) -> torch.Tensor:
    """How many queries see each body token (positions, a long tensor) unquantized: L - 1 - j, L the length
    whose update flushes position j (the first with quantized_end(L) > j)."""
    sink, step = plan.sink, plan.flush_step
    flush_len = sink + plan.window + step * ((positions - sink) // step + 1)
    return flush_len - 1 - positions


class SalientState:
    """One salient layer's statistics and choices, over its `LayerTables` (`kvquant.cache.SalientLayer`
    holds one and calls it around each append; attention calls `before_attention`). pending: the tokens the
    last update encoded, until the queries of its forward have been counted. fp_prefill: set by
    `fp_prefill(cache)` for a prompt's forward."""

    def __init__(self, plan: LayerPlan, tables: LayerTables):
        self.plan, self.tables = plan, tables
        self.salient = plan.scheme.salient
        self.stat_dtype = salient_stat_dtype(plan.dtype)
        self.pending: _Pending | None = None
        self.fp_prefill = False
        self._held: torch.Tensor | None = None  # statistics of window tokens the next append encodes

    # ---- around an append

    def before_append(self, num_new: int) -> None:
        """Choose for any group still pending (an update without attention in between: a prompt stored from
        K/V alone), and read the statistics of the window tokens this append of num_new tokens will encode
        before their pages go."""
        self.resolve()
        t = self.tables
        if self.fp_prefill and t.length:
            raise ValueError("fp_prefill: the prompt's forward must be the first one of the cache")
        p1 = t.length + num_new
        body_end = t.body_end
        leaving = self.plan.quantized_end(p1) - body_end
        held = min(body_end + leaving, max(t.length, t.sink)) - body_end  # those already in the window
        self._held = t.read_window(body_end, held)["a"][..., 0].double() if held > 0 else None

    def after_append(self, first_new: int, k: torch.Tensor, fresh) -> None:
        """New window tokens (positions from first_new on, k (B, H, t, D) the update's keys) start at 0; the
        tokens just encoded (`fresh`, as `_BodyWriter.flush` returns it) wait for the forward's queries."""
        t = self.tables
        w0 = max(first_new, t.sink, t.body_end)
        if w0 < t.length:
            b, h = k.shape[:2]
            t.write_window_fields(w0, {"a": k.new_zeros((b, h, t.length - w0, 1), dtype=self.stat_dtype)})
        held, self._held = self._held, None
        if fresh is not None:
            fk, fv, f0 = fresh
            stats = fk.new_zeros(fk.shape[:3], dtype=torch.float64)
            if held is not None:
                stats[:, :, : held.shape[2]] = held
            self.pending = _Pending(fk, fv, f0, stats)

    # ---- the statistics and the choice

    def before_attention(self, query: torch.Tensor, view, attention_mask, scaling: float | None):
        """Add the queries' shares, choose for the groups the update encoded, and return the body patch the
        reference path reads with (`kvquant.attention.reference_attention`'s body_patch)."""
        if self.salient.rule == "attn":
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            _accumulate(self, query, view, attention_mask, scale)
        patch = self.patch
        if self.fp_prefill:
            if self.pending is None or view.body.length != self.pending.k.shape[2]:
                raise ValueError(
                    "fp_prefill: the prompt's forward must be the cache's first and reach past the window"
                )
            patch = _copies_patch(self.pending)
        self.resolve()
        return patch

    def add_window_stats(self, position: int, shares: torch.Tensor) -> None:
        """Add shares (B, H, n) to the statistics of window positions [position, position + n)."""
        t = self.tables
        a = t.read_window(position, shares.shape[2])["a"][..., 0]
        t.write_window_fields(position, {"a": (a.double() + shares).to(self.stat_dtype)[..., None]})

    def resolve(self) -> None:
        """Choose the salient tokens of the groups the last update encoded (their statistics are final once
        the forward's queries are counted) and write them beside the body."""
        p, self.pending = self.pending, None
        if p is None:
            return
        sal, plan = self.salient, self.plan
        b, h, n, d = p.k.shape
        groups = n // sal.group
        if sal.rule == "attn":
            pos = torch.arange(p.start, p.start + n, device=p.k.device)
            score = p.stats / fp_queries(plan, pos).clamp(min=1)
            order = torch.argsort(score.view(b, h, groups, sal.group), dim=-1, descending=True, stable=True)
            idx = order[..., : sal.count].sort(dim=-1).values  # (B, H, groups, N)
        else:  # stride: the same slots in every group
            idx = (torch.arange(sal.count, device=p.k.device) * sal.ratio).expand(b, h, groups, sal.count)

        def pick(x: torch.Tensor) -> torch.Tensor:  # (B, H, n, D) -> (B, H, groups * N, D)
            at = idx[..., None].expand(b, h, groups, sal.count, d)
            return x.view(b, h, groups, sal.group, d).gather(3, at).reshape(b, h, groups * sal.count, d)

        sc = plan.salient_codec
        rows = {f"s.k.{name}": x for name, x in sc.encode(pick(p.k)).items()}
        rows |= {f"s.v.{name}": x for name, x in sc.encode(pick(p.v)).items()}
        rows["s.idx"] = idx.reshape(b, h, groups * sal.count, 1)
        self.tables.write_body_fields(p.start - plan.sink, rows)

    # ---- reading

    def patch(self, sub, k: torch.Tensor, v: torch.Tensor, key_frame, value_frame):
        """Body tokens of `sub` (a Region of body pages) decoded, k and v (B, H, sub.length, D) in the codecs'
        read frames: the salient tokens' rows put in place (in the same frames). Writes into k and v."""
        sal, plan = self.salient, self.plan
        pool = self.tables.body_pool.tensors
        g_lo, g_hi = sub.offset // sal.group, (sub.offset + sub.length) // sal.group
        rows = slice(g_lo * sal.count, g_hi * sal.count)  # the salient rows of the groups in `sub`
        if rows.stop <= rows.start:
            return k, v
        sc = plan.salient_codec

        def decoded(role: str, frame) -> torch.Tensor:
            fields = {n: page_rows(pool[f"s.{role}.{n}"], sub.table)[:, :, rows] for n in sc.fields()}
            x = sc.decode(fields, k.dtype)  # (B, H, m, D)
            return frame.into(x) if frame is not None else x

        idx = page_rows(pool["s.idx"], sub.table)[:, :, rows, 0].long()  # (B, H, m)
        groups = torch.arange(g_lo, g_hi, device=idx.device).repeat_interleave(sal.count)
        at = (groups * sal.group + idx - sub.offset)[..., None].expand(-1, -1, -1, k.shape[3])
        k.scatter_(2, at, decoded("k", key_frame))
        v.scatter_(2, at, decoded("v", value_frame))
        return k, v


def _copies_patch(pending: _Pending):
    """An FP prefill's body patch: every body token read from its FP copy (the prompt's first forward, whose
    body holds only tokens it encoded)."""

    def patch(sub, k, v, key_frame, value_frame):
        lo = sub.start - pending.start
        ck, cv = pending.k[:, :, lo : lo + sub.length], pending.v[:, :, lo : lo + sub.length]
        ck = key_frame.into(ck, k.dtype) if key_frame is not None else ck.to(k.dtype)
        cv = value_frame.into(cv, v.dtype) if value_frame is not None else cv.to(v.dtype)
        return ck, cv

    return patch


def _accumulate(
    layer: SalientState,
    query: torch.Tensor,
    view: LayerView,
    attention_mask: torch.Tensor | None,
    scale: float,
) -> None:
    """Add every query's shares (module docstring) to the statistics of the FP tokens it saw after the sink:
    the fresh copies (tokens this update encoded: the pending ones) and the window."""
    b, hq, q, d = query.shape
    hkv, kv_len = view.shape[1], view.shape[2]
    g = hq // hkv
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    sink_n, body_n = view.sink.length, view.body.length
    pend = layer.pending
    recent_k = _rows(view.fp_k, view.recent, work)  # (B, H_kv, n_recent, D)
    band_k = recent_k if pend is None else torch.cat([pend.k.to(work), recent_k], dim=2)
    band0 = sink_n + body_n if pend is None else view.fresh_start - view.start  # column of band_k[:, :, 0]
    if band0 + band_k.shape[2] != kv_len:
        raise RuntimeError(f"salient statistics: FP keys from column {band0} do not end at {kv_len}")
    sink_k = _rows(view.fp_k, view.sink, work)
    own = torch.arange(kv_len - q, kv_len, device=query.device)  # each query's own column
    ends = layer.plan.quantized_ends(own + view.start + 1) - view.start  # first column each saw unquantized
    explicit = attention_mask[..., :kv_len] if attention_mask is not None else None
    shares = torch.zeros((b, hkv, band_k.shape[2]), dtype=torch.float64, device=query.device)
    for r0 in range(0, q, _ROW_TILE):
        r1 = min(q, r0 + _ROW_TILE)
        lo, hi = max(int(ends[r0]) - band0, 0), min(int(own[r1 - 1]) + 1 - band0, band_k.shape[2])
        if hi <= lo:
            continue
        cols = torch.arange(band0 + lo, band0 + hi, device=query.device)
        seen = (cols[None, :] >= ends[r0:r1, None]) & (cols[None, :] <= own[r0:r1, None])  # (r, n)
        qg = query[:, :, r0:r1].to(work).reshape(b, hkv, g, r1 - r0, d)
        keys = torch.cat([sink_k, band_k[:, :, lo:hi]], dim=2)[:, :, None]  # (B, H_kv, 1, sink + n, D)
        s = (qg @ keys.transpose(-1, -2)) * scale  # (B, H_kv, g, r, sink + n)
        keep = torch.cat([torch.ones((r1 - r0, sink_n), dtype=torch.bool, device=query.device), seen], dim=1)
        s = _masked(s, keep, explicit, r0, r1, torch.cat([torch.arange(sink_n, device=query.device), cols]))
        p = _softmax_or_zero(s)[..., sink_n:]  # (B, H_kv, g, r, n): the shares of the band's keys
        shares[:, :, lo:hi] += p.sum(dim=(2, 3), dtype=torch.float64)
    n_fresh = 0 if pend is None else pend.k.shape[2]
    if pend is not None:
        pend.stats += shares[:, :, :n_fresh]
    if view.recent.length:
        layer.add_window_stats(view.recent.start, shares[:, :, n_fresh:])


def _rows(pool: torch.Tensor, region, work: torch.dtype) -> torch.Tensor:
    """FP keys of a sink or window region, (B, H_kv, n, D) in `work`."""
    return page_rows(pool, region.table)[:, :, region.offset : region.offset + region.length].to(work)


def _masked(
    s: torch.Tensor, keep: torch.Tensor, explicit: torch.Tensor | None, r0: int, r1: int, cols: torch.Tensor
) -> torch.Tensor:
    """Scores s (B, H_kv, g, r, n) with keys outside `keep` (r, n) and the model's mask (rows r0..r1 of
    columns `cols`) at -inf (a float mask is added, as attention adds it)."""
    s = s.masked_fill(~keep[None, None, None], float("-inf"))
    if explicit is not None:
        m = explicit[:, :, r0:r1].index_select(-1, cols)  # (B or 1, 1, r, n)
        if m.dtype == torch.bool:
            s = s.masked_fill(~m[:, :, None], float("-inf"))
        else:
            s = s + m[:, :, None].to(s.dtype)
    return s


def _softmax_or_zero(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension; a row with every key at -inf gives zeros (a padded query)."""
    mx = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)))
    total = e.sum(dim=-1, keepdim=True)
    return e / total.clamp_min(torch.finfo(s.dtype).tiny)


# ------------------------------------------------------------------------------------------------ prefill


def needs_prompt_queries(cache) -> bool:
    """Whether a cache chooses from attention statistics (salient=N/G with the attn rule), so a prompt
    stored from K/V alone (`kvquant.eval.measure.store_prefill`) would choose blind: use `fp_prefill`."""
    scheme = getattr(cache, "scheme", None)
    return getattr(scheme, "salient", None) is not None


@contextlib.contextmanager
def fp_prefill(cache) -> Iterator[None]:
    """The forward run inside is a prompt's prefill (prefill mode): its queries attend to every key of the
    prompt unquantized, as an FP prefill does, while the statistics follow the cache-mode rule, so the
    prompt's own queries choose its salient tokens; the tokens are stored as any update stores them. It
    must be the cache's first forward, and the prompt must reach past the window."""
    if not needs_prompt_queries(cache):
        raise ValueError(f"fp_prefill: {cache!r} has no salient= layers")
    for lay in cache.layers:
        lay.fp_prefill = True
    try:
        yield
    finally:
        for lay in cache.layers:
            lay.fp_prefill = False
