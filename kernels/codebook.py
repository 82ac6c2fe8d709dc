"""Codebook (`nuq2/3/4`) lookup inside the decode kernel: packed codes -> the fp16 values of their levels.

The levels of one codec (2^bits of them, `codecs.base.CodebookCodec.levels`) reach the kernel as a small
table (`table_for`): the fp16 bits of each level (int16) for fp16 / bf16 attention, or the float32 levels
for fp32 attention. Codes are read from the pool as int32 words (the launcher views a pool so when its rows
are whole words: D a multiple of 8 for 4 bits, 16 for 2 bits, 32 for 3 bits), as the 8-bit integer codes:

    bits   one word holds                     codes per word   order inside the word
    4      8 codes (2 per byte, low first)    8                code i at bits 4i
    2      16 codes (4 per byte)              16               code i at bits 2i
    3      three words hold 4 units of 8      32 per 3 words   unit q = bytes 3q..3q+2, code k at bit 3k

Compiled (ASM), the lookup stays in registers: the table's low bytes and high bytes are packed once per
program into 32-bit "planes" (4 levels per register), and a PRMT (byte permute) whose selector nibbles are
the codes picks four bytes at once: two PRMTs (low and high plane) give four levels' bytes and two more
interleave them into two half2 registers. 4-bit codes use two 8-level tables (levels 0-7 and 8-15) and a
per-byte mask made from bit 3 of each code (PRMT's sign-replicate mode) to choose between them (LOP3);
3-bit codes are first spread from 3 to 4 bits per code (three steps); 2-bit codes index a
single 4-level plane pair, one PRMT per two codes. About 2-2.6 instructions per code, where a table in
global memory costs a 64-bit address (two instructions) and a load per code. The interpreter cannot run
PTX: it takes the generic path (shifts, masks, and a load from the table per code), which gives the same
values; `tests/kernels/test_codebook_kernel.py` also runs the PTX strings through a small model of the
instructions they use, against the generic path, since no GPU has run them yet.

Every helper returns the levels of a word's codes as separate tensors of the word tile's shape, in code
order; `join8` and friends interleave them so that a reshape gives the codes in channel order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["table_for", "LUT4_ASM", "LUT3_ASM", "LUT2_ASM", "lut4", "words_ok"]


def table_for(levels: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """The kernel's table of levels (2^bits,): float32 for fp32 attention, else the fp16 bits as int16."""
    if dtype == torch.float32:
        return levels.to(device=device, dtype=torch.float32).contiguous()
    return levels.to(torch.float16).view(torch.int16).to(device).contiguous()


