"""Attention over a quantized layer, registered with transformers' AttentionInterface.

`QuantizedLayer.update` returns a `LayerView` in place of K/V tensors. The function registered here
as "kvquant" reads that view as it is stored, on the path `kvquant.backend` chose for the layer:
  - Triton kernels (kvquant.kernels) when the backend selects them;
  - otherwise the PyTorch reference (`reference_attention`): it streams the stored pages block by block
    (sink, body in chunks of `STREAM_TOKENS`, window), decodes one block at a time through the codec and
    folds it into an online softmax (flash-decoding's recurrence), so the whole cache is never decoded at
    once.
Given plain tensors (a DynamicCache, or no cache) it is transformers' SDPA attention unchanged, so a
model can keep this implementation whatever cache it is handed.

Decode-exact chunks: a multi-token forward lets each query see every key as the cache held it when that
query would have been decoded one token at a time (`_fresh_masks`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .backend import ATTN_IMPLEMENTATION, call_attends
from .cache import LayerView
from .codecs.base import PageRead, page_rows, split_region
from .paging import Region

__all__ = [
    "ATTN_IMPLEMENTATION",
    "STREAM_TOKENS",
    "kvquant_attention",
    "reference_attention",
    "register_attention",
]

logger = logging.getLogger(__name__)

STREAM_TOKENS = 1024  # keys decoded per step of the reference path: (B, H_kv, 1024, D) at a time


def kvquant_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, H_q, q, D)
    key: torch.Tensor | LayerView,
    value: torch.Tensor | LayerView,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Returns (attn_output (B, q, H_q, D), None), as transformers' attention functions do."""
    if isinstance(key, LayerView):
        if key.salient is not None:  # salient=N/G (kvquant.salient): statistics and choice, then reference
            patch = key.salient.before_attention(query, key, attention_mask, scaling)
            return reference_attention(query, key, attention_mask, scaling, body_patch=patch), None
        # the kernel when kvquant.backend chose it for this layer (LayerPaths.attend) and for this call
        if key.kernel_registry is not None and call_attends(query, attention_mask, key.shape[2]):
            from .kernels.dispatch import fused_attention  # lazy: `import kvquant` never imports triton

            out = fused_attention(query, key, attention_mask, scaling, registry=key.kernel_registry)
            if out is not None:  # None: the variant cannot be built here (the registry logged it once)
                return out, None
        return reference_attention(query, key, attention_mask, scaling), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


@dataclass(frozen=True)
class _Segment:
    """Stored keys/values of view columns [col, col + n) as attention reads them.

    fresh: None for keys every query reads as stored; "stored" for a body block that may hold keys the
    update before this call encoded (a query reads those only if it saw them quantized); "copy" for the FP
    copies of those keys (read only by the queries that saw them unquantized). See `_Masks`."""

    key: torch.Tensor  # (B, H_kv, n, D) in the working dtype
    value: torch.Tensor
    col: int
    fresh: str | None = None
    key_frame: object | None = None  # KernelFrame: keys are R k (score with R q); None: k itself
    value_frame: object | None = None  # KernelFrame: values are R v (rotate the block's output back)


