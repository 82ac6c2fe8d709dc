"""Packed codes -> floats inside the decode kernel, exactly: the exponent trick for integer codes (OR a code
into the mantissa of 2^m, subtract 2^m + bias: no I2F), float8 bytes to fp16, and the unpacking of 2/3/4/8-bit
codes.

Compiled (ASM), four codes of one 32-bit register become two half2 registers with one PRMT each (8-bit codes;
plus a LOP3 for a nibble), through inline PTX; the interpreter, which cannot run PTX, takes Triton's generic
path (shifts and masks), which gives the same bits. Used by `kernels.decode_attention` (affine and FP8 bodies)
and `kernels.engine_blocks` (the GGUF blocks' codes).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["NIB8_ASM", "_code_ints", "_codes", "_codes_w8", "_fp8_byte_f16", "_fp8_w8", "_u8_to_f16",
           "_w32_fp8_to_f16x4", "_w32_to_f16x4", "w32_bytes", "w32_nibbles"]


@triton.jit
def _u8_to_f16(p, SHIFT: tl.constexpr, ASM: tl.constexpr):
    """uint8 (any shape) -> fp16 holding 1024 + (p >> SHIFT) & (255 >> SHIFT) exactly (SHIFT 0 or 4; 0 with
    a 4-bit mask when SHIFT is 4 and the low nibble is wanted: see _codes).

    The exponent trick: OR-ing an 8-bit value into the mantissa of 1024.0 (0x6400) gives 1024 + value.
    Compiled (ASM), four bytes of one register become two half2 registers with one PRMT each (and a LOP3
    for a nibble), where Triton's generic path extracts and re-packs every byte (two PRMTs per value); the
    interpreter, which cannot run PTX, takes the generic path, bit for bit the same values."""
    if ASM:
        if SHIFT == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 m; mov.b32 m, 0x64646464; "
                "prmt.b32 $0, $2, m, 0x5140; prmt.b32 $1, $2, m, 0x7362; }",
                "=r,=r,r", [p], dtype=tl.float16, is_pure=True, pack=4)
        elif SHIFT == 4:  # high nibbles: 64 + n/16 * 16 ... scaled so that the result is 1024 + n
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1; prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342; "
                "shr.b32 t0, t0, 4; shr.b32 t1, t1, 4; "
                "lop3.b32 $0, t0, 0x000f000f, 0x64006400, 0xea; "
                "lop3.b32 $1, t1, 0x000f000f, 0x64006400, 0xea; }",
                "=r,=r,r", [p], dtype=tl.float16, is_pure=True, pack=4)
        else:  # low nibbles
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1; prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342; "
                "lop3.b32 $0, t0, 0x000f000f, 0x64006400, 0xea; "
                "lop3.b32 $1, t1, 0x000f000f, 0x64006400, 0xea; }",
                "=r,=r,r", [p], dtype=tl.float16, is_pure=True, pack=4)
    else:
        w = p.to(tl.uint16)
        if SHIFT == 4:
            w = w >> 4
        elif SHIFT == 5:
            w = w & 15
        return (w | 0x6400).to(tl.float16, bitcast=True)


@triton.jit
def _w32_to_f16x4(w, ASM: tl.constexpr):
    """int32 words (any shape) -> four fp16 tensors of that shape, byte k of each word as 1024 + byte k.

    Compiled (ASM): two PRMTs per word (0x64 into the high byte of each half), the halves of the two
    results handed out as 16-bit registers; a word-sized load keeps the four codes in the register they
    arrived in, where a uint8 load is split into bytes and packed again (three PRMTs and two LOP3s per
    word more). The interpreter extracts the bytes with shifts, bit for bit the same values."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 m, t0, t1; mov.b32 m, 0x64646464; prmt.b32 t0, $4, m, 0x5140; "
            "prmt.b32 t1, $4, m, 0x7362; mov.b32 {$0, $1}, t0; mov.b32 {$2, $3}, t1; }",
            "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
            pack=1)
    else:
        c0 = ((w & 255) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        c1 = (((w >> 8) & 255) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        c2 = (((w >> 16) & 255) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        c3 = (((w >> 24) & 255) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        return c0, c1, c2, c3


# the 4-bit codes of four bytes as bf16 128 + code (bf16 0x4300 = 128, ulp 1 up to 256): `_u8_to_f16`'s
# nibble PTX with bf16's exponent byte; outputs (code of byte 0, byte 1) and (byte 2, byte 3) as bf16x2
NIB_BF16_LO_ASM = ("{ .reg .b32 t0, t1; prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342; "
                   "lop3.b32 $0, t0, 0x000f000f, 0x43004300, 0xea; "
                   "lop3.b32 $1, t1, 0x000f000f, 0x43004300, 0xea; }")
NIB_BF16_HI_ASM = ("{ .reg .b32 t0, t1; prmt.b32 t0, $2, 0, 0x4140; prmt.b32 t1, $2, 0, 0x4342; "
                   "shr.b32 t0, t0, 4; shr.b32 t1, t1, 4; "
                   "lop3.b32 $0, t0, 0x000f000f, 0x43004300, 0xea; "
                   "lop3.b32 $1, t1, 0x000f000f, 0x43004300, 0xea; }")
_NIB_BF16_LO: tl.constexpr = tl.constexpr(NIB_BF16_LO_ASM)
_NIB_BF16_HI: tl.constexpr = tl.constexpr(NIB_BF16_HI_ASM)


@triton.jit
def _u8_nib_bf16(p, HIGH: tl.constexpr):
    """uint8 (any shape) -> bf16 128 + (p's low or high nibble), exactly; compiled only (the interpreter has
    no bf16 arithmetic: its bf16 attention takes the fp32 path)."""
    if HIGH:
        out = tl.inline_asm_elementwise(_NIB_BF16_HI, "=r,=r,r", [p], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        out = tl.inline_asm_elementwise(_NIB_BF16_LO, "=r,=r,r", [p], dtype=tl.bfloat16, is_pure=True, pack=4)
    return out


@triton.jit
def _codes(p, BLOCK_T: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, BIAS: tl.constexpr,
           OUT: tl.constexpr, ASM: tl.constexpr):
    """(BLOCK_T, D * BITS // 8) packed bytes -> (BLOCK_T, D) in OUT holding code - BIAS exactly.

    Byte j holds codes per*j .. per*j+per-1, lowest bits first (codecs.packing). Integer -> float by the
    exponent trick instead of a (quarter-rate) I2F: OR-ing a code c into the mantissa of 2^m gives the
    float 2^m + c (fp16: 0x6400 = 1024; fp32: 0x4B000000 = 2^23, for bf16 too), and one
    subtraction of 2^m + BIAS, exact, leaves c - BIAS (BIAS: a symmetric spec's code offset, else 0)."""
    if OUT == tl.float16 and BITS == 8:
        return _u8_to_f16(p, 0, ASM) - (1024.0 + BIAS)
    elif OUT == tl.bfloat16 and BITS == 4 and ASM:  # bf16x2 arithmetic from here on (compiled only)
        lo = _u8_nib_bf16(p, False)
        hi = _u8_nib_bf16(p, True)
        return tl.reshape(tl.join(lo, hi), (BLOCK_T, D)) - (128.0 + BIAS)
    elif OUT == tl.float16 and BITS == 4:
        lo = _u8_to_f16(p, 5, ASM)
        hi = _u8_to_f16(p, 4, ASM)
        return tl.reshape(tl.join(lo, hi), (BLOCK_T, D)) - (1024.0 + BIAS)  # [.., j, i] = code 2j + i
    if BITS == 8:
        c = p.to(tl.uint32)
    elif BITS == 4:
        w = p.to(tl.uint32)
        c = tl.reshape(tl.join(w & 15, w >> 4), (BLOCK_T, D))  # [.., j, i] = code 2j + i
    else:
        # join appends a last axis: join(join(c0, c2), join(c1, c3))[.., j, a, c] = code 4j + 2a + c
        w = p.to(tl.uint32)
        c0, c1, c2, c3 = w & 3, (w >> 2) & 3, (w >> 4) & 3, w >> 6
        c = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (BLOCK_T, D))
    if OUT == tl.float16:
        return (c.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + BIAS)
    else:  # bf16 and fp32 go through fp32 (the interpreter cannot bitcast to bf16; one F2FP per pair)
        return ((c | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)).to(OUT)


@triton.jit
def _codes_w8(p, BLOCK_T: tl.constexpr, D: tl.constexpr, BIAS: tl.constexpr, OUT: tl.constexpr,
              ASM: tl.constexpr):
    """int32 words (BLOCK_T, D // 4) of 8-bit codes (the pool viewed as int32; byte k of word j = code
    4j + k) -> (BLOCK_T, D) in OUT holding code - BIAS exactly, as `_codes`."""
    # join(join(c0, c2), join(c1, c3))[.., j, a, b] = c_{2a+b} = code 4j + 2a + b
    if OUT == tl.float16:
        c0, c1, c2, c3 = _w32_to_f16x4(p, ASM)
        x = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (BLOCK_T, D)) - (1024.0 + BIAS)
    else:
        w0, w1, w2, w3 = p & 255, (p >> 8) & 255, (p >> 16) & 255, (p >> 24) & 255
        c = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_T, D))
        x = ((c | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)).to(OUT)
    return x


# eight 4-bit codes of a word -> four half2 registers (1024 + code each): two PRMTs spread bytes 0-1 and 2-3
# into 16-bit lanes, a LOP3 per low-nibble pair, a shift and a LOP3 per high-nibble pair; outputs $0..$7
# are codes 0..7 (code i at bits 4i). Modelled instruction by instruction in test_engine_kernel.py.
NIB8_ASM = (
    "{ .reg .b32 t0, t1, u0, u1; prmt.b32 t0, $8, 0, 0x4140; prmt.b32 t1, $8, 0, 0x4342; "
    "lop3.b32 u0, t0, 0x000f000f, 0x64006400, 0xea; shr.b32 t0, t0, 4; "
    "lop3.b32 t0, t0, 0x000f000f, 0x64006400, 0xea; "
    "lop3.b32 u1, t1, 0x000f000f, 0x64006400, 0xea; shr.b32 t1, t1, 4; "
    "lop3.b32 t1, t1, 0x000f000f, 0x64006400, 0xea; "
    "mov.b32 {$0, $2}, u0; mov.b32 {$1, $3}, t0; mov.b32 {$4, $6}, u1; mov.b32 {$5, $7}, t1; }"
)
_NIB8: tl.constexpr = tl.constexpr(NIB8_ASM)


@triton.jit
def _nib_f16(w, i: tl.constexpr):
    return (((w >> (4 * i)) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def w32_nibbles(w, OUT: tl.constexpr, ASM: tl.constexpr):
    """uint32 words (any shape) of eight 4-bit codes (code i at bits 4i) -> eight tensors of w's shape holding
    2^m + code i exactly: fp16 1024 + c (OUT fp16; `NIB8_ASM` when compiled) or fp32 2^23 + c."""
    if OUT == tl.float16:
        if ASM:
            out = tl.inline_asm_elementwise(_NIB8, "=h,=h,=h,=h,=h,=h,=h,=h,r", [w],
                                            dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            out = (_nib_f16(w, 0), _nib_f16(w, 1), _nib_f16(w, 2), _nib_f16(w, 3), _nib_f16(w, 4),
                   _nib_f16(w, 5), _nib_f16(w, 6), _nib_f16(w, 7))
    else:
        out = (_nib_f32(w, 0), _nib_f32(w, 1), _nib_f32(w, 2), _nib_f32(w, 3), _nib_f32(w, 4), _nib_f32(w, 5),
               _nib_f32(w, 6), _nib_f32(w, 7))
    return out


@triton.jit
def _nib_f32(w, i: tl.constexpr):
    return (((w >> (4 * i)) & 15) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def w32_bytes(w, OUT: tl.constexpr, ASM: tl.constexpr):
    """uint32 words (any shape) -> four tensors of w's shape holding 2^m + byte k exactly (fp16 1024 + b
    through `_w32_to_f16x4`, or fp32 2^23 + b)."""
    if OUT == tl.float16:
        out = _w32_to_f16x4(w, ASM)
    else:
        out = (((w & 255) | 0x4B000000).to(tl.float32, bitcast=True),
               (((w >> 8) & 255) | 0x4B000000).to(tl.float32, bitcast=True),
               (((w >> 16) & 255) | 0x4B000000).to(tl.float32, bitcast=True),
               ((w >> 24) | 0x4B000000).to(tl.float32, bitcast=True))
    return out


@triton.jit
def _fp8_byte_f16(b, FMT: tl.constexpr):
    """Bytes b (int32, 0..255) holding float8 bits -> fp16 of the same value, exactly (the generic path).
    E5M2 is the top byte of an fp16 (the same exponent), so b << 8. E4M3 (bias 7, no Inf, 0x7F/0xFF NaN):
    sign to bit 15, exponent and mantissa shifted into fp16's fields (b & 0x7F) << 7, which reads the
    value divided by 2^8 (fp16's bias is 15), subnormals included; times 256 is exact."""
    if FMT == 2:
        return (b << 8).to(tl.int16).to(tl.float16, bitcast=True)
    h = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True) * 256.0
    return tl.where((b & 0x7F) == 0x7F, float("nan"), h)


@triton.jit
def _w32_fp8_to_f16x4(w, FMT: tl.constexpr, ASM: tl.constexpr):
    """int32 words (any shape) of four float8 codes -> four fp16 tensors of that shape, byte k of each word
    as the value of float8 code k, exactly. Compiled (ASM): E4M3 with two `cvt.rn.f16x2.e4m3x2` per word
    (sm_89+: one instruction per two codes, NaN kept); E5M2 with two PRMTs (each code to the high byte of
    an fp16, zeros below), no arithmetic at all. The interpreter takes `_fp8_byte_f16` (same values)."""
    if ASM:
        if FMT == 2:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1; prmt.b32 t0, $4, 0, 0x1404; prmt.b32 t1, $4, 0, 0x3424; "
                "mov.b32 {$0, $1}, t0; mov.b32 {$2, $3}, t1; }",
                "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
                pack=1)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; .reg .b32 t0, t1; mov.b32 {lo, hi}, $4; "
                "cvt.rn.f16x2.e4m3x2 t0, lo; cvt.rn.f16x2.e4m3x2 t1, hi; "
                "mov.b32 {$0, $1}, t0; mov.b32 {$2, $3}, t1; }",
                "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
                pack=1)
    else:
        return (_fp8_byte_f16(w & 255, FMT), _fp8_byte_f16((w >> 8) & 255, FMT),
                _fp8_byte_f16((w >> 16) & 255, FMT), _fp8_byte_f16((w >> 24) & 255, FMT))


@triton.jit
def _fp8_w8(p, BLOCK_T: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr, OUT: tl.constexpr,
            ASM: tl.constexpr):
    """int32 words (BLOCK_T, D // 4) of float8 codes (FMT 1: E4M3, 2: E5M2; byte k of word j = code
    4j + k) -> (BLOCK_T, D) in OUT (fp16, or fp32 for bf16/fp32 math) holding the codes' values exactly."""
    c0, c1, c2, c3 = _w32_fp8_to_f16x4(p, FMT, ASM)
    # join(join(c0, c2), join(c1, c3))[.., j, a, b] = c_{2a+b} = code 4j + 2a + b
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (BLOCK_T, D)).to(OUT)


@triton.jit
def _code_ints(c_ptr, row, valid, BLOCK_T: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
               RS: tl.constexpr = 0):
    """The packed codes of rows `row` (BLOCK_T,) of a code pool -> (BLOCK_T, D) uint32 codes (packing):
    2 / 4 / 8 bits lowest bits first within a byte; 3 bits 8 codes per 24-bit little-endian unit of 3 bytes,
    loaded as three (BLOCK_T, D // 8) byte tiles (a row of 3 D / 8 bytes is not a power of two wide).
    RS: bytes per row when the codes are the head of a longer row (a TurboQuant slot), else 0.
    (One return at the end: the compiler also walks the statements after a constexpr branch's return.)"""
    if BITS == 3:
        U: tl.constexpr = D // 8
        R3: tl.constexpr = RS if RS > 0 else 3 * U
        base = row[:, None] * R3 + 3 * tl.arange(0, U)[None, :]  # (BLOCK_T, U): first byte of each unit
        w = tl.load(c_ptr + base, mask=valid[:, None], other=0).to(tl.uint32)
        w = w | (tl.load(c_ptr + base + 1, mask=valid[:, None], other=0).to(tl.uint32) << 8)
        w = w | (tl.load(c_ptr + base + 2, mask=valid[:, None], other=0).to(tl.uint32) << 16)
        c0, c1, c2, c3 = w & 7, (w >> 3) & 7, (w >> 6) & 7, (w >> 9) & 7
        c4, c5, c6, c7 = (w >> 12) & 7, (w >> 15) & 7, (w >> 18) & 7, w >> 21
        # [.., u, x, y, z] = code 8u + 4x + 2y + z: the innermost join is x, the outermost z
        c = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    else:
        PER: tl.constexpr = 8 // BITS
        COLS: tl.constexpr = D // PER
        RC: tl.constexpr = RS if RS > 0 else COLS
        p = tl.load(c_ptr + row[:, None] * RC + tl.arange(0, COLS)[None, :], mask=valid[:, None], other=0)
        w = p.to(tl.uint32)
        if BITS == 8:
            c = w
        elif BITS == 4:
            c = tl.join(w & 15, w >> 4)  # [.., j, i] = code 2j + i
        else:  # [.., j, a, c] = code 4j + 2a + c
            c = tl.join(tl.join(w & 3, (w >> 4) & 3), tl.join((w >> 2) & 3, w >> 6))
    return tl.reshape(c, (BLOCK_T, D))