def words_ok(bits: int, d: int) -> bool:
    """Whether a code row of D channels is a whole number of the words the word path reads."""
    return (d * bits // 8) % 4 == 0 and (bits != 3 or d % 32 == 0)


# PTX (operands: $0..$7 the eight fp16 outputs, then the code word / unit, then the table planes). Each is
# modelled instruction by instruction in tests/kernels/test_codebook_kernel.py.
LUT4_ASM = (
    "{ .reg .b32 s, s1, r4, m0, m1, la, lb, ha, hb, l0, h0, l1, h1, o0, o1, o2, o3; "
    "and.b32 s, $8, 0x77777777; "  # selector nibble i = low 3 bits of code i
    "shr.b32 s1, s, 16; "  # codes 4..7
    "shl.b32 r4, $8, 4; "
    "prmt.b32 m0, r4, $8, 0xD9C8; "  # byte i = 0xFF iff bit 3 of code i (sign-replicate), codes 0..3
    "prmt.b32 m1, r4, $8, 0xFBEA; "  # codes 4..7
    "prmt.b32 la, $9, $10, s; prmt.b32 ha, $11, $12, s; prmt.b32 lb, $13, $14, s; prmt.b32 hb, $15, $16, s; "
    "lop3.b32 l0, la, lb, m0, 0xD8; lop3.b32 h0, ha, hb, m0, 0xD8; "  # (a & ~m) | (b & m)
    "prmt.b32 la, $9, $10, s1; prmt.b32 ha, $11, $12, s1; prmt.b32 lb, $13, $14, s1; "
    "prmt.b32 hb, $15, $16, s1; "
    "lop3.b32 l1, la, lb, m1, 0xD8; lop3.b32 h1, ha, hb, m1, 0xD8; "
    "prmt.b32 o0, l0, h0, 0x5140; prmt.b32 o1, l0, h0, 0x7362; "  # (lo, hi) byte pairs -> half2
    "prmt.b32 o2, l1, h1, 0x5140; prmt.b32 o3, l1, h1, 0x7362; "
    "mov.b32 {$0, $1}, o0; mov.b32 {$2, $3}, o1; mov.b32 {$4, $5}, o2; mov.b32 {$6, $7}, o3; }"
)
LUT3_ASM = (
    "{ .reg .b32 a, t, s, s1, l0, h0, l1, h1, o0, o1, o2, o3; "
    # spread the unit's eight 3-bit codes to nibbles: 12-bit halves to bits 0 and 16 (bits 24-31 of the
    # unit are ignored), 6-bit quarters to bytes, 3-bit codes to nibbles; the last two steps move a field
    # by adding a multiple of it, a + (2^k - 1) t = (a - t) + (t << k) with t the field's bits of a (no
    # carries: the fields are apart), one IMAD where shift, mask and or took two more instructions
    "and.b32 t, $8, 0xFFF000; shl.b32 t, t, 4; and.b32 a, $8, 0xFFF; or.b32 a, a, t; "
    "and.b32 t, a, 0x0FC00FC0; mad.lo.u32 a, t, 3, a; "
    "and.b32 t, a, 0x38383838; add.u32 s, a, t; "
    "shr.b32 s1, s, 16; "
    "prmt.b32 l0, $9, $10, s; prmt.b32 h0, $11, $12, s; prmt.b32 l1, $9, $10, s1; prmt.b32 h1, $11, $12, s1; "
    "prmt.b32 o0, l0, h0, 0x5140; prmt.b32 o1, l0, h0, 0x7362; "
    "prmt.b32 o2, l1, h1, 0x5140; prmt.b32 o3, l1, h1, 0x7362; "
    "mov.b32 {$0, $1}, o0; mov.b32 {$2, $3}, o1; mov.b32 {$4, $5}, o2; mov.b32 {$6, $7}, o3; }"
)


def _lut2_asm(shift: int) -> str:
    """Codes 8h..8h+7 of a word of 2-bit codes (h = shift // 16): each code c becomes the selector byte
    c | (c + 4) << 4, so one PRMT over (low plane, high plane) gives the half2 of two codes directly."""
    spread = ("and.b32 x, x, 0xFF; shl.b32 t, x, 12; or.b32 x, x, t; and.b32 x, x, 0x000F000F; "
              "shl.b32 t, x, 6; or.b32 x, x, t; and.b32 x, x, 0x03030303; "
              "shl.b32 t, x, 4; or.b32 x, x, t; or.b32 {y}, x, 0x40404040; ")
    return (
        "{ .reg .b32 h, x, t, ya, yb, o0, o1, o2, o3; "
        f"shr.b32 h, $8, {shift}; "
        "mov.b32 x, h; " + spread.format(y="ya")
        + "shr.b32 x, h, 8; " + spread.format(y="yb")
        + "prmt.b32 o0, $9, $10, ya; shr.b32 ya, ya, 16; prmt.b32 o1, $9, $10, ya; "
        "prmt.b32 o2, $9, $10, yb; shr.b32 yb, yb, 16; prmt.b32 o3, $9, $10, yb; "
        "mov.b32 {$0, $1}, o0; mov.b32 {$2, $3}, o1; mov.b32 {$4, $5}, o2; mov.b32 {$6, $7}, o3; }"
    )


LUT2_ASM = (_lut2_asm(0), _lut2_asm(16))
_LUT2_LO: tl.constexpr = tl.constexpr(LUT2_ASM[0])
_LUT2_HI: tl.constexpr = tl.constexpr(LUT2_ASM[1])
_LUT3: tl.constexpr = tl.constexpr(LUT3_ASM)
_LUT4: tl.constexpr = tl.constexpr(LUT4_ASM)
_F16X8: tl.constexpr = tl.constexpr((tl.float16,) * 8)  # the dtypes of eight fp16 outputs


# ----------------------------------------------------------------------------------------------- jit


@triton.jit
def _planes(lv_ptr, first: tl.constexpr):
    """(low bytes, high bytes) of the fp16 bits of levels first..first+3, four to a register (level first
    in byte 0): the table a PRMT indexes."""
    v0 = tl.load(lv_ptr + first).to(tl.int32) & 0xFFFF
    v1 = tl.load(lv_ptr + first + 1).to(tl.int32) & 0xFFFF
    v2 = tl.load(lv_ptr + first + 2).to(tl.int32) & 0xFFFF
    v3 = tl.load(lv_ptr + first + 3).to(tl.int32) & 0xFFFF
    lo = (v0 & 255) | ((v1 & 255) << 8) | ((v2 & 255) << 16) | ((v3 & 255) << 24)
    hi = (v0 >> 8) | ((v1 >> 8) << 8) | ((v2 >> 8) << 16) | ((v3 >> 8) << 24)
    return lo, hi


@triton.jit
def lut_tables(lv_ptr, BITS: tl.constexpr, ON: tl.constexpr):
    """The PRMT planes of a codec's fp16 table, loaded once per program: 8 int32 scalars (unused ones 0).
    2 bits: (lo 0-3, hi 0-3); 3 bits: (lo 0-3, lo 4-7, hi 0-3, hi 4-7); 4 bits: the same for levels 0-7,
    then for levels 8-15. ON False (no codebook, or the generic path): zeros, nothing loaded."""
    z = tl.zeros((), tl.int32)
    t0, t1, t2, t3, t4, t5, t6, t7 = z, z, z, z, z, z, z, z
    if ON:
        if BITS == 2:
            t0, t1 = _planes(lv_ptr, 0)
        else:
            t0, t2 = _planes(lv_ptr, 0)
            t1, t3 = _planes(lv_ptr, 4)
            if BITS == 4:
                t4, t6 = _planes(lv_ptr, 8)
                t5, t7 = _planes(lv_ptr, 12)
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def join8(c0, c1, c2, c3, c4, c5, c6, c7):
    """Eight tensors (...) -> (..., 2, 2, 2) with [..., x, y, z] = c_{4x + 2y + z}: a reshape that merges
    the new axes into the last one then lists the eight in order."""
    return tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))