def reference_attention(
    query: torch.Tensor,  # (B, H_q, q, D)
    view: LayerView,
    attention_mask: torch.Tensor | None,  # (B or 1, 1, q, >= T): bool (True = attend) or additive float
    scaling: float | None = None,
    *,
    stream_tokens: int = STREAM_TOKENS,
    body_patch=None,
) -> torch.Tensor:
    """Attention of `query` over the layer view, streaming its pages: (B, q, H_q, D).

    The keys and values of one block of pages are decoded by the view's codecs and folded into the result
    with their log-sum-exp, so the layer is never decoded whole. One query (decoding) is scored directly in
    fp32 (fp64 for an fp64 query), the H_q / H_kv query heads of a KV head sharing its decoded block; a chunk
    of queries goes through torch's fused CPU attention kernel one (query block, key block) tile at a time,
    skipping tiles its mask hides entirely (the causal upper triangle). A query that may attend to no key
    gets zeros. `attention_mask` None means causal over absolute positions (every key for one query).
    body_patch(sub, k, v, key_frame, value_frame) -> (k, v): called on every decoded body block (a salient
    layer puts its salient tokens in place, `kvquant.salient`); the block path then serves decoding too.
    """
    b, hq, q, d = query.shape
    hkv = view.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads cannot share {hkv} KV heads (H_q must be a multiple of H_kv)")
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    scale = scaling if scaling is not None else d**-0.5
    masks = _Masks(query, view, attention_mask)
    if q <= _DIRECT_QUERIES and masks.ends is None and body_patch is None:  # decoding: keys read as stored
        return _two_pass(query, view, masks, scale, work, stream_tokens)
    g = hq // hkv
    # (B, H_kv, q, g, D): a KV head's query heads side by side for each query row, so a tile of rows is one
    # contiguous (B, H_kv, r * g, D) block that torch's attention takes against unexpanded K/V
    state = _Merge((b, hkv, q, g, d), work, query.device)
    tiled = q > _DIRECT_QUERIES
    framed: dict[int, torch.Tensor] = {}  # the query in each key frame, rotated (and laid out) once per call
    for seg in _segments(view, masks, work, stream_tokens, body_patch):
        f = seg.key_frame
        key = id(f.signs) if f is not None else None
        if key not in framed:
            qs = f.into(query.to(work)) if f is not None else query
            framed[key] = qs.view(b, hkv, g, q, d).transpose(2, 3).contiguous() if tiled else qs
        qs = framed[key]
        if tiled:
            _tiles(qs, seg, masks, scale, state)
        else:
            visible, mask = masks.tile(slice(0, q), seg.col, seg.key.shape[2], seg.fresh)
            if visible:
                out, lse = _direct(qs, seg, mask, scale, work)  # (B, H_q, q, D), (B, H_q, q)
                out = out.view(b, hkv, g, q, d).transpose(2, 3)
                state.add(out, lse.view(b, hkv, g, q).transpose(2, 3), frame=seg.value_frame)
    out = state.result().permute(0, 2, 1, 3, 4).reshape(b, q, hq, d)  # (B, q, H_q, D)
    return out.to(query.dtype)


