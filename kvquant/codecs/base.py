"""Codecs: how one K or V spec is stored, read back, sized and served by kernels, said in one place.

A codec is bound to a spec and a layer's shape (H_kv heads, head_dim D, K/V dtype). It stores T tokens
(B, H_kv, T, D) as named fields, each laid out (B, heads_f, T // tokens_f, cols_f):

    codec        field    heads_f      tokens_f   cols_f        dtype
    dense (fp16) values   H            1          D             the K/V dtype
    affine INT   codes    H            1          D * bits / 8  uint8 (packed; kvquant.codecs.quantize)
                 scale    H or 1 (*)   t_e        D / c_e       the scale dtype
                 zero     same as scale (asymmetric specs only)
    codebook NUQ codes    H            1          D * bits / 8  uint8 (3 bits: 8 codes per 3 bytes)
                 scale    as affine (half-range, or absmax for -sym); zero: the block's mid-range (asymmetric)
    pre-RoPE     the fields of the codec it wraps (keys stored before RoPE; `encode_at` / `decode_at`)
    FP8          codes    H            1          D             uint8 (float8 bits; kvquant.codecs.fp8)
                 scale    as affine (absent for -tensor: a fixed unit scale)
    -center/-rot/-out     the wrapped codec's fields, plus offset (H, N, D) / nothing / out_values and
                          out_index (H, 1, k) (kvquant.codecs.transforms)

(*) a scale shared by all heads of a token (per-token granularity) is stored once: heads_f = 1.

`BlockExtent` says which elements share one scale (the spec's grain says it: `block_extent`); the
quantizer's lowering, dequantize's broadcast, the bytes formula, the page layout and the kernels' launch
arguments all read it, so nothing else switches on granularity. The page store (`kvquant.paging`) keeps each
field in pages of `block_size` tokens ((P, heads_f, block_size // tokens_f, cols_f)) and never looks inside
a field.

`codec_for` dispatches on the spec's typed parts (`kvquant.spec_types`): the codec registered for the type of
`spec.family`, wrapped by the codec of each of `spec.transforms` (outermost first), then `PreRopeCodec` for
-prerope keys. A new quantizer family is its module, holding a `Codec` subclass under `@register(ItsConfig)`,
plus its import in `kvquant/codecs/__init__.py`; the store, the bytes formula and the attention path need no
change. A codec that no kernel serves returns None from `kernel_layout`, and attention then takes the
PyTorch reference path.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..scheme import CALIBRATE_COMMAND, QuantSpec, SchemeError, parse_spec
from ..spec_types import Codebook, Dense
from .packing import pack, packed_size, unpack

__all__ = [
    "BlockExtent",
    "Codec",
    "CodebookCodec",
    "PreRopeCodec",
    "DenseCodec",
    "Field",
    "KernelLayout",
    "PageRead",
    "block_extent",
    "codec_class",
    "codec_for",
    "gather_region",
    "page_rows",
    "register",
    "round_stat",
    "split_region",
    "torch_dtype",
]

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """A scale-dtype name ("fp16", "bf16", "fp32") as a torch dtype; a torch dtype passes through."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise SchemeError(f"unknown dtype name {name!r}; known: {', '.join(_DTYPES)}") from None


