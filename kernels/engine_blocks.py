"""GGUF blocks (`kvquant.codecs.engine`: llama.cpp's q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, ggml's mxfp4 and
nvfp4) decoded in place inside the decode kernel, from the one uint8 field `blocks` per (token, head).

A row (one token of one KV head) is NB = D / BLK blocks of TS bytes: a header (scale, min, high bits or
exponents; HDR bytes) then NQ code bytes. The kernel reads the code bytes as int32 words when the pool's rows
are whole words (RB = NB * TS a multiple of 4; every format at D >= 64 but mxfp4 at D = 64), else byte by
byte and assembles the same words. Blocks are read in units of A bytes: A = 8 where rows are whole 8-byte
words and the codes are too (RB % 8 == 0, NQ % 8 == 0, 32-blocks: q8_0, q4_0, q5_0, iq4_nl at D >= 128,
q4_1, q5_1 at D >= 64, mxfp4 at D = 256): loads 8 bytes wide; else A = 4. A block whose codes start
r = (b * TS + HDR) % A bytes past a unit (q8_0, q4_0, iq4_nl, q5_0 at A = 8: r = 2, 4, 6, 0 in turn) is read
as its NQ / 4 words from the unit before its first code byte: the r bytes there that are not its codes
(header, the previous block's last codes) are replaced by its last r code bytes, from the word (A = 4) or the
two words (A = 8) after (one more load per block and row, one select per word). So the kernel sees a block's
code bytes rotated by r: kernel byte j holds code byte (j - r) mod NQ. Codes then come out in the order the
word helpers give them (8-bit: byte order; 4-bit: byte j low nibble, then high nibble).

A row is loaded as P parts of the same shape (`_part`: NG groups of blocks times WG groups of words), each
a tile of its own: Triton lays a tile out by its contiguous words, so a whole row's (BLOCK_T, NB, NQ / 4)
tile put 16 (8 at A = 8) token rows in each thread, and every per-row cost (the page and key-mask loads,
addresses, predicates) was paid that many times; a part of 4 words a row puts 1 or 2 (q8_0 at D = 128:
1,241 SASS instructions per 64 tokens, 1,013 with 8-byte loads alone, 651 in parts; int8 605). The parts
are joined as whole runs of channels (q8_0, iq4_nl, mxfp4, nvfp4: channel C s + c of the kernel is channel
c of part s, C = D / P) or interleaved (q4_0, q4_1, q5_x: channel P c + s), whichever compiled shorter. So
kernel channel p holds an element of the row that `kvquant.kernels.layouts.engine_order` names: a fixed
permutation per format and D, which decode applies to the query and undoes on the output outside the
kernel (`KernelFrame.order`), as `-rot`'s rotation (no register shuffles inside the loop).

    id  format   BLK  TS  HDR  NQ  codes                              value
    1   q8_0     32   34   2   32  int8 (words ^ 0x80808080, bias 128)   c * d
    2   q4_0     32   18   2   16  4-bit (`kernels.codes.w32_nibbles`)   (c - 8) * d
    3   q4_1     32   20   4   16  4-bit                                 c * d + m
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

from .codebook import _join4 as join4
from .codebook import join8, lut4
from .codes import w32_bytes, w32_nibbles
from .layouts import engine_format, engine_parts

__all__ = ["engine_body"]


# a format's constants and the part shape, computed at compile time by the functions `engine_order` calls
_engine_format = triton.constexpr_function(engine_format)
_engine_parts = triton.constexpr_function(engine_parts)


@triton.jit
def _code_words(c_ptr, row, valid, BLOCK_T: tl.constexpr, NB: tl.constexpr, B0: tl.constexpr,
                NBP: tl.constexpr, K0: tl.constexpr, KW: tl.constexpr, TS: tl.constexpr, HDR: tl.constexpr,
                NQ: tl.constexpr, A: tl.constexpr):
    """Code words K0 .. K0 + KW - 1 of blocks B0 .. B0 + NBP - 1 of rows `row` (BLOCK_T,) as
    (BLOCK_T, NBP, KW) uint32, each block's rotated by its r (module docstring; A: the unit): from int32
    words when the launcher viewed the pool so, else assembled from bytes."""
    NQW: tl.constexpr = NQ // 4
    RB: tl.constexpr = NB * TS
    ALIGNED: tl.constexpr = TS % A == 0 and HDR % A == 0  # every block's codes on A-byte words
    start = (tl.arange(0, NBP) + B0) * TS + HDR  # (NBP,): each block's first code byte in its row
    r = start % A
    if c_ptr.dtype.element_ty == tl.int32:
        k = tl.arange(0, KW) + K0
        base = row[:, None] * (RB // 4) + ((start // A) * (A // 4))[None, :]  # (BLOCK_T, NBP): 1st word read
        w = tl.load(c_ptr + base[:, :, None] + k[None, None, :], mask=valid[:, None, None], other=0)
        w = w.to(tl.uint32, bitcast=True)
        if not ALIGNED and K0 == 0 and A == 8:  # the last r < 8 code bytes: from the two words after
            e = tl.arange(0, 2)
            fix = tl.load(c_ptr + (base + NQW)[:, :, None] + e[None, None, :],
                          mask=valid[:, None, None] & (r != 0)[None, :, None], other=0)
            fix = fix.to(tl.uint32, bitcast=True)  # (BLOCK_T, NBP, 2)
            n = tl.minimum(tl.maximum(r[:, None] - 4 * e[None, :], 0), 4).to(tl.uint32)  # (NBP, 2): bytes
            ones = tl.full((NBP, 2), 0xFFFFFFFF, tl.uint32)
            m = ~((ones << (4 * n)) << (4 * n))  # the n low bytes (n = 4: all; two shifts, never by 32)
            m = tl.where((tl.arange(0, KW // 2) == 0)[None, :, None], m[:, None, :], 0)  # (NBP, KW // 2, 2)
            w4 = tl.reshape(w, (BLOCK_T, NBP, KW // 2, 2))
            w4 = w4 ^ ((w4 ^ fix[:, :, None, :]) & m[None, :, :, :])  # one LOP3: the masked bytes from fix
            w = tl.reshape(w4, (BLOCK_T, NBP, KW))
        elif not ALIGNED and K0 == 0:  # the last r < 4 code bytes: the low bytes of the word after
            fix = tl.load(c_ptr + base + NQW, mask=valid[:, None] & (r != 0)[None, :], other=0)
            fix = fix.to(tl.uint32, bitcast=True)[:, :, None]
            m = (tl.full((NBP,), 1, tl.uint32) << (8 * r).to(tl.uint32)) - 1  # (NBP,): the r low bytes
            m = tl.where(k[None, :] == 0, m[:, None], 0)  # (NBP, KW): only in a block's first word
            w = w ^ ((w ^ fix) & m[None, :, :])  # one LOP3: the masked bytes from fix
    else:
        j = tl.arange(0, 4 * KW) + 4 * K0
        src = start[:, None] + (j[None, :] - r[:, None] + NQ) % NQ  # (NBP, 4 KW): kernel byte j's address
        b = tl.load(c_ptr + row[:, None, None] * RB + src[None, :, :], mask=valid[:, None, None], other=0)
        b4 = tl.reshape(b.to(tl.uint32), (BLOCK_T, NBP, KW, 4))
        w = tl.sum(b4 << (8 * tl.arange(0, 4)).to(tl.uint32)[None, None, None, :], axis=3)
    return w


@triton.jit
def _word_scales(c_ptr, row, valid, BLOCK_T: tl.constexpr, NB: tl.constexpr, B0: tl.constexpr,
                 NBP: tl.constexpr, K0: tl.constexpr, KW: tl.constexpr, TS: tl.constexpr, ENG: tl.constexpr,
                 MATH: tl.constexpr):
    """The scale (and min; zeros without one) of code words K0 .. K0 + KW - 1 of blocks B0 .. B0 + NBP - 1,
    (BLOCK_T, NBP, 1) in MATH, from each block's header (nvfp4: (BLOCK_T, NBP, KW), one per 16 values: word k
    takes sub-block k // 2); also qh (q5_x; zeros otherwise), (BLOCK_T, NBP, 1) uint32."""
    RB: tl.constexpr = NB * TS
    boff = row[:, None] * RB + ((tl.arange(0, NBP) + B0) * TS)[None, :]  # (BLOCK_T, NBP): each block's byte 0
    vm = valid[:, None]
    mn = tl.zeros((BLOCK_T, NBP, 1), MATH)
    qh = tl.zeros((BLOCK_T, NBP, 1), tl.uint32)
    if ENG == 7:  # E8M0 exponent byte: 2^(e - 128) as fp32 bits (e < 2: a subnormal)
        e = tl.load(c_ptr.to(tl.pointer_type(tl.uint8)) + boff, mask=vm, other=0).to(tl.int32)
        d = tl.where(e < 2, (e * 0 + 0x00200000) << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        d = d.to(MATH)[:, :, None]
    elif ENG == 8:  # UE4M3 per sub-block: E4M3 without its sign (fp16 bits << 7, times 2^8), halved
        SW: tl.constexpr = KW // 2 if KW >= 2 else 1  # sub-blocks of words K0 .. K0 + KW - 1
        s = tl.arange(0, SW) + K0 // 2
        u = tl.load(c_ptr.to(tl.pointer_type(tl.uint8)) + boff[:, :, None] + s[None, None, :],
                    mask=vm[:, :, None], other=0).to(tl.int32)
        h = ((u & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 128.0
        d = tl.where(u == 0x7F, 0.0, h).to(MATH)  # (BLOCK_T, NBP, SW)
        if KW >= 2:
            d = tl.reshape(tl.join(d, d), (BLOCK_T, NBP, KW))  # word k: sub-block k // 2
    else:  # fp16 d at byte 0 (TS even: halves), then m (q4_1, q5_1) and the 32 high bits qh (q5_x)
        hp = c_ptr.to(tl.pointer_type(tl.float16))
        hoff = boff // 2
        d = tl.load(hp + hoff, mask=vm, other=0.0).to(MATH)[:, :, None]
        if ENG == 3 or ENG == 5:
            mn = tl.load(hp + hoff + 1, mask=vm, other=0.0).to(MATH)[:, :, None]
        if ENG == 4 or ENG == 5:
            up = c_ptr.to(tl.pointer_type(tl.uint16))
            q0: tl.constexpr = 1 if ENG == 4 else 2
            lo = tl.load(up + hoff + q0, mask=vm, other=0).to(tl.uint32)
            qh = (lo | (tl.load(up + hoff + q0 + 1, mask=vm, other=0).to(tl.uint32) << 16))[:, :, None]
    return d, mn, qh


@triton.jit
def _high_bit(qh, B0: tl.constexpr, NBP: tl.constexpr, K0: tl.constexpr, KW: tl.constexpr, TS: tl.constexpr,
              HDR: tl.constexpr, A: tl.constexpr, i: tl.constexpr):
    """16 x bit 4 of q5_x's code i of each word (BLOCK_T, NBP, KW): kernel byte 4k + i // 2 of block b holds
    element ((4k + i // 2 - r_b) mod 16) + 16 (i % 2), whose high bit is that bit of qh."""
    r = ((tl.arange(0, NBP) + B0) * TS + HDR) % A
    e = ((4 * (tl.arange(0, KW) + K0) + i // 2)[None, :] - r[:, None] + 16) % 16 + 16 * (i % 2)  # (NBP, KW)
    return ((qh >> e.to(tl.uint32)[None, :, :]) & 1) << 4


@triton.jit
def _q5(w, qh, i: tl.constexpr, B0: tl.constexpr, NBP: tl.constexpr, K0: tl.constexpr, KW: tl.constexpr,
        TS: tl.constexpr, HDR: tl.constexpr, A: tl.constexpr, MATH: tl.constexpr):
    """2^m + the 5-bit code i of each word, exactly (the exponent trick on nibble | high bit)."""
    c = ((w >> (4 * i)) & 15) | _high_bit(qh, B0, NBP, K0, KW, TS, HDR, A, i)
    if MATH == tl.float16:
        out = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        out = (c | 0x4B000000).to(tl.float32, bitcast=True)
    return out


@triton.jit
def _parts(w, qh, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, B0: tl.constexpr, NBP: tl.constexpr,
           K0: tl.constexpr, KW: tl.constexpr, TS: tl.constexpr, HDR: tl.constexpr, A: tl.constexpr,
           ENG: tl.constexpr, MATH: tl.constexpr, F32: tl.constexpr, ASM: tl.constexpr):
    """The eight values of each 4-bit code word, in MATH, before the scale: table formats their level,
    q4_x / q5_x 2^m + code (the caller removes 2^m + bias)."""
    if ENG == 2 or ENG == 3:
        a = w32_nibbles(w, MATH, ASM)
    elif ENG == 4 or ENG == 5:
        a = (_q5(w, qh, 0, B0, NBP, K0, KW, TS, HDR, A, MATH),
             _q5(w, qh, 1, B0, NBP, K0, KW, TS, HDR, A, MATH),
             _q5(w, qh, 2, B0, NBP, K0, KW, TS, HDR, A, MATH),
             _q5(w, qh, 3, B0, NBP, K0, KW, TS, HDR, A, MATH),
             _q5(w, qh, 4, B0, NBP, K0, KW, TS, HDR, A, MATH),
             _q5(w, qh, 5, B0, NBP, K0, KW, TS, HDR, A, MATH),
             _q5(w, qh, 6, B0, NBP, K0, KW, TS, HDR, A, MATH),
             _q5(w, qh, 7, B0, NBP, K0, KW, TS, HDR, A, MATH))
    else:
        a = lut4(w, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, F32, ASM and not F32)
    return a


@triton.jit
def _scaled(a, d, mn, B: tl.constexpr, MIN: tl.constexpr):
    """(a - B) * d (+ mn): B removes the exponent trick's 2^m and the code offset, exactly."""
    x = (a.to(d.dtype) - B) * d
    if MIN:
        x = x + mn
    return x


@triton.jit
def _part(c_ptr, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, row, valid, BLOCK_T: tl.constexpr, ENG: tl.constexpr,
          BLK: tl.constexpr, TS: tl.constexpr, HDR: tl.constexpr, NQ: tl.constexpr, NB: tl.constexpr,
          A: tl.constexpr, NG: tl.constexpr, WG: tl.constexpr, S: tl.constexpr, MATH: tl.constexpr,
          F32: tl.constexpr, ASM: tl.constexpr):
    """Part S of the rows (`engine_body`): code words K0 .. K0 + KW - 1 of blocks B0 .. B0 + NBP - 1 ->
    (BLOCK_T, NBP * KW * values per word) values in MATH, block by block, then word by word."""
    NBP: tl.constexpr = NB // NG
    KW: tl.constexpr = NQ // 4 // WG
    B0: tl.constexpr = (S // WG) * NBP
    K0: tl.constexpr = (S % WG) * KW
    w = _code_words(c_ptr, row, valid, BLOCK_T, NB, B0, NBP, K0, KW, TS, HDR, NQ, A)  # (BLOCK_T, NBP, KW)
    d, mn, qh = _word_scales(c_ptr, row, valid, BLOCK_T, NB, B0, NBP, K0, KW, TS, ENG, MATH)
    MIN: tl.constexpr = ENG == 3 or ENG == 5
    if ENG == 1:  # signed bytes: flip the sign bits, then 2^m + 128 + code
        B8: tl.constexpr = 1152.0 if MATH == tl.float16 else 8388736.0
        c0, c1, c2, c3 = w32_bytes(w ^ 0x80808080, MATH, ASM)
        x = join4(_scaled(c0, d, mn, B8, False), _scaled(c1, d, mn, B8, False), _scaled(c2, d, mn, B8, False),
                  _scaled(c3, d, mn, B8, False))  # [.., k, a, b] = byte 2a + b of word k
    else:
        a0, a1, a2, a3, a4, a5, a6, a7 = _parts(w, qh, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, B0, NBP, K0,
                                                KW, TS, HDR, A, ENG, MATH, F32, ASM)
        BIAS: tl.constexpr = 8 if ENG == 2 else 16 if ENG == 4 else 0
        TWO: tl.constexpr = 1024.0 if MATH == tl.float16 else 8388608.0
        B: tl.constexpr = TWO + BIAS if ENG <= 5 else 0.0  # table formats: the level itself
        x = join8(_scaled(a0, d, mn, B, MIN), _scaled(a1, d, mn, B, MIN), _scaled(a2, d, mn, B, MIN),
                  _scaled(a3, d, mn, B, MIN), _scaled(a4, d, mn, B, MIN), _scaled(a5, d, mn, B, MIN),
                  _scaled(a6, d, mn, B, MIN), _scaled(a7, d, mn, B, MIN))  # [.., k, x, y, z] = code 4x+2y+z
    return tl.reshape(x, (BLOCK_T, NB * BLK // (NG * WG)))


@triton.jit
def engine_body(c_ptr, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, row, valid, BLOCK_T: tl.constexpr,
                D: tl.constexpr, ENG: tl.constexpr, OUT: tl.constexpr, ASM: tl.constexpr):
    """Rows `row` (BLOCK_T,) of a GGUF block pool (viewed as int32 words, or uint8) -> (BLOCK_T, D) values
    in OUT (fp16 arithmetic for fp16, fp32 for bf16 / fp32), in `engine_order`'s channel order. lv_ptr:
    the format's 16-value table (`engine_levels`; unused for q8_0, q4_x, q5_x), t0..t7 its PRMT planes
    (`kernels.codebook.lut_tables`, compiled path). ENG: the format's id (module docstring). Each code
    word is scaled where it was decoded, with its own copy of its block's scale. The row is read in
    P = NG * WG parts (module docstring; `kvquant.kernels.layouts.engine_parts`): q8_0, iq4_nl, mxfp4 in
    WG = 4 groups of words of every block (2 where 4 would split an A-byte unit), nvfp4 a block a part (up to
    4), q4_x, q5_x 2 groups of blocks x 2 of words."""
    FMT: tl.constexpr = _engine_format(ENG)  # (block, type_size, header, code bytes): ENGINE_KERNEL_FORMATS
    BLK: tl.constexpr = FMT[0]
    TS: tl.constexpr = FMT[1]
    HDR: tl.constexpr = FMT[2]
    NQ: tl.constexpr = FMT[3]
    NB: tl.constexpr = D // BLK
    PARTS: tl.constexpr = _engine_parts(ENG, NB, TS, NQ, BLK)  # (unit of reads, parts, their join)
    A: tl.constexpr = PARTS[0]
    NG: tl.constexpr = PARTS[1]
    WG: tl.constexpr = PARTS[2]
    RUNS: tl.constexpr = PARTS[3]
    P: tl.constexpr = NG * WG  # 1, 2 or 4
    MATH: tl.constexpr = tl.float16 if OUT == tl.float16 else tl.float32
    F32: tl.constexpr = OUT == tl.float32
    x = _part(c_ptr, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, row, valid, BLOCK_T, ENG, BLK, TS, HDR, NQ, NB,
              A, NG, WG, 0, MATH, F32, ASM)
    if P >= 2:  # [.., c, i] = channel c of part i P / 2
        x = tl.join(x, _part(c_ptr, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, row, valid, BLOCK_T, ENG, BLK, TS,
                             HDR, NQ, NB, A, NG, WG, P // 2, MATH, F32, ASM))
        if P == 4:  # [.., c, i, j] = channel c of part 2 i + j
            x1 = _part(c_ptr, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, row, valid, BLOCK_T, ENG, BLK, TS, HDR,
                       NQ, NB, A, NG, WG, 1, MATH, F32, ASM)
            x3 = _part(c_ptr, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, row, valid, BLOCK_T, ENG, BLK, TS, HDR,
                       NQ, NB, A, NG, WG, 3, MATH, F32, ASM)
            x = tl.join(x, tl.join(x1, x3))
        # so channel P c + s holds channel c of part s
        if RUNS:  # runs of channels: C s + c
            x = tl.permute(tl.reshape(x, (BLOCK_T, D // P, P)), (0, 2, 1))
    return tl.reshape(x, (BLOCK_T, D)).to(OUT)