def _two_pass(
    query: torch.Tensor, view: LayerView, masks: _Masks, scale: float, work: torch.dtype, stream_tokens: int
) -> torch.Tensor:
    """A few queries that read every key as stored (decoding): the scores of all keys first (a layer's
    scores are small: (B, H_q, q, T)), one softmax, then the values into the output. The codec streams
    the body (`Codec.score_pages` / `value_pages`: `stream_tokens` keys at a time, decoded or, for affine
    codes, unpacked and scaled in the product, into one scratch buffer reused for keys and values), so no
    (B, H_kv, T, D) tensor is made and no running maximum is merged: (B, q, H_q, D)."""
    b, hq, q, d = query.shape
    hkv = view.shape[1]
    g = hq // hkv
    qw = query.to(work).reshape(b, hkv, g * q, d)  # (B, H_kv, g*q, D): query heads of a KV head together
    kf, vf = view.key_codec.read_frame(query.device), view.value_codec.read_frame(query.device)
    kc, vc = (kf.codec if kf else view.key_codec), (vf.codec if vf else view.value_codec)
    q_body = kf.into(qw) if kf is not None else qw  # the query in the keys' frame (R q for rotated keys)
    tokens = min(view.body.length, max(1, stream_tokens // view.block_size) * view.block_size)
    read = PageRead(stream_tokens, torch.empty(b * hkv * (tokens + view.block_size) * d, device=query.device))
    regions = _regions(view)
    parts = []
    for kind, col, region in regions:  # pass 1: scores (B, H_kv, g * q, n) per region
        if kind == "body":
            s = kc.score_pages(q_body, view.key_pages, region, read)
        else:
            s = torch.matmul(qw, _fp_rows(view.fp_k, region, work).transpose(-1, -2))
        s.mul_(scale)
        visible, mask = masks.tile(slice(0, q), col, region.length, None)
        s5 = s.view(b, hkv, g, q, region.length)
        if not visible:
            s5.fill_(float("-inf"))
        elif mask is not None:
            if mask.dtype == torch.bool:
                s5.masked_fill_(~mask.unsqueeze(2), float("-inf"))
            else:
                s5.add_(mask.unsqueeze(2).to(work))
        parts.append(s)
    scores = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]  # (B, H_kv, g * q, T)
    mx = scores.amax(dim=-1, keepdim=True)
    base = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))  # all masked: no NaN
    p = scores.sub_(base).exp_()
    total = p.sum(dim=-1, keepdim=True)
    out = None
    for kind, col, region in regions:  # pass 2: values
        w = p[..., col : col + region.length]
        if kind == "body":
            o = vc.value_pages(w, view.value_pages, region, read)
            if vf is not None and vf.signs is not None:  # values stored as R v: rotate their sum back once
                o = vf.out_of(o.view(b, hq, q, d)).view(b, hkv, g * q, d)
        else:
            o = torch.matmul(w, _fp_rows(view.fp_v, region, work))
        out = o if out is None else out.add_(o)
    if out is None:
        out = torch.zeros((b, hkv, g * q, d), dtype=work, device=query.device)
    out.div_(total.clamp_min(torch.finfo(work).tiny))
    return out.view(b, hq, q, d).transpose(1, 2).contiguous().to(query.dtype)  # (B, q, H_q, D)


def _regions(view: LayerView) -> list[tuple[str, int, Region]]:
    """(kind, first column, region) of the view's non-empty regions in column order: the FP sink, the
    body, the FP window."""
    sink_n, body_n = view.sink.length, view.body.length
    out = [("fp", 0, view.sink), ("body", sink_n, view.body), ("fp", sink_n + body_n, view.recent)]
    return [r for r in out if r[2].length]


def _fp_rows(pool: torch.Tensor, region: Region, work: torch.dtype) -> torch.Tensor:
    """FP keys or values of a sink or window region, (B, H_kv, n, D) in the working dtype."""
    return page_rows(pool, region.table)[:, :, region.offset : region.offset + region.length].to(work)


_DIRECT_QUERIES = 16  # up to this many queries are scored directly; more go through the fused kernel in tiles
_QUERY_TILE = 256
_MIXED_TILE = 64  # query rows per tile where a chunk's queries read fresh keys some as stored, some as copies


