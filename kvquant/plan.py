"""One decoder layer's storage plan: its codecs, page formats, the storage rule and its sizes, said once.

A `LayerPlan` is built once per layer from the layer's uniform scheme (`Scheme.for_layer`), the layer kind
(full attention, or sliding with its window), the requested block size and the storage dtype. Everything
that asks "where does the body end after n tokens", "how many pages and bytes does n tokens take" or "how
many FP pages can this layer ever hold at once" asks the plan:

    sink     positions [0, sink)                 FP pages     (none on a sliding layer: its mask never lets a
                                                                query see a key behind the window)
    body     positions [sink, quantized_end(n))  codec pages  encoded once, in multiples of flush_step
    window   positions [quantized_end(n), n)     FP pages     at least `window`, plus an incomplete group

Body pages hold `block_size` tokens: the requested page size raised to a multiple of every codec's token
group (a channel-wise group of 64 tokens makes 64-token pages). FP pages hold `fp_block_size` tokens, the
requested size itself (it divides block_size), so a 4-token sink and a window of about `window` tokens are
not rounded up to the codecs' groups. With `salient=N/G` (`kvquant.salient`) body pages also hold, for each
group of G tokens, the N salient tokens' K and V (the salient spec's fields) and their index in the group, and
FP pages each token's attention statistic (fp32, one per head): the plan's fields and bytes say so, so the
store, `nbytes()` and `kvquant.memory` count them like any field. Tokens of the body and the window share
one numbering (body token i sits in body page i // block_size and in window page i // fp_block_size; each
body page spans block_size // fp_block_size window pages), so a window page is freed once all its tokens are
encoded. A sliding layer releases the pages before `dropped(n)`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .codecs.base import Codec, Field, codec_for
from .scheme import Scheme

__all__ = ["LayerPlan", "salient_stat_dtype"]


def salient_stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of salient=N/G's attention statistics beside K/V in `dtype`: fp32 (fp64 in fp64 runs, so
    exact-arithmetic tests rank the same sums)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pages(lo: int, hi: int, block_size: int) -> int:
    """Pages holding region tokens [lo, hi): logical pages lo // bs .. (hi - 1) // bs."""
    return 0 if hi <= lo else (hi - 1) // block_size - lo // block_size + 1


