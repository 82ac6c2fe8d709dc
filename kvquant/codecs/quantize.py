"""quantize(x, spec) -> QTensor and dequantize(q), for K/V tensors of shape (B, H_kv, T, D).

Every granularity is lowered to one form by its `kvquant.codecs.base.BlockExtent`: a view `blocks` of shape
(*scale_shape, G) whose last dimension holds the G elements that share one scale (and zero). Statistics
reduce over that last dimension; dequantize broadcasts the scale back with the same extent.

    granularity   scale/zero shape      G
    token         (B, 1, T, 1)          H * D
    head          (B, H, T, 1)          D
    group (N)     (B, H, T, D // N)     N
    channel (N)   (B, H, T // N, D)     N   (tokens)

Arithmetic (fp32, against the *stored* scale and zero so that the dequantizer sees what the
quantizer used; rounding is floor(v + 0.5), which a kernel reproduces bit for bit). Stored in a
narrower dtype, the zero is rounded down and the scale up (to the next representable value when
round-to-nearest fell short), so the stored range always covers the block and no element is
clipped: every element is within half a step of its value.
    asymmetric: zero = min, scale = (max - zero) / (2^b - 1), code = floor((x - zero) / scale + 0.5)
                x_hat = code * scale + zero
    symmetric:  scale = max|x| (absmax), code = floor(x / scale * qmax + 0.5) + 2^(b-1),
                x_hat = (code - 2^(b-1)) / qmax * scale, with qmax = 2^(b-1) - 1
A constant (or all-zero) block dequantizes exactly: scale 0 gives code 0 (asymmetric, x_hat = zero)
or the absmax itself (symmetric). Codes are packed along D (`kvquant.codecs.packing`).

Non-finite input: a block holding NaN or +-Inf, or whose scale or zero overflows the scale dtype
(|x| > 65504 with fp16 scales), gets a NaN scale and zero codes, so the whole block dequantizes to NaN.
Bad values stay loud; they never turn into finite garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scheme import QuantSpec, parse_spec
from .base import block_extent, torch_dtype
from .packing import pack, unpack

__all__ = ["QTensor", "quantize", "dequantize", "fake_quantize", "scale_shape", "sqnr_db"]


@dataclass(frozen=True)
class QTensor:
    """Quantized K or V: packed codes plus per-block scale (and zero for asymmetric specs).

    codes: uint8 (B, H, T, D * bits // 8), packed along D.
    scale, zero: see the table in the module docstring; zero is None for symmetric specs.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    spec: QuantSpec
    shape: torch.Size  # (B, H, T, D) of the original tensor
    dtype: torch.dtype  # dtype that dequantize returns

    @property
    def nbytes(self) -> int:
        zero = 0 if self.zero is None else self.zero.nbytes
        return self.codes.nbytes + self.scale.nbytes + zero

    def fields(self) -> dict[str, torch.Tensor]:
        """The stored fields by name, as `kvquant.codecs.base.AffineCodec` lays them out."""
        out = {"codes": self.codes, "scale": self.scale}
        if self.zero is not None:
            out["zero"] = self.zero
        return out


def scale_shape(shape: torch.Size | tuple[int, ...], spec: QuantSpec | str) -> tuple[int, ...]:
    """Shape of the scale (and zero) for a (B, H, T, D) tensor quantized with `spec`."""
    spec = parse_spec(spec)
    return block_extent(spec, shape[1], shape[3]).stat_shape(tuple(shape))


def _check(x: torch.Tensor, spec: QuantSpec) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected K/V as a torch.Tensor of shape (B, H_kv, T, D), got {type(x).__name__}")
    if not spec.is_quantized:
        raise ValueError("spec is fp16: there is nothing to quantize")
    if spec.fp8 is not None or spec.transforms:
        raise ValueError(
            f"quantize() is the uniform affine arithmetic; {spec} is stored by its codec: "
            "kvquant.codecs.base.codec_for(spec, H_kv, D, dtype).encode(x), or fake_quantize(x, spec)"
        )
    if x.dim() != 4:
        raise ValueError(f"expected K/V of shape (B, H_kv, T, D), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    spec.check_head_dim(x.shape[-1])
    tokens = block_extent(spec, x.shape[1], x.shape[3]).tokens
    if x.shape[2] % tokens:
        raise ValueError(
            f"{spec} groups {tokens} tokens, but T={x.shape[2]} is not a multiple; "
            "quantize whole groups (the cache keeps an incomplete group in FP16 until it fills)"
        )


def _round(t: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """fp32 t -> dtype, rounded up (or down) so that the stored statistic still covers t: a scale
    rounded down (bf16 keeps 8 bits) would clip the block's largest values by up to qmax * 2^-8 steps."""
    if dtype == t.dtype:
        return t  # nothing to round
    r = t.to(dtype)
    off = r.float() < t if up else r.float() > t
    return torch.where(off, torch.nextafter(r, torch.full_like(r, float("inf") if up else float("-inf"))), r)


def _round_up_to_cover(scale: torch.Tensor, span: torch.Tensor, qmax: int) -> torch.Tensor:
    """One more step up where scale * qmax, computed in fp32, still falls short of the span."""
    short = scale.float() * qmax < span
    return torch.where(short, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)


def quantize(x: torch.Tensor, spec: QuantSpec | str) -> QTensor:
    """Quantize x (B, H_kv, T, D) with `spec` (a QuantSpec or a spec string such as "int4-g64");
    see the module docstring for the arithmetic."""
    spec = parse_spec(spec)
    _check(x, spec)
    extent = block_extent(spec, x.shape[1], x.shape[3])
    blocks = extent.blocks(x.float())  # (*stat_shape, G)
    finite = torch.isfinite(blocks).all(dim=-1, keepdim=True)
    sdtype = torch_dtype(spec.scale_dtype) if spec.scale_dtype else x.dtype
    if spec.symmetric:
        scale = _round(blocks.abs().amax(dim=-1, keepdim=True), sdtype, up=True)
        s = scale.float()
        offset = 1 << (spec.bits - 1)
        q = torch.floor(blocks / s * spec.qmax + 0.5).clamp_(-spec.qmax, spec.qmax) + offset
        zero = None
    else:
        lo, hi = blocks.aminmax(dim=-1, keepdim=True)
        zero = _round(lo, sdtype, up=False)
        z = zero.float()
        scale = _round((hi - z) / spec.qmax, sdtype, up=True)
        scale = _round_up_to_cover(scale, hi - z, spec.qmax)
        s = scale.float()
        q = torch.floor((blocks - z) / s + 0.5).clamp_(0, spec.qmax)
    # a finite block whose statistic overflows the scale dtype (1e5 in an fp16 scale) is poisoned too
    finite &= torch.isfinite(s) if zero is None else torch.isfinite(s) & torch.isfinite(z)
    q = torch.where((s > 0) & finite, q, 0.0 if not spec.symmetric else float(offset))
    q = torch.where(finite, q, 0.0)
    scale = torch.where(finite, scale, torch.nan)
    codes = extent.unblocks(q.to(torch.uint8), x.shape)  # (B, H, T, D)
    squeeze = -1  # the reduced G dimension
    zero = None if zero is None else zero.squeeze(squeeze).contiguous()
    return QTensor(
        codes=pack(codes.contiguous(), spec.bits),
        scale=scale.squeeze(squeeze).contiguous(),
        zero=zero,
        spec=spec,
        shape=x.shape,
        dtype=x.dtype,
    )


def dequantize(q: QTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """QTensor -> tensor of q.shape, in `dtype` (default: the dtype that was quantized).

    Codes are unpacked with shifts and masks on the packed bytes (`kvquant.codecs.packing.unpack`, no index
    tensors), then x_hat = code * scale + zero, or (code - 2^(b-1)) / qmax * scale, in fp32."""
    spec = q.spec
    # one fresh buffer, then in place: each fresh (B, H, T, D) temporary costs its page faults on the CPU
    values = unpack(q.codes, spec.bits, q.shape[-1]).float()  # (B, H, T, D)
    if spec.symmetric:
        values.sub_(1 << (spec.bits - 1)).div_(spec.qmax)
    extent = block_extent(spec, q.shape[1], q.shape[3])
    blocks, scale = extent.broadcast(values, q.scale.float())
    blocks.mul_(scale)
    if not spec.symmetric:
        blocks.add_(extent.broadcast(values, q.zero.float())[1])
    return values.to(dtype or q.dtype)


def fake_quantize(x: torch.Tensor, spec: QuantSpec | str) -> torch.Tensor:
    """Encode then decode x (B, H, T, D) with the spec's codec; an incomplete last token group
    (channel-wise specs) stays as it is, as the cache keeps it."""
    from .base import codec_for

    spec = parse_spec(spec)
    if not spec.is_quantized:
        return x
    codec = codec_for(spec, x.shape[1], x.shape[3], x.dtype)
    full = x.shape[2] - x.shape[2] % codec.token_group
    head = codec.decode(codec.encode(x[:, :, :full]), x.dtype) if full else x[:, :, :0]
    return head if full == x.shape[2] else torch.cat([head, x[:, :, full:]], dim=2)


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|x|^2 / |x - x_hat|^2)."""
    x, x_hat = x.double(), x_hat.double()
    noise = (x - x_hat).pow(2).sum()
    return float(10 * torch.log10(x.pow(2).sum() / noise.clamp_min(1e-300)))