class _Merge:
    """Partial attention outputs over disjoint key sets, combined by their log-sum-exp (flash-decoding).

    Outputs of values stored in a frame (R v, `-rot`) are summed in that frame, in an accumulator of their
    own that every merge weight scales as it scales the plain one, and taken out of it once, at the end:
    R^T is linear, so sum_i w_i R^T o_i = R^T sum_i w_i o_i, and the layer pays one transform per query
    instead of one per (query tile, key block)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        """shape: the output's, (B, heads, q, ..., D), query rows along dim 2 (`add`'s rows)."""
        self.out = torch.zeros(shape, dtype=dtype, device=device)  # normalized so far
        self.lse = torch.full(shape[:-1], float("-inf"), dtype=dtype, device=device)
        self.framed: torch.Tensor | None = None  # like out, in `frame`: once some values are framed
        self.frame = None

    def add(self, out: torch.Tensor, lse: torch.Tensor, rows: slice = slice(None), frame=None) -> None:
        """Fold out (B, heads, r, ..., D) with lse (B, heads, r, ...) (-inf: no key attended) into query rows
        `rows` (dim 2); frame: the KernelFrame out is in (values stored as R v), None for plain values."""
        if frame is not None and self.framed is None:
            self.framed, self.frame = torch.zeros_like(self.out), frame
        elif frame is not None and frame is not self.frame:
            raise ValueError("one layer's values are in one frame: got a second one")
        acc, old = self.out[:, :, rows], self.lse[:, :, rows]
        new = _logaddexp_by_row(old, lse)
        safe = torch.nan_to_num(new, nan=0.0, posinf=0.0, neginf=0.0)  # (no key attended so far: 0)
        w_old = torch.exp(old - safe).unsqueeze(-1)
        w_new = torch.exp(lse - safe).unsqueeze(-1)
        framed = self.framed[:, :, rows] if self.framed is not None else None
        into, other = (acc, framed) if frame is None else (framed, acc)
        into.mul_(w_old).add_(out.to(acc.dtype) * w_new)
        if other is not None:  # the other frame's sum so far takes the same weight
            other.mul_(w_old)
        old.copy_(new)

    def result(self) -> torch.Tensor:
        if self.framed is not None:  # rows that attended nothing kept their zeros in both
            self.out.add_(self.frame.out_of(self.framed).to(self.out.dtype))
        return self.out


def _logaddexp_by_row(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.logaddexp of (B, ...) tensors, one batch row per call, so a row's bits do not depend on B.

    ATen runs an elementwise op over a contiguous tensor in vectors of 2 x 16 floats (AVX-512) and the last
    elements one at a time, and its scalar logaddexp rounds unlike its vector one (1.4% of random inputs
    differ in the last bit on this Xeon, where exp, log and div agree): in one call over B rows, whether an
    element falls in the scalar tail depends on B. Per row, every B gives batch 1's layout, and so its bits
    (lm-eval's batch N scores equal batch 1's wherever the GEMMs are row-invariant)."""
    if a.shape[0] == 1:
        return torch.logaddexp(a, b)
    return torch.cat([torch.logaddexp(a[i : i + 1], b[i : i + 1]) for i in range(a.shape[0])])