@triton.jit
def _join4(c0, c1, c2, c3):
    """Four tensors (...) -> (..., 2, 2) with [..., a, b] = c_{2a + b}."""
    return tl.join(tl.join(c0, c2), tl.join(c1, c3))


@triton.jit
def _level(lv_ptr, c, F32: tl.constexpr):
    """The level of codes c (uint32, any shape) from the table: fp16 (bits stored as int16), or fp32."""
    if F32:
        x = tl.load(lv_ptr + c)
    else:  # (one return at the end: compiled, statements after a constexpr branch's return are walked too)
        x = tl.load(lv_ptr + c).to(tl.float16, bitcast=True)
    return x


@triton.jit
def _lut4_generic(w, lv_ptr, F32: tl.constexpr):
    u = w.to(tl.uint32, bitcast=True)
    return (_level(lv_ptr, u & 15, F32), _level(lv_ptr, (u >> 4) & 15, F32),
            _level(lv_ptr, (u >> 8) & 15, F32), _level(lv_ptr, (u >> 12) & 15, F32),
            _level(lv_ptr, (u >> 16) & 15, F32), _level(lv_ptr, (u >> 20) & 15, F32),
            _level(lv_ptr, (u >> 24) & 15, F32), _level(lv_ptr, u >> 28, F32))


@triton.jit
def _lut_unit3_generic(u, lv_ptr, F32: tl.constexpr):
    return (_level(lv_ptr, u & 7, F32), _level(lv_ptr, (u >> 3) & 7, F32),
            _level(lv_ptr, (u >> 6) & 7, F32), _level(lv_ptr, (u >> 9) & 7, F32),
            _level(lv_ptr, (u >> 12) & 7, F32), _level(lv_ptr, (u >> 15) & 7, F32),
            _level(lv_ptr, (u >> 18) & 7, F32), _level(lv_ptr, (u >> 21) & 7, F32))


@triton.jit
def _lut_half2_generic(u, lv_ptr, F32: tl.constexpr):
    return (_level(lv_ptr, u & 3, F32), _level(lv_ptr, (u >> 2) & 3, F32),
            _level(lv_ptr, (u >> 4) & 3, F32), _level(lv_ptr, (u >> 6) & 3, F32),
            _level(lv_ptr, (u >> 8) & 3, F32), _level(lv_ptr, (u >> 10) & 3, F32),
            _level(lv_ptr, (u >> 12) & 3, F32), _level(lv_ptr, (u >> 14) & 3, F32))


@triton.jit
def _unit3(u, lv_ptr, t0, t1, t2, t3, F32: tl.constexpr, ASM: tl.constexpr):
    """A 3-bit unit (uint32, 8 codes in its low 24 bits) -> its 8 levels, in code order."""
    if ASM:
        out = tl.inline_asm_elementwise(_LUT3, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [u, t0, t1, t2, t3],
                                        dtype=_F16X8, is_pure=True, pack=1)
    else:
        out = _lut_unit3_generic(u, lv_ptr, F32)
    return out


