"""GGUF blocks (`kvquant.codecs.engine`: llama.cpp's q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, ggml's mxfp4 and
nvfp4) decoded in place inside the decode kernel, from the one uint8 field `blocks` per (token, head).

A row (one token of one KV head) is NB = D / BLK blocks of TS bytes: a header (scale, min, high bits or
exponents; HDR bytes) then NQ code bytes. The kernel reads the code bytes as int32 words when the pool's rows
are whole words (RB = NB * TS a multiple of 4; every format at D >= 64 but mxfp4 at D = 64), else byte by
byte and assembles the same words. A block whose code bytes start r = (b * TS + HDR) % 4 bytes past a word
boundary (q8_0, q4_0, iq4_nl, q5_0: every other block; mxfp4: three blocks in four) is read as the NQ / 4
words from the word before its first code byte: the r bytes of header there are replaced by the block's last
r code bytes, which sit in the word after (one more load per block and row, one select). So the kernel sees
a block's code bytes rotated by r: kernel byte j holds code byte (j - r) mod NQ. Codes then come out in the
order the word helpers give them (8-bit: byte order; 4-bit: byte j low nibble, then high nibble), so kernel
channel p of a block holds an element of the block that `kvquant.kernels.layouts.engine_order` names: a
fixed permutation per format and D, which decode applies to the query and undoes on the output outside the
kernel (`KernelFrame.order`), as `-rot`'s rotation (no register shuffles inside the loop).

    id  format   BLK  TS  HDR  NQ  codes                              value
    1   q8_0     32   34   2   32  int8 (words ^ 0x80808080, bias 128)   c * d
    2   q4_0     32   18   2   16  4-bit, table c - 8                    t[c] * d
    3   q4_1     32   20   4   16  4-bit, table c                        t[c] * d + m
    4   q5_0     32   22   6   16  4-bit | bit e of qh << 4              (c - 16) * d
    5   q5_1     32   24   8   16  as q5_0                               c * d + m
    6   iq4_nl   32   18   2   16  4-bit, table kvalues_iq4nl            t[c] * d
    7   mxfp4    32   17   1   16  4-bit, table kvalues_mxfp4 (2 E2M1)   t[c] * 2^(e - 128)
    8   nvfp4    64   36   4   32  4-bit, table kvalues_mxfp4, per 16    t[c] * UE4M3(u) / 2

Tables: `kvquant.kernels.layouts.engine_levels`, looked up as codebooks are (`kernels.codebook.lut_words`:
PRMT in registers when compiled). d, m are the header's fp16; e the E8M0 byte (2^(e - 128), the half of
ggml's 2^(e - 127) since the table holds doubled E2M1 values); UE4M3 u decodes as E4M3 without its sign
(fp16 bits (u & 0x7F) << 7, times 2^8), 0 for u = 0x7F, as `ggml_ue4m3_to_fp32`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codebook import join8, lut_words
from .codes import _codes_w8

__all__ = ["engine_body"]


@triton.jit
def _code_words(c_ptr, row, valid, BLOCK_T: tl.constexpr, NB: tl.constexpr, TS: tl.constexpr,
                HDR: tl.constexpr, NQ: tl.constexpr):
    """The code bytes of each block of rows `row` (BLOCK_T,) as (BLOCK_T, NB * NQ // 4) uint32 words, each
    block's rotated by its r (module docstring): from int32 words when the launcher viewed the pool so,
    else assembled from bytes."""
    NQW: tl.constexpr = NQ // 4
    RB: tl.constexpr = NB * TS
    start = tl.arange(0, NB) * TS + HDR  # (NB,): each block's first code byte in its row
    r = start % 4
    if c_ptr.dtype.element_ty == tl.int32:
        k = tl.arange(0, NQW)
        base = row[:, None] * (RB // 4) + ((start - r) // 4)[None, :]  # (BLOCK_T, NB): first word read
        w = tl.load(c_ptr + base[:, :, None] + k[None, None, :], mask=valid[:, None, None], other=0)
        w = w.to(tl.uint32, bitcast=True)
        # the last r code bytes of an unaligned block are the low bytes of the word after its NQ / 4
        fix = tl.load(c_ptr + base + NQW, mask=valid[:, None] & (r != 0)[None, :], other=0)
        fix = fix.to(tl.uint32, bitcast=True)
        m = (tl.full((NB,), 1, tl.uint32) << (8 * r).to(tl.uint32)) - 1  # (NB,): the r low bytes
        m = tl.where(k[None, :] == 0, m[:, None], 0)  # (NB, NQW): only in a block's first word
        w = w ^ ((w ^ fix[:, :, None]) & m[None, :, :])  # one LOP3: the masked bytes from fix
    else:
        j = tl.arange(0, NQ)
        src = start[:, None] + (j[None, :] - r[:, None] + NQ) % NQ  # (NB, NQ): kernel byte j's address
        b = tl.load(c_ptr + row[:, None, None] * RB + src[None, :, :], mask=valid[:, None, None], other=0)
        b4 = tl.reshape(b.to(tl.uint32), (BLOCK_T, NB, NQW, 4))
        w = tl.sum(b4 << (8 * tl.arange(0, 4)).to(tl.uint32)[None, None, None, :], axis=3)
    return tl.reshape(w, (BLOCK_T, NB * NQW))


@triton.jit
def _half(hp, off, valid):
    """The fp16 at half index off (BLOCK_T, NB) -> fp32."""
    return tl.load(hp + off, mask=valid[:, None], other=0.0).to(tl.float32)


@triton.jit
def _u16(up, off, valid):
    return tl.load(up + off, mask=valid[:, None], other=0).to(tl.uint32)


@triton.jit
def _headers(c_ptr, row, valid, BLOCK_T: tl.constexpr, NB: tl.constexpr, TS: tl.constexpr,
             ENG: tl.constexpr):
    """Each block's header -> (scale (BLOCK_T, NS) fp32, min (BLOCK_T, NB) fp32 (zeros without one),
    qh (BLOCK_T, NB) uint32 (q5_x; zeros otherwise)); NS = NB * 4 for nvfp4 (a scale per 16), else NB."""
    RB: tl.constexpr = NB * TS
    ob = tl.arange(0, NB)
    bp = c_ptr.to(tl.pointer_type(tl.uint8))
    zero = tl.zeros((BLOCK_T, NB), tl.float32)
    qh = tl.zeros((BLOCK_T, NB), tl.uint32)
    mn = zero
    if ENG == 7:  # E8M0 exponent byte: 2^(e - 128) as fp32 bits (e < 2: a subnormal)
        e = tl.load(bp + row[:, None] * RB + (ob * TS)[None, :], mask=valid[:, None], other=0).to(tl.int32)
        d = tl.where(e < 2, (e * 0 + 0x00200000) << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    elif ENG == 8:  # four UE4M3 bytes, one per 16 values
        s = tl.arange(0, 4)
        off = row[:, None, None] * RB + (ob * TS)[None, :, None] + s[None, None, :]
        u = tl.load(bp + off, mask=valid[:, None, None], other=0).to(tl.int32)
        h = ((u & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 128.0
        d = tl.reshape(tl.where(u == 0x7F, 0.0, h), (BLOCK_T, NB * 4))
    else:  # fp16 d at byte 0 (TS even: halves), then m (q4_1, q5_1) and the 32 high bits qh (q5_x)
        HW: tl.constexpr = TS // 2
        hoff = row[:, None] * (NB * HW) + (ob * HW)[None, :]
        d = _half(c_ptr.to(tl.pointer_type(tl.float16)), hoff, valid)
        up = c_ptr.to(tl.pointer_type(tl.uint16))
        if ENG == 3 or ENG == 5:
            mn = _half(c_ptr.to(tl.pointer_type(tl.float16)), hoff + 1, valid)
        if ENG == 4:
            qh = _u16(up, hoff + 1, valid) | (_u16(up, hoff + 2, valid) << 16)
        elif ENG == 5:
            qh = _u16(up, hoff + 2, valid) | (_u16(up, hoff + 3, valid) << 16)
    return d, mn, qh


@triton.jit
def _q5_codes(w, qh, BLOCK_T: tl.constexpr, D: tl.constexpr, NB: tl.constexpr, TS: tl.constexpr,
              HDR: tl.constexpr):
    """5-bit codes (BLOCK_T, D) uint32 of q5_0 / q5_1: the nibbles of the words w (BLOCK_T, D // 8), in
    nibble order, with bit 4 from the block's qh: kernel channel p of block b holds element
    ((p // 2 - r_b) mod 16) + 16 (p % 2), whose high bit is bit that of qh."""
    c = tl.reshape(join8(w & 15, (w >> 4) & 15, (w >> 8) & 15, (w >> 12) & 15, (w >> 16) & 15,
                         (w >> 20) & 15, (w >> 24) & 15, w >> 28), (BLOCK_T, D))
    r = (tl.arange(0, NB) * TS + HDR) % 4
    p = tl.arange(0, 32)
    e = ((p // 2)[None, :] - r[:, None] + 16) % 16 + 16 * (p % 2)[None, :]  # (NB, 32)
    hb = (qh[:, :, None] >> e.to(tl.uint32)[None, :, :]) & 1  # (BLOCK_T, NB, 32)
    return c | tl.reshape(hb << 4, (BLOCK_T, D))


@triton.jit
def engine_body(c_ptr, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, row, valid, BLOCK_T: tl.constexpr,
                D: tl.constexpr, ENG: tl.constexpr, OUT: tl.constexpr, ASM: tl.constexpr):
    """Rows `row` (BLOCK_T,) of a GGUF block pool (viewed as int32 words, or uint8) -> (BLOCK_T, D) values
    in OUT (fp16 arithmetic for fp16, fp32 for bf16 / fp32), in `engine_order`'s channel order. lv_ptr:
    the format's 16-value table (`engine_levels`; unused for q8_0 / q5_x), t0..t7 its PRMT planes
    (`kernels.codebook.lut_tables`, compiled path). ENG: the format's id (module docstring)."""
    BLK: tl.constexpr = 64 if ENG == 8 else 32
    TS: tl.constexpr = (34 if ENG == 1 else 18 if ENG == 2 or ENG == 6 else 20 if ENG == 3 else 22 if ENG == 4
                        else 24 if ENG == 5 else 17 if ENG == 7 else 36)
    HDR: tl.constexpr = (2 if ENG == 1 or ENG == 2 or ENG == 6 else 4 if ENG == 3 or ENG == 8
                         else 6 if ENG == 4 else 8 if ENG == 5 else 1)
    NQ: tl.constexpr = 32 if ENG == 1 or ENG == 8 else 16
    NB: tl.constexpr = D // BLK
    MATH: tl.constexpr = tl.float16 if OUT == tl.float16 else tl.float32
    F32: tl.constexpr = OUT == tl.float32
    w = _code_words(c_ptr, row, valid, BLOCK_T, NB, TS, HDR, NQ)  # (BLOCK_T, D * 8 // NQ // ...) words
    d, mn, qh = _headers(c_ptr, row, valid, BLOCK_T, NB, TS, ENG)
    if ENG == 1:  # signed bytes: flip the sign bits, then the unsigned path with bias 128
        x = _codes_w8(w ^ 0x80808080, BLOCK_T, D, 128, MATH, ASM)
    elif ENG == 4 or ENG == 5:
        c = _q5_codes(w, qh, BLOCK_T, D, NB, TS, HDR)
        BIAS: tl.constexpr = 16 if ENG == 4 else 0
        if MATH == tl.float16:  # the exponent trick (kernels.codes): 1024 + c, exactly
            x = (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + BIAS)
        else:
            x = (c | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)
    else:
        x = lut_words(w, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, BLOCK_T, D, 4, F32, ASM and not F32).to(MATH)
    SUB: tl.constexpr = 16 if ENG == 8 else BLK  # values per scale
    x3 = tl.reshape(x, (BLOCK_T, D // SUB, SUB)) * d.to(MATH)[:, :, None]
    if ENG == 3 or ENG == 5:
        x3 = x3 + mn.to(MATH)[:, :, None]
    return tl.reshape(x3, (BLOCK_T, D)).to(OUT)