def _direct(
    query: torch.Tensor, seg: _Segment, mask: torch.Tensor | None, scale: float, work: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment for a few queries: (out (B, H_q, q, D), lse (B, H_q, q)), scores in `work`."""
    b, hq, q, d = query.shape
    hkv, n = seg.key.shape[1], seg.key.shape[2]
    g = hq // hkv
    qg = query.to(work).reshape(b, hkv, g * q, d)  # (B, H_kv, g*q, D): query heads of a KV head together
    s = torch.matmul(qg, seg.key.transpose(-1, -2)) * scale  # (B, H_kv, g*q, n)
    if mask is not None:
        s5 = s.view(b, hkv, g, q, n)
        if mask.dtype == torch.bool:
            s5.masked_fill_(~mask.unsqueeze(2), float("-inf"))
        else:
            s5.add_(mask.unsqueeze(2).to(work))
    mx = s.amax(dim=-1, keepdim=True)
    base = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))  # all masked: no NaN
    p = torch.exp(s - base)
    total = p.sum(dim=-1, keepdim=True)
    out = torch.matmul(p, seg.value) / total.clamp_min(torch.finfo(work).tiny)  # (B, H_kv, g*q, D)
    lse = torch.where(total > 0, torch.log(total) + base, torch.full_like(total, float("-inf")))
    return out.view(b, hq, q, d), lse.view(b, hq, q)


def _tiles(
    query: torch.Tensor, seg: _Segment, masks: _Masks, scale: float, state: _Merge
) -> None:
    """One segment for a chunk of queries (B, H_kv, q, g, D), through torch's fused CPU attention one query
    tile at a time (`_Masks.spans`); tiles the mask hides entirely are skipped, tiles it leaves whole run
    unmasked. GQA without copies of K/V: the g query heads of a KV head are g rows per query, (B, H_kv,
    r * g, D), against the stored (B, H_kv, n, D) keys and values (each row is scored on its own: grouping
    them does not change a row's result), the tile's mask repeated for them."""
    b, hkv, q, g, d = query.shape
    k, v = seg.key.to(query.dtype), seg.value.to(query.dtype)  # once per segment (no copy when equal)
    for rows, lo, hi in masks.spans(q, seg.col, seg.key.shape[2], seg.fresh):
        visible, tile = masks.tile(rows, seg.col + lo, hi - lo, seg.fresh)  # (B or 1, 1, r, hi - lo) or None
        if not visible:
            continue
        float_mask, empty_rows = None, None
        if tile is not None and tile.dtype == torch.bool:
            if not bool(tile.all()):
                float_mask = torch.zeros(tile.shape, dtype=query.dtype, device=query.device)
                float_mask.masked_fill_(~tile, float("-inf"))
                empty_rows = ~tile.any(dim=-1)  # (B or 1, 1, r): the kernel gives them lse 0, not -inf
        elif tile is not None:
            float_mask = tile.to(query.dtype)
            empty_rows = ~torch.isfinite(tile).any(dim=-1)
        if float_mask is not None and g > 1:
            float_mask = float_mask.repeat_interleave(g, dim=2)  # (B or 1, 1, r * g, n)
        kt, vt = (k, v) if (lo, hi) == (0, k.shape[2]) else (k[:, :, lo:hi], v[:, :, lo:hi])
        r = rows.stop - rows.start
        qt = query[:, :, rows].view(b, hkv, r * g, d)
        out, lse = _FLASH_CPU(qt, kt, vt, 0.0, False, attn_mask=float_mask, scale=scale)
        out, lse = out.view(b, hkv, r, g, d), lse.view(b, hkv, r, g)
        if empty_rows is not None:
            lse = lse.masked_fill(empty_rows.unsqueeze(-1), float("-inf"))
        state.add(out, lse, rows, seg.value_frame)


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns (out, logsumexp)


class _Masks:
    """Which keys each query attends to, tile by tile, built only for the tiles read (never a (q, T) mask
    for a causal chunk).

    Columns are the view's key indices. The base rule is the model's mask (its first T columns), or, when the
    model passed none, causal by position for several queries and every key for one. Decode-exact chunks
    narrow it for the body tokens the update before this call encoded (view.fresh_*, columns [F0, F1)):
    query p (an absolute position) would have seen key j quantized only if j < plan.quantized_end(p + 1),
    and a later query of the same chunk may see more of them quantized than an earlier one. So those keys
    are read twice: as stored (quantized) by the queries that saw them quantized, and from their FP copy by
    the others. Without this, a query would see its own near past quantized although a decoder keeps it in
    the FP window, and results would depend on the chunk size."""

    def __init__(self, query: torch.Tensor, view: LayerView, attention_mask: torch.Tensor | None):
        q, kv_len = query.shape[2], view.shape[2]
        self.device = query.device
        self.q0_col = kv_len - q  # column of query 0's own key
        self.explicit = attention_mask[..., :kv_len] if attention_mask is not None else None
        self.causal = attention_mask is None and q > 1
        self.fresh_cols = (0, 0)
        self.ends: torch.Tensor | None = None  # (q,) column before which each query saw keys quantized
        self.copies_needed = False
        if view.fresh_k is not None and q > 1:
            f0 = view.fresh_start - view.start
            self.fresh_cols = (f0, f0 + view.fresh_k.shape[2])
            pos = torch.arange(kv_len - q, kv_len, device=self.device) + view.start  # absolute positions
            self.ends = view.plan.quantized_ends(pos + 1) - view.start  # nondecreasing in the query
            self.copies_needed = self._any_copy_visible()

    def _any_copy_visible(self) -> bool:
        """Whether some query may attend to a fresh key it saw unquantized (never without a window)."""
        f0, f1 = self.fresh_cols
        lo = self.ends.clamp(min=f0)  # first fresh column each query saw unquantized
        if self.causal:
            own = torch.arange(self.ends.shape[0], device=self.device) + self.q0_col
            return bool((torch.minimum(own + 1, torch.full_like(own, f1)) > lo).any())
        if self.explicit is None:  # one query, no mask: it attends to every key
            return bool((lo < f1).any())
        # the model's mask: does some query attend to a fresh key at or past its quantized end? (row tiles:
        # no (q, F) mask at once; a causal mask answers no without a window, where every end is own + 1)
        cols = torch.arange(f0, f1, device=self.device)
        for r0 in range(0, lo.shape[0], _QUERY_TILE):
            r1 = min(lo.shape[0], r0 + _QUERY_TILE)
            c = int(lo[r0])  # ends rise with the query: columns before c were quantized for every row
            if c >= f1:
                continue
            m = self.explicit[:, :, r0:r1, c:f1]  # (B or 1, 1, r, F - c)
            attends = m if m.dtype == torch.bool else m > float("-inf")
            unquantized = cols[None, c - f0 :] >= lo[r0:r1, None]  # (r, F - c)
            if bool((attends & unquantized).any()):
                return True
        return False

    def columns(self, rows: slice, c0: int, n: int, fresh: str | None) -> tuple[int, int]:
        """[lo, hi): the columns of [c0, c0 + n), relative to c0, outside which no query of `rows` attends
        (a bound; `tile` decides inside it). Causal chunks stop at the last row's own key; FP copies of
        fresh keys start at the first row's quantized end (ends rise with the query: every row saw the keys
        before it quantized), so a query tile reads a band of copies about a window wide, not all of them."""
        lo, hi = 0, n
        if self.causal:
            hi = min(hi, self.q0_col + rows.stop - c0)
        if fresh == "copy" and self.ends is not None:
            lo = max(lo, int(self.ends[rows.start]) - c0)
        elif fresh == "stored" and self.ends is not None:  # fresh keys past the last row's end: copies only
            f0, f1 = self.fresh_cols
            if c0 + n <= f1:  # (the body ends where the fresh keys end; keys after f1 are read as stored)
                hi = min(hi, max(f0, int(self.ends[rows.stop - 1])) - c0)
        return lo, max(lo, hi)

    def spans(self, q: int, c0: int, n: int, fresh: str | None) -> Iterator[tuple[slice, int, int]]:
        """(rows, lo, hi): the query tiles and column bounds (relative to c0) that read the segment of
        columns [c0, c0 + n); empty bounds are left out. Tiles of `_QUERY_TILE` rows; where the queries
        read fresh keys part as stored and part from their FP copies (a window: `copies_needed`), the
        columns every row of a tile reads as stored stay one tile, and the rest (a band about a window
        wide along the diagonal) go in tiles of `_MIXED_TILE` rows, so each reads a narrow band."""
        mixed = self.copies_needed and fresh is not None
        for q0 in range(0, q, _QUERY_TILE):
            rows = slice(q0, min(q, q0 + _QUERY_TILE))
            lo, hi = self.columns(rows, c0, n, fresh)
            if not mixed:
                if hi > lo:
                    yield rows, lo, hi
                continue
            start = lo
            if fresh == "stored":  # before the first row's quantized end, every row reads the keys as stored
                start = min(hi, max(lo, int(self.ends[rows.start]) - c0))
                if start > lo:
                    yield rows, lo, start
            for s0 in range(rows.start, rows.stop, _MIXED_TILE):
                sub = slice(s0, min(rows.stop, s0 + _MIXED_TILE))
                slo, shi = self.columns(sub, c0, n, fresh)
                slo = max(slo, start)
                if shi > slo:
                    yield sub, slo, shi

    def tile(self, rows: slice, c0: int, n: int, fresh: str | None) -> tuple[bool, torch.Tensor | None]:
        """(visible, mask) of query rows x key columns [c0, c0 + n): visible False when no query of the rows
        attends to any of the keys; mask None when every one attends to every key, else (B or 1, 1, r, n)
        bool (True = attend) or the model's float mask."""
        if fresh == "copy" and not self.copies_needed:
            return False, None
        r0, r1 = rows.start, rows.stop
        mask = None
        if self.explicit is not None:
            mask = self.explicit[:, :, r0:r1, c0 : c0 + n]
        elif self.causal:
            first, last = self.q0_col + r0, self.q0_col + r1 - 1  # own columns of the first and last rows
            if c0 > last:
                return False, None
            if c0 + n - 1 > first:  # the diagonal crosses the tile
                own = torch.arange(first, last + 1, device=self.device)
                cols = torch.arange(c0, c0 + n, device=self.device)
                mask = (cols[None, :] <= own[:, None])[None, None]
        keep = self._fresh_keep(r0, r1, c0, n, fresh)
        if keep is not None:
            if mask is None:
                mask = keep[None, None]
            elif mask.dtype == torch.bool:
                mask = mask & keep
            else:
                mask = torch.where(keep, mask, torch.full_like(mask, float("-inf")))
        if mask is not None and mask.dtype == torch.bool and not bool(mask.any()):
            return False, None
        return True, mask

    def _fresh_keep(self, r0: int, r1: int, c0: int, n: int, fresh: str | None) -> torch.Tensor | None:
        """(r, n) bool: which of the tile's keys each query reads in this copy; None: no narrowing."""
        if fresh is None or self.ends is None:
            return None
        f0, f1 = self.fresh_cols
        lo, hi = max(c0, f0), min(c0 + n, f1)
        if lo >= hi:
            return None
        ends = self.ends[r0:r1]
        if fresh == "stored" and hi <= int(ends[0]):  # every query saw these keys quantized
            return None
        cols = torch.arange(c0, c0 + n, device=self.device)
        quantized = cols[None, :] < ends[:, None]  # (r, n)
        if fresh == "copy":
            return ~quantized
        in_fresh = (cols >= lo) & (cols < hi)
        return quantized | ~in_fresh[None, :]


def _segments(
    view: LayerView, masks: _Masks, work: torch.dtype, stream_tokens: int, body_patch=None
) -> Iterator[_Segment]:
    """The view's keys and values block by block, decoded: sink, body (chunks of whole pages, each through
    body_patch when given), window, and the FP copies of freshly encoded tokens where a query of this chunk
    saw them unquantized."""
    sink_n, body_n = view.sink.length, view.body.length
    if sink_n:
        yield _Segment(*_fp_region(view, view.sink, work), 0)
    f0, f1 = masks.fresh_cols
    device = masks.device
    kf, vf = view.key_codec.read_frame(device), view.value_codec.read_frame(device)
    kc, vc = (kf.codec if kf else view.key_codec), (vf.codec if vf else view.value_codec)
    for sub, off in split_region(view.body, view.block_size, stream_tokens, even=False):
        c0 = sink_n + off
        k = kc.decode_pages(view.key_pages, sub, work)  # in R's frame for a rotated codec: no R^T per token
        v = vc.decode_pages(view.value_pages, sub, work)
        if body_patch is not None:
            k, v = body_patch(sub, k, v, kf, vf)
        overlaps = masks.ends is not None and max(c0, f0) < min(c0 + sub.length, f1)
        yield _Segment(k, v, c0, "stored" if overlaps else None, kf, vf)
    if view.recent.length:
        yield _Segment(*_fp_region(view, view.recent, work), sink_n + body_n)
    if masks.copies_needed:
        yield _Segment(view.fresh_k.to(work), view.fresh_v.to(work), f0, "copy")


def _fp_region(view: LayerView, region: Region, work: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """FP keys and values of a sink or window region, (B, H_kv, n, D) each in the working dtype."""
    return _fp_rows(view.fp_k, region, work), _fp_rows(view.fp_v, region, work)


def register_attention() -> None:
    """Register "kvquant" for attention and for mask creation (without the mask, padding would vanish)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvquant_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
