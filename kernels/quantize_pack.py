"""Quantize and pack K/V in one pass, written straight into pages: `quantize_pack_into` (Triton) and its
twin `quantize_pack_into_ref`; `quantize_pack` / `quantize_pack_ref` return a non-paged QTensor.

`quantize_pack_into(x, codec, pages, table, start)` encodes x (B, H_kv, t, D) with a codec and writes its
fields into the page pools at region tokens [start, start + t) of each sequence's table row; the twin is
`codec.encode(x)` followed by the same index writes. Which codecs a kernel serves is said in
`kvquant.kernels.pack_layouts` (`pack_parts`): affine INT8/4/2, FP8 (E4M3 / E5M2) and codebooks (nuq2/3/4)
at every granularity, `-centerN` and `-outP` around them (here), and the llama.cpp / GGUF block formats
(`kvquant.kernels.pack_engine`). What one program handles follows the codec's block extent, never a
granularity switch:

    extent                          stats row per page     one program handles
    1 token x all heads x D         (P, 1, BS, 1)          one token: H * D elements, one block
    1 token x 1 head x CE channels  (P, H, BS, D // CE)    one token: H * D / CE blocks of CE
    TE tokens x 1 channel           (P, H, BS // TE, D)    one token group of one head, a slice of D
    none (fp8 -tensor)              no scale field         one token: H blocks of D, codes only

Codes: affine `floor(v + 0.5)` against the stored scale and zero (kvquant.codecs.quantize); FP8 the
float8 bits of x / scale clamped to +-max, rounded to nearest even on the fp32 bits (`_fp8_bits`, torch's
cast; NaN keeps its sign, 0x7F); codebook the number of level midpoints strictly below (x - zero) / scale
(torch.bucketize: a tie goes to the lower level). 3-bit codes are packed 8 per 3 bytes.

`-centerN`: the offsets (B, H, t / N, D) come from `CenterCodec.offsets` (torch's fp32 mean, whose summation
order is the device library's); the kernel subtracts them in fp32, rounds to the K/V dtype and writes them to
their pool. `-outP`: the outliers' channels come from `OutlierCodec.select` (torch's topk, whose order
among equal magnitudes is the library's); the kernel writes their values and indices and fills their places
with the nearest value in the range of the rest of their block (zero for a unit scale), as
`OutlierCodec._fill` does. See kvquant.kernels.pack_layouts for why these two steps stay torch's.

Bit-exactness: the arithmetic is the reference's, step for step, in fp32, against the *stored* scale
and zero (rounded to the scale dtype so they cover the block: zero down, scale up, as the reference
does). fp32 division on the GPU is approximate unless asked otherwise, so every division is
`tl.math.div_rn`; the kernels are compiled with `enable_fp_fusion=False` so `v / s * qmax + 0.5` is not
contracted into an FMA (torch rounds after each operation). Rounding to a bf16 scale is done by hand
(round to nearest even on the fp32 bits) because the Triton interpreter truncates on a bf16 cast.
NaN and +-Inf are tested where they reach a min, max or clamp (`tl.max` and `tl.maximum` do not propagate
NaN on a GPU, torch's do).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from kvquant.codecs.base import CodebookCodec, DenseCodec, codec_for
from kvquant.codecs.engine import EngineCodec
from kvquant.codecs.fp8 import FP8Codec
from kvquant.codecs.quantize import AffineCodec, QTensor, quantize
from kvquant.scheme import QuantSpec

from . import pack_engine
from .pack_engine import Launch
from .pack_layouts import PackParts, pack_parts
from .registry import KernelRegistry, default_registry

__all__ = ["quantize_pack", "quantize_pack_ref", "quantize_pack_into", "quantize_pack_into_ref",
           "write_fields", "kernel_supports", "pool_differences", "random_pools"]

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
    """codecs.base.round_stat: nearest in the scale dtype, then one step up (UP) or down where that fell
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
    values exact in the scale dtype). The steps and their order are kvquant.codecs.quantize.quantize's.
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
        short = scale * QMAX < span  # codecs.quantize._round_up_to_cover: scale * qmax must reach the span
        scale = tl.where(short, _next_after(scale, True, KIND), scale)
        v = tl.math.div_rn(x - tl.expand_dims(zero, AXIS), tl.expand_dims(scale, AXIS)) + 0.5
        q = tl.minimum(tl.maximum(tl.floor(v), 0.0), QMAX)
        fill = 0
    # a finite block whose statistic overflows the scale dtype is poisoned too (codecs.quantize.quantize)
    finite = finite & (tl.abs(scale) != float("inf")) & (scale == scale)
    if not SYMMETRIC:
        finite = finite & (tl.abs(zero) != float("inf")) & (zero == zero)
    ok = (scale > 0) & finite
    q = tl.where(tl.expand_dims(ok, AXIS), q, fill)  # a constant block: scale 0, exact codes
    q = tl.where(tl.expand_dims(finite, AXIS), q, 0)
    scale = tl.where(finite, scale, float("nan"))
    return q.to(tl.int32), scale, zero


