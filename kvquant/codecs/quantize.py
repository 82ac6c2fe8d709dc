"""The uniform integer family (`int8`, `int4`, `int2`; `kvquant.spec_types.UniformInt`): quantize(x, spec)
-> QTensor and dequantize(q), for K/V tensors of shape (B, H_kv, T, D), and `AffineCodec`, the codec that
stores them in pages with this arithmetic bit for bit. `fake_quantize` encodes and decodes with any spec's
codec.

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

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..scheme import QuantSpec, parse_spec
from ..spec_types import UniformInt
from .base import (
    Codec,
    Field,
    KernelLayout,
    PageRead,
    _scaled_code_fields,
    block_extent,
    codec_for,
    page_rows,
    register,
    round_stat,
    split_region,
    torch_dtype,
)
from .packing import pack, unpack, unpack_into

__all__ = ["AffineCodec", "QTensor", "quantize", "dequantize", "fake_quantize", "scale_shape", "sqnr_db"]


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
        """The stored fields by name, as `AffineCodec` (below) lays them out."""
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
    if not isinstance(spec.family, UniformInt) or spec.transforms:
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
        scale = round_stat(blocks.abs().amax(dim=-1, keepdim=True), sdtype, up=True)
        s = scale.float()
        offset = 1 << (spec.bits - 1)
        q = torch.floor(blocks / s * spec.qmax + 0.5).clamp_(-spec.qmax, spec.qmax) + offset
        zero = None
    else:
        lo, hi = blocks.aminmax(dim=-1, keepdim=True)
        zero = round_stat(lo, sdtype, up=False)
        z = zero.float()
        scale = round_stat((hi - z) / spec.qmax, sdtype, up=True)
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


@register(UniformInt)
class AffineCodec(Codec):
    """Uniform affine INT8/INT4/INT2 at any granularity: `kvquant.codecs.quantize` arithmetic, bit for bit."""

    def __init__(self, spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__(spec, heads, head_dim, dtype)
        self.extent = block_extent(spec, heads, head_dim)
        self.scale_dtype = torch_dtype(spec.scale_dtype) if spec.scale_dtype else dtype

    def fields(self) -> dict[str, Field]:
        return _scaled_code_fields(self)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return quantize(x.to(self.dtype), self.spec).fields()

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        codes = fields["codes"]
        shape = torch.Size((*codes.shape[:3], self.head_dim))
        q = QTensor(codes, fields["scale"], fields.get("zero"), self.spec, shape, self.dtype)
        return dequantize(q, dtype)

    def decode_pages(
        self, pages: Mapping[str, torch.Tensor], region, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`decode` of a region, page-major: each page's codes are unpacked straight into their tokens' rows
        of one fp32 buffer (B, H, pages * block_size, D), then scaled and shifted in place, with dequantize's
        arithmetic (so bit for bit its values), and the region's tokens sliced out. No int64 index tensors,
        no (B, H, T, D) temporary but the buffer itself."""
        table = region.table
        bsz, n = table.shape
        codes = pages["codes"].index_select(0, table.reshape(-1).to(pages["codes"].device))
        rows = codes.shape[2]  # tokens per page
        numel = bsz * self.heads * n * rows * self.head_dim
        if out is None or out.numel() < numel or out.dtype != torch.float32:
            out = torch.empty(numel, dtype=torch.float32, device=codes.device)
        values = out[:numel].view(bsz, self.heads, n * rows, self.head_dim)  # (B, H, pages * bs, D)
        by_page = values.view(bsz, self.heads, n, rows, self.head_dim).transpose(1, 2)  # (B, n, H, bs, D)
        unpack_into(codes.view(bsz, n, self.heads, rows, codes.shape[-1]), self.spec.bits, by_page)
        spec = self.spec
        if spec.symmetric:
            values.sub_(1 << (spec.bits - 1)).div_(spec.qmax)
        blocks, scale = self.extent.broadcast(values, page_rows(pages["scale"], table).float())
        blocks.mul_(scale)
        if not spec.symmetric:
            blocks.add_(self.extent.broadcast(values, page_rows(pages["zero"], table).float())[1])
        got = values[:, :, region.offset : region.offset + region.length]  # (B, H, length, D)
        return got if dtype == torch.float32 else got.to(dtype)

    def _folds(self, dtype: torch.dtype) -> bool:
        """Whether score_pages / value_pages fold the scales into the products: fp32 work, one token per
        block (not channel-wise), and groups of whole bytes."""
        e = self.extent
        return dtype == torch.float32 and e.tokens == 1 and (e.channels * self.spec.bits) % 8 == 0

    def _native(self, x: torch.Tensor, read: PageRead):
        """kvquant.native's ops when they serve this call (fp32 on the CPU, built, no autograd), else None."""
        if not read.native or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        if x.requires_grad and torch.is_grad_enabled():
            return None
        from .. import native

        return native.ops()

    def _stat_rows(self, pages: Mapping[str, torch.Tensor], table: torch.Tensor):
        """The factor and offset (B, H_f, pages * rows, n_groups) fp32, one row per block of tokens, that turn
        code c into A c + Z over the pages of `table`: dequantize's arithmetic, reassociated."""
        a = page_rows(pages["scale"], table).float()
        if self.spec.symmetric:  # ((c - 2^(b-1)) / qmax) s
            a = a / self.spec.qmax
            return a, a * -float(1 << (self.spec.bits - 1))
        return a, page_rows(pages["zero"], table).float()  # c s + zero

    def _fold_stats(self, pages: Mapping[str, torch.Tensor], region) -> tuple[torch.Tensor, torch.Tensor]:
        """`_stat_rows` of the region's tokens (one token per row: not channel-wise), (B, H_f, length, G)."""
        a, z = self._stat_rows(pages, region.table)
        span = slice(region.offset, region.offset + region.length)
        return a[:, :, span], z[:, :, span]

    def _native_call(self, op, x: torch.Tensor, pages, region, *extra) -> torch.Tensor:
        a, z = self._stat_rows(pages, region.table)
        table = region.table.to(x.device).contiguous()
        stats = (a.contiguous(), z.contiguous())
        return op(x.contiguous(), pages["codes"], table, *stats, region.offset, *extra, self.spec.bits,
                  self.extent.tokens)

    def _code_blocks(self, pages: Mapping[str, torch.Tensor], region, read: PageRead):
        """(first token, tokens, codes (B, H, n_groups, tokens, G) fp32 unscaled) per block of the region:
        each block's pages unpacked into one reused buffer, page by page."""
        table = region.table
        bsz, n = table.shape
        h, d, g = self.heads, self.head_dim, self.extent.channels
        ng = d // g
        pool = pages["codes"]
        codes = pool.index_select(0, table.reshape(-1).to(pool.device)).view(bsz, n, h, pool.shape[2], -1)
        bs = pool.shape[2]
        for sub, off in split_region(region, bs, read.tokens):
            j0 = (region.offset + off) // bs  # first page of the block
            k = sub.table.shape[1]
            numel = bsz * h * k * bs * d
            buf = read.buffer
            if buf is None or buf.numel() < numel or buf.dtype != torch.float32:
                buf = torch.empty(numel, dtype=torch.float32, device=pool.device)
            c = buf[:numel].view(bsz, h, ng, k * bs, g)  # (B, H, n_groups, pages * bs, G)
            dst = c.view(bsz, h, ng, k, bs, g).permute(0, 3, 1, 4, 2, 5)  # (B, k, H, bs, n_groups, G)
            unpack_into(codes[:, j0 : j0 + k].view(bsz, k, h, bs, ng, -1), self.spec.bits, dst)
            yield off, sub.length, c[:, :, :, sub.offset : sub.offset + sub.length]

    def score_pages(
        self, q: torch.Tensor, pages: Mapping[str, torch.Tensor], region, read: PageRead = None
    ) -> torch.Tensor:
        """q . (A c + Z) = A (q . c) + Z sum(q), group by group: the codes are unpacked but never scaled."""
        read = read or PageRead()
        native = self._native(q, read)
        if native is not None:  # any granularity: statistics per row of te tokens
            return self._native_call(native.affine_scores, q, pages, region, region.length)
        if not self._folds(q.dtype):
            return super().score_pages(q, pages, region, read)
        a, z = self._fold_stats(pages, region)
        bsz, h, m, d = q.shape
        ng = d // self.extent.channels
        qg = q.reshape(bsz, h, m, ng, d // ng)
        s = q.new_empty((bsz, h, m, region.length))
        for off, n, c in self._code_blocks(pages, region, read):
            if ng == 1:
                s[..., off : off + n] = torch.matmul(q, c[:, :, 0].transpose(-1, -2))
            else:
                parts = torch.matmul(qg.transpose(2, 3), c.transpose(-1, -2))  # (B, H, n_groups, m, n)
                a_t = a[:, :, off : off + n].permute(0, 1, 3, 2).unsqueeze(3)  # (B, H_f, n_groups, 1, n)
                s[..., off : off + n] = (parts * a_t).sum(2)
        qsum = qg.sum(-1)  # (B, H, m, n_groups)
        if ng == 1:
            return s.mul_(a.transpose(-1, -2)).add_(qsum * z.transpose(-1, -2))
        return s.add_(torch.matmul(qsum, z.transpose(-1, -2)))

    def value_pages(
        self, p: torch.Tensor, pages: Mapping[str, torch.Tensor], region, read: PageRead = None
    ) -> torch.Tensor:
        """sum_t p_t (A_t c_t + Z_t) = (p A) @ c + p @ Z, group by group."""
        read = read or PageRead()
        native = self._native(p, read)
        if native is not None:
            return self._native_call(native.affine_values, p, pages, region)
        if not self._folds(p.dtype):
            return super().value_pages(p, pages, region, read)
        a, z = self._fold_stats(pages, region)
        bsz, h, m, _ = p.shape
        ng, g = self.head_dim // self.extent.channels, self.extent.channels
        if ng == 1:
            w = p * a.transpose(-1, -2)  # (B, H, m, length)
        else:
            w = p.unsqueeze(2) * a.permute(0, 1, 3, 2).unsqueeze(3)  # (B, H, n_groups, m, length)
        o = p.new_zeros((bsz, h, m, self.head_dim) if ng == 1 else (bsz, h, ng, m, g))
        for off, n, c in self._code_blocks(pages, region, read):
            if ng == 1:
                o.add_(torch.matmul(w[..., off : off + n], c[:, :, 0]))
            else:
                o.add_(torch.matmul(w[..., off : off + n], c))  # (B, H, n_groups, m, G)
        bias = torch.matmul(p, z)  # (B, H, m, n_groups)
        if ng == 1:
            return o.add_(bias)
        return o.add_(bias.transpose(2, 3).unsqueeze(-1)).transpose(2, 3).reshape(bsz, h, m, ng * g)

    def kernel_layout(self) -> KernelLayout:
        e = self.extent
        return KernelLayout(
            bits=self.spec.bits,
            symmetric=self.spec.symmetric,
            token_extent=e.tokens,
            channel_extent=e.channels,
            shared_heads=e.heads == self.heads and self.heads > 1,
        )


def fake_quantize(x: torch.Tensor, spec: QuantSpec | str) -> torch.Tensor:
    """Encode then decode x (B, H, T, D) with the spec's codec; an incomplete last token group
    (channel-wise specs) stays as it is, as the cache keeps it."""
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
