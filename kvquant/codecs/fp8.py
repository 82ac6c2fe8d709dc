"""FP8 codec (`fp8-e4m3`, `fp8-e5m2`): torch's float8 dtypes, one byte per value, as vLLM and TensorRT-LLM
store
their FP8 KV caches.

    field    heads_f       tokens_f   cols_f     dtype
    codes    H             1          D          uint8 (the float8 bit pattern; viewed back as float8)
    scale    H or 1 (*)    t_e        D / c_e    the scale dtype (absent for -tensor)

Scale options are the block extents of the integer codecs (`codecs.base.block_extent`): per token over all
heads (the default, as `int8`), `-head`, `-gN`, `-channel-gN`; the scale is the block's absmax divided by
the format's largest finite value (448 for E4M3, 57344 for E5M2), rounded up in the scale dtype so that no
element overflows. `-tensor` is a fixed unit scale with nothing stored: vLLM's FP8 cache when no
calibrated k_scale / v_scale is given. A per-tensor scale measured on the data is not appendable in a cache
(tokens arrive one at a time), so it is offered only as this fixed value; values beyond the format's range
saturate to +-max (never Inf or NaN).

Rounding is torch's float -> float8 cast (round to nearest even). Non-finite input poisons its block as in
`kvquant.codecs.quantize`: NaN scale, so the block decodes to NaN (with -tensor, NaN codes per element).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..scheme import QuantSpec
from ..spec_types import FP8
from .base import Codec, Field, KernelLayout, block_extent, register, round_stat, torch_dtype

__all__ = ["FP8Codec", "FP8KernelLayout", "FP8_DTYPES", "fp8_max"]

FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_max(kind: str) -> float:
    """Largest finite value of an FP8 kind: 448 (e4m3fn), 57344 (e5m2)."""
    return float(torch.finfo(FP8_DTYPES[kind]).max)


@dataclass(frozen=True)
class FP8KernelLayout(KernelLayout):
    """An FP8 codec's kernel layout: 8-bit `codes` holding float8 bits of kind `fp8` ("e4m3" or "e5m2"),
    times a scale laid out as the integer codecs' (no zero); unit_scale: no scale field (-tensor)."""

    fp8: str = "e4m3"
    unit_scale: bool = False


@register(FP8)
class FP8Codec(Codec):
    """FP8 codes with an absmax scale per block (or a fixed unit scale for -tensor)."""

    def __init__(self, spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__(spec, heads, head_dim, dtype)
        self.kind = spec.family.kind  # "e4m3" or "e5m2"
        self.fp8_dtype = FP8_DTYPES[self.kind]
        self.fmax = fp8_max(self.kind)
        self.unit_scale = spec.family.unit_scale
        self.extent = None if self.unit_scale else block_extent(spec, heads, head_dim)
        self.scale_dtype = torch_dtype(spec.scale_dtype) if spec.scale_dtype else dtype

    def fields(self) -> dict[str, Field]:
        out = {"codes": Field(self.heads, 1, self.head_dim, torch.uint8)}
        if not self.unit_scale:
            e = self.extent
            out["scale"] = Field(
                self.heads // e.heads, e.tokens, self.head_dim // e.channels, self.scale_dtype
            )
        return out

    def _cast(self, v: torch.Tensor) -> torch.Tensor:
        """fp32 -> float8 bit pattern as uint8, saturating finite values (NaN stays NaN)."""
        return v.clamp(-self.fmax, self.fmax).to(self.fp8_dtype).view(torch.uint8)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        xf = x.to(self.dtype).float()
        if self.unit_scale:
            return {"codes": self._cast(xf).contiguous()}
        e = self.extent
        blocks = e.blocks(xf)  # (*stat_shape, G)
        finite = torch.isfinite(blocks).all(dim=-1, keepdim=True)
        scale = round_stat(blocks.abs().amax(dim=-1, keepdim=True) / self.fmax, self.scale_dtype, up=True)
        s = scale.float()
        finite &= torch.isfinite(s)
        q = torch.where((s > 0) & finite, blocks / torch.where(s > 0, s, 1.0), 0.0)
        scale = torch.where(finite, scale, torch.nan)
        codes = self._cast(e.unblocks(q, x.shape))  # (B, H, T, D)
        return {"codes": codes.contiguous(), "scale": scale.squeeze(-1).contiguous()}

    def kernel_layout(self) -> FP8KernelLayout:
        """Read in place by the decode kernel (kvquant.kernels.decode_attention); appends take `encode`."""
        if self.unit_scale:
            return FP8KernelLayout(bits=8, symmetric=True, channel_extent=self.head_dim, fp8=self.kind,
                                   unit_scale=True)
        e = self.extent
        return FP8KernelLayout(bits=8, symmetric=True, token_extent=e.tokens, channel_extent=e.channels,
                               shared_heads=e.heads == self.heads and self.heads > 1, fp8=self.kind)

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        values = fields["codes"].contiguous().view(self.fp8_dtype).float()  # (B, H, T, D)
        if self.unit_scale:
            return values.to(dtype or self.dtype)
        blocks, scale = self.extent.broadcast(values, fields["scale"].float())
        return (blocks * scale).reshape(values.shape).to(dtype or self.dtype)
