"""Codecs: how one K or V spec is stored, read back, sized and served by kernels, said in one place.

A codec is bound to a spec and a layer's shape (H_kv heads, head_dim D, K/V dtype). It stores T tokens
(B, H_kv, T, D) as named fields, each laid out (B, heads_f, T // tokens_f, cols_f):

    codec        field    heads_f      tokens_f   cols_f        dtype
    dense (fp16) values   H            1          D             the K/V dtype
    affine INT   codes    H            1          D * bits / 8  uint8 (packed, kvquant.packing)
                 scale    H or 1 (*)   t_e        D / c_e       the scale dtype
                 zero     same as scale (asymmetric specs only)

(*) a scale shared by all heads of a token (per-token granularity) is stored once: heads_f = 1.

`BlockExtent` says which elements share one scale; the quantizer's lowering, dequantize's broadcast, the
bytes formula, the page layout and the kernels' launch arguments all read it, so nothing else switches on
granularity. The page store (`kvquant.store`) keeps each field in pages of `block_size` tokens
((P, heads_f, block_size // tokens_f, cols_f)) and never looks inside a field.

A new quantizer family is one more `Codec` subclass registered in `_FAMILIES`; the store, the bytes formula
and the attention path need no change. A codec that no kernel serves returns None from `kernel_layout`,
and attention then takes the PyTorch reference path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .packing import packed_size
from .scheme import Granularity, QuantSpec, SchemeError, parse_spec

__all__ = [
    "AffineCodec",
    "BlockExtent",
    "Codec",
    "DenseCodec",
    "Field",
    "KernelLayout",
    "block_extent",
    "codec_for",
    "torch_dtype",
]

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
    consecutive channels x `heads` consecutive heads. Scale shape: (B, H // heads, T // tokens, D // channels).

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
    """The one place that turns a granularity into a block extent."""
    n = spec.group_size or 1
    return {
        Granularity.TOKEN: BlockExtent(heads, 1, head_dim),
        Granularity.HEAD: BlockExtent(1, 1, head_dim),
        Granularity.GROUP: BlockExtent(1, 1, n),
        Granularity.CHANNEL: BlockExtent(1, n, 1),
    }[spec.granularity]


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

    def bytes(self, num_tokens: int) -> int:
        """Bytes held for num_tokens tokens of one sequence (a multiple of token_group)."""
        return sum(f.nbytes(num_tokens) for f in self.fields().values())

    def num_tokens(self, fields: Mapping[str, torch.Tensor]) -> int:
        name, f = next(iter(self.fields().items()))
        return fields[name].shape[2] * f.tokens

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec}, heads={self.heads}, head_dim={self.head_dim})"


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


class AffineCodec(Codec):
    """Uniform affine INT8/INT4/INT2 at any granularity: `kvquant.quantize` arithmetic, bit for bit."""

    def __init__(self, spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__(spec, heads, head_dim, dtype)
        self.extent = block_extent(spec, heads, head_dim)
        self.scale_dtype = torch_dtype(spec.scale_dtype) if spec.scale_dtype else dtype

    def fields(self) -> dict[str, Field]:
        e, d = self.extent, self.head_dim
        stat = Field(self.heads // e.heads, e.tokens, d // e.channels, self.scale_dtype)
        out = {"codes": Field(self.heads, 1, packed_size(d, self.spec.bits), torch.uint8), "scale": stat}
        if not self.spec.symmetric:
            out["zero"] = stat
        return out

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        from .quantize import quantize

        return quantize(x.to(self.dtype), self.spec).fields()

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        from .quantize import QTensor, dequantize

        codes = fields["codes"]
        shape = torch.Size((*codes.shape[:3], self.head_dim))
        q = QTensor(codes, fields["scale"], fields.get("zero"), self.spec, shape, self.dtype)
        return dequantize(q, dtype)

    def kernel_layout(self) -> KernelLayout:
        e = self.extent
        return KernelLayout(
            bits=self.spec.bits,
            symmetric=self.spec.symmetric,
            token_extent=e.tokens,
            channel_extent=e.channels,
            shared_heads=e.heads == self.heads and self.heads > 1,
        )


# The codec family of a spec. Research codecs (rotation, FP8, codebooks, outliers) register here.
_FAMILIES: dict[str, type[Codec]] = {"dense": DenseCodec, "affine": AffineCodec}


def _family(spec: QuantSpec) -> str:
    return "affine" if spec.is_quantized else "dense"


def codec_for(spec: QuantSpec | str, heads: int, head_dim: int, dtype: torch.dtype = torch.float16) -> Codec:
    """The codec that stores `spec` for H_kv=heads, head_dim and the K/V dtype."""
    spec = parse_spec(spec)
    if not isinstance(heads, int) or not isinstance(head_dim, int) or heads < 1 or head_dim < 1:
        raise ValueError(f"heads and head_dim must be positive integers, got {heads!r} and {head_dim!r}")
    return _FAMILIES[_family(spec)](spec, heads, head_dim, torch_dtype(dtype))