@triton.jit
def _fp8_bits(v, E5M2: tl.constexpr):
    """fp32 v with |v| <= the format's largest value, or NaN -> its float8 bit pattern (int32 0..255), round
    to nearest even: torch's fp32 -> float8_e4m3fn / float8_e5m2 cast of the clamped value, on the bits
    (both GPU and interpreter give these bits; a hardware cvt would saturate NaN differently)."""
    MBITS: tl.constexpr = 2 if E5M2 else 3
    BIAS: tl.constexpr = 15 if E5M2 else 7
    SUB_SCALE: tl.constexpr = 65536.0 if E5M2 else 512.0  # 1 / the subnormal step (2^-16, 2^-9)
    MIN_NORMAL: tl.constexpr = 0.00006103515625 if E5M2 else 0.015625  # 2^-14, 2^-6
    SHIFT: tl.constexpr = 23 - MBITS
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    mag = a.to(tl.float32, bitcast=True)
    # below the smallest normal: the nearest multiple of the subnormal step (the count carries into the
    # smallest normal's code exactly: 8 = 0b0001000 for e4m3, 4 for e5m2)
    m = tl.minimum(mag, MIN_NORMAL) * SUB_SCALE  # exact: a power of two
    r = tl.floor(m)
    frac = m - r
    ri = r.to(tl.int32)
    sub = ri + ((frac > 0.5) | ((frac == 0.5) & ((ri & 1) == 1))).to(tl.int32)
    # normal: keep MBITS of mantissa, round to nearest even on the dropped bits (a carry bumps the exponent)
    low = a & ((1 << SHIFT) - 1)
    base = (a >> SHIFT) - ((127 - BIAS) << MBITS)
    HALF: tl.constexpr = 1 << (SHIFT - 1)
    up = (low > HALF) | ((low == HALF) & ((base & 1) == 1))
    code = tl.where(mag < MIN_NORMAL, sub, base + up.to(tl.int32))
    code = tl.where(v != v, 0x7F, code)
    return code | (sign << 7)


@triton.jit
def _fp8_tile(x, valid, AXIS: tl.constexpr, E5M2: tl.constexpr, KIND: tl.constexpr):
    """kvquant.codecs.fp8.FP8Codec.encode on a tile, one block per line along AXIS: (codes int32, scale as
    stored). scale = absmax / max rounded up in the scale dtype; codes = float8(clamp(x / scale)); a constant
    zero block gets scale 0 and codes 0; a NaN/Inf block (or an overflowing scale) a NaN scale and codes 0."""
    FMAX: tl.constexpr = 57344.0 if E5M2 else 448.0
    bad = valid & ((x != x) | (tl.abs(x) == float("inf")))
    finite = tl.sum(bad.to(tl.int32), axis=AXIS) == 0
    amax = tl.max(tl.where(valid, tl.abs(x), 0.0), axis=AXIS).to(tl.float32)
    scale = _round_to_cover(tl.math.div_rn(amax, FMAX), True, KIND).to(tl.float32)
    finite = finite & (tl.abs(scale) != float("inf")) & (scale == scale)
    pos = scale > 0
    q = tl.math.div_rn(x, tl.expand_dims(tl.where(pos, scale, 1.0), AXIS))
    q = tl.where(tl.expand_dims(pos & finite, AXIS), q, 0.0)
    q = tl.minimum(tl.maximum(q, -FMAX), FMAX)
    return _fp8_bits(q, E5M2), tl.where(finite, scale, float("nan"))


@triton.jit
def _fp8_unit(x, E5M2: tl.constexpr):
    """`-tensor` (a fixed unit scale): float8(clamp(x)), +-Inf saturated, NaN kept (with its sign)."""
    FMAX: tl.constexpr = 57344.0 if E5M2 else 448.0
    return _fp8_bits(tl.where(x != x, x, tl.minimum(tl.maximum(x, -FMAX), FMAX)), E5M2)


@triton.jit
def _codebook_tile(x, valid, mids_ptr, AXIS: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
                   KIND: tl.constexpr):
    """kvquant.codecs.base.CodebookCodec.encode on a tile, one block per line along AXIS: (codes int32, scale,
    zero) as stored. Asymmetric: zero = (max + min) / 2 rounded to nearest in the scale dtype, scale =
    max(max - zero, zero - min) rounded up; symmetric: scale = absmax rounded up. code = the number of
    midpoints (mids_ptr: 2^BITS - 1 fp32, ascending) strictly below (x - zero) / scale (0 where scale
    is 0)."""
    bad = valid & ((x != x) | (tl.abs(x) == float("inf")))
    finite = tl.sum(bad.to(tl.int32), axis=AXIS) == 0
    if SYMMETRIC:
        amax = tl.max(tl.where(valid, tl.abs(x), 0.0), axis=AXIS).to(tl.float32)
        scale = _round_to_cover(amax, True, KIND).to(tl.float32)
        zero = scale  # no zero field
        xz = x  # x - 0: the same bits
    else:
        has_nan = tl.sum((valid & (x != x)).to(tl.int32), axis=AXIS) > 0
        lo = tl.min(tl.where(valid, x, float("inf")), axis=AXIS)
        hi = tl.max(tl.where(valid, x, float("-inf")), axis=AXIS)
        lo = tl.where(has_nan, float("nan"), lo).to(tl.float32)  # torch's aminmax propagates NaN
        hi = tl.where(has_nan, float("nan"), hi).to(tl.float32)
        zero = _round_nearest((hi + lo) * 0.5, KIND).to(tl.float32)  # * 0.5 == / 2, both rounded once
        scale = _round_to_cover(tl.maximum(hi - zero, zero - lo), True, KIND).to(tl.float32)
        finite = finite & (tl.abs(zero) != float("inf")) & (zero == zero)
        xz = x - tl.expand_dims(zero, AXIS)
    finite = finite & (tl.abs(scale) != float("inf")) & (scale == scale)
    pos = scale > 0
    xn = tl.math.div_rn(xz, tl.expand_dims(tl.where(pos, scale, 1.0), AXIS))
    xn = tl.where(tl.expand_dims(pos, AXIS), xn, 0.0)
    code = tl.zeros(x.shape, tl.int32)
    for i in tl.static_range((1 << BITS) - 1):
        code += (xn > tl.load(mids_ptr + i)).to(tl.int32)
    code = tl.where(tl.expand_dims(finite, AXIS), code, 0)
    return code, tl.where(finite, scale, float("nan")), zero