@dataclass(frozen=True)
class LayerPlan:
    """The storage rule and sizes of one decoder layer (see the module docstring).

    scheme: the layer's uniform scheme as stored (sink 0 on a sliding layer).
    block_size: tokens per body page, the requested size raised to a multiple of every codec's token group.
    fp_block_size: tokens per FP (sink and window) page: the requested size, which divides block_size.
    """

    scheme: Scheme
    key_codec: Codec
    value_codec: Codec
    block_size: int
    requested_block_size: int
    sliding_window: int | None
    heads: int
    head_dim: int
    dtype: torch.dtype
    salient_codec: Codec | None = None  # how salient tokens are stored (scheme.salient), else None

    @classmethod
    def build(
        cls,
        scheme: Scheme,
        *,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        block_size: int = 16,
        sliding_window: int | None = None,
        layer: int | None = None,
        calib=None,
        rope=None,
    ) -> LayerPlan:
        """The plan of a layer with H_kv=heads of head_dim, K/V in dtype; layer, calib and rope give
        calibrated and pre-RoPE codecs their tables (`kvquant.codecs.base.codec_for`)."""
        if scheme.layers:
            raise ValueError("a layer plan takes the layer's uniform scheme: pass scheme.for_layer(i)")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if sliding_window is not None:
            if sliding_window < 1:
                raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
            scheme = dataclasses.replace(scheme, sink=0)  # one rule, in every mode: no sinks when sliding
        ctx = dict(layer=layer, calib=calib, rope=rope)
        kc = codec_for(scheme.key, heads, head_dim, dtype, role="k", **ctx)
        vc = codec_for(scheme.value, heads, head_dim, dtype, role="v", **ctx)
        bs = math.lcm(block_size, kc.token_group, vc.token_group)
        sc = None
        if scheme.salient is not None:
            if sliding_window is not None:
                raise ValueError(
                    f"salient={scheme.salient} is not supported on sliding-window layers (layer {layer}: "
                    f"window {sliding_window}; they release pages a selection would need); use a model "
                    "without sliding-window layers or drop salient="
                )
            sc = codec_for(scheme.salient.spec, heads, head_dim, dtype)
            bs = math.lcm(bs, scheme.salient.group)
        return cls(scheme, kc, vc, bs, block_size, sliding_window, heads, head_dim, dtype, sc)

    # ---- the storage rule

    @property
    def sink(self) -> int:
        return self.scheme.sink

    @property
    def window(self) -> int:
        return self.scheme.window

    @property
    def flush_step(self) -> int:
        """Tokens move from the window to the body in multiples of this."""
        return self.scheme.tokens_per_flush

    def quantized_end(self, num_tokens: int) -> int:
        """After num_tokens tokens, positions [min(sink, n), quantized_end) are in the body."""
        return self.scheme.quantized_end(num_tokens)

    def quantized_ends(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """`quantized_end` of every count in an integer tensor, at once (the same formula)."""
        sink = num_tokens.clamp(max=self.sink)
        step = self.flush_step
        return sink + (num_tokens - sink - self.window).clamp(min=0) // step * step

    def dropped(self, num_tokens: int) -> int:
        """Positions below this are released after num_tokens tokens (sliding layers; 0 otherwise): the next
        query attends to positions >= num_tokens - window + 1, rounded down to a page."""
        if self.sliding_window is None:
            return 0
        return max(num_tokens - self.sliding_window + 1, 0) // self.block_size * self.block_size

    @property
    def fp_block_size(self) -> int:
        return self.requested_block_size

    # ---- page formats and sizes

    def fp_fields(self, dtype: torch.dtype | None = None) -> dict[str, Field]:
        f = Field(self.heads, 1, self.head_dim, dtype or self.dtype)
        out = {"k": f, "v": f}
        if self.salient_codec is not None:  # each FP token's attention statistic, one per head
            out["a"] = Field(self.heads, 1, 1, salient_stat_dtype(dtype or self.dtype))
        return out

    def body_fields(self) -> dict[str, Field]:
        """The body page's fields: K's and V's codec fields under one page id ("k.codes", "v.scale", ...),
        and with salient=N/G the salient tokens' ("s.k.values", "s.v.values", "s.idx", ...)."""
        out = {f"k.{n}": f for n, f in self.key_codec.fields().items()}
        out |= {f"v.{n}": f for n, f in self.value_codec.fields().items()}
        return out | self.salient_fields()

    def salient_fields(self, codec: Codec | None = None) -> dict[str, Field]:
        """With salient=N/G: the salient tokens' fields in a body page, one row per G / N tokens: the salient
        spec's K and V fields ("s.k.<name>", "s.v.<name>") and "s.idx", each row's token index in its
        group (uint8, or int16 past 256 tokens); {} without salient=. codec: the salient codec at another
        dtype (`page_bytes`)."""
        sc = codec or self.salient_codec
        if sc is None:
            return {}
        r = self.scheme.salient.ratio
        rows = {n: Field(f.heads, f.tokens * r, f.cols, f.dtype) for n, f in sc.fields().items()}
        idx = torch.uint8 if self.scheme.salient.group <= 256 else torch.int16
        out = {f"s.k.{n}": f for n, f in rows.items()} | {f"s.v.{n}": f for n, f in rows.items()}
        return out | {"s.idx": Field(self.heads, r, 1, idx)}

    def page_bytes(self, dtype: torch.dtype | None = None) -> tuple[int, int]:
        """(FP page, body page) bytes at `dtype` (default the plan's: what the pools hold)."""
        fp = sum(f.nbytes(self.fp_block_size) for f in self.fp_fields(dtype).values())
        if dtype is None or dtype == self.dtype:
            kc, vc, sc = self.key_codec, self.value_codec, self.salient_codec
        else:
            kc = codec_for(self.key_codec.spec, self.heads, self.head_dim, dtype)
            vc = codec_for(self.value_codec.spec, self.heads, self.head_dim, dtype)
            sc = self.salient_codec and codec_for(self.salient_codec.spec, self.heads, self.head_dim, dtype)
        salient = sum(f.nbytes(self.block_size) for f in self.salient_fields(sc).values())
        return fp, kc.bytes(self.block_size) + vc.bytes(self.block_size) + salient

    def pages_for(self, num_tokens: int) -> tuple[int, int]:
        """(FP pages, body pages) one sequence holds after num_tokens tokens, as the store holds them."""
        bs, fbs, s = self.block_size, self.fp_block_size, self.sink
        sink = min(s, num_tokens)
        body_end = self.quantized_end(num_tokens)
        dropped = self.dropped(num_tokens)
        body_lo, body_hi = max(dropped - s, 0), max(body_end - s, 0)
        recent_lo, recent_hi = max(body_end, dropped) - s, num_tokens - s
        fp = _pages(0, sink, fbs) + _pages(recent_lo, recent_hi, fbs)
        return fp, _pages(body_lo, body_hi, bs)

    def bytes_for(self, num_tokens: int, dtype: torch.dtype | None = None) -> int:
        """Bytes one sequence holds after num_tokens tokens (whole pages) at `dtype`."""
        fp_page, body_page = self.page_bytes(dtype)
        fp, body = self.pages_for(num_tokens)
        return fp * fp_page + body * body_page

    @property
    def max_fp_pages(self) -> int:
        """The most FP pages one sequence holds at any time: the sink's, and a window of at most
        window + flush_step - 1 tokens over consecutive pages (none for a scheme with neither)."""
        fbs = self.fp_block_size
        recent = self.window + self.flush_step - 1
        return -(-self.sink // fbs) + (0 if recent <= 0 else -(-recent // fbs) + 1)

    def body_pages(self, num_tokens: int) -> int:
        """Body pages one sequence needs for num_tokens tokens (what `capacity=` preallocates)."""
        return self.pages_for(num_tokens)[1]
