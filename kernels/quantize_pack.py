"""Quantize and pack K/V in one pass: `quantize_pack` (Triton) and its twin `quantize_pack_ref`.

Both take x (B, H_kv, T, D) and a quantized `QuantSpec` and return a `kvquant.quantize.QTensor` that is
bit for bit what `kvquant.quantize.quantize` returns (codes, scale, zero), for every granularity:

    granularity   scale/zero shape      one program handles
    token         (B, 1, T, 1)          one token (b, t): H * D elements, one block
    head          (B, H, T, 1)          one token (b, t): H blocks of D
    group (N)     (B, H, T, D // N)     one token (b, t): H * D / N blocks of N
    channel (N)   (B, H, T // N, D)     one token group (b, h, T-group) and a slice of D

Bit-exactness: the arithmetic is the reference's, step for step, in fp32, against the *stored* scale
and zero (rounded to the scale dtype so they cover the block: zero down, scale up, as the reference
does). fp32 division on the GPU is approximate unless asked otherwise, so every division is
`tl.math.div_rn`; the kernels are compiled with `enable_fp_fusion=False` so `v / s * qmax + 0.5` is not
contracted into an FMA (torch rounds after each operation). Rounding to a bf16 scale is done by hand
(round to nearest even on the fp32 bits) because the Triton interpreter truncates on a bf16 cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvquant.packing import packed_size
from kvquant.quantize import QTensor, quantize, scale_shape
from kvquant.scheme import Granularity, QuantSpec

__all__ = ["quantize_pack", "quantize_pack_ref", "kernel_supports"]

_SCALE_KIND = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_MAX_TILE = 8192  # elements per program (fp32 registers); larger tokens/groups are split along D


# ----------------------------------------------------------------------------------------------- jit


@triton.jit
def _round_nearest(x, KIND: tl.constexpr):
    """fp32 -> the nearest value of the scale dtype (round to nearest even), still as fp32.

    KIND: 0 fp16, 1 bf16, 2 fp32. The result is exact in the scale dtype, so the later store casts exactly.
    """
    if KIND == 0:
        return x.to(tl.float16).to(tl.float32)
    elif KIND == 1:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # RNE on the upper 16 bits
        return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))  # keep a NaN a NaN
    else:
        return x


@triton.jit
def _next_after(r, UP: tl.constexpr, KIND: tl.constexpr):
    """torch.nextafter(r, +-inf) in the scale dtype, for r exact in it (as fp32): one step on the bits."""
    if KIND == 0:
        bits = r.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        ULP: tl.constexpr = 1
        SIGN: tl.constexpr = 0x8000
    else:
        bits = r.to(tl.uint32, bitcast=True)
        ULP: tl.constexpr = 0x10000 if KIND == 1 else 1  # bf16 is the upper half of an fp32
        SIGN: tl.constexpr = 0x80000000
    away = (r < 0) != UP  # the magnitude grows: up from a positive value, down from a negative one
    stepped = tl.where(away, bits + ULP, bits - ULP)
    stepped = tl.where(r == 0, (ULP if UP else SIGN | ULP) + bits * 0, stepped)  # +-0 -> +-smallest subnormal
    if KIND == 0:
        return stepped.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return stepped.to(tl.float32, bitcast=True)


@triton.jit
def _round_to_cover(t, UP: tl.constexpr, KIND: tl.constexpr):
    """kvquant.quantize._round: nearest in the scale dtype, then one step up (UP) or down where that fell
    short of t, so a stored scale or zero never shrinks the range it covers."""
    r = _round_nearest(t, KIND)
    if KIND != 2:
        off = (r < t) if UP else (r > t)
        r = tl.where(off, _next_after(r, UP, KIND), r)
    return r


@triton.jit
def _quantize_tile(x, valid, AXIS: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
                   KIND: tl.constexpr):
    """x: fp32 tile, valid: its in-bounds mask; one block per line along AXIS.

    Returns (codes (like x, int32, unpacked), scale, zero), scale/zero reduced over AXIS, as stored (fp32
    values exact in the scale dtype). The steps and their order are kvquant.quantize.quantize's.
    """
    bad = valid & ((x != x) | (tl.abs(x) == float("inf")))
    finite = tl.sum(bad.to(tl.int32), axis=AXIS) == 0  # a NaN/Inf block gets a NaN scale and zero codes
    if SYMMETRIC:
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        OFFSET: tl.constexpr = 1 << (BITS - 1)
        amax = tl.max(tl.where(valid, tl.abs(x), 0.0), axis=AXIS).to(tl.float32)
        scale = _round_to_cover(amax, True, KIND).to(tl.float32)
        zero = scale  # unused
        v = tl.math.div_rn(x, tl.expand_dims(scale, AXIS)) * QMAX + 0.5
        q = tl.minimum(tl.maximum(tl.floor(v), -QMAX), QMAX) + OFFSET
        fill = OFFSET
    else:
        QMAX: tl.constexpr = (1 << BITS) - 1
        has_nan = tl.sum((valid & (x != x)).to(tl.int32), axis=AXIS) > 0
        lo = tl.min(tl.where(valid, x, float("inf")), axis=AXIS)
        hi = tl.max(tl.where(valid, x, float("-inf")), axis=AXIS)
        # torch's aminmax propagates NaN into the zero; the casts keep every step fp32 (the interpreter
        # may widen a where() with a Python float to fp64)
        lo = tl.where(has_nan, float("nan"), lo).to(tl.float32)
        zero = _round_to_cover(lo, False, KIND).to(tl.float32)
        span = hi.to(tl.float32) - zero
        scale = _round_to_cover(tl.math.div_rn(span, QMAX * 1.0), True, KIND).to(tl.float32)
        short = scale * QMAX < span  # kvquant.quantize._round_up_to_cover: scale * qmax must reach the span
        scale = tl.where(short, _next_after(scale, True, KIND), scale)
        v = tl.math.div_rn(x - tl.expand_dims(zero, AXIS), tl.expand_dims(scale, AXIS)) + 0.5
        q = tl.minimum(tl.maximum(tl.floor(v), 0.0), QMAX)
        fill = 0
    # a finite block whose statistic overflows the scale dtype is poisoned too (kvquant.quantize.quantize)
    finite = finite & (tl.abs(scale) != float("inf")) & (scale == scale)
    if not SYMMETRIC:
        finite = finite & (tl.abs(zero) != float("inf")) & (zero == zero)
    ok = (scale > 0) & finite
    q = tl.where(tl.expand_dims(ok, AXIS), q, fill)  # a constant block: scale 0, exact codes
    q = tl.where(tl.expand_dims(finite, AXIS), q, 0)
    scale = tl.where(finite, scale, float("nan"))
    return q.to(tl.int32), scale, zero


@triton.jit
def _pack_rows(q, ROWS: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr):
    """(ROWS, COLS) int32 codes -> (ROWS, COLS * BITS // 8) bytes, lowest bits first (kvquant.packing)."""
    PER: tl.constexpr = 8 // BITS
    if PER == 1:
        return q.to(tl.uint8)
    else:
        grouped = tl.reshape(q, (ROWS, COLS // PER, PER))
        shifts = tl.arange(0, PER) * BITS
        return tl.sum(grouped << shifts[None, None, :], axis=2).to(tl.uint8)  # disjoint bits: sum == or


@triton.jit
def _quantize_token_kernel(
    x_ptr, codes_ptr, scale_ptr, zero_ptr,
    sxb, sxh, sxt, sxd,  # x (B, H, T, D)
    scb, sch, sct,  # codes (B, H, T, D * BITS // 8), last stride 1
    ssb, ssh, sst, ssg,  # scale/zero, shape scale_shape(...)
    T,
    D: tl.constexpr, NB: tl.constexpr, G: tl.constexpr, NB_PAD: tl.constexpr, G_PAD: tl.constexpr,
    BITS: tl.constexpr, SYMMETRIC: tl.constexpr, KIND: tl.constexpr,
):
    """One program per token (b, t): its H * D elements as NB blocks of G (token: 1 x H*D, head: H x D,
    group: H*D/N x N). Flat element f = j * G + e of block j lies at head f // D, channel f % D."""
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, NB_PAD)
    e = tl.arange(0, G_PAD)
    valid = (j[:, None] < NB) & (e[None, :] < G)
    f = j[:, None] * G + e[None, :]
    x_off = b * sxb + t * sxt + (f // D) * sxh + (f % D) * sxd
    x = tl.load(x_ptr + x_off, mask=valid, other=0.0).to(tl.float32)

    q, scale, zero = _quantize_tile(x, valid, 1, BITS, SYMMETRIC, KIND)

    # stats: block j starts at flat f0 = j * G -> head f0 // D, group (f0 % D) // G (0 unless -gN)
    f0 = j * G
    s_off = b * ssb + t * sst + (f0 // D) * ssh + ((f0 % D) // G) * ssg
    tl.store(scale_ptr + s_off, scale, mask=j < NB)
    if not SYMMETRIC:
        tl.store(zero_ptr + s_off, zero, mask=j < NB)

    PER: tl.constexpr = 8 // BITS
    packed = _pack_rows(q, NB_PAD, G_PAD, BITS)  # (NB_PAD, G_PAD // PER)
    k = tl.arange(0, G_PAD // PER)
    fb = j[:, None] * G + k[None, :] * PER  # flat index of each byte's first code; G % PER == 0
    c_off = b * scb + t * sct + (fb // D) * sch + (fb % D) // PER
    tl.store(codes_ptr + c_off, packed, mask=(j[:, None] < NB) & (k[None, :] * PER < G))


@triton.jit
def _quantize_channel_kernel(
    x_ptr, codes_ptr, scale_ptr, zero_ptr,
    sxb, sxh, sxt, sxd,  # x (B, H, T, D)
    scb, sch, sct,  # codes (B, H, T, D * BITS // 8)
    ssb, ssh, ssg, ssd,  # scale/zero (B, H, T // N, D)
    H,
    D: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BITS: tl.constexpr, SYMMETRIC: tl.constexpr, KIND: tl.constexpr,
):
    """One program per (b, h, token group, D slice): N tokens x BLOCK_D channels, one block per channel."""
    grp = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    i = tl.arange(0, N_PAD)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    t = grp * N + i
    valid = (i[:, None] < N) & (d[None, :] < D)
    x_off = b * sxb + h * sxh + t[:, None] * sxt + d[None, :] * sxd
    x = tl.load(x_ptr + x_off, mask=valid, other=0.0).to(tl.float32)

    q, scale, zero = _quantize_tile(x, valid, 0, BITS, SYMMETRIC, KIND)

    s_off = b * ssb + h * ssh + grp * ssg + d * ssd
    tl.store(scale_ptr + s_off, scale, mask=d < D)
    if not SYMMETRIC:
        tl.store(zero_ptr + s_off, zero, mask=d < D)

    PER: tl.constexpr = 8 // BITS
    packed = _pack_rows(q, N_PAD, BLOCK_D, BITS)  # (N_PAD, BLOCK_D // PER)
    k = tl.program_id(2) * (BLOCK_D // PER) + tl.arange(0, BLOCK_D // PER)
    c_off = b * scb + h * sch + t[:, None] * sct + k[None, :]
    tl.store(codes_ptr + c_off, packed, mask=(i[:, None] < N) & (k[None, :] * PER < D))


# ----------------------------------------------------------------------------------------------- launcher


def kernel_supports(x: torch.Tensor, spec: QuantSpec) -> bool:
    """Whether the kernel serves this input; otherwise `quantize_pack` uses the reference (same bits).

    Not served: a group of channels that does not fill whole bytes (group size not a multiple of
    8 // bits, e.g. int4-g1), and non-float inputs.
    """
    per = 8 // spec.bits
    if x.dtype not in _SCALE_KIND:
        return False
    if spec.granularity is Granularity.GROUP and spec.group_size % per:
        return False
    return True


def _launch(x: torch.Tensor, spec: QuantSpec) -> QTensor:
    """Check x and spec, allocate the outputs, compute the grid and run the kernel."""
    if x.dim() != 4:
        raise ValueError(f"quantize_pack: expected x of shape (B, H_kv, T, D), got {tuple(x.shape)}")
    if not spec.is_quantized:
        raise ValueError("quantize_pack: spec is fp16, there is nothing to quantize")
    if x.dtype not in _SCALE_KIND:
        raise TypeError(f"quantize_pack: x must be fp16, bf16 or fp32, got {x.dtype}")
    spec.check_head_dim(x.shape[-1])
    b, h, t, d = x.shape
    n = spec.group_size
    if spec.granularity is Granularity.CHANNEL and t % n:
        raise ValueError(f"quantize_pack: channel granularity groups {n} tokens, but T={t} is not a multiple")
    sdtype = spec.scale_dtype or x.dtype
    kind = _SCALE_KIND[sdtype]
    bits, per = spec.bits, 8 // spec.bits
    codes = torch.empty((b, h, t, packed_size(d, bits)), dtype=torch.uint8, device=x.device)
    sshape = scale_shape(x.shape, spec)
    scale = torch.empty(sshape, dtype=sdtype, device=x.device)
    zero = None if spec.symmetric else torch.empty(sshape, dtype=sdtype, device=x.device)
    zero_arg = scale if zero is None else zero
    if x.numel() == 0:
        return QTensor(codes, scale, zero, spec, x.shape, x.dtype)

    if spec.granularity is Granularity.CHANNEL:
        n_pad = triton.next_power_of_2(n)
        d_pad = max(triton.next_power_of_2(d), per)
        block_d = max(min(d_pad, triton.next_power_of_2(max(_MAX_TILE // n_pad, 1))), per)
        grid = (t // n, b * h, triton.cdiv(d, block_d))
        _quantize_channel_kernel[grid](
            x, codes, scale, zero_arg,
            *x.stride(), *codes.stride()[:3], *scale.stride(),
            h, D=d, N=n, N_PAD=n_pad, BLOCK_D=block_d,
            BITS=bits, SYMMETRIC=spec.symmetric, KIND=kind,
            enable_fp_fusion=False,
        )
    else:
        g = {Granularity.TOKEN: h * d, Granularity.HEAD: d, Granularity.GROUP: n}[spec.granularity]
        nb = h * d // g
        ss = scale.stride()
        s_h = 0 if spec.granularity is Granularity.TOKEN else ss[1]
        s_g = ss[3] if spec.granularity is Granularity.GROUP else 0
        _quantize_token_kernel[(t, b)](
            x, codes, scale, zero_arg,
            *x.stride(), *codes.stride()[:3], ss[0], s_h, ss[2], s_g,
            t, D=d, NB=nb, G=g, NB_PAD=triton.next_power_of_2(nb), G_PAD=max(triton.next_power_of_2(g), per),
            BITS=bits, SYMMETRIC=spec.symmetric, KIND=kind,
            enable_fp_fusion=False,
        )
    return QTensor(codes, scale, zero, spec, x.shape, x.dtype)


# ----------------------------------------------------------------------------------------------- public


def quantize_pack(x: torch.Tensor, spec: QuantSpec) -> QTensor:
    """Quantize x (B, H_kv, T, D) with a quantized `spec` and pack the codes along D.

    Returns a QTensor: codes uint8 (B, H_kv, T, D * bits // 8), scale/zero of `scale_shape(x.shape, spec)`
    in `spec.scale_dtype or x.dtype`; equal bit for bit to `kvquant.quantize.quantize(x, spec)`.
    Preconditions: x is fp16/bf16/fp32 on a device Triton runs on; D divisible by the group size and by
    8 // bits; for channel granularity T is a multiple of the token-group size.
    """
    if not kernel_supports(x, spec):
        return quantize_pack_ref(x, spec)
    return _launch(x, spec)


def quantize_pack_ref(x: torch.Tensor, spec: QuantSpec) -> QTensor:
    """The reference twin of `quantize_pack` (same signature, same result): `kvquant.quantize.quantize`."""
    return quantize(x, spec)