@triton.jit
def lut4(w, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, F32: tl.constexpr, ASM: tl.constexpr):
    """int32 words (any shape) of eight 4-bit codes -> their eight levels (tensors of w's shape), code i at
    bits 4i: the PRMT lookup in registers when compiled (t0..t7: `lut_tables`), else a load per code."""
    if ASM:
        out = tl.inline_asm_elementwise(_LUT4, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r,r,r",
                                        [w, t0, t1, t2, t3, t4, t5, t6, t7], dtype=_F16X8, is_pure=True,
                                        pack=1)
    else:
        out = _lut4_generic(w, lv_ptr, F32)
    return out


@triton.jit
def lut_words(p, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, BLOCK_T: tl.constexpr, D: tl.constexpr,
              BITS: tl.constexpr, F32: tl.constexpr, ASM: tl.constexpr):
    """Codebook codes read as int32 words -> (BLOCK_T, D) levels (fp16, or fp32 when F32), channel order.

    p: (BLOCK_T, D * BITS // 32) words for 2 and 4 bits; for 3 bits a tuple of the three (BLOCK_T, D // 32)
    tiles of words 3m, 3m + 1, 3m + 2 of each row. t0..t7: `lut_tables` (compiled path only)."""
    if BITS == 4:
        a0, a1, a2, a3, a4, a5, a6, a7 = lut4(p, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, F32, ASM)
        x = join8(a0, a1, a2, a3, a4, a5, a6, a7)  # [.., j, x, y, z] = code 8j + 4x + 2y + z
    elif BITS == 2:
        if ASM:
            a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
                _LUT2_LO, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [p, t0, t1], dtype=_F16X8, is_pure=True,
                pack=1)
            b0, b1, b2, b3, b4, b5, b6, b7 = tl.inline_asm_elementwise(
                _LUT2_HI, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [p, t0, t1], dtype=_F16X8, is_pure=True,
                pack=1)
        else:
            u = p.to(tl.uint32, bitcast=True)
            a0, a1, a2, a3, a4, a5, a6, a7 = _lut_half2_generic(u, lv_ptr, F32)
            b0, b1, b2, b3, b4, b5, b6, b7 = _lut_half2_generic(u >> 16, lv_ptr, F32)
        # [.., j, h, x, y, z] = code 16j + 8h + 4x + 2y + z: the half h is the most significant new axis
        x = join8(tl.join(a0, b0), tl.join(a1, b1), tl.join(a2, b2), tl.join(a3, b3), tl.join(a4, b4),
                  tl.join(a5, b5), tl.join(a6, b6), tl.join(a7, b7))
    else:
        w0, w1, w2 = p
        w0 = w0.to(tl.uint32, bitcast=True)
        w1 = w1.to(tl.uint32, bitcast=True)
        w2 = w2.to(tl.uint32, bitcast=True)
        # units of 24 bits: bytes 0-2 | 3-5 | 6-8 | 9-11 of the 12-byte group in the low 24 bits of a word;
        # the top byte is left as it comes (the next unit's codes): both lookups ignore it
        u0 = w0
        u1 = (w0 >> 24) | (w1 << 8)
        u2 = (w1 >> 16) | (w2 << 16)
        u3 = w2 >> 8
        a0, a1, a2, a3, a4, a5, a6, a7 = _unit3(u0, lv_ptr, t0, t1, t2, t3, F32, ASM)
        b0, b1, b2, b3, b4, b5, b6, b7 = _unit3(u1, lv_ptr, t0, t1, t2, t3, F32, ASM)
        c0, c1, c2, c3, c4, c5, c6, c7 = _unit3(u2, lv_ptr, t0, t1, t2, t3, F32, ASM)
        d0, d1, d2, d3, d4, d5, d6, d7 = _unit3(u3, lv_ptr, t0, t1, t2, t3, F32, ASM)
        # [.., m, a, b, x, y, z] = code 32m + 8(2a + b) + 4x + 2y + z: the unit axes (a, b) are joined
        # first, so they are the more significant ones
        x = join8(_join4(a0, b0, c0, d0), _join4(a1, b1, c1, d1), _join4(a2, b2, c2, d2),
                  _join4(a3, b3, c3, d3), _join4(a4, b4, c4, d4), _join4(a5, b5, c5, d5),
                  _join4(a6, b6, c6, d6), _join4(a7, b7, c7, d7))
    return tl.reshape(x, (BLOCK_T, D))
