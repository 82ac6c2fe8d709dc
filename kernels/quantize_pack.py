"""Quantize and pack K/V in one pass, written straight into pages: `quantize_pack_into` (Triton) and its
twin `quantize_pack_into_ref`; `quantize_pack` / `quantize_pack_ref` return a non-paged QTensor.

`quantize_pack_into(x, codec, pages, table, start)` encodes x (B, H_kv, t, D) with an affine codec
(kvquant.codecs.base) and writes codes, scale and zero into the page pools at region tokens [start, start + t)
of each sequence's table row; the twin is `codec.encode(x)` followed by the same index writes. What one
program handles follows the codec's block extent (its `kernel_layout()`), never a granularity switch:

    extent                          stats row per page     one program handles
    1 token x all heads x D         (P, 1, BS, 1)          one token: H * D elements, one block
    1 token x 1 head x CE channels  (P, H, BS, D // CE)    one token: H * D / CE blocks of CE
    TE tokens x 1 channel           (P, H, BS // TE, D)    one token group of one head, a slice of D

Bit-exactness: the arithmetic is the reference's, step for step, in fp32, against the *stored* scale
and zero (rounded to the scale dtype so they cover the block: zero down, scale up, as the reference
does). fp32 division on the GPU is approximate unless asked otherwise, so every division is
`tl.math.div_rn`; the kernels are compiled with `enable_fp_fusion=False` so `v / s * qmax + 0.5` is not
contracted into an FMA (torch rounds after each operation). Rounding to a bf16 scale is done by hand
(round to nearest even on the fp32 bits) because the Triton interpreter truncates on a bf16 cast.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from kvquant.codecs.base import codec_for
from kvquant.codecs.quantize import QTensor, quantize
from kvquant.scheme import QuantSpec

from .registry import KernelRegistry, default_registry

__all__ = ["quantize_pack", "quantize_pack_ref", "quantize_pack_into", "quantize_pack_into_ref",
           "write_fields", "kernel_supports"]

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
def _pack_rows(q, ROWS: tl.constexpr, COLS: tl.constexpr, BITS: tl.constexpr):
    """(ROWS, COLS) int32 codes -> (ROWS, COLS * BITS // 8) bytes, lowest bits first (codecs.packing)."""
    PER: tl.constexpr = 8 // BITS
    if PER == 1:
        return q.to(tl.uint8)
    else:
        grouped = tl.reshape(q, (ROWS, COLS // PER, PER))
        shifts = tl.arange(0, PER) * BITS
        return tl.sum(grouped << shifts[None, None, :], axis=2).to(tl.uint8)  # disjoint bits: sum == or


_TOKEN_DNS = ["sxb", "scp", "sch", "ssp", "ssh", "tab_b", "tab_n", "START", "BS"]


@triton.jit(do_not_specialize=_TOKEN_DNS)
def _quantize_token_kernel(
    x_ptr, codes_ptr, scale_ptr, zero_ptr,
    sxb, sxh, sxt, sxd,  # x (B, H, t, D)
    scp, sch, sct,  # codes pool (P, H, BS, D * BITS // 8), last stride 1
    ssp, ssh, sst, ssg,  # scale/zero pool (P, H or 1, BS, D // N)
    tab_ptr, tab_b, tab_n, START, BS,  # token i of x goes to region token START + i of the table row
    D: tl.constexpr, NB: tl.constexpr, G: tl.constexpr, NB_PAD: tl.constexpr, G_PAD: tl.constexpr,
    BITS: tl.constexpr, SYMMETRIC: tl.constexpr, KIND: tl.constexpr,
):
    """One program per token (i, b): its H * D elements as NB blocks of G (token: 1 x H*D, head: H x D,
    group: H*D/N x N). Flat element f = j * G + e of block j lies at head f // D, channel f % D.
    Written to page table[b, (START + i) // BS], slot (START + i) % BS."""
    i = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    jt = START + i
    page = tl.load(tab_ptr + b * tab_b + (jt // BS) * tab_n)
    slot = jt % BS
    j = tl.arange(0, NB_PAD)
    e = tl.arange(0, G_PAD)
    valid = (j[:, None] < NB) & (e[None, :] < G)
    f = j[:, None] * G + e[None, :]
    x_off = b * sxb + i * sxt + (f // D) * sxh + (f % D) * sxd
    x = tl.load(x_ptr + x_off, mask=valid, other=0.0).to(tl.float32)

    q, scale, zero = _quantize_tile(x, valid, 1, BITS, SYMMETRIC, KIND)

    # stats: block j starts at flat f0 = j * G -> head f0 // D, group (f0 % D) // G (0 unless -gN)
    f0 = j * G
    s_off = page * ssp + slot * sst + (f0 // D) * ssh + ((f0 % D) // G) * ssg
    tl.store(scale_ptr + s_off, scale, mask=j < NB)
    if not SYMMETRIC:
        tl.store(zero_ptr + s_off, zero, mask=j < NB)

    PER: tl.constexpr = 8 // BITS
    packed = _pack_rows(q, NB_PAD, G_PAD, BITS)  # (NB_PAD, G_PAD // PER)
    k = tl.arange(0, G_PAD // PER)
    fb = j[:, None] * G + k[None, :] * PER  # flat index of each byte's first code; G % PER == 0
    c_off = page * scp + slot * sct + (fb // D) * sch + (fb % D) // PER
    tl.store(codes_ptr + c_off, packed, mask=(j[:, None] < NB) & (k[None, :] * PER < G))


_CHANNEL_DNS = ["sxb", "scp", "sch", "ssp", "ssh", "tab_b", "tab_n", "START", "BS"]


@triton.jit(do_not_specialize=_CHANNEL_DNS)
def _quantize_channel_kernel(
    x_ptr, codes_ptr, scale_ptr, zero_ptr,
    sxb, sxh, sxt, sxd,  # x (B, H, t, D)
    scp, sch, sct,  # codes pool (P, H, BS, D * BITS // 8), last stride 1
    ssp, ssh, ssg, ssd,  # scale/zero pool (P, H, BS // N, D)
    tab_ptr, tab_b, tab_n, START, BS,
    H,
    D: tl.constexpr, N: tl.constexpr, N_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    BITS: tl.constexpr, SYMMETRIC: tl.constexpr, KIND: tl.constexpr,
):
    """One program per (token group, b * h, D slice): N tokens x BLOCK_D channels, one block per channel.
    The group's N tokens lie in one page (START and BS are multiples of N); its stats row is slot // N."""
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

    q, scale, zero = _quantize_tile(x, valid, 0, BITS, SYMMETRIC, KIND)

    s_off = page * ssp + h * ssh + (slot0 // N) * ssg + d * ssd
    tl.store(scale_ptr + s_off, scale, mask=d < D)
    if not SYMMETRIC:
        tl.store(zero_ptr + s_off, zero, mask=d < D)

    PER: tl.constexpr = 8 // BITS
    packed = _pack_rows(q, N_PAD, BLOCK_D, BITS)  # (N_PAD, BLOCK_D // PER)
    k = tl.program_id(2) * (BLOCK_D // PER) + tl.arange(0, BLOCK_D // PER)
    c_off = page * scp + h * sch + (slot0 + i)[:, None] * sct + k[None, :]
    tl.store(codes_ptr + c_off, packed, mask=(i[:, None] < N) & (k[None, :] * PER < D))


# ----------------------------------------------------------------------------------------------- launcher


def kernel_supports(x: torch.Tensor, spec: QuantSpec) -> bool:
    """Whether the kernel serves this input; otherwise the reference runs (same bits).

    Not served: a group of channels that does not fill whole bytes (group size not a multiple of
    8 // bits, e.g. int4-g1), and non-float inputs.
    """
    if x.dtype not in _SCALE_KIND or not spec.is_quantized:
        return False
    lay = codec_for(spec, x.shape[1], x.shape[3], x.dtype).kernel_layout()
    if lay is None or lay.bits == 16 or not _affine(lay):
        return False
    return lay.token_extent > 1 or lay.channel_extent % (8 // spec.bits) == 0


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


def _launch_into(x, codec, pages, table, start, registry) -> bool:
    """Quantize x and write it through the table; False when the kernel cannot serve (caller: the ref)."""
    lay = codec.kernel_layout()
    if lay is None or lay.bits == 16 or x.dtype not in _SCALE_KIND or not _affine(lay):
        return False
    x = x.to(codec.dtype)  # codec.encode quantizes the K/V dtype
    b, h, t, d = x.shape
    bits, per = lay.bits, 8 // lay.bits
    te, ce = lay.token_extent, lay.channel_extent
    if te == 1 and ce % per:
        return False  # a group that does not fill whole bytes
    codes, scale = pages["codes"], pages["scale"]
    zero = pages.get("zero", scale) if not lay.symmetric else scale
    bs = codes.shape[2]
    if bs % te or codes.stride(-1) != 1:
        return False
    if t == 0:
        return True
    kind = _SCALE_KIND[codec.scale_dtype]
    ss = scale.stride()
    tab = (table, table.stride(0), table.stride(1), start, bs)
    if te > 1:
        n = te
        n_pad = triton.next_power_of_2(n)
        d_pad = max(triton.next_power_of_2(d), per)
        block_d = max(min(d_pad, triton.next_power_of_2(max(_MAX_TILE // n_pad, 1))), per)
        grid = (t // n, b * h, triton.cdiv(d, block_d))
        consts = dict(D=d, N=n, N_PAD=n_pad, BLOCK_D=block_d, BITS=bits, SYMMETRIC=lay.symmetric, KIND=kind)
        args = (x, codes, scale, zero, *x.stride(), *codes.stride()[:3], *ss, *tab, h)
        kernel = _quantize_channel_kernel
    else:
        g = ce * (h if lay.shared_heads else 1)  # elements per block
        nb = h * d // g
        s_h = 0 if lay.shared_heads else ss[1]
        consts = dict(D=d, NB=nb, G=g, NB_PAD=triton.next_power_of_2(nb),
                      G_PAD=max(triton.next_power_of_2(g), per), BITS=bits, SYMMETRIC=lay.symmetric,
                      KIND=kind)
        args = (x, codes, scale, zero, *x.stride(), *codes.stride()[:3], ss[0], s_h, ss[2], ss[3], *tab)
        grid = (t, b)
        kernel = _quantize_token_kernel
    variant = (x.dtype, codes.dtype, scale.dtype, *sorted(consts.items()))
    registry = registry or default_registry()
    trusted = getattr(registry, "trusted", None)
    if trusted is not None and not trusted("quantize_pack", variant, x.device,
                                           lambda: _probe(codec, x.device, registry)):
        return False
    return registry.launch(kernel, grid, args, dict(consts, enable_fp_fusion=False), variant)


def _affine(lay) -> bool:
    """Whether a kernel layout is the affine integer one these kernels quantize (FP8's is read by the
    decode kernel only: its appends take the reference encoder, the same bits)."""
    return getattr(lay, "fp8", None) is None


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
    pools = {}
    for name, f in codec.fields().items():
        shape = (2 * n + 1, f.heads, bs // f.tokens, f.cols)
        if f.dtype == torch.uint8:
            pools[name] = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        else:
            pools[name] = (torch.rand(shape, generator=gen) + 0.5).to(f.dtype)
    got = {k: p.to(device) for k, p in pools.items()}
    want = {k: p.clone().to(device) for k, p in pools.items()}
    if not _launch_into(x, codec, got, table, start, registry):
        return None
    quantize_pack_into_ref(x, codec, want, table, start)
    problems = []
    for name in want:
        a, b = got[name], want[name]
        if torch.equal(a, b):
            continue
        diff = (a != b) if a.dtype == torch.uint8 else ~((a == b) | (a.isnan() & b.isnan()))
        if not diff.any():
            continue
        where = tuple(int(i) for i in diff.nonzero()[0])
        problems.append(f"{name}: {int(diff.sum())} of {diff.numel()} elements differ, first at (page, head, "
                        f"row, col) {where}: kernel {a[where].item()}, reference {b[where].item()}")
    return "; ".join(problems) or None


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