@dataclass(frozen=True)
class BlockExtent:
    """Which elements of a (B, H, T, D) tensor share one scale: `tokens` consecutive tokens x `channels`
    consecutive channels x `heads` consecutive heads.
    Scale shape: (B, H // heads, T // tokens, D // channels).

        token        (heads=H, tokens=1, channels=D)   x (2, 3, 5, 64) -> scale (2, 1, 5, 1)
        head         (1, 1, D)                          x (2, 3, 5, 64) -> scale (2, 3, 5, 1)
        group N      (1, 1, N)                          x (2, 3, 5, 64), N=32 -> scale (2, 3, 5, 2)
        channel N    (1, N, 1)                          x (2, 3, 64, 64), N=32 -> scale (2, 3, 2, 64)
    """

    heads: int
    tokens: int
    channels: int

    def stat_shape(self, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
        b, h, t, d = shape
        return b, h // self.heads, t // self.tokens, d // self.channels

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) -> (*stat_shape, G): the G = heads * tokens * channels elements of each block last."""
        b, h, t, d = x.shape
        he, te, ce = self.heads, self.tokens, self.channels
        x = x.reshape(b, h // he, he, t // te, te, d // ce, ce)
        x = x.permute(0, 1, 3, 5, 2, 4, 6)  # (B, H/he, T/te, D/ce, he, te, ce)
        return x.reshape(b, h // he, t // te, d // ce, he * te * ce)

    def unblocks(self, blocks: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The inverse of `blocks`: (*stat_shape, G) -> (B, H, T, D)."""
        b, h, t, d = shape
        he, te, ce = self.heads, self.tokens, self.channels
        x = blocks.reshape(b, h // he, t // te, d // ce, he, te, ce)
        return x.permute(0, 1, 4, 2, 5, 3, 6).reshape(b, h, t, d)

    def broadcast(self, values: torch.Tensor, stat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of values (B, H, T, D) and a statistic (stat_shape) that broadcast elementwise, no copy."""
        b, h, t, d = values.shape
        he, te, ce = self.heads, self.tokens, self.channels
        v = values.reshape(b, h // he, he, t // te, te, d // ce, ce)
        s = stat.reshape(b, h // he, 1, t // te, 1, d // ce, 1)
        return v, s


def block_extent(spec: QuantSpec, heads: int, head_dim: int) -> BlockExtent:
    """The one place that turns a grain (`kvquant.spec_types`: PerToken, PerHead, ChannelGroups(N),
    TokenGroups(N)) into a block extent: the grain says its (heads, tokens, channels)."""
    if spec.grain is None:
        raise SchemeError(f"{spec} keeps no per-block scales (no grain), so it has no block extent")
    return BlockExtent(*spec.grain.extent(heads, head_dim))


def round_stat(t: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """fp32 t -> dtype, rounded up (or down) so that the stored statistic still covers t: a scale
    rounded down (bf16 keeps 8 bits) would clip the block's largest values by up to qmax * 2^-8 steps.
    Every codec that stores block statistics rounds them so (affine INT, codebooks, FP8)."""
    if dtype == t.dtype:
        return t  # nothing to round
    r = t.to(dtype)
    off = r.float() < t if up else r.float() > t
    return torch.where(off, torch.nextafter(r, torch.full_like(r, float("inf") if up else float("-inf"))), r)


@dataclass(frozen=True)
class Field:
    """One stored tensor of a codec: (B, heads, T // tokens, cols) for T tokens, in `dtype`."""

    heads: int
    tokens: int
    cols: int
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def nbytes(self, num_tokens: int) -> int:
        """Bytes for num_tokens tokens of one sequence (num_tokens a multiple of `tokens`)."""
        return self.heads * (num_tokens // self.tokens) * self.cols * self.itemsize


@dataclass(frozen=True)
class KernelLayout:
    """What a Triton kernel needs to read a codec's fields in place.

    bits: 16 for a dense field `values`, else 8/4/2 packed `codes`. The scale (and zero) of token t,
    channel c sits at row t // token_extent, column c // channel_extent; shared_heads: one scale row for all
    heads (heads_f == 1), read with head stride 0.
    """

    bits: int
    symmetric: bool = False
    token_extent: int = 1
    channel_extent: int = 1
    shared_heads: bool = False


def page_rows(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The rows of the pages `table` (B, n) names, from a pool tensor (P, heads_f, rows, cols): a copy,
    (B, heads_f, n * rows, cols), whole pages in table order."""
    bsz, n = table.shape
    got = pool.index_select(0, table.reshape(-1).to(pool.device))  # (B * n, heads_f, rows, cols)
    _, h, rows, cols = got.shape
    return got.view(bsz, n, h, rows, cols).transpose(1, 2).reshape(bsz, h, n * rows, cols)


def gather_region(
    pages: Mapping[str, torch.Tensor], fields: Mapping[str, Field], region
) -> dict[str, torch.Tensor]:
    """A region's fields {name: (B, heads_f, length // tokens_f, cols_f)} from the pool tensors (P, heads_f,
    rows_per_page, cols): a copy of just its pages. `region` is a `kvquant.paging.Region` (table (B, n_pages),
    offset, length, start)."""
    out = {}
    for name, pool in pages.items():
        tokens = fields[name].tokens
        rows = page_rows(pool, region.table)
        out[name] = rows[:, :, region.offset // tokens : (region.offset + region.length) // tokens]
    return out


@dataclass(frozen=True)
class PageRead:
    """How `Codec.score_pages` / `value_pages` stream a region: `tokens` keys decoded at a time (whole
    pages), into `buffer`, a flat fp32 scratch tensor reused by every block (None: allocated per call)."""

    tokens: int = 1024
    buffer: torch.Tensor | None = None
    native: bool = True  # False: the PyTorch twin even where kvquant.native's ops serve

    def block_size(self, pages: Mapping[str, torch.Tensor], codec: Codec) -> int:
        """Tokens per page of the pool tensors `pages` (the first field's rows times its tokens per row)."""
        name, field = next(iter(codec.fields().items()))
        return pages[name].shape[2] * field.tokens


def split_region(region, block_size: int, tokens: int, even: bool = True):
    """(sub-region, index of its first token in the region) over whole pages of at most about `tokens`
    tokens: as even as whole pages allow (no one-token tail block), or with even=False blocks of exactly
    `tokens // block_size` pages and a tail (the multi-token path keeps its summation order: its blocks
    decide how the fused kernel's sums associate, and every measured number depends on that)."""
    pages = region.table.shape[1]
    most = max(1, tokens // block_size)  # pages per block at most
    per = -(-pages // -(-pages // most)) if pages and even else most
    done = 0
    for j0 in range(0, pages, per):
        j1 = min(pages, j0 + per)
        offset = region.offset if j0 == 0 else 0
        n = min(region.length - done, (j1 - j0) * block_size - offset)
        if n <= 0:
            break
        yield dataclasses.replace(region, table=region.table[:, j0:j1], offset=offset, length=n,
                                  start=region.start + done), done
        done += n


# ---------------------------------------------------------------------------------------------- registry

# family config type (kvquant.spec_types: UniformInt, FP8, ...) or transform type (Rotate, ...) -> its codec
_FAMILIES: dict[type, type[Codec]] = {}


def register(kind: type) -> Callable[[type[Codec]], type[Codec]]:
    """Class decorator: `@register(FP8)` makes `codec_for` build this codec for a spec whose family (or one of
    whose transforms) is a `kind`. A family codec is built as cls(spec, heads, head_dim, dtype); a transform
    codec as cls(spec, inner), around the codec of the same spec without it. Each family module of
    kvquant.codecs registers its own (the package imports them all, so base never does)."""

    def add(cls: type[Codec]) -> type[Codec]:
        if _FAMILIES.get(kind, cls) is not cls:
            raise ValueError(f"{kind.__name__} already has a codec: {_FAMILIES[kind].__name__}")
        _FAMILIES[kind] = cls
        return cls

    return add


class Codec(ABC):
    """Encodes (B, H_kv, T, D) K or V into named fields and decodes them back, for one spec and shape."""

    def __init__(self, spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype):
        spec.check_head_dim(head_dim)
        self.spec, self.heads, self.head_dim, self.dtype = spec, heads, head_dim, dtype

    @property
    def token_group(self) -> int:
        """Tokens that must arrive before they can be encoded (N for channel-wise statistics, else 1)."""
        return max(f.tokens for f in self.fields().values())

    @abstractmethod
    def fields(self) -> dict[str, Field]:
        """The stored fields and their layout."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x (B, H, T, D), T a multiple of token_group -> {name: (B, heads_f, T // tokens_f, cols_f)}."""

    @abstractmethod
    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Fields as `encode` returns them (or gathered from pages) -> (B, H, T, D) in dtype."""

    def kernel_layout(self) -> KernelLayout | None:
        """How the Triton kernels read this codec, or None when no kernel serves it (reference path)."""
        return None

    def read_frame(self, device: torch.device):
        """A `kvquant.codecs.transforms.KernelFrame` (inner codec, rotation R) when this codec stores R x and
        attention may score in the rotated frame ((R q) . (R k) = q . k, and sum p (R v) rotated back once),
        skipping R^T on every decoded token; None: `decode_at` gives x itself."""
        return None

    def encode_at(self, x: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
        """`encode` for tokens at positions start .. start + T - 1 (position-dependent codecs use it)."""
        return self.encode(x)

    def decode_at(
        self, fields: Mapping[str, torch.Tensor], start: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """`decode` of tokens at positions start .. (position-dependent codecs use it)."""
        return self.decode(fields, dtype)

    def decode_pages(
        self, pages: Mapping[str, torch.Tensor], region, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The tokens of `region` (a `kvquant.paging.Region`) decoded from the pool tensors {name: (P,
        heads_f, rows_per_page, cols)}: (B, H, region.length, D) in dtype, what `decode_at` gives for the
        gathered fields. `out`, a flat fp32 scratch tensor, may serve as the working buffer (a codec that
        decodes in place uses it; the result may then be a view of it, valid until it is reused)."""
        return self.decode_at(gather_region(pages, self.fields(), region), region.start, dtype)

    def score_pages(
        self, q: torch.Tensor, pages: Mapping[str, torch.Tensor], region, read: PageRead = None
    ) -> torch.Tensor:
        """q (B, H, m, D) against the keys of `region`: (B, H, m, region.length), q . k in q's dtype, as
        `q @ decode_pages(...)^T` computes it, block by block (`read`). A codec may fold its scales into
        the product instead of decoding (AffineCodec)."""
        read = read or PageRead()
        parts = [
            torch.matmul(q, self.decode_pages(pages, sub, q.dtype, read.buffer).transpose(-1, -2))
            for sub, _ in split_region(region, read.block_size(pages, self), read.tokens)
        ]
        return torch.cat(parts, dim=-1) if len(parts) != 1 else parts[0]

    def value_pages(
        self, p: torch.Tensor, pages: Mapping[str, torch.Tensor], region, read: PageRead = None
    ) -> torch.Tensor:
        """Weights p (B, H, m, region.length) over the values of `region`: (B, H, m, D), `p @ decode_pages`,
        block by block (`read`)."""
        read = read or PageRead()
        out = None
        for sub, off in split_region(region, read.block_size(pages, self), read.tokens):
            v = self.decode_pages(pages, sub, p.dtype, read.buffer)
            o = torch.matmul(p[..., off : off + sub.length], v)
            out = o if out is None else out.add_(o)
        if out is None:
            return p.new_zeros((*p.shape[:3], self.head_dim))
        return out

    def bind(self, *, layer: int | None, role: str | None, calib, spec: QuantSpec) -> None:
        """Take this layer's calibrated tables (codebooks) from `calib`; most codecs have none."""
        return None

    def batches_with(self, other: Codec) -> bool:
        """Whether one encode call may serve this codec's and `other`'s tokens together (same codes)."""
        return type(self) is type(other) and self.spec == other.spec

    def codebook_values(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The values a codebook inside this codec quantizes, for x (B, H, T, D) at positions start..: what
        calibration fits levels on (`kvquant.calibration`). A wrapper that transforms x must say how."""
        raise SchemeError(f"{self.spec}: fitting a codebook under this codec is not supported")

    def bytes(self, num_tokens: int) -> int:
        """Bytes held for num_tokens tokens of one sequence (a multiple of token_group)."""
        return sum(f.nbytes(num_tokens) for f in self.fields().values())

    def num_tokens(self, fields: Mapping[str, torch.Tensor]) -> int:
        name, f = next(iter(self.fields().items()))
        return fields[name].shape[2] * f.tokens

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec}, heads={self.heads}, head_dim={self.head_dim})"


@register(Dense)
class DenseCodec(Codec):
    """fp16 specs: tokens stored as they are, in the K/V dtype."""

    def fields(self) -> dict[str, Field]:
        return {"values": Field(self.heads, 1, self.head_dim, self.dtype)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"values": x.to(self.dtype)}

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        return fields["values"].to(dtype or self.dtype)

    def kernel_layout(self) -> KernelLayout:
        return KernelLayout(bits=16)


def _scaled_code_fields(codec) -> dict[str, Field]:
    """Packed `codes` plus a `scale` (and, asymmetric, a `zero`) per block of the codec's extent: the layout
    of every codec that stores b-bit codes against per-block statistics (affine INT, codebooks)."""
    e, d = codec.extent, codec.head_dim
    stat = Field(codec.heads // e.heads, e.tokens, d // e.channels, codec.scale_dtype)
    out = {"codes": Field(codec.heads, 1, packed_size(d, codec.spec.bits), torch.uint8), "scale": stat}
    if not codec.spec.symmetric:
        out["zero"] = stat
    return out


@register(Codebook)
class CodebookCodec(Codec):
    """Non-uniform levels (`nuq4`, `nuq3`, `nuq2`; KVQuant's NUQ): each block (the spec's granularity) is
    normalized to [-1, 1] and each value stored as the index of the nearest of 2^bits levels, a codebook
    fitted offline per layer and K/V on calibration text (`kvquant.calibration`).

        asymmetric: zero = (max + min) / 2, scale = max(max - zero, zero - min)   x_n = (x - zero) / scale
        symmetric:  scale = max |x|                                                 x_n = x / scale
        code = argmin_i |x_n - level_i| (bucketize against the midpoints)
        x_hat = level[code] * scale (+ zero)

    zero is rounded to nearest in the scale dtype and scale up, so the stored pair still maps the block into
    [-1, 1]. A constant block gets scale 0 and decodes to its zero (exact when the scale dtype holds it).
    Non-finite blocks decode to NaN, as the affine codec's. Codes are packed (3 bits: 8 codes per 3 bytes), so
    the bytes held are exactly bits * D / 8 per (token, head) plus the scales.
    """

    def __init__(self, spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__(spec, heads, head_dim, dtype)
        self.extent = block_extent(spec, heads, head_dim)
        self.scale_dtype = torch_dtype(spec.scale_dtype) if spec.scale_dtype else dtype
        self.levels: torch.Tensor | None = None  # (2^bits,) float32, ascending; from `bind`
        self.where = ""  # which table, for messages

    def bind(self, *, layer: int | None, role: str | None, calib, spec: QuantSpec) -> None:
        if calib is not None and layer is not None and role is not None:
            self.set_levels(calib.codebook(layer, role, spec))
            self.where = f" (layer {layer} {role.upper()}, {calib.path})"

    def set_levels(self, levels: torch.Tensor) -> None:
        levels = torch.as_tensor(levels, dtype=torch.float32).flatten()
        if levels.numel() != 1 << self.spec.bits or not bool((levels[1:] > levels[:-1]).all()):
            raise ValueError(
                f"a {self.spec} codebook holds {1 << self.spec.bits} ascending levels, got {levels}"
            )
        self.levels = levels

    def _levels(self, device: torch.device) -> torch.Tensor:
        if self.levels is None:
            raise SchemeError(
                f"{self.spec} has no codebook: give the scheme a calibration file (calib=FILE), written by `"
                + CALIBRATE_COMMAND.format(scheme=self.spec)
                + "`, and build the codec with its layer (codec_for(..., layer=i, role='k', calib=...))"
            )
        return self.levels.to(device)

    def fields(self) -> dict[str, Field]:
        return _scaled_code_fields(self)

    def normalize(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """x (B, H, T, D) -> (x_n (*stat_shape, G) fp32, stored scale, stored zero or None,
        finite (*stat, 1)): the values the codebook quantizes; calibration fits the levels on exactly
        these."""
        blocks = self.extent.blocks(x.float())
        finite = torch.isfinite(blocks).all(dim=-1, keepdim=True)
        if self.spec.symmetric:
            zero = None
            scale = round_stat(blocks.abs().amax(dim=-1, keepdim=True), self.scale_dtype, up=True)
            z = torch.zeros((), device=x.device)
        else:
            lo, hi = blocks.aminmax(dim=-1, keepdim=True)
            zero = ((hi + lo) / 2).to(self.scale_dtype)
            z = zero.float()
            scale = round_stat(torch.maximum(hi - z, z - lo), self.scale_dtype, up=True)
        s = scale.float()
        finite &= torch.isfinite(s) & torch.isfinite(z)
        xn = torch.where(s > 0, (blocks - z) / s, torch.zeros_like(blocks))
        return xn, scale, zero, finite

    def midpoints(self, device: torch.device) -> torch.Tensor:
        """(2^bits - 1,) float32: the midpoints between neighbouring levels that `encode` bucketizes against
        (a code is the number of midpoints strictly below x_n: a tie goes to the lower level)."""
        levels = self._levels(device)
        return (levels[1:] + levels[:-1]) / 2

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        mids = self.midpoints(x.device)
        xn, scale, zero, finite = self.normalize(x.to(self.dtype))
        codes = torch.bucketize(xn.contiguous(), mids)  # nearest level
        codes = torch.where(finite, codes, 0).to(torch.uint8)
        scale = torch.where(finite, scale, torch.nan)
        out = {"codes": pack(self.extent.unblocks(codes, x.shape).contiguous(), self.spec.bits)}
        out["scale"] = scale.squeeze(-1).contiguous()
        if zero is not None:
            out["zero"] = zero.squeeze(-1).contiguous()
        return out

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        codes = fields["codes"]
        shape = (*codes.shape[:3], self.head_dim)
        idx = unpack(codes, self.spec.bits, self.head_dim).int()  # (B, H, T, D): shifts and masks, int32
        values = torch.nn.functional.embedding(idx, self._levels(codes.device)[:, None]).squeeze(-1)
        blocks, scale = self.extent.broadcast(values, fields["scale"].float())
        x = blocks * scale
        if "zero" in fields:
            x = x + self.extent.broadcast(values, fields["zero"].float())[1]
        return x.reshape(shape).to(dtype or self.dtype)

    def codebook_values(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        xn, _, _, finite = self.normalize(x)
        return xn[finite.expand_as(xn)]

    def batches_with(self, other: Codec) -> bool:
        return (
            super().batches_with(other)
            and self.levels is not None
            and other.levels is not None
            and torch.equal(self.levels, other.levels)
        )


class PreRopeCodec(Codec):
    """Keys stored before the rotary embedding (`-prerope`): `encode_at` un-rotates keys at their positions
    (`kvquant.rope.Rope.invert`, exact) and the wrapped codec encodes them; `decode_at` decodes and re-applies
    RoPE. Fields are the wrapped codec's. The decode kernel reads the wrapped codec's fields and applies RoPE
    at each key's position in place (`kvquant.kernels.layouts.decode_parts`), when the wrapped codec is
    read in the model's frame (no -rot inside); appends take `encode_at`."""

    def __init__(self, spec: QuantSpec, inner: Codec, rope=None):
        super().__init__(spec, inner.heads, inner.head_dim, inner.dtype)
        self.inner, self.rope = inner, rope

    def _rope(self):
        if self.rope is None:
            raise SchemeError(
                f"{self.spec} stores keys before RoPE and needs the model's rotary embedding: "
                "build the cache with the model's config (QuantizedCache(scheme, model.config))"
            )
        return self.rope

    def fields(self) -> dict[str, Field]:
        return self.inner.fields()

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        raise SchemeError(f"{self.spec} needs the keys' positions: call encode_at(x, start)")

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        raise SchemeError(f"{self.spec} needs the keys' positions: call decode_at(fields, start, dtype)")

    def encode_at(self, x: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
        return self.inner.encode(self._rope().invert(x, start))

    def decode_at(
        self, fields: Mapping[str, torch.Tensor], start: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        return self._rope().apply(self.inner.decode(fields, dtype), start)

    def bind(self, *, layer: int | None, role: str | None, calib, spec: QuantSpec) -> None:
        self.inner.bind(layer=layer, role=role, calib=calib, spec=spec)

    def codebook_values(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        return self.inner.codebook_values(self._rope().invert(x, start), start)

    def kernel_layout(self) -> None:
        return None  # no pack kernel (the decode kernel reads it through kvquant.kernels.layouts)

    def batches_with(self, other: Codec) -> bool:
        return False


def codec_class(part) -> type[Codec]:
    """The registered codec of a family config or transform object (by its type, or the nearest base)."""
    for kind in type(part).__mro__:
        if kind in _FAMILIES:
            return _FAMILIES[kind]
    known = ", ".join(sorted(k.__name__ for k in _FAMILIES))
    raise SchemeError(
        f"no codec is registered for {type(part).__name__} ({part!r}); registered: {known} "
        "(a family's module registers its codec with @kvquant.codecs.base.register(ItsConfig))"
    )


def _build(spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype) -> Codec:
    """The family's codec, then each transform's around it, innermost first: int4-g64-center-rot gives
    CenterCodec(RotationCodec(AffineCodec)), each wrapper bound to the spec from its transform inwards."""
    ts = spec.transforms
    core = dataclasses.replace(spec, transforms=()) if ts else spec
    codec = codec_class(spec.family)(core, heads, head_dim, dtype)
    for i in reversed(range(len(ts))):
        codec = codec_class(ts[i])(dataclasses.replace(spec, transforms=ts[i:]), codec)
    return codec


def codec_for(
    spec: QuantSpec | str,
    heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    *,
    layer: int | None = None,
    role: str | None = None,
    calib=None,
    rope=None,
) -> Codec:
    """The codec that stores `spec` for H_kv=heads, head_dim and the K/V dtype.

    layer, role ("k" or "v") and calib (a `kvquant.calibration.Calibration`) give calibrated codecs their
    tables (a codebook spec without them can size its fields but not encode); rope (`kvquant.rope.Rope`)
    serves `-prerope` keys."""
    spec = parse_spec(spec)
    if not isinstance(heads, int) or not isinstance(head_dim, int) or heads < 1 or head_dim < 1:
        raise ValueError(f"heads and head_dim must be positive integers, got {heads!r} and {head_dim!r}")
    if role not in (None, "k", "v"):
        raise ValueError(f"role must be 'k' or 'v', got {role!r}")
    inner = dataclasses.replace(spec, prerope=False) if spec.prerope else spec
    codec = _build(inner, heads, head_dim, torch_dtype(dtype))
    if spec.prerope:  # wraps last: keys un-rotated by RoPE before any transform sees them
        codec = PreRopeCodec(spec, codec, rope)
    codec.bind(layer=layer, role=role, calib=calib, spec=spec)
    return codec

