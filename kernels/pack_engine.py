"""Quantize + pack K/V rows into llama.cpp / GGUF block bytes, straight into pages: the engine formats of
`kvquant.codecs.engine` (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, mxfp4, nvfp4), byte for byte
`EngineCodec.encode` (whose arithmetic is ggml's reference quantizers, checked against the `gguf` package).
The twin is `kvquant.kernels.quantize_pack.quantize_pack_into_ref`; `quantize_pack_into` launches
`engine_plan`'s launch.

One program per token (i, b): the token's H * D values as NB sub-blocks of SUB (32; nvfp4: 16, one UE4M3
scale each), flat element f = j * SUB + e at head f // D, channel f % D, its block of BLK values at bytes
[kb * TS, (kb + 1) * TS) of the head's row. Block statistics come from the whole tile; the codes are then
computed column by column (element e of every sub-block at once), so that iq4_nl's least-squares sums
add in element order as the C loop does, and the two nibbles of a byte (e and e + SUB / 2) meet.

The module docstring of kvquant.codecs.engine says what is computed; here, step for step the same:
- fp32 throughout, `tl.math.div_rn` for every quotient, no FP fusion (`x * id + 8.5f` is two roundings);
- C's float -> int8 cast: truncation toward zero, NaN / +-Inf -> 0 (`_c_int`); q8_0's `roundf` (half away
  from zero); `id = d ? 1/d : 0`;
- amax / min / max loops that skip NaN (q8_0: a NaN is kept only when it is the block's last element), and the
  first element of largest magnitude as the signed max;
- the fp16 scale rounded to nearest even from fp32 (overflow -> Inf), stored little-endian;
- mxfp4's exponent `floor(log2f(amax))` as fp64 log2 rounded to fp32 (torch: the same; on a GPU both call
  libdevice's `__nv_log2`), E8M0 / UE4M3 by their bit recipes, and the nearest E2M1 value with ties to the
  lower index.
The rows are `EngineCodec.rows(x)`: llama.cpp's attention rotation is a matrix product whose summation order
is the device BLAS's, so it stays torch's (kvquant.kernels.pack_layouts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvquant.codecs.engine import GROUP_MAX_EPS, IQ4_NL_VALUES, MXFP4_VALUES, EngineCodec

__all__ = ["ENGINE_FORMATS", "Launch", "engine_plan"]

# format -> (FORMAT constexpr, values per block BLK, bytes per block TS, values per scale SUB)
ENGINE_FORMATS = {
    "Q8_0": (0, 32, 34, 32), "Q4_0": (1, 32, 18, 32), "Q4_1": (2, 32, 20, 32), "Q5_0": (3, 32, 22, 32),
    "Q5_1": (4, 32, 24, 32), "IQ4_NL": (5, 32, 18, 32), "MXFP4": (6, 32, 17, 32), "NVFP4": (7, 64, 36, 16),
}
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_GROUP_MAX_EPS = tl.constexpr(GROUP_MAX_EPS)


@dataclass(frozen=True)
class Launch:
    """One kernel launch, planned: kernel[grid](*args, **consts); `variant` names what it compiles (the
    `KernelRegistry`'s key for build failures and the first-use self-check)."""

    kernel: object
    grid: tuple
    args: tuple
    consts: dict
    variant: tuple


# ----------------------------------------------------------------------------------------------- jit


@triton.jit
def _c_int(v):
    """C's (int8_t) cast of a float as x86-64 compiles it: truncation toward zero; NaN and +-Inf -> 0."""
    finite = (v == v) & (tl.abs(v) != float("inf"))
    return tl.where(finite, tl.where(v < 0, tl.ceil(v), tl.floor(v)), 0.0)


@triton.jit
def _recip(d):
    """`id = d ? 1.0f / d : 0.0f` (NaN is true)."""
    return tl.where(d != 0, tl.math.div_rn(1.0, tl.where(d != 0, d, 1.0)), 0.0)


@triton.jit
def _store_fp16(ptr, v, mask):
    """v (fp32) as GGML_FP32_TO_FP16 (round to nearest even), two bytes little-endian."""
    bits = v.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
    tl.store(ptr, (bits & 255).to(tl.uint8), mask=mask)
    tl.store(ptr + 1, (bits >> 8).to(tl.uint8), mask=mask)


@triton.jit
def _signed_absmax(x, valid, col, SUB: tl.constexpr):
    """`if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` from 0: (amax, the first element of that
    magnitude), NaN skipped, per line of x (NB, SUB)."""
    a = tl.where(valid & (x == x), tl.abs(x), -1.0)
    amax = tl.max(a, axis=1)
    first = tl.min(tl.where(a == amax[:, None], col, SUB), axis=1)
    vmax = tl.sum(tl.where(col == first[:, None], x, 0.0), axis=1)  # one term: exact
    pos = amax > 0
    return tl.where(pos, amax, 0.0), tl.where(pos, vmax, 0.0)


@triton.jit
def _min_max(x, valid):
    """`min = FLT_MAX; max = -FLT_MAX; if (v < min) min = v; if (v > max) max = v;` per line, NaN skipped."""
    skip = ~valid | (x != x)
    lo = tl.minimum(tl.min(tl.where(skip, _FLT_MAX, x), axis=1), _FLT_MAX)
    hi = tl.maximum(tl.max(tl.where(skip, -_FLT_MAX, x), axis=1), -_FLT_MAX)
    return lo, hi


@triton.jit
def _q8_amax(x, valid, col, SUB: tl.constexpr):
    """q8_0's `amax = MAX(amax, fabsf(v))` (a > b ? a : b): a NaN is replaced by the next element, so amax is
    the largest magnitude after the last NaN, or NaN when the last element is NaN."""
    last_nan = tl.max(tl.where(valid & (x != x), col, -1), axis=1)
    amax = tl.max(tl.where(valid & (col > last_nan[:, None]), tl.abs(x), 0.0), axis=1)
    return tl.where(last_nan == SUB - 1, float("nan"), amax)


@triton.jit
def _ue4m3(v):
    """ggml_fp32_to_ue4m3: unsigned E4M3 from fp32 (v <= 0 or NaN -> 0, saturating to 0x7E), int32."""
    pos = v > 0
    v = tl.where(pos, tl.minimum(v, 448.0), 1.0)
    bits = v.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 120
    man = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    carry = man > 7
    normal_exp = tl.where(carry, exp + 1, exp)
    normal = tl.where(normal_exp >= 15, 0x7E, (normal_exp << 3) | tl.where(carry, 0, man))
    sub = tl.minimum(_c_int(v * 512.0 + 0.5), 7.0).to(tl.int32)
    sub = tl.where(sub < 1, 0, sub)
    return tl.where(pos, tl.where(exp <= 0, sub, normal), 0)


@triton.jit
def _ue4m3_value(u):
    """ggml_ue4m3_to_fp32 times 0.5 (kvalues_mxfp4 are doubled), exact: built on the fp32 bits."""
    exp = (u >> 3) & 0xF
    man = u & 7
    normal = (((exp + 119) << 23) | (man << 20)).to(tl.float32, bitcast=True)  # (1 + man / 8) 2^(exp - 8)
    value = tl.where(exp == 0, man.to(tl.float32) * 0.0009765625, normal)  # man 2^-10
    return tl.where((u == 0) | (u == 0x7F), 0.0, value)


@triton.jit
def _best_fp4(x, d, tab_ptr):
    """best_index_mxfp4: the first code i minimising |kvalues_mxfp4[i] * d - x| (x, d: (NB,)), that is the
    lowest index among equal errors; NaN -> 0."""
    k = tl.arange(0, 16)[None, :]
    xs = tl.where(x != x, 0.0, x)  # a NaN gets code 0 below; no NaN errors to reduce
    err = tl.abs(tl.load(tab_ptr + k) * d[:, None] - xs[:, None])  # (NB, 16)
    best = tl.min(err, axis=1)
    code = tl.min(tl.where(err == best[:, None], k, 16), axis=1)
    return tl.where(x != x, 0, code)


@triton.jit
def _iq4_code(x, ident, tab_ptr):
    """best_index_int8 of ident * x against kvalues_iq4nl: the number of midpoints (tab_ptr + 16: the 15 sums
    of neighbouring levels) that 2v has reached; ties go up, NaN gets 0. x, ident: (NB,)."""
    k = tl.arange(0, 16)[None, :]
    v = ident * x
    reached = ((v + v)[:, None] >= tl.load(tab_ptr + 16 + k, mask=k < 15, other=0.0)) & (k < 15)
    return tl.sum(reached.to(tl.int32), axis=1)


@triton.jit
def _code(x, p1, p2, tab_ptr, FORMAT: tl.constexpr):
    """The code of each value of a column (one element of every block) given its block's parameters:
    p1 = id (q8/q4/q5), ident (iq4_nl) or the scale d (mxfp4, nvfp4); p2 = min (q4_1, q5_1)."""
    if FORMAT == 0:  # q8_0: roundf(x * id), as a byte
        v = x * p1
        t = tl.where(v < 0, tl.ceil(v), tl.floor(v))
        r = t + tl.where(tl.abs(v - t) >= 0.5, tl.where(v > 0, 1.0, -1.0), 0.0)
        return _c_int(r).to(tl.int32) & 0xFF
    elif FORMAT == 1 or FORMAT == 3:  # q4_0 / q5_0: MIN(L - 1, (int8_t)(x * id + L / 2 + 0.5f))
        L: tl.constexpr = 16 if FORMAT == 1 else 32
        return tl.minimum(tl.maximum(_c_int(x * p1 + (L // 2 + 0.5)), 0.0), L - 1.0).to(tl.int32)
    elif FORMAT == 2 or FORMAT == 4:  # q4_1 / q5_1: (int8_t)((x - min) * id + 0.5f)
        L: tl.constexpr = 16 if FORMAT == 2 else 32
        return tl.minimum(tl.maximum(_c_int((x - p2) * p1 + 0.5), 0.0), L - 1.0).to(tl.int32)
    elif FORMAT == 5:
        return _iq4_code(x, p1, tab_ptr)
    else:
        return _best_fp4(x, p1, tab_ptr)


_DNS = ["sxb", "sxh", "sxt", "sbp", "sbh", "sbt", "tab_b", "tab_n", "START", "BS"]


@triton.jit(do_not_specialize=_DNS)
def _engine_kernel(
    x_ptr, blocks_ptr, tab_ptr,
    sxb, sxh, sxt, sxd,  # rows (B, H, t, D)
    sbp, sbh, sbt,  # blocks pool (P, H, BS, D / BLK * TS), last stride 1
    table_ptr, tab_b, tab_n, START, BS,  # token i goes to region token START + i of the table row
    D: tl.constexpr, NB: tl.constexpr, NB_PAD: tl.constexpr, FORMAT: tl.constexpr, BLK: tl.constexpr,
    TS: tl.constexpr, SUB: tl.constexpr,
):
    i = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    jt = START + i
    page = tl.load(table_ptr + b * tab_b + (jt // BS) * tab_n)
    row = page * sbp + (jt % BS) * sbt
    j = tl.arange(0, NB_PAD)
    col = tl.arange(0, SUB)[None, :]
    live = j < NB
    valid = live[:, None] & (col < SUB)
    f0 = j * SUB  # first flat element of each sub-block
    head = f0 // D
    ch0 = f0 % D
    xrow = x_ptr + b * sxb + i * sxt + head * sxh + ch0 * sxd  # (NB_PAD,) pointers to element 0
    x = tl.load(xrow[:, None] + col * sxd, mask=valid, other=0.0).to(tl.float32)
    out = blocks_ptr + row + head * sbh + (ch0 // BLK) * TS  # (NB_PAD,) each block's first byte
    p2 = tl.zeros([NB_PAD], tl.float32)
    small = live & False
    qs = 2  # where the codes start in the block
    if FORMAT == 0:  # q8_0: d = amax / 127
        d = tl.math.div_rn(_q8_amax(x, valid, col, SUB), 127.0)
        p1 = _recip(d)
        _store_fp16(out, d, live)
    elif FORMAT == 1 or FORMAT == 3:  # q4_0 / q5_0: d = max / -(L / 2)
        _, vmax = _signed_absmax(x, valid, col, SUB)
        d = tl.math.div_rn(vmax, -8.0 if FORMAT == 1 else -16.0)
        p1 = _recip(d)
        _store_fp16(out, d, live)
    elif FORMAT == 2 or FORMAT == 4:  # q4_1 / q5_1: d = (max - min) / (L - 1), m = min
        p2, hi = _min_max(x, valid)
        d = tl.math.div_rn(hi - p2, 15.0 if FORMAT == 2 else 31.0)
        p1 = _recip(d)
        _store_fp16(out, d, live)
        _store_fp16(out + 2, p2, live)
        qs = 4
    elif FORMAT == 5:  # iq4_nl: codes against 1 / (max / -127), then the least-squares scale
        amax, vmax = _signed_absmax(x, valid, col, SUB)
        p1 = tl.math.div_rn(1.0, tl.math.div_rn(vmax, -127.0))
        small = live & ~(amax >= _GROUP_MAX_EPS)
        _store_fp16(out, _iq4_scale(xrow, sxd, p1, small, live, tab_ptr, SUB), live)
    elif FORMAT == 6:  # mxfp4: E8M0 exponent e = floor(log2f(amax)) - 2 + 127, d = 2^(e - 127) / 2
        amax, _ = _signed_absmax(x, valid, col, SUB)
        lg = tl.log2(tl.where(amax > 0, amax, 1.0).to(tl.float64)).to(tl.float32)
        f = tl.floor(lg) - 2.0 + 127.0
        e = tl.where(tl.abs(f) != float("inf"), f, 0.0).to(tl.int32) & 0xFF  # (uint8_t), Inf -> 0 on x86
        e = tl.where(amax > 0, e, 0)
        p1 = tl.where(e < 2, (e * 0 + 0x00200000) << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        tl.store(out, e.to(tl.uint8), mask=live)
        qs = 1
    else:  # nvfp4: per 16 values, the UE4M3 scale of amax / 6; sub-block s of a block at bytes 4 + 8 s
        amax, _ = _signed_absmax(x, valid, col, SUB)
        ue = _ue4m3(tl.math.div_rn(amax, 6.0))
        p1 = _ue4m3_value(ue)
        sub = (ch0 % BLK) // SUB
        tl.store(out + sub, ue.to(tl.uint8), mask=live)
        out = out + 8 * sub
        qs = 4
    _store_codes(xrow, sxd, out + qs, p1, p2, small, live, tab_ptr, FORMAT, SUB)


@triton.jit
def _iq4_scale(xrow, sxd, ident, small, live, tab_ptr, SUB: tl.constexpr):
    """iq4_nl's d = sum(w q x) / sum(w q^2), w = x^2, q = kvalues_iq4nl[code], summed in element order (the
    C loop's); 0 for a block below GROUP_MAX_EPS."""
    sumqx = tl.zeros(ident.shape, tl.float32)
    sumq2 = tl.zeros(ident.shape, tl.float32)
    for e in tl.static_range(SUB):
        xe = tl.load(xrow + e * sxd, mask=live, other=0.0).to(tl.float32)
        q = tl.load(tab_ptr + _iq4_code(xe, ident, tab_ptr))
        w = xe * xe
        wq = w * q
        sumqx = sumqx + wq * xe
        sumq2 = sumq2 + wq * q
    d = tl.where(sumq2 > 0, tl.math.div_rn(sumqx, tl.where(sumq2 > 0, sumq2, 1.0)), 0.0)
    return tl.where(small, 0.0, d)


@triton.jit
def _store_codes(xrow, sxd, qs_ptr, p1, p2, small, live, tab_ptr, FORMAT: tl.constexpr, SUB: tl.constexpr):
    """The codes, column by column: 8-bit codes a byte each (q8_0); 4-bit codes two per byte, element e in the
    low nibble of byte e and e + SUB / 2 in the high one; q5's fifth bits gathered into the 32-bit qh
    before the nibbles."""
    HALF: tl.constexpr = SUB // 2
    if FORMAT == 0:
        for e in tl.static_range(SUB):
            xe = tl.load(xrow + e * sxd, mask=live, other=0.0).to(tl.float32)
            tl.store(qs_ptr + e, _code(xe, p1, p2, tab_ptr, FORMAT).to(tl.uint8), mask=live)
    else:
        FIVE: tl.constexpr = FORMAT == 3 or FORMAT == 4
        qh = tl.zeros(p1.shape, tl.int32)
        for e in tl.static_range(HALF):
            lo = _code(tl.load(xrow + e * sxd, mask=live, other=0.0).to(tl.float32), p1, p2, tab_ptr, FORMAT)
            hi = _code(tl.load(xrow + (e + HALF) * sxd, mask=live, other=0.0).to(tl.float32), p1, p2, tab_ptr,
                       FORMAT)
            lo = tl.where(small, 0, lo)
            hi = tl.where(small, 0, hi)
            if FIVE:
                qh = qh | (((lo >> 4) & 1) << e) | (((hi >> 4) & 1) << (e + HALF))
            tl.store(qs_ptr + (4 if FIVE else 0) + e, ((lo & 15) | ((hi & 15) << 4)).to(tl.uint8), mask=live)
        if FIVE:
            for k in tl.static_range(4):
                tl.store(qs_ptr + k, ((qh >> (8 * k)) & 255).to(tl.uint8), mask=live)


# ----------------------------------------------------------------------------------------------- launcher


def _tables(fmt: str, device, registry) -> torch.Tensor:
    """The format's value table, fp32 on the device: 16 levels (kvalues_iq4nl or kvalues_mxfp4), then for
    iq4_nl the 15 sums of neighbouring levels; made once per device, kept on the registry."""
    store = getattr(registry, "constants", None)
    key = ("engine_table", fmt, str(device))
    if store is not None and key in store:
        return store[key][1]
    levels = IQ4_NL_VALUES if fmt == "IQ4_NL" else MXFP4_VALUES
    values = list(levels) + [a + b for a, b in zip(levels[:-1], levels[1:], strict=True)]
    table = torch.tensor(values, dtype=torch.float32).to(device)
    if store is not None:
        store[key] = (fmt, table)
    return table


def engine_plan(x: torch.Tensor, codec: EngineCodec, pages: Mapping[str, torch.Tensor], table: torch.Tensor,
                start: int, registry=None) -> Launch | None:
    """The launch that writes `codec.encode(x)`'s blocks for x (B, H, t, D) in the K/V dtype at region tokens
    [start, start + t) of table's rows; None when the pool is laid out in a way the kernel does not
    address."""
    fmt = codec.block_type.name
    if fmt not in ENGINE_FORMATS:
        return None
    fcode, blk, ts, sub = ENGINE_FORMATS[fmt]
    pool = pages["blocks"]
    b, h, t, d = x.shape
    if pool.stride(-1) != 1 or d % blk or pool.dtype != torch.uint8:
        return None
    rows = codec.rows(x)  # (B, H, t, D): the K/V dtype, or fp32 when llama.cpp rotates them
    nb = h * d // sub
    consts = dict(D=d, NB=nb, NB_PAD=triton.next_power_of_2(nb), FORMAT=fcode, BLK=blk, TS=ts, SUB=sub)
    args = (rows, pool, _tables(fmt, x.device, registry), *rows.stride(), *pool.stride()[:3], table,
            table.stride(0), table.stride(1), start, pool.shape[2])
    variant = ("_engine_kernel", rows.dtype, *sorted(consts.items()))
    return Launch(_engine_kernel, (t, b), args, consts, variant)