@triton.jit
def _encode_tile(x, valid, mids_ptr, AXIS: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr,
                 SYMMETRIC: tl.constexpr, KIND: tl.constexpr):
    """(codes int32, scale, zero) of a tile by the base codec FMT: 0 affine, 1 FP8 E4M3, 2 FP8 E5M2,
    3 codebook (zero is meaningless where the codec stores none)."""
    if FMT == 0:
        return _quantize_tile(x, valid, AXIS, BITS, SYMMETRIC, KIND)
    elif FMT == 3:
        return _codebook_tile(x, valid, mids_ptr, AXIS, BITS, SYMMETRIC, KIND)
    else:
        q, scale = _fp8_tile(x, valid, AXIS, FMT == 2, KIND)
        return q, scale, scale


@triton.jit
def _outlier_mask(idx_ptrs, channel, valid, K: tl.constexpr):
    """Whether each element's channel is one of its (token, head)'s K outlier indices (idx_ptrs: a pointer
    per element to its row of K int64 indices)."""
    hit = valid & (channel < 0)  # all False, the tile's shape
    for kk in tl.static_range(K):
        hit = hit | (tl.load(idx_ptrs + kk, mask=valid, other=-1) == channel)
    return hit & valid


@triton.jit
def _fill_outliers(x, valid, mask, AXIS: tl.constexpr, FILL: tl.constexpr):
    """kvquant.codecs.transforms.OutlierCodec._fill: the masked elements moved to the nearest value in the
    range of their block's other elements (FILL 2; 0 where the block has no other; NaN stays NaN, as
    torch's minimum / maximum give it) or to 0 (FILL 1: a codec without block statistics)."""
    if FILL == 1:
        return tl.where(mask, 0.0, x)
    else:
        keep = valid & ~mask
        nan_in = tl.sum((keep & (x != x)).to(tl.int32), axis=AXIS) > 0
        lo = tl.min(tl.where(keep, x, float("inf")), axis=AXIS)
        hi = tl.max(tl.where(keep, x, float("-inf")), axis=AXIS)
        lo = tl.expand_dims(tl.where(nan_in, float("nan"), lo).to(tl.float32), AXIS)
        hi = tl.expand_dims(tl.where(nan_in, float("nan"), hi).to(tl.float32), AXIS)
        clamped = tl.where(x != x, x, tl.minimum(tl.maximum(x, lo), hi))
        return tl.where(mask, tl.where(lo <= hi, clamped, 0.0), x)


@triton.jit
def _pack_rows(q, ROWS: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr):
    """(ROWS, COLS) int32 codes -> (ROWS, COLS // UNIT) int32 packing units, lowest bits first
    (codecs.packing): a byte of 8 // BITS codes, or (3 bits) a 24-bit word of 8 codes, which `_store_units`
    stores as three bytes."""
    UNIT: tl.constexpr = 8 if BITS == 3 else 8 // BITS
    SHIFT: tl.constexpr = 3 if BITS == 3 else BITS
    if UNIT == 1:
        return q
    else:
        grouped = tl.reshape(q, (ROWS, COLS // UNIT, UNIT))
        shifts = tl.arange(0, UNIT) * SHIFT
        return tl.sum(grouped << shifts[None, None, :], axis=2)  # disjoint bits: sum == or


@triton.jit
def _store_units(ptrs, units, mask, BITS: tl.constexpr):
    """Store packing units at their first byte's pointer: a byte each, or (3 bits) a 24-bit word as three
    bytes, little-endian."""
    if BITS == 3:
        for k in tl.static_range(3):
            tl.store(ptrs + k, ((units >> (8 * k)) & 255).to(tl.uint8), mask=mask)
    else:
        tl.store(ptrs, units.to(tl.uint8), mask=mask)


_TOKEN_DNS = ["sxb", "scp", "sch", "ssp", "ssh", "tab_b", "tab_n", "START", "BS", "sob", "soh", "sot",
              "sop", "soph", "sib", "sih", "sit", "svp", "svh"]


@triton.jit(do_not_specialize=_TOKEN_DNS)
def _quantize_token_kernel(
    x_ptr, codes_ptr, scale_ptr, zero_ptr,
    sxb, sxh, sxt, sxd,  # x (B, H, t, D)
    scp, sch, sct,  # codes pool (P, H, BS, D * BITS // 8), last stride 1
    ssp, ssh, sst, ssg,  # scale/zero pool (P, H or 1, BS, D // N)
    tab_ptr, tab_b, tab_n, START, BS,  # token i of x goes to region token START + i of the table row
    mids_ptr,  # codebook: the 2^BITS - 1 level midpoints, fp32
    off_ptr, sob, soh, sot, sod,  # -centerN: offsets (B, H, t // NC, D) in the K/V dtype
    opool_ptr, sop, soph, sopr,  # their pool (P, H, BS // NC, D), last stride 1
    idx_ptr, sib, sih, sit,  # -outP: outlier channels (B, H, t, K) int64, last stride 1
    ov_ptr, oi_ptr, svp, svh, svt,  # out_values / out_index pools (P, H, BS, K), the same strides
    D: tl.constexpr, NB: tl.constexpr, G: tl.constexpr, NB_PAD: tl.constexpr, G_PAD: tl.constexpr,
    BITS: tl.constexpr, SYMMETRIC: tl.constexpr, KIND: tl.constexpr, FMT: tl.constexpr, STATS: tl.constexpr,
    XKIND: tl.constexpr, NC: tl.constexpr, K: tl.constexpr, FILL: tl.constexpr, H: tl.constexpr,
    H_PAD: tl.constexpr, K_PAD: tl.constexpr,
):
    """One program per token (i, b): its H * D elements as NB blocks of G (token: 1 x H*D, head: H x D,
    group: H*D/N x N; fp8 -tensor: H x D without statistics). Flat element f = j * G + e of block j lies at
    head f // D, channel f % D. Written to page table[b, (START + i) // BS], slot (START + i) % BS."""
    i = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    jt = START + i
    page = tl.load(tab_ptr + b * tab_b + (jt // BS) * tab_n)
    slot = jt % BS
    j = tl.arange(0, NB_PAD)
    e = tl.arange(0, G_PAD)
    valid = (j[:, None] < NB) & (e[None, :] < G)
    f = j[:, None] * G + e[None, :]
    hh = f // D
    cc = f % D
    x = tl.load(x_ptr + b * sxb + i * sxt + hh * sxh + cc * sxd, mask=valid, other=0.0).to(tl.float32)
    if NC > 0:  # the offset row of the token's group subtracted (fp32, then the K/V dtype), stored once
        off = tl.load(off_ptr + b * sob + (i // NC) * sot + hh * soh + cc * sod, mask=valid, other=0.0)
        off = off.to(tl.float32)
        x = _round_nearest(x - off, XKIND)
        first = valid & ((i + cc * 0) % NC == 0)  # the group's first token writes its row
        tl.store(opool_ptr + page * sop + hh * soph + (slot // NC) * sopr + cc, off, mask=first)
    if K > 0:  # outliers: their values and channels written, their places filled within their block
        x = _fill_outliers(x, valid, _outlier_mask(idx_ptr + b * sib + i * sit + hh * sih, cc, valid, K),
                           1, FILL)
        h2 = tl.arange(0, H_PAD)[:, None]
        k2 = tl.arange(0, K_PAD)[None, :]
        m2 = (h2 < H) & (k2 < K)
        ix = tl.load(idx_ptr + b * sib + i * sit + h2 * sih + k2, mask=m2, other=0)
        xv = tl.load(x_ptr + b * sxb + i * sxt + h2 * sxh + ix * sxd, mask=m2, other=0.0).to(tl.float32)
        if NC > 0:
            ov = tl.load(off_ptr + b * sob + (i // NC) * sot + h2 * soh + ix * sod, mask=m2, other=0.0)
            xv = _round_nearest(xv - ov.to(tl.float32), XKIND)
        o = page * svp + slot * svt + h2 * svh + k2
        tl.store(ov_ptr + o, xv, mask=m2)
        tl.store(oi_ptr + o, ix, mask=m2)

    if STATS:
        q, scale, zero = _encode_tile(x, valid, mids_ptr, 1, FMT, BITS, SYMMETRIC, KIND)
        # stats: block j starts at flat f0 = j * G -> head f0 // D, group (f0 % D) // G (0 unless -gN)
        f0 = j * G
        s_off = page * ssp + slot * sst + (f0 // D) * ssh + ((f0 % D) // G) * ssg
        tl.store(scale_ptr + s_off, scale, mask=j < NB)
        if not SYMMETRIC:
            tl.store(zero_ptr + s_off, zero, mask=j < NB)
    else:
        q = _fp8_unit(x, FMT == 2)

    UNIT: tl.constexpr = 8 if BITS == 3 else 8 // BITS  # codes per packing unit
    UBYTES: tl.constexpr = 3 if BITS == 3 else 1  # bytes per unit
    units = _pack_rows(q, NB_PAD, G_PAD, BITS)  # (NB_PAD, G_PAD // UNIT)
    k = tl.arange(0, G_PAD // UNIT)
    fb = j[:, None] * G + k[None, :] * UNIT  # flat index of each unit's first code; G % UNIT == 0
    c_off = page * scp + slot * sct + (fb // D) * sch + (fb % D) // UNIT * UBYTES
    _store_units(codes_ptr + c_off, units, (j[:, None] < NB) & (k[None, :] * UNIT < G), BITS)


_CHANNEL_DNS = _TOKEN_DNS


@triton.jit(do_not_specialize=_CHANNEL_DNS)
def _quantize_channel_kernel(
    x_ptr, codes_ptr, scale_ptr, zero_ptr,
    sxb, sxh, sxt, sxd,  # x (B, H, t, D)
    scp, sch, sct,  # codes pool (P, H, BS, D * BITS // 8), last stride 1
    ssp, ssh, ssg, ssd,  # scale/zero pool (P, H, BS // N, D)
    tab_ptr, tab_b, tab_n, START, BS,
    H,
    mids_ptr,  # codebook: the 2^BITS - 1 level midpoints, fp32
    off_ptr, sob, soh, sot, sod,  # -centerN: offsets (B, H, t // NC, D) in the K/V dtype
    opool_ptr, sop, soph, sopr,  # their pool (P, H, BS // NC, D), last stride 1
    idx_ptr, sib, sih, sit,  # -outP: outlier channels (B, H, t, K) int64, last stride 1
    ov_ptr, oi_ptr, svp, svh, svt,  # out_values / out_index pools (P, H, BS, K), the same strides
    D: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BITS: tl.constexpr, SYMMETRIC: tl.constexpr, KIND: tl.constexpr, FMT: tl.constexpr,
    XKIND: tl.constexpr, NC: tl.constexpr, K: tl.constexpr, FILL: tl.constexpr, K_PAD: tl.constexpr,
):
    """One program per (token group, b * h, D slice): N tokens x BLOCK_D channels, one block per channel.
    The group's N tokens lie in one page (START and BS are multiples of N); its stats row is slot // N.
    The outlier fields of the group's tokens are written by the programs of the first D slice."""
    grp = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    j0 = START + grp * N
    page = tl.load(tab_ptr + b * tab_b + (j0 // BS) * tab_n)
    slot0 = j0 % BS
    i = tl.arange(0, N_PAD)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    t = grp * N + i
    valid = (i[:, None] < N) & (d[None, :] < D)
    x_off = b * sxb + h * sxh + t[:, None] * sxt + d[None, :] * sxd
    x = tl.load(x_ptr + x_off, mask=valid, other=0.0).to(tl.float32)
    if NC > 0:  # each token's offset row subtracted (fp32, then the K/V dtype); a group's row stored once
        o_row = b * sob + h * soh + (t // NC)[:, None] * sot
        off = tl.load(off_ptr + o_row + d[None, :] * sod, mask=valid, other=0.0).to(tl.float32)
        x = _round_nearest(x - off, XKIND)
        first = valid & ((t % NC) == 0)[:, None]
        tl.store(opool_ptr + page * sop + h * soph + ((slot0 + i) // NC)[:, None] * sopr + d[None, :], off,
                 mask=first)
    if K > 0:  # outliers: their places filled within their (channel) block; values and channels written
        idx_rows = idx_ptr + b * sib + h * sih + t[:, None] * sit  # (N_PAD, 1)
        x = _fill_outliers(x, valid, _outlier_mask(idx_rows, d[None, :], valid, K), 0, FILL)
        k2 = tl.arange(0, K_PAD)[None, :]
        m2 = (i[:, None] < N) & (k2 < K) & (tl.program_id(2) + k2 * 0 == 0)  # the first D slice writes them
        ix = tl.load(idx_rows + k2, mask=m2, other=0)
        xv = tl.load(x_ptr + b * sxb + h * sxh + t[:, None] * sxt + ix * sxd, mask=m2, other=0.0)
        xv = xv.to(tl.float32)
        if NC > 0:
            ov = tl.load(off_ptr + o_row + ix * sod, mask=m2, other=0.0)
            xv = _round_nearest(xv - ov.to(tl.float32), XKIND)
        o = page * svp + h * svh + (slot0 + i)[:, None] * svt + k2
        tl.store(ov_ptr + o, xv, mask=m2)
        tl.store(oi_ptr + o, ix, mask=m2)

    q, scale, zero = _encode_tile(x, valid, mids_ptr, 0, FMT, BITS, SYMMETRIC, KIND)

    s_off = page * ssp + h * ssh + (slot0 // N) * ssg + d * ssd
    tl.store(scale_ptr + s_off, scale, mask=d < D)
    if not SYMMETRIC:
        tl.store(zero_ptr + s_off, zero, mask=d < D)

    UNIT: tl.constexpr = 8 if BITS == 3 else 8 // BITS  # codes per packing unit
    UBYTES: tl.constexpr = 3 if BITS == 3 else 1
    units = _pack_rows(q, N_PAD, BLOCK_D, BITS)  # (N_PAD, BLOCK_D // UNIT)
    k = tl.program_id(2) * (BLOCK_D // UNIT) + tl.arange(0, BLOCK_D // UNIT)
    c_off = page * scp + h * sch + (slot0 + i)[:, None] * sct + k[None, :] * UBYTES
    _store_units(codes_ptr + c_off, units, (i[:, None] < N) & (k[None, :] * UNIT < D), BITS)


# ----------------------------------------------------------------------------------------------- launcher

_AFFINE, _FP8_E4M3, _FP8_E5M2, _CODEBOOK = 0, 1, 2, 3  # FMT: how a base codec's codes are computed


def kernel_supports(x: torch.Tensor, spec: QuantSpec) -> bool:
    """Whether the kernel serves `quantize_pack` (an affine spec, not paged) for this input; otherwise the
    reference runs (same bits).

    Not served: a group of channels that does not fill whole bytes (group size not a multiple of
    8 // bits, e.g. int4-g1), and non-float inputs.
    """
    if x.dtype not in _SCALE_KIND or not spec.is_quantized:
        return False
    parts = pack_parts(codec_for(spec, x.shape[1], x.shape[3], x.dtype))
    return (parts is not None and type(parts.base) is AffineCodec and parts.center is None
            and parts.outliers is None)


def _check_into(x: torch.Tensor, codec, pages: Mapping[str, torch.Tensor], table: torch.Tensor, start: int):
    if x.dim() != 4 or x.shape[1] != codec.heads or x.shape[3] != codec.head_dim:
        raise ValueError(f"quantize_pack_into: x must be (B, H_kv={codec.heads}, t, D={codec.head_dim}), "
                         f"got {tuple(x.shape)}")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[0] != x.shape[0]:
        raise ValueError(f"quantize_pack_into: table must be int64 (B={x.shape[0]}, n_pages), "
                         f"got {table.dtype} {tuple(table.shape)}")
    group = codec.token_group
    if start % group or x.shape[2] % group:
        raise ValueError(f"quantize_pack_into: start={start} and t={x.shape[2]} must be multiples of the "
                         f"codec's token group {group}")
    missing = set(codec.fields()) - set(pages)
    if missing:
        raise ValueError(f"quantize_pack_into: pages lack the fields {sorted(missing)}")


def write_fields(pages: Mapping[str, torch.Tensor], fields: Mapping[str, torch.Tensor], codec,
                 table: torch.Tensor, start: int) -> None:
    """Write encoded fields {name: (B, heads_f, t // tokens_f, cols_f)} into their pools
    (P, heads_f, BS // tokens_f, cols_f) at region tokens [start, start + t) of table's rows."""
    layout = codec.fields()
    for name, val in fields.items():
        pool, tokens = pages[name], layout[name].tokens
        n = val.shape[2]
        if n == 0:
            continue
        bs = pool.shape[2] * tokens
        j = start + torch.arange(n, device=table.device) * tokens  # first region token of each row
        idx = table[:, j // bs].to(pool.device)  # (B, n)
        rows = ((j % bs) // tokens).to(pool.device).expand_as(idx)
        pool[idx, :, rows] = val.transpose(1, 2).to(pool.dtype)  # (B, n, heads_f, cols_f)


def _base_consts(base) -> dict:
    """The constexprs that say how the kernels compute a base codec's codes and statistics."""
    kind = _SCALE_KIND[base.scale_dtype]
    if type(base) is FP8Codec:
        fmt = _FP8_E5M2 if base.kind == "e5m2" else _FP8_E4M3
        return dict(FMT=fmt, BITS=8, SYMMETRIC=True, KIND=kind, STATS=not base.unit_scale)
    fmt = _CODEBOOK if type(base) is CodebookCodec else _AFFINE
    return dict(FMT=fmt, BITS=base.spec.bits, SYMMETRIC=base.spec.symmetric, KIND=kind, STATS=True)


def _prologue(parts: PackParts, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(offsets (B, H, t / N, D), outlier channels (B, H, t, k) int64): the two choices the codec's torch
    code makes for the kernel (kvquant.kernels.pack_layouts), from x (B, H, t, D) in the K/V dtype, exactly
    as `CenterCodec.encode` / `OutlierCodec.encode` make them."""
    offsets = index = None
    if parts.center is not None:
        xf = x.float()
        offsets = parts.center.offsets(xf)
    if parts.outliers is not None:
        rest = x if offsets is None else parts.center.centered(xf, offsets)
        index = parts.outliers.select(rest.to(parts.outliers.dtype).float()).contiguous()
    return offsets, index


def _transform_args(parts: PackParts, pages, offsets, index, x) -> tuple[tuple, dict] | None:
    """The kernels' -center and -outP arguments (x stands in for absent tensors) and constexprs; None
    when a pool is laid out in a way the kernels do not address (its last stride not 1)."""
    nc = k = 0
    center = (x, 0, 0, 0, 0, x, 0, 0, 0)
    outliers = (x, 0, 0, 0, x, x, 0, 0, 0)
    if offsets is not None:
        pool = pages["offset"]
        if pool.stride(-1) != 1:
            return None
        center = (offsets, *offsets.stride(), pool, *pool.stride()[:3])
        nc = parts.center.n
    if index is not None:
        ov, oi = pages["out_values"], pages["out_index"]
        if ov.stride() != oi.stride() or ov.stride(-1) != 1:
            return None
        outliers = (index, *index.stride()[:3], ov, oi, *ov.stride()[:3])
        k = parts.outliers.k
    fill = 0 if index is None else 2 if getattr(parts.base, "extent", None) is not None else 1
    consts = dict(NC=nc, XKIND=_SCALE_KIND[x.dtype], K=k, FILL=fill, K_PAD=triton.next_power_of_2(max(k, 1)))
    return (*center, *outliers), consts


def _mids(codec: CodebookCodec, device, registry) -> torch.Tensor:
    """The codec's level midpoints on the device (`CodebookCodec.midpoints`, the encoder's), made once per
    (codec, device) and kept on the registry, so an append never copies them from the host."""
    store = getattr(registry, "constants", None)
    key = ("pack_mids", id(codec), str(device))
    held = store.get(key) if store is not None else None
    if held is not None and held[0] is codec.levels:
        return held[1]
    mids = codec.midpoints(device)
    if store is not None:
        store[key] = (codec.levels, mids)
    return mids


def _scaled_plan(x, codec, parts: PackParts, pages, table, start, registry) -> Launch | None:
    """The launch that encodes x (B, H, t, D) in the K/V dtype with an affine, FP8 or codebook base codec
    (and -center / -outP around it) into the pages; None when the kernels cannot address these pools."""
    base = parts.base
    consts = _base_consts(base)
    b, h, t, d = x.shape
    bits, stats = consts["BITS"], consts["STATS"]
    unit = 8 if bits == 3 else 8 // bits  # codes per packing unit
    codes = pages["codes"]
    bs = codes.shape[2]
    te = base.extent.tokens if stats else 1
    if bs % codec.token_group or codes.stride(-1) != 1 or d % unit:
        return None
    offsets, index = _prologue(parts, x)
    extra = _transform_args(parts, pages, offsets, index, x)
    if extra is None:
        return None
    mids = _mids(base, x.device, registry) if consts["FMT"] == _CODEBOOK else x
    scale = pages.get("scale", codes)  # fp8 -tensor stores none: never written
    zero = pages.get("zero", scale)
    ss = scale.stride() if stats else (0, 0, 0, 0)
    tab = (table, table.stride(0), table.stride(1), start, bs)
    consts.update(extra[1], D=d)
    if te > 1:
        n_pad = triton.next_power_of_2(te)
        d_pad = max(triton.next_power_of_2(d), unit)
        block_d = max(min(d_pad, triton.next_power_of_2(max(_MAX_TILE // n_pad, 1))), unit)
        grid = (t // te, b * h, triton.cdiv(d, block_d))
        consts.update(N=te, N_PAD=n_pad, BLOCK_D=block_d)
        del consts["STATS"]
        args = (x, codes, scale, zero, *x.stride(), *codes.stride()[:3], *ss, *tab, h, mids, *extra[0])
        kernel = _quantize_channel_kernel
    else:
        e = base.extent if stats else None
        g = e.heads * e.channels if stats else d  # elements per block (fp8 -tensor: one head's D)
        s_h = ss[1] if e is None or e.heads == 1 else 0
        consts.update(NB=h * d // g, G=g, NB_PAD=triton.next_power_of_2(h * d // g),
                      G_PAD=max(triton.next_power_of_2(g), unit), H=h, H_PAD=triton.next_power_of_2(h))
        args = (x, codes, scale, zero, *x.stride(), *codes.stride()[:3], ss[0], s_h, ss[2], ss[3], *tab, mids,
                *extra[0])
        grid = (t, b)
        kernel = _quantize_token_kernel
    dtypes = tuple((name, pages[name].dtype) for name in sorted(codec.fields()))
    variant = (getattr(getattr(kernel, "fn", None), "__name__", str(kernel)), x.dtype, dtypes,
               *sorted(consts.items()))
    return Launch(kernel, grid, args, consts, variant)


def _launch_into(x, codec, pages, table, start, registry) -> bool:
    """Quantize x and write it through the table; False when no kernel serves (caller: the reference)."""
    parts = pack_parts(codec)
    if parts is None or x.dtype not in _SCALE_KIND or type(parts.base) is DenseCodec:
        return False  # a dense body is a copy: the reference's index write
    x = x.to(codec.dtype)  # codec.encode quantizes the K/V dtype
    if x.shape[2] == 0:
        return True
    registry = registry or default_registry()
    if type(parts.base) is EngineCodec:
        plan = pack_engine.engine_plan(x, parts.base, pages, table, start, registry)
    else:
        plan = _scaled_plan(x, codec, parts, pages, table, start, registry)
    if plan is None:
        return False
    trusted = getattr(registry, "trusted", None)
    if trusted is not None and not trusted("quantize_pack", plan.variant, x.device,
                                           lambda: _probe(codec, x.device, registry)):
        return False
    return registry.launch(plan.kernel, plan.grid, plan.args, dict(plan.consts, enable_fp_fusion=False),
                           plan.variant)


def random_pools(codec, n_pages: int, block_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Pools of random contents (so that a stray or missing write shows), one per codec field, on the CPU:
    (n_pages, heads_f, block_size // tokens_f, cols_f); bytes uniform, floats in [0.5, 1.5)."""
    pools = {}
    for name, f in codec.fields().items():
        shape = (n_pages, f.heads, block_size // f.tokens, f.cols)
        if f.dtype == torch.uint8:
            pools[name] = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
        else:
            pools[name] = (torch.rand(shape, generator=generator) + 0.5).to(f.dtype)
    return pools


def pool_differences(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> list[str]:
    """What differs between two sets of pools, field by field (NaN equals NaN in float fields; bytes are
    compared as they are): empty when every pool is equal."""
    problems = []
    for name in want:
        a, b = got[name], want[name].to(got[name].device)
        if torch.equal(a, b):
            continue
        diff = (a != b) if not a.is_floating_point() else ~((a == b) | (a.isnan() & b.isnan()))
        if not diff.any():
            continue
        where = tuple(int(i) for i in diff.nonzero()[0])
        problems.append(f"{name}: {int(diff.sum())} of {diff.numel()} elements differ, first at (page, head, "
                        f"row, col) {where}: kernel {a[where].item()}, reference {b[where].item()}")
    return problems


def _probe(codec, device, registry) -> str | None:
    """The first-use self-check of one pack variant (`KernelRegistry.trusted`): 2 sequences of a few token
    groups (a zero token, an outlier), written from mid-page through shuffled pages over garbage, by the
    kernel and by `quantize_pack_into_ref`: None when every pool is equal (torch.equal), else what
    differed. None too when the kernel declines or cannot be built (the caller takes the reference)."""
    h, d, te = codec.heads, codec.head_dim, codec.token_group
    gen = torch.Generator().manual_seed(4321)
    t = 2 * te if te > 1 else 5
    start = te if te > 1 else 3
    bs = te * max(1, 16 // te)
    x = torch.randn(2, h, t, d, generator=gen) * 3
    x[0, :, 0] = 0.0  # a constant block (scale 0)
    x[1, 0, -1, 0] = 60.0  # an outlier that sets its block's range
    x = x.to(codec.dtype).to(device)
    n = -(-(start + t) // bs)
    ids = torch.randperm(2 * n + 1, generator=gen)
    table = ids[: 2 * n].view(2, n).to(device)
    pools = random_pools(codec, 2 * n + 1, bs, gen)
    got = {k: p.to(device) for k, p in pools.items()}
    want = {k: p.clone().to(device) for k, p in pools.items()}
    if not _launch_into(x, codec, got, table, start, registry):
        return None
    quantize_pack_into_ref(x, codec, want, table, start)
    return "; ".join(pool_differences(got, want)) or None


# ----------------------------------------------------------------------------------------------- public


def quantize_pack_into(x: torch.Tensor, codec, pages: Mapping[str, torch.Tensor], table: torch.Tensor,
                       start: int, *, registry: KernelRegistry | None = None) -> None:
    """Quantize + pack x (B, H_kv, t, D) with `codec` and write it straight into the body pages.

    pages: the codec's field pools by name, (P, heads_f, BS // tokens_f, cols_f) (kvquant.codecs.base);
    table: (B, n_pages) int64 page ids of a region in position order (its offset 0); the t tokens go to
    region tokens [start, start + t): token i to page table[b, (start + i) // BS], slot (start + i) % BS,
    its scale row to slot // token_extent. start and t are multiples of the codec's token group, and so
    is BS. Bit for bit `quantize_pack_into_ref` (= codec.encode + the same index writes), for every
    granularity; a dense codec (fp16 body) is a plain copy. Nothing outside the written rows changes.
    """
    _check_into(x, codec, pages, table, start)
    if not _launch_into(x, codec, pages, table, start, registry):
        quantize_pack_into_ref(x, codec, pages, table, start)


def quantize_pack_into_ref(x: torch.Tensor, codec, pages: Mapping[str, torch.Tensor], table: torch.Tensor,
                           start: int, **unused) -> None:
    """The reference twin of `quantize_pack_into` (same arguments, same pool contents afterwards)."""
    _check_into(x, codec, pages, table, start)
    write_fields(pages, codec.encode(x), codec, table, start)


def quantize_pack(x: torch.Tensor, spec: QuantSpec, *, registry: KernelRegistry | None = None) -> QTensor:
    """Quantize x (B, H_kv, T, D) with a quantized `spec` and pack the codes along D (not paged).

    Returns a QTensor: codes uint8 (B, H_kv, T, D * bits // 8), scale/zero of `scale_shape(x.shape, spec)`
    in the spec's scale dtype (default x.dtype); equal bit for bit to `codecs.quantize.quantize(x, spec)`.
    The same kernel as `quantize_pack_into`, with each sequence's tensor seen as one page of T tokens.
    """
    if x.dim() != 4:
        raise ValueError(f"quantize_pack: expected x of shape (B, H_kv, T, D), got {tuple(x.shape)}")
    if not spec.is_quantized:
        raise ValueError("quantize_pack: spec is fp16, there is nothing to quantize")
    if x.dtype not in _SCALE_KIND:
        raise TypeError(f"quantize_pack: x must be fp16, bf16 or fp32, got {x.dtype}")
    spec.check_head_dim(x.shape[-1])
    b, h, t, d = x.shape
    codec = codec_for(spec, h, d, x.dtype)
    if t % codec.token_group:
        raise ValueError(
            f"quantize_pack: {spec} groups {codec.token_group} tokens, but T={t} is not a multiple"
        )
    if not kernel_supports(x, spec):
        return quantize_pack_ref(x, spec)
    fields = codec.fields()
    pages = {name: torch.empty((b, f.heads, t // f.tokens, f.cols), dtype=f.dtype, device=x.device)
             for name, f in fields.items()}
    table = torch.arange(b, device=x.device).view(b, 1)
    if t and not _launch_into(x, codec, pages, table, 0, registry):
        return quantize_pack_ref(x, spec)
    return QTensor(pages["codes"], pages["scale"], pages.get("zero"), spec, x.shape, x.dtype)


def quantize_pack_ref(x: torch.Tensor, spec: QuantSpec) -> QTensor:
    """The reference twin of `quantize_pack` (same signature, same result): `codecs.quantize.quantize`."""
    return quantize(x, spec)
