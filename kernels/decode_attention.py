"""Decode attention over a paged quantized layer, read in place: `decode_attention` (Triton) and its twin
`decode_attention_ref` (PyTorch: gather the pages, decode with the codec, attend in fp32 or query's dtype).

Storage (per decoder layer; vLLM's layout, `block_size` BS tokens per page):

    fp_k, fp_v          (P_fp, H_kv, BS, D) model dtype      sink and recent-window tokens
    key_pages[name]     (P_b, heads_f, BS // tokens_f, cols_f)   one pool per codec field (codecs.base);
    value_pages[name]   K and V body pages share page ids       affine: codes/scale/zero; dense: values

A region (`.table` (B, n_pages) int64 page ids in position order, `.offset` slot of its first token in its
first page, `.length` tokens, equal for all sequences) says where tokens live: token r of a region sits in
page table[b, (offset + r) // BS], slot (offset + r) % BS; its scale row is slot // token_extent. A layer
holds three regions in position order: sink (FP pool), body (body pools), recent (FP pool).

One new query token per sequence attends to sink | body | recent without materializing dequantized K/V.
Flash-decoding: the token axis is cut into splits; each program computes an unnormalized partial (running
max m, sum l, accumulator acc) for one split of one (sequence, KV head), reading either body pages (codes
through the block table) or FP pages (sink then recent, one table lookup per token, two pointers); a
reduce kernel merges the splits in tiles of 32. GQA: one program serves the H_q / H_kv query heads of its
KV head, so every stored byte is read once per step.

Inside a program, each block of 64 or 128 tokens (`_block_tokens`: compiled, 128 where it spills nothing and
issues fewer instructions per token) is cut into W slabs of 16 or 32 tokens, one per warp, each with its own
running max and sum (merged once, after the loop): no softmax statistic crosses a warp inside the loop (no
shared-memory round trip, no barrier for them). The output is accumulated transposed, V^T P^T, so the query
heads (padded to 8) are the narrow side of the MMA. Scale folding: a per-token scale and zero (int8,
int4/int2 per token) never touch the elements: q.(c s + z) = (q.c) s + z sum(q) on the scores, and sum_t p_t
(c_t s_t + z_t) = sum_t (p_t s_t) c_t + sum_t p_t z_t on the probabilities. Group-wise scales are loaded as
(tokens, groups) tiles, channel-wise ones as the block's BLOCK_T // TE scale rows, and broadcast (one HFMA2
per pair). Codes become fp16 by the exponent trick (0x6400 | c = 1024 + c); compiled, four codes go to two
half2 registers with one PRMT (8-bit) or PRMT+LOP3 (4-bit) each, through inline PTX; the interpreter cannot
run PTX and takes Triton's generic path, which gives the same bits. 8-bit code pools are read as int32 words
(the launcher views them so): a uint8 load would be split into bytes and packed again for the PRMT (about
230 more instructions per 64 tokens at D=128).

Masking: key_mask (B, T) bool, True = attend, positions in sink | body | recent order; each program loads
the mask bytes of its token block, so nothing is checked on the host (no device->host sync). A sequence
with no attended token gets a zero output, as torch SDPA's math path gives for an all-False bool row.

Rotated codecs (`-rot`, `kvquant.codecs.transforms.kernel_frame`): body keys are stored as codes of R_k k
and body values decode to R_v v, so `decode_attention` serves them with the same kernel in the rotated
frame: (R_k q).(R_k k) = q.k, and sum_j p_j v_j = R_v^T sum_j p_j (R_v v_j). It rotates the query by R_k,
gives the kernel rotated copies of the FP sink and window pages (R_k k, R_v v; a small pool of just the
pages those two regions use, their tables renumbered into it) so the whole softmax runs in one frame, and
un-rotates the output by R_v^T; K and V each only when their codec rotates, each with its own signs. All
of it is `fwht` (O(D log D) per token) on the device: no dense matrix, no host sync. Any other frame
(`KernelFrame`: `-crot`'s dense M, llama.cpp's blockwise Hadamard and a GGUF format's channel order,
`kernels.layouts.decode_frame`) takes the same path: query and FP copies into the frame, output out of it.
The alternative, the kernel returning the body's partial output and log-sum-exp apart for a merge with an
unrotated torch pass over sink and window, would need a second output format of the kernel for the same
work.

Compilation: every length, offset, split count and table/mask stride is `do_not_specialize`, so one
variant per (codecs, head_dim, dtype, GQA group, parts present) serves a whole decode; pool strides stay
specialised (they are fixed for a pool's life and their alignment buys vector loads). A variant that
cannot be built on the device (shared memory, registers, ptxas) is refused once by the
`kvquant.kernels.registry.KernelRegistry` that launched it; `decode_attention` then returns None.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvquant.codecs.transforms import KernelFrame

from .codebook import _level, lut_tables, lut_words, words_ok
from .codes import _code_ints, _codes, _codes_w8, _fp8_byte_f16, _fp8_w8  # noqa: F401 (tests import them here)
from .engine_blocks import engine_body
from .layouts import (
    EngineKernelLayout,
    SignedInt8KernelLayout,
    SlotKernelLayout,
    decode_frame,
    decode_layout,
    decode_parts,
    device_levels,
    engine_levels,
    rope_table,
    slot_levels,
)
from .registry import KernelRegistry, default_registry

__all__ = ["decode_attention", "decode_attention_ref", "gather_region", "BLOCK_T", "WIDE_BLOCK_T"]

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_T = 64  # tokens per loop iteration: the interpreter's, D = 256's, and the fallback
WIDE_BLOCK_T = 128  # compiled, D <= 128, where it spills nothing and costs less (_block_tokens)
WIDE_GAIN = 0.95  # ... at most this many instructions per token of 64's: twice the shared memory must pay
SPLIT_BLOCK = 32  # splits merged per reduce iteration (a constant, so the split count never recompiles)

# runtime integers that change during a decode: never part of the compiled variant
_SPLIT_DNS = ["S", "R", "R_OFF", "T_BODY", "B_OFF", "B_START", "N_BODY_SPLITS", "NSPLIT", "BODY_CHUNK",
              "FP_CHUNK", "s_stb", "s_stn", "s_rtb", "s_rtn", "s_btb", "s_btn",
              "s_mb"]  # s_mt: 1 for every (B, T) mask
_REDUCE_DNS = ["NSPLIT", "s_ob"]


# ----------------------------------------------------------------------------------------------- jit


@triton.jit
def _stat(ptr, offs, mask, SYM: tl.constexpr, BITS: tl.constexpr, OUT: tl.constexpr, IS_ZERO: tl.constexpr,
          FMT: tl.constexpr = 0, LUT: tl.constexpr = False):
    """A scale (divided by qmax when symmetric integer, in fp32) or zero, loaded and cast to OUT; an FP8
    scale (FMT > 0) or a codebook's (LUT: absmax or half range) is the stored one as it is."""
    x = tl.load(ptr + offs, mask=mask, other=0.0)
    if SYM and not IS_ZERO and FMT == 0 and not LUT:
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
        x = x.to(tl.float32) * (1.0 / QMAX)
    return x.to(OUT)


@triton.jit
def _runtime_zero(n):
    """0 for any int32 n >= 0 (a token count), as a value the compiler cannot prove constant.

    For `_load_body`'s codebook planes: ptxas keeps planes it knows are uniform in uniform registers and
    copies them into a regular register before every PRMT lookup (124 copies per 128 tokens of
    `nuq3-g64`); planes OR-ed with this zero stay in regular registers. Measured on sm_90 SASS (SASS
    instructions per 64 tokens; docs/kernels.md), it pays only at D = 128 with 128-token blocks:
    `nuq4-g64` 806 -> 685, `nuq3-g64` 710 -> 685, iq4_nl 852 -> 800, mxfp4 916 -> 796 (fp16); at D = 64
    and 256 and at 64-token blocks it compiles longer (`nuq4-g64` at D = 64 401 -> 432, iq4_nl at D = 256
    801 -> 899). Where it is applied is what compiled shortest: OR-ed per row for 4-bit codes, per 12-byte
    group for 3-bit ones but fp16 attention with one scale per token (`nuq3`: 678 -> 691 with it), not for
    2-bit ones; the GGUF tables of iq4_nl and mxfp4 per row in fp16 attention only (not in bf16, nor
    nvfp4's: 894 -> 930)."""
    return n >> 31


@triton.jit
def _opaque_planes(tab, zz, N: tl.constexpr):
    """The eight PRMT planes `tab` with the first N (4 or 8) OR-ed with zz, a `_runtime_zero` shaped as the
    tile each lookup runs over (per row, per 12-byte group): the planes a lookup then takes."""
    t0, t1, t2, t3, t4, t5, t6, t7 = tab
    t0, t1, t2, t3 = t0 | zz, t1 | zz, t2 | zz, t3 | zz
    if N == 8:
        t4, t5, t6, t7 = t4 | zz, t5 | zz, t6 | zz, t7 | zz
    return t0, t1, t2, t3, t4, t5, t6, t7


@triton.jit
def _load_body(
    c_ptr, s_ptr, z_ptr, lv_ptr, o_ptr, ov_ptr, oi_ptr, tab, pg, slot, h, valid, tab_row, s_btn, t0, hi,
    B_OFF,
    H_KV: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr,
    SYM: tl.constexpr, TE: tl.constexpr, CE: tl.constexpr, SHARED: tl.constexpr, IDX64: tl.constexpr,
    OUT: tl.constexpr, ASM: tl.constexpr, FMT: tl.constexpr, UNIT: tl.constexpr, LUT: tl.constexpr,
    CENTER: tl.constexpr = 0, OUTK: tl.constexpr = 0, ENG: tl.constexpr = 0, SLOT: tl.constexpr = 0,
    ROPE: tl.constexpr = False,
):
    """Body tokens at pages pg (BLOCK_T,) int32, slots slot (BLOCK_T,) of KV head h ->
    (x (BLOCK_T, D) in OUT, s, z (BLOCK_T,) fp32).

    Pools are contiguous, so a row's address is ((page * heads + head) * rows_per_page + row) * cols with
    every factor but page and row known at compile time; 32-bit unless a pool holds 2^31 elements (IDX64).
    BITS 16: a dense body (`values`); x is it, s and z unused. Else packed codes; the scale (and zero) of
    (token, channel) is at row slot // TE, column channel // CE of the token's page (head 0 when SHARED).
    One scale per token (TE == 1, CE == D): x is the codes (offset removed, exact) and s, z the token's
    scale and zero, which the caller folds into the scores (K) or the probabilities (V) instead of
    multiplying every element. Otherwise x is dequantized in OUT: c * s + z with s, z a (BLOCK_T, D // CE)
    tile broadcast along each group of CE channels (TE == 1), or a row of D per token (TE > 1,
    channel-wise: TE tokens share it); s and z are returned as zeros. Channel-wise with TE <= BLOCK_T, the
    block [t0, t0 + BLOCK_T) of the region (tab_row: its block-table row, s_btn: stride; hi: its end)
    holds BLOCK_T // TE whole scale rows (t0, B_OFF and BS are multiples of TE): those rows are loaded
    once, (BLOCK_T // TE, D), and broadcast along their TE tokens, instead of one row per token.
    FMT 1 / 2: float8 codes (E4M3 / E5M2, kvquant.codecs.fp8) read as int32 words, their values times the
    scale laid out as above (no zero; SYM); UNIT: no scale at all (`-tensor`), x is the codes' values.
    LUT: codebook codes (`kernels.layouts.CodebookKernelLayout`; BITS 2, 3 or 4): each code is looked up in
    the levels table lv_ptr (`kernels.codebook.table_for`: fp16 bits, or fp32 for fp32 attention; tab: its
    PRMT planes on the compiled path), then scaled as above with the stored scale as it is (no qmax):
    level * scale (+ zero), folded for one scale per token just as integer codes are. Codes are read as
    int32 words when the launcher viewed the pool so (`kernels.codebook`), else byte by byte.
    OUTK > 0 (`-outP` around the codec): the token's OUTK exact values (ov_ptr, the K/V dtype) replace the
    dequantized values at their channels (oi_ptr); CENTER > 0 (`-centerN`): the offset row of each N
    tokens (o_ptr, (P * H * BS / N, D)) is added, loaded once per block when N divides it. Either one turns
    the folding of a per-token scale off (x is then dequantized here).
    FMT 3: signed 8-bit codes (vLLM's int8_per_token_head), read as int8's biased codes after flipping their
    sign bits, times the scale as stored. ENG > 0: GGUF blocks (`kernels.engine_blocks`), dequantized here
    in the kernel's channel order; s and z unused. SLOT > 0: a TurboQuant slot (`kernels.layouts.
    SlotKernelLayout`): rows of SLOT bytes, the packed codes first, then fp16 stats that s_ptr / z_ptr
    point at (the pool seen as fp16 from the first stat: a token's stat at row * SLOT / 2). (A key's norm
    correction, NC, is `_attend`'s: x is the centroids, s the norm.)"""
    offs_d = tl.arange(0, D)
    WIDE128: tl.constexpr = D == 128 and BLOCK_T == 128  # opaque planes compile shorter (`_runtime_zero`)
    row = (pg * H_KV + h) * BS + slot  # (BLOCK_T,) row of the (P * H * BS, cols) pool
    if IDX64:
        row = row.to(tl.int64)
    none = tl.zeros((BLOCK_T,), tl.float32)
    if ENG > 0:
        t0_, t1_, t2_, t3_, t4_, t5_, t6_, t7_ = tab
        if ASM and WIDE128 and (ENG == 6 or ENG == 7) and OUT == tl.float16:  # iq4_nl, mxfp4: `_runtime_zero`
            zz = (row & _runtime_zero(hi))[:, None, None]  # per row of the (BLOCK_T, blocks, words) tiles
            t0_, t1_, t2_, t3_, t4_, t5_, t6_, t7_ = _opaque_planes(tab, zz, 8)
        x = engine_body(c_ptr, lv_ptr, t0_, t1_, t2_, t3_, t4_, t5_, t6_, t7_, row,
                        valid, BLOCK_T, D, ENG, OUT, ASM)
        s = none
        z = none
    elif BITS == 16:
        x = tl.load(c_ptr + row[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0).to(OUT)
        s = none
        z = none
    else:
        BIAS: tl.constexpr = (1 << (BITS - 1)) if SYM and not LUT else 0
        # fp16: codes and dequantization in fp16 (packed HFMA2); bf16 and fp32: in fp32 (the interpreter has
        # no bf16 arithmetic), then one rounding to OUT (codes stay exact: |c| <= 255)
        # compiled bf16, asymmetric 4-bit codes with bf16 scales and zeros: bf16x2 arithmetic as fp16's
        # (128 + c is exact in bf16; a symmetric scale / qmax, or an fp16 / fp32 scale, would round to bf16
        # first, so those keep fp32)
        BF16X2: tl.constexpr = (OUT == tl.bfloat16 and ASM and BITS == 4 and not LUT and FMT == 0 and not SYM
                                and s_ptr.dtype.element_ty == tl.bfloat16
                                and z_ptr.dtype.element_ty == tl.bfloat16)
        MATH: tl.constexpr = tl.float16 if OUT == tl.float16 else tl.bfloat16 if BF16X2 else tl.float32
        if LUT:  # codebook: the level of each code, in MATH
            F32: tl.constexpr = OUT == tl.float32  # an fp32 table, looked up generically
            if c_ptr.dtype.element_ty == tl.int32:  # codes as words: in registers when compiled
                if BITS == 3:
                    M: tl.constexpr = D // 32  # 12-byte groups (32 codes) per row
                    base = row[:, None] * (3 * M) + 3 * tl.arange(0, M)[None, :]
                    w0 = tl.load(c_ptr + base, mask=valid[:, None], other=0)
                    w1 = tl.load(c_ptr + base + 1, mask=valid[:, None], other=0)
                    w2 = tl.load(c_ptr + base + 2, mask=valid[:, None], other=0)
                    p = (w0, w1, w2)
                else:
                    COLW: tl.constexpr = D * BITS // 32
                    p = tl.load(c_ptr + row[:, None] * COLW + tl.arange(0, COLW)[None, :],
                                mask=valid[:, None], other=0)
                t0_, t1_, t2_, t3_, t4_, t5_, t6_, t7_ = tab
                OPAQUE: tl.constexpr = WIDE128 and (BITS == 4 or (BITS == 3 and (TE > 1 or CE < D
                                                                               or OUT != tl.float16)))
                if ASM and not F32 and OPAQUE:  # codebook planes in regular registers (`_runtime_zero`)
                    zero = _runtime_zero(hi)
                    if BITS == 4:  # per token row
                        t0_, t1_, t2_, t3_, t4_, t5_, t6_, t7_ = _opaque_planes(tab, (row & zero)[:, None], 8)
                    else:  # per 12-byte group of 3-bit codes (only planes 0-3 are used)
                        t0_, t1_, t2_, t3_, t4_, t5_, t6_, t7_ = _opaque_planes(tab, p[2] & zero, 4)
                c = lut_words(p, lv_ptr, t0_, t1_, t2_, t3_, t4_, t5_, t6_, t7_,
                              BLOCK_T, D, BITS, F32, ASM and not F32).to(MATH)  # (BLOCK_T, D)
            else:  # (a TurboQuant key's rows are not whole words: its codes take this path too)
                c = _level(lv_ptr, _code_ints(c_ptr, row, valid, BLOCK_T, D, BITS, SLOT), F32).to(MATH)
        elif BITS == 3:  # affine 3-bit codes (a TurboQuant value slot): 2^m + c, less the offset
            c3 = _code_ints(c_ptr, row, valid, BLOCK_T, D, BITS, SLOT)
            if MATH == tl.float16:
                c = (c3.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + BIAS)
            else:
                c = (c3 | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)
        else:
            PER: tl.constexpr = 8 // BITS
            WORDS: tl.constexpr = c_ptr.dtype.element_ty == tl.int32  # 8-bit codes read as int32 words
            COLS: tl.constexpr = D // PER // 4 if WORDS else D // PER
            RC: tl.constexpr = COLS if SLOT == 0 else SLOT // 4 if WORDS else SLOT  # a row, in loaded units
            offs_b = tl.arange(0, COLS)
            p = tl.load(c_ptr + row[:, None] * RC + offs_b[None, :], mask=valid[:, None], other=0)
            if FMT == 3 and WORDS:  # signed bytes: flip the sign bits, then codes biased by 128
                c = _codes_w8(p.to(tl.uint32, bitcast=True) ^ 0x80808080, BLOCK_T, D, BIAS, MATH, ASM)
            elif FMT == 3:
                c = _codes((p ^ 0x80).to(tl.uint8), BLOCK_T, D, BITS, BIAS, MATH, ASM)
            elif FMT != 0 and WORDS:
                c = _fp8_w8(p, BLOCK_T, D, FMT, MATH, ASM)  # (BLOCK_T, D): the float8 values
            elif FMT != 0:  # a pool not aligned to words: byte by byte
                c = _fp8_byte_f16(p.to(tl.int32), FMT).to(MATH)
            elif WORDS:
                c = _codes_w8(p, BLOCK_T, D, BIAS, MATH, ASM)  # (BLOCK_T, D): code - offset
            else:
                c = _codes(p, BLOCK_T, D, BITS, BIAS, MATH, ASM)
        NG: tl.constexpr = D // CE
        if SLOT > 0:  # the stats sit in the slot row itself
            srow = row * (SLOT // 2)
        elif TE == 1:
            srow = row if not SHARED else pg * BS + slot
        elif SHARED:
            srow = pg * (BS // TE) + slot // TE
        else:
            srow = (pg * H_KV + h) * (BS // TE) + slot // TE
        if IDX64:
            srow = srow.to(tl.int64)
        s = none
        z = none
        if UNIT:  # FP8 -tensor: scale 1, nothing stored
            x = c
        elif TE == 1 and NG == 1:  # one scale per token (and head): folded by the caller
            s = _stat(s_ptr, srow, valid, SYM, BITS, tl.float32, False, FMT, LUT)
            z = none
            if not SYM:
                z = _stat(z_ptr, srow, valid, SYM, BITS, tl.float32, True)
            x = c
            if CENTER + OUTK > 0 or ROPE:  # the transforms need the values: dequantize (no folding)
                x = c * s.to(MATH)[:, None]
                if not SYM:
                    x = x + z.to(MATH)[:, None]
                s = none
                z = none
        elif TE > 1 and TE <= BLOCK_T:  # channel-wise: the block's BLOCK_T // TE scale rows, broadcast
            NR: tl.constexpr = BLOCK_T // TE
            rg = t0 + tl.arange(0, NR) * TE  # first token of each scale row
            vg = rg < hi
            jg = (B_OFF + rg).to(tl.uint32)
            pgg = tl.load(tab_row + (jg // BS) * s_btn, mask=vg, other=0).to(tl.int32)
            rowg = (jg % BS).to(tl.int32) // TE
            srg = pgg * (BS // TE) + rowg if SHARED else (pgg * H_KV + h) * (BS // TE) + rowg
            if IDX64:
                srg = srg.to(tl.int64)
            sp = srg[:, None] * D + offs_d[None, :]  # (NR, D)
            sc = _stat(s_ptr, sp, vg[:, None], SYM, BITS, MATH, False, FMT, LUT)[:, None, :]
            c3 = tl.reshape(c, (NR, TE, D))
            if SYM:
                x3 = c3 * sc
            else:
                x3 = c3 * sc + _stat(z_ptr, sp, vg[:, None], SYM, BITS, MATH, True)[:, None, :]
            x = tl.reshape(x3, (BLOCK_T, D))
        elif TE > 1:  # channel-wise, TE > BLOCK_T: a row per token (L1 serves the repeats)
            sp = srow[:, None] * D + offs_d[None, :]
            sc = _stat(s_ptr, sp, valid[:, None], SYM, BITS, MATH, False, FMT, LUT)
            if SYM:
                x = c * sc
            else:
                x = c * sc + _stat(z_ptr, sp, valid[:, None], SYM, BITS, MATH, True)
        else:  # NG groups of CE channels: a (BLOCK_T, NG) tile, broadcast along each group
            offs_g = tl.arange(0, NG)
            sp = srow[:, None] * NG + offs_g[None, :]
            sc = _stat(s_ptr, sp, valid[:, None], SYM, BITS, MATH, False, FMT, LUT)[:, :, None]
            c3 = tl.reshape(c, (BLOCK_T, NG, CE))
            if SYM:
                x3 = c3 * sc
            else:
                x3 = c3 * sc + _stat(z_ptr, sp, valid[:, None], SYM, BITS, MATH, True)[:, :, None]
            x = tl.reshape(x3, (BLOCK_T, D))
        if OUTK > 0:  # -outP: the exact values at their channels
            for jo in tl.static_range(OUTK):
                oi = tl.load(oi_ptr + row * OUTK + jo, mask=valid, other=0).to(tl.int32)  # (BLOCK_T,)
                ov = tl.load(ov_ptr + row * OUTK + jo, mask=valid, other=0.0).to(MATH)
                x = tl.where(offs_d[None, :] == oi[:, None], ov[:, None], x)
        if CENTER > 0:  # -centerN: the offset of each N tokens added back
            if BLOCK_T % CENTER == 0:  # the block holds BLOCK_T // N whole offset rows: one load each
                NO: tl.constexpr = BLOCK_T // CENTER
                rg = t0 + tl.arange(0, NO) * CENTER
                jg = (B_OFF + rg).to(tl.uint32)
                pgo = tl.load(tab_row + (jg // BS) * s_btn, mask=rg < hi, other=0).to(tl.int32)
                orow = (pgo * H_KV + h) * (BS // CENTER) + (jg % BS).to(tl.int32) // CENTER
                if IDX64:
                    orow = orow.to(tl.int64)
                off = tl.load(o_ptr + orow[:, None] * D + offs_d[None, :], mask=(rg < hi)[:, None], other=0.0)
                x = tl.reshape(tl.reshape(x, (NO, CENTER, D)) + off.to(MATH)[:, None, :], (BLOCK_T, D))
            else:  # N > BLOCK_T: a row per token (L1 serves the repeats)
                orow = (pg * H_KV + h) * (BS // CENTER) + slot // CENTER
                if IDX64:
                    orow = orow.to(tl.int64)
                off = tl.load(o_ptr + orow[:, None] * D + offs_d[None, :], mask=valid[:, None], other=0.0)
                x = x + off.to(MATH)
    if not ROPE:  # (RoPE follows, in fp32: one rounding to OUT after it)
        x = x.to(OUT)
    return x, s, z


@triton.jit
def _rope(x, cs_ptr, pos, valid, BLOCK_T: tl.constexpr, D: tl.constexpr, OUT: tl.constexpr):
    """Keys x (BLOCK_T, D) at positions pos (BLOCK_T,) -> rotated as the model rotates them (rotate-half
    RoPE: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), c and s of frequency i for channels i and i + D / 2),
    in fp32, then rounded to OUT. cs_ptr: `kernels.layouts.rope_table`, (P, D), cos then sin (fp32; fp16 for
    bf16 attention)."""
    H: tl.constexpr = D // 2
    off = pos[:, None] * D + tl.arange(0, H)[None, :]  # (BLOCK_T, H)
    c = tl.load(cs_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
    s = tl.load(cs_ptr + off + H, mask=valid[:, None], other=0.0).to(tl.float32)
    x1, x2 = tl.split(tl.permute(tl.reshape(x.to(tl.float32), (BLOCK_T, 2, H)), (0, 2, 1)))
    y = tl.join(x1 * c - x2 * s, x2 * c + x1 * s)  # (BLOCK_T, H, 2)
    return tl.reshape(tl.permute(y, (0, 2, 1)), (BLOCK_T, D)).to(OUT)


@triton.jit
def _attend(q, qsum, k, ks, kz, v, vs, vz, valid, m_i, l_i, acc, qk_scale,
            K_FOLD: tl.constexpr, K_SYM: tl.constexpr, V_FOLD: tl.constexpr, V_SYM: tl.constexpr,
            W: tl.constexpr, DOT_FP32: tl.constexpr, K_NC: tl.constexpr = False):
    """One online-softmax step (log2 domain) over a block of BT tokens, cut into W slabs of BT // W (one
    per warp), each with its own running max and sum, so no statistic crosses a warp inside the loop.

    q (W, G_PAD, D) (the same rows per slab); qsum (G_PAD,) fp32 row sums of q; k, v (BT, D); ks, kz, vs,
    vz (BT,) fp32 per-token scales and zeros, folded when K_FOLD / V_FOLD (k, v are then the codes):
    q.(c s + z) = (q.c) s + z sum(q) and sum_t p_t (c_t s_t + z_t) = sum_t (p_t s_t) c_t + sum_t p_t z_t.
    valid (BT,); m_i, l_i (W, G_PAD); acc (W, D, G_PAD): the output transposed, so the PV product is
    V^T (D x BT/W) by P^T (BT/W x G_PAD) and G_PAD (8 for up to 8 query heads) is the narrow side.
    K_NC: k holds TurboQuant centroid vectors c (norm in ks), renormalized to unit length as vLLM reads
    them: |c|^2 of every token comes from one more MMA, 1 (G_PAD x D) by (c * c)^T, already laid out as
    the scores are (a row sum across lanes would take shuffles per token)."""
    BT: tl.constexpr = k.shape[0]
    D: tl.constexpr = k.shape[1]
    TW: tl.constexpr = BT // W
    k3 = tl.reshape(k, (W, TW, D))
    v3 = tl.reshape(v, (W, TW, D))
    ok = tl.reshape(valid, (W, TW))[:, None, :]
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(k3.to(tl.float32), (0, 2, 1)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k3, (0, 2, 1)))  # (W, G_PAD, TW), fp32 accumulation
    if K_FOLD:
        s = s * tl.reshape(ks * qk_scale, (W, TW))[:, None, :]
        if not K_SYM:
            s = s + qsum[None, :, None] * tl.reshape(kz * qk_scale, (W, TW))[:, None, :]
    else:
        s = s * qk_scale
    if K_NC:  # TurboQuant _nc keys: times 1 / |c| of each token's centroid vector, by one more MMA (1 . c^2)
        kf = k3.to(tl.float32)
        kk = kf * kf  # (squared in fp32: no bf16 arithmetic in the interpreter; one rounding compiled)
        if DOT_FP32:
            n2 = tl.dot(tl.full(q.shape, 1.0, tl.float32), tl.trans(kk, (0, 2, 1)), input_precision="ieee")
        else:  # (W, G_PAD, TW), fp32 accumulation
            n2 = tl.dot(tl.full(q.shape, 1.0, q.dtype), tl.trans(kk.to(q.dtype), (0, 2, 1)))
        s = s / tl.sqrt(n2 + 1e-16)
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=2))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block must not give NaN
    p = tl.exp2(s - m_safe[:, :, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=2)
    acc = acc * alpha[:, None, :]
    pw = p
    if V_FOLD:
        vs3 = tl.reshape(vs, (W, TW))[:, None, :]
        pw = p * vs3
        if not V_SYM:
            acc = acc + tl.sum(p * tl.reshape(vz, (W, TW))[:, None, :], axis=2)[:, None, :]
    if DOT_FP32:
        acc = tl.dot(tl.trans(v3.to(tl.float32), (0, 2, 1)), tl.trans(pw, (0, 2, 1)), acc,
                     input_precision="ieee")
    else:
        acc = tl.dot(tl.trans(v3, (0, 2, 1)), tl.trans(pw.to(v.dtype), (0, 2, 1)), acc)  # (W, D, G_PAD)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=_SPLIT_DNS)
def _paged_split_kernel(
    q_ptr, s_qb, s_qh,  # query (B, H_q, D), last stride 1
    fpk_ptr, fpv_ptr,  # FP pools (P_fp, H_kv, FBS, D), contiguous
    stab_ptr, s_stb, s_stn, S,  # sink region: table (B, n) int64, length (offset 0)
    rtab_ptr, s_rtb, s_rtn, R, R_OFF,  # recent region: table, length, offset
    btab_ptr, s_btb, s_btn, T_BODY, B_OFF, B_START,  # body region: table, length, offset, first position
    kc_ptr, ks_ptr, kz_ptr, kl_ptr,  # K body pools: codes (or values), scale, zero; contiguous; levels
    ko_ptr, kov_ptr, koi_ptr, kr_ptr,  # K's -center offset, -outP values and indices; -prerope cos | sin
    vc_ptr, vs_ptr, vz_ptr, vl_ptr,  # V body pools; codebook levels (2^bits,) when V_LUT
    vo_ptr, vov_ptr, voi_ptr, vr_ptr,
    mask_ptr, s_mb, s_mt,  # key_mask (B, T) as uint8; s_mb = 0 for a broadcast (1, T) mask
    m_ptr, l_ptr, acc_ptr,  # partials (B * H_kv, NSPLIT, G[, D]), contiguous fp32
    N_BODY_SPLITS, NSPLIT, BODY_CHUNK, FP_CHUNK, qk_scale,
    H_KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    BS: tl.constexpr, FBS: tl.constexpr, IDX64: tl.constexpr,
    K_BITS: tl.constexpr, K_SYM: tl.constexpr, K_TE: tl.constexpr, K_CE: tl.constexpr, K_SHARED: tl.constexpr,
    V_BITS: tl.constexpr, V_SYM: tl.constexpr, V_TE: tl.constexpr, V_CE: tl.constexpr, V_SHARED: tl.constexpr,
    K_FMT: tl.constexpr, K_UNIT: tl.constexpr, V_FMT: tl.constexpr, V_UNIT: tl.constexpr,
    K_LUT: tl.constexpr, V_LUT: tl.constexpr, K_ENG: tl.constexpr, V_ENG: tl.constexpr,
    K_SLOT: tl.constexpr, V_SLOT: tl.constexpr, K_NC: tl.constexpr, V_NC: tl.constexpr,
    K_ROPE: tl.constexpr, V_ROPE: tl.constexpr,
    K_CENTER: tl.constexpr, K_OUT: tl.constexpr, V_CENTER: tl.constexpr, V_OUT: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BODY: tl.constexpr, HAS_FP: tl.constexpr, DOT_FP32: tl.constexpr,
    BODY_STAGES: tl.constexpr, FP_STAGES: tl.constexpr, W: tl.constexpr,
    ASM: tl.constexpr,
):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H_KV
    h = bh % H_KV
    b64 = b.to(tl.int64)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BLOCK_T)
    q_ptrs = q_ptr + b64 * s_qb + (h * G + offs_g)[:, None] * s_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=offs_g[:, None] < G, other=0.0)  # (G_PAD, D): the query heads of KV head h
    mask_row = mask_ptr + b64 * s_mb
    cdt = q.dtype

    qsum = tl.sum(q.to(tl.float32), axis=1)  # (G_PAD,): the zero of an asymmetric per-token K, folded
    q = tl.broadcast_to(q[None, :, :], (W, G_PAD, D))
    none = tl.zeros((BLOCK_T,), tl.float32)
    # a per-token scale is folded, unless a transform needs the dequantized values (-center, -outP)
    K_FOLD: tl.constexpr = (K_BITS < 16 and K_TE == 1 and K_CE == D and not K_UNIT and K_CENTER + K_OUT == 0
                            and K_ENG == 0 and not K_ROPE)
    V_FOLD: tl.constexpr = (V_BITS < 16 and V_TE == 1 and V_CE == D and not V_UNIT and V_CENTER + V_OUT == 0
                            and V_ENG == 0 and not V_ROPE)
    m_i = tl.full((W, G_PAD), float("-inf"), tl.float32)
    l_i = tl.zeros((W, G_PAD), tl.float32)
    acc = tl.zeros((W, D, G_PAD), tl.float32)
    if split < N_BODY_SPLITS:
        if HAS_BODY:
            # body tokens [lo, hi) of the region; body token r is position S + r
            lo = split * BODY_CHUNK
            hi = tl.minimum(lo + BODY_CHUNK, T_BODY)
            tab_row = btab_ptr + b64 * s_btb
            # a codebook's PRMT planes, once per program (compiled, fp16/bf16, codes read as words; a GGUF
            # block's codes are words either way)
            ktab = lut_tables(kl_ptr, K_BITS, K_LUT and ASM and cdt != tl.float32
                              and (kc_ptr.dtype.element_ty == tl.int32 or K_ENG > 0))
            vtab = lut_tables(vl_ptr, V_BITS, V_LUT and ASM and cdt != tl.float32
                              and (vc_ptr.dtype.element_ty == tl.int32 or V_ENG > 0))
            for t0 in tl.range(lo, hi, BLOCK_T, num_stages=BODY_STAGES):
                r = t0 + offs_t
                valid = r < hi
                if HAS_MASK:
                    valid = valid & (tl.load(mask_row + (S + r) * s_mt, mask=valid, other=0) != 0)
                j = (B_OFF + r).to(tl.uint32)  # unsigned: // and % by a power of two are shifts and masks
                pg = tl.load(tab_row + (j // BS) * s_btn, mask=valid, other=0).to(tl.int32)  # page ids
                slot = (j % BS).to(tl.int32)
                k, ks, kz = _load_body(kc_ptr, ks_ptr, kz_ptr, kl_ptr, ko_ptr, kov_ptr, koi_ptr, ktab, pg,
                                       slot, h, valid, tab_row, s_btn, t0, hi, B_OFF, H_KV, D, BLOCK_T, BS,
                                       K_BITS, K_SYM, K_TE, K_CE, K_SHARED, IDX64, cdt, ASM, K_FMT, K_UNIT,
                                       K_LUT, K_CENTER, K_OUT, K_ENG, K_SLOT, K_ROPE)
                v, vs, vz = _load_body(vc_ptr, vs_ptr, vz_ptr, vl_ptr, vo_ptr, vov_ptr, voi_ptr, vtab, pg,
                                       slot, h, valid, tab_row, s_btn, t0, hi, B_OFF, H_KV, D, BLOCK_T, BS,
                                       V_BITS, V_SYM, V_TE, V_CE, V_SHARED, IDX64, cdt, ASM, V_FMT, V_UNIT,
                                       V_LUT, V_CENTER, V_OUT, V_ENG, V_SLOT, V_ROPE)
                if K_ROPE:  # -prerope keys: RoPE at each key's position, after decoding
                    k = _rope(k, kr_ptr, B_START + r, valid, BLOCK_T, D, cdt)
                if V_ROPE:
                    v = _rope(v, vr_ptr, B_START + r, valid, BLOCK_T, D, cdt)
                m_i, l_i, acc = _attend(q, qsum, k, ks, kz, v, vs, vz, valid, m_i, l_i, acc, qk_scale,
                                        K_FOLD, K_SYM, V_FOLD, V_SYM, W, DOT_FP32, K_NC)
    else:
        if HAS_FP:
            # FP tokens u in [0, S + R): u < S is sink token u (position u), else recent token u - S
            # (position u + T_BODY); both regions live in the one FP pool, so K and V are one pointer each
            f = split - N_BODY_SPLITS
            lo = f * FP_CHUNK
            hi = tl.minimum(lo + FP_CHUNK, S + R)
            stab_row = stab_ptr + b64 * s_stb
            rtab_row = rtab_ptr + b64 * s_rtb
            for u0 in tl.range(lo, hi, BLOCK_T, num_stages=FP_STAGES):
                u = u0 + offs_t
                valid = u < hi
                in_sink = u < S
                if HAS_MASK:
                    pos = tl.where(in_sink, u, u + T_BODY)
                    valid = valid & (tl.load(mask_row + pos * s_mt, mask=valid, other=0) != 0)
                j = tl.where(in_sink, u, R_OFF + u - S).to(tl.uint32)
                pidx = j // FBS
                tab = tl.where(in_sink, stab_row + pidx * s_stn, rtab_row + pidx * s_rtn)
                pg = tl.load(tab, mask=valid, other=0).to(tl.int32)
                row = (pg * H_KV + h) * FBS + (j % FBS).to(tl.int32)
                if IDX64:
                    row = row.to(tl.int64)
                fp_off = row[:, None] * D + offs_d[None, :]
                k = tl.load(fpk_ptr + fp_off, mask=valid[:, None], other=0.0).to(cdt)
                v = tl.load(fpv_ptr + fp_off, mask=valid[:, None], other=0.0).to(cdt)
                m_i, l_i, acc = _attend(q, qsum, k, none, none, v, none, none, valid, m_i, l_i, acc, qk_scale,
                                        False, True, False, True, W, DOT_FP32)


    # merge the W slabs: (W, G_PAD) -> (G_PAD,)
    m_all = tl.max(m_i, axis=0)
    m_s = tl.where(m_all == float("-inf"), 0.0, m_all)
    wgt = tl.exp2(m_i - m_s[None, :])  # (W, G_PAD); 0 for a slab that saw no token
    l_i = tl.sum(l_i * wgt, axis=0)
    acc = tl.trans(tl.sum(acc * wgt[:, None, :], axis=0))
    m_i = m_all
    part = (bh.to(tl.int64) * NSPLIT + split) * G
    real = offs_g < G  # only the G real query heads are stored
    tl.store(m_ptr + part + offs_g, m_i, mask=real)
    tl.store(l_ptr + part + offs_g, l_i, mask=real)
    tl.store(acc_ptr + (part + offs_g)[:, None] * D + offs_d[None, :], acc, mask=real[:, None])


@triton.jit(do_not_specialize=_REDUCE_DNS)
def _reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, s_ob, s_oh,
    H_KV, NSPLIT,
    G: tl.constexpr, D: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
):
    """Merge the splits of one query head, SPLIT_BLOCK at a time as one tile:
    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    bh = tl.program_id(0)
    g = tl.program_id(1)
    b = bh // H_KV
    h = bh % H_KV
    offs_s = tl.arange(0, SPLIT_BLOCK)
    offs_d = tl.arange(0, D)
    base = bh.to(tl.int64) * NSPLIT * G + g
    m_run = tl.full((1,), float("-inf"), tl.float32)
    l_run = tl.zeros((1,), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for s0 in tl.range(0, NSPLIT, SPLIT_BLOCK):
        s = s0 + offs_s
        ok = s < NSPLIT
        rows = base + s * G
        m = tl.load(m_ptr + rows, mask=ok, other=float("-inf"))
        l_s = tl.load(l_ptr + rows, mask=ok, other=0.0)
        a = tl.load(acc_ptr + rows[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(m - m_safe)  # (SPLIT_BLOCK,); 0 for empty splits
        alpha = tl.exp2(m_run - m_safe)
        l_run = l_run * alpha + tl.sum(w * l_s, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * a, axis=0)
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)  # no valid token at all -> zeros, not NaN
    o_ptrs = out_ptr + b.to(tl.int64) * s_ob + (h * G + g) * s_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------- launcher


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_splits(bh: int, t_body: int, device: torch.device, block_t: int) -> int:
    """Enough body splits to give every SM about two programs, none shorter than 4 blocks of block_t."""
    if t_body == 0:
        return 0
    if device.type == "cuda":
        target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    elif _interpreting():
        target = 2  # the interpreter runs programs one after another
    else:
        target = 2 * 132  # compile-only (kvquant.kernels.compiled): an H200
    want = triton.cdiv(target, bh)
    return max(1, min(want, triton.cdiv(t_body, 4 * block_t)))


def _length(region) -> int:
    return 0 if region is None else int(region.length)


def _table_args(region, bsz: int, like: torch.Tensor):
    """(table, stride_b, stride_n) of a region; a dummy pointer (never read) when it holds no token."""
    if _length(region) == 0:
        return like, 0, 0
    t = region.table
    if t.dtype != torch.int64 or t.dim() != 2 or t.shape[0] not in (1, bsz):
        raise ValueError(f"decode_attention: a block table must be int64 (B={bsz}, n_pages), "
                         f"got {t.dtype} {tuple(t.shape)}")
    if t.device != like.device:
        raise ValueError(f"decode_attention: a block table is on {t.device}, another on {like.device}")
    return t, (t.stride(0) if t.shape[0] == bsz else 0), t.stride(1)


_FP8_FORMATS = {"e4m3": 1, "e5m2": 2}


def _body_args(codec, pages: Mapping[str, torch.Tensor] | None, h_kv: int, d: int, bs: int, like,
               registry=None, positions: int = 0):
    """(codes, scale, zero, levels, offset, out_values, out_index, rope) pools and (BITS, SYM, TE, CE, SHARED,
    FMT, UNIT, LUT, ENG, SLOT, NC, CENTER, OUTK, ROPE) of one body (`_base_args`, plus the `-center` /
    `-outP` fields around the base codec and a `-prerope` key's cos / sin table for positions below
    `positions`, `kernels.layouts.decode_parts`); dummies when absent."""
    base, extra = _base_args(None if codec is None else decode_parts(codec).base, pages, h_kv, d, bs, like,
                             registry)
    if codec is None:
        return (*base, like, like, like, like), (*extra, 0, 0, False)
    parts = decode_parts(codec)
    offset = vals = index = table = like
    if parts.center:
        offset = pages["offset"]
        _check_pool("offset", offset, (h_kv, bs // parts.center, d), like)
        if offset.dtype not in _FLOAT:
            raise TypeError(f"decode_attention: the offset pool must be float, got {offset.dtype}")
    if parts.outliers:
        vals, index = pages["out_values"], pages["out_index"]
        for name, t in (("out_values", vals), ("out_index", index)):
            _check_pool(name, t, (h_kv, bs, parts.outliers), like)
    if parts.rope is not None:
        table = rope_table(parts.rope, positions, like.device, registry,  # (P, D): cos | sin
                           torch.float16 if like.dtype == torch.bfloat16 else torch.float32)
    return (*base, offset, vals, index, table), (*extra, parts.center, parts.outliers, parts.rope is not None)


def _base_args(codec, pages: Mapping[str, torch.Tensor] | None, h_kv: int, d: int, bs: int, like,
               registry=None):
    """(codes, scale, zero, levels) pools and (BITS, SYM, TE, CE, SHARED, FMT, UNIT, LUT, ENG, SLOT, NC) of
    one body's base codec; dummies when absent. FMT: 0 integer codes, 1 / 2 float8 E4M3 / E5M2 (an
    `FP8KernelLayout`), 3 signed int8 codes with the scale as stored (`SignedInt8KernelLayout`); UNIT: FP8
    without a scale; LUT: codebook codes (`CodebookKernelLayout`), levels their table
    (`kernels.codebook.table_for`); ENG: a GGUF block format's id (`_engine_args`); SLOT, NC: a TurboQuant
    slot's row bytes and norm correction (`_slot_args`)."""
    if codec is None:
        return (like, like, like, like), (16, False, 1, d, False, 0, False, False, 0, 0, False)
    lay = decode_layout(codec)
    if isinstance(lay, EngineKernelLayout):
        return _engine_args(lay, pages, h_kv, d, bs, like, registry)
    if isinstance(lay, SlotKernelLayout):
        return _slot_args(codec, lay, pages, h_kv, d, bs, like, registry)
    if lay.bits == 16:
        vals = pages["values"]
        _check_pool("values", vals, (h_kv, bs, d), like)
        return (vals, vals, vals, vals), (16, False, 1, d, False, 0, False, False, 0, 0, False)
    if getattr(lay, "codebook", False):
        codes, scale = pages["codes"], pages["scale"]
        zero = scale if lay.symmetric else pages["zero"]
        if codes.dtype != torch.uint8:
            raise TypeError(f"decode_attention: packed codes must be uint8, got {codes.dtype}")
        _check_pool("codes", codes, (h_kv, bs, d * lay.bits // 8), like)
        shared = lay.shared_heads or h_kv == 1 or scale.shape[1] == 1
        for name, t in (("scale", scale), ("zero", zero)):
            _check_pool(name, t, (1 if shared else h_kv, bs // lay.token_extent, d // lay.channel_extent),
                        like)
        levels = device_levels(codec, like.device, registry, like.dtype)
        if words_ok(lay.bits, d) and codes.storage_offset() % 4 == 0:
            codes = codes.view(torch.int32)  # read as words (kernels.codebook)
        return (codes, scale, zero, levels), (lay.bits, lay.symmetric, lay.token_extent, lay.channel_extent,
                                              shared, 0, False, True, 0, 0, False)
    fp8 = getattr(lay, "fp8", None)
    fmt, unit = (_FP8_FORMATS[fp8], bool(lay.unit_scale)) if fp8 is not None else (0, False)
    if unit:
        codes = pages["codes"]
        if codes.dtype != torch.uint8:
            raise TypeError(f"decode_attention: FP8 codes must be uint8, got {codes.dtype}")
        _check_pool("codes", codes, (h_kv, bs, d), like)
        if codes.storage_offset() % 4 == 0:
            codes = codes.view(torch.int32)
        return (codes, codes, codes, codes), (8, True, 1, d, False, fmt, True, False, 0, 0, False)
    codes, scale = pages["codes"], pages["scale"]
    zero = pages.get("zero", scale) if not lay.symmetric else scale
    if isinstance(lay, SignedInt8KernelLayout):
        if codes.dtype != torch.int8:
            raise TypeError(f"decode_attention: signed codes must be int8, got {codes.dtype}")
        codes, fmt = codes.view(torch.uint8), 3
    if codes.dtype != torch.uint8:
        raise TypeError(f"decode_attention: packed codes must be uint8, got {codes.dtype}")
    _check_pool("codes", codes, (h_kv, bs, d * lay.bits // 8), like)
    if lay.bits == 8 and codes.storage_offset() % 4 == 0:
        codes = codes.view(torch.int32)  # 8-bit codes read as words: four codes stay in one register
    shared = lay.shared_heads or h_kv == 1 or scale.shape[1] == 1
    for name, t in (("scale", scale), ("zero", zero)):
        _check_pool(name, t, (1 if shared else h_kv, bs // lay.token_extent, d // lay.channel_extent), like)
    return (codes, scale, zero, codes), (lay.bits, lay.symmetric, lay.token_extent, lay.channel_extent,
                                         shared, fmt, False, False, 0, 0, False)


def _engine_args(lay: EngineKernelLayout, pages, h_kv: int, d: int, bs: int, like, registry):
    """A GGUF block body (`kernels.engine_blocks`): the `blocks` pool, viewed as int32 words when its rows
    are whole words, and the format's table of 16 values (4-bit table formats; else the pool again)."""
    blocks = pages["blocks"]
    if blocks.dtype != torch.uint8:
        raise TypeError(f"decode_attention: GGUF blocks must be uint8, got {blocks.dtype}")
    row = d // lay.block * lay.type_size
    _check_pool("blocks", blocks, (h_kv, bs, row), like)
    if row % 4 == 0 and blocks.storage_offset() % 4 == 0:
        blocks = blocks.view(torch.int32)
    levels = engine_levels(lay, like.device, registry, like.dtype) if lay.lut else blocks
    return (blocks, blocks, blocks, levels), (lay.bits, True, 1, lay.block, False, 0, False, lay.lut,
                                              lay.kernel_id, 0, False)


def _slot_args(codec, lay: SlotKernelLayout, pages, h_kv: int, d: int, bs: int, like, registry):
    """A TurboQuant half (`SlotKernelLayout`): the `slot` pool as the codes (rows of row_bytes: SLOT), the
    same pool seen as fp16 from each row's first stat as the scale (a key's norm, a value's scale) and,
    one half further, the zero; a key's table of centroids. k8v4's E4M3 keys are a row of D codes: FP8
    -tensor's path."""
    slot = pages["slot"]
    if slot.dtype != torch.uint8:
        raise TypeError(f"decode_attention: a TurboQuant slot must be uint8, got {slot.dtype}")
    _check_pool("slot", slot, (h_kv, bs, lay.row_bytes), like)
    if lay.kind == "fp8":
        codes = slot.view(torch.int32) if slot.storage_offset() % 4 == 0 else slot
        return (codes, codes, codes, codes), (8, True, 1, d, False, 1, True, False, 0, 0, False)
    stats = slot.view(torch.float16)[..., lay.code_bytes // 2:]  # (P, H_kv, BS, 1 or 2): views, no copy
    zero = stats[..., 1:] if lay.kind == "affine" else stats
    mse = lay.kind == "mse"
    levels = slot_levels(codec, like.device, registry, like.dtype) if mse else slot
    consts = (lay.bits, lay.symmetric, 1, d, False, 0, False, mse, 0, lay.row_bytes, lay.norm_correction)
    return (slot, stats, zero, levels), consts


def _check_pool(name: str, t: torch.Tensor, tail: tuple[int, ...], like: torch.Tensor) -> None:
    if t.dim() != 4 or tuple(t.shape[1:]) != tail:
        raise ValueError(f"decode_attention: the {name} pool must be (P, {', '.join(map(str, tail))}), "
                         f"got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"decode_attention: the {name} pool must be contiguous (the kernel derives its "
                         "strides from the page geometry)")
    if t.device != like.device:
        raise ValueError(f"decode_attention: the {name} pool is on {t.device}, query on {like.device}")


def _mask_arg(key_mask: torch.Tensor | None, bsz: int, total: int, like: torch.Tensor):
    """(mask as uint8, stride_b, stride_t, HAS_MASK) for the split kernel; a dummy pointer when None."""
    if key_mask is None:
        return like, 0, 0, False
    if key_mask.dtype != torch.bool:
        raise TypeError(f"decode_attention: key_mask must be bool (True = attend), got {key_mask.dtype}")
    if key_mask.dim() != 2 or key_mask.shape[0] not in (1, bsz) or key_mask.shape[1] != total:
        raise ValueError(f"decode_attention: key_mask must be (B={bsz} or 1, T={total}), "
                         f"got {tuple(key_mask.shape)}")
    if key_mask.device != like.device:
        raise ValueError(f"decode_attention: key_mask is on {key_mask.device}, query on {like.device}")
    m = key_mask.expand(bsz, total).view(torch.uint8)  # a view: (1, T) -> stride 0 along B, no copy
    return m, m.stride(0), m.stride(1), True


@dataclass(frozen=True)
class _Extent:
    """Where a call's tokens are: region lengths (sink, body, recent) and the pools' geometry."""

    s_len: int
    t_body: int
    r_len: int
    h_kv: int
    bs: int  # tokens per body page
    fbs: int  # tokens per FP (sink and recent) page

    @property
    def total(self) -> int:
        return self.s_len + self.t_body + self.r_len

    @property
    def has_fp(self) -> bool:
        return self.s_len + self.r_len > 0


@dataclass(frozen=True)
class _Splits:
    """How the token axis is cut: body splits of body_chunk tokens, then FP splits of fp_chunk."""

    n_body: int
    nsplit: int
    body_chunk: int
    fp_chunk: int


# the per-codec constants `_body_args` returns, in its order; the split kernel takes them as K_* and V_*
_CODEC_CONSTS = ("BITS", "SYM", "TE", "CE", "SHARED", "FMT", "UNIT", "LUT", "ENG", "SLOT", "NC", "CENTER",
                 "OUT", "ROPE")


def _check_query(query: torch.Tensor) -> tuple[int, int, int]:
    """(B, H_q, D) of a query (B, H_q, 1, D) in fp16/bf16/fp32 with D a power of two >= 16."""
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"decode_attention: query must be (B, H_q, 1, D), got {tuple(query.shape)}")
    if query.dtype not in _FLOAT:
        raise TypeError(f"decode_attention: query must be fp16, bf16 or fp32, got {query.dtype}")
    bsz, h_q, _, d = query.shape
    if d < 16 or d & (d - 1):
        raise ValueError(f"decode_attention: head_dim must be a power of two >= 16, got {d}")
    return bsz, h_q, d


def _extent(query, fp_k, fp_v, key_pages, key_codec, value_codec, sink, body, recent) -> _Extent:
    """The regions' lengths and the pools' (H_kv, BS, FBS), checked: some token, GQA, FP pools of the
    query's head_dim and device, a body offset and block size on each codec's token group. FP pages may
    hold fewer tokens (FBS) than body pages (BS)."""
    s_len, t_body, r_len = _length(sink), _length(body), _length(recent)
    if s_len + t_body + r_len == 0:
        raise ValueError("decode_attention: the layer holds no tokens")
    has_fp = s_len + r_len > 0
    name, kpool = next(iter(key_pages.items()))
    bs = kpool.shape[2] * key_codec.fields()[name].tokens  # a field's pool holds BS // tokens_f rows
    h_kv = fp_k.shape[1] if has_fp else kpool.shape[1]
    fbs = fp_k.shape[2] if has_fp else bs
    if query.shape[1] % h_kv:
        raise ValueError(f"decode_attention: H_q={query.shape[1]} is not a multiple of H_kv={h_kv}")
    if has_fp:
        for name, pool in (("fp_k", fp_k), ("fp_v", fp_v)):
            _check_pool(name, pool, (h_kv, fbs, query.shape[3]), query)
            if pool.dtype not in _FLOAT:
                raise TypeError(f"decode_attention: {name} must be float, got {pool.dtype}")
    if t_body:
        for codec in (key_codec, value_codec):
            te = max(decode_layout(codec).token_extent, codec.token_group)
            if bs % te or int(body.offset) % te:
                raise ValueError(f"decode_attention: block_size {bs} and the body offset must be multiples "
                                 f"of the token group {te}")
    return _Extent(s_len, t_body, r_len, h_kv, bs, fbs)


def _splits(bh: int, ext: _Extent, num_splits: int | None, device: torch.device, block_t: int) -> _Splits:
    """Body splits (`_num_splits` unless given, at most one per token), each a whole number of block_t
    blocks, then FP splits of 4 * block_t sink and recent tokens."""
    n_body, body_chunk = 0, block_t
    if ext.t_body:
        n_body = _num_splits(bh, ext.t_body, device, block_t) if num_splits is None else max(
            1, min(num_splits, ext.t_body))
        body_chunk = triton.cdiv(triton.cdiv(ext.t_body, n_body), block_t) * block_t
        n_body = triton.cdiv(ext.t_body, body_chunk)
    fp_chunk = 4 * block_t
    n_fp = triton.cdiv(ext.s_len + ext.r_len, fp_chunk)
    return _Splits(n_body, n_body + n_fp, body_chunk, fp_chunk)


def _constants(query: torch.Tensor, ext: _Extent, g: int, k_consts: tuple, v_consts: tuple, has_mask: bool,
               idx64: bool, body_stages: int | None, fp_stages: int) -> dict:
    """The split kernel's constexprs (what one compiled variant is specialised on) but its token block
    (`_at_block`)."""
    d = query.shape[3]
    return dict(
        H_KV=ext.h_kv, G=g, G_PAD=max(8, triton.next_power_of_2(g)),  # G_PAD: the N side of P V (mma n8)
        D=d, BS=ext.bs, FBS=ext.fbs, IDX64=idx64,
        **{f"K_{name}": c for name, c in zip(_CODEC_CONSTS, k_consts, strict=True)},
        **{f"V_{name}": c for name, c in zip(_CODEC_CONSTS, v_consts, strict=True)},
        HAS_MASK=has_mask, HAS_BODY=ext.t_body > 0, HAS_FP=ext.has_fp,
        DOT_FP32=query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and _interpreting()),
        BODY_STAGES=body_stages or (2 if d <= 128 else 1),  # D=256, 2 stages: 116 KB of smem
        FP_STAGES=fp_stages,
        ASM=not _interpreting(),
    )


def _at_block(consts: dict, block_t: int, num_warps: int) -> dict:
    """`_constants` at block_t tokens per iteration, cut into W slabs with a running softmax each (one per
    warp, >= 16 tokens)."""
    return dict(consts, BLOCK_T=block_t, W=min(num_warps, block_t // 16))


def _variant(query: torch.Tensor, fpk: torch.Tensor, kb: tuple, vb: tuple, consts: dict, num_warps: int):
    """The registry's key of a split-kernel variant: the dtypes of what it reads, and its constexprs."""
    luts = (kb[3].dtype, vb[3].dtype) if consts["K_LUT"] or consts["V_LUT"] else ()
    extras = consts["K_CENTER"] or consts["K_OUT"] or consts["V_CENTER"] or consts["V_OUT"]
    parts = tuple(t.dtype for t in kb[4:] + vb[4:]) if extras else ()
    return (query.dtype, fpk.dtype, kb[0].dtype, kb[1].dtype, vb[0].dtype, vb[1].dtype, *luts, *parts,
            num_warps, *sorted(consts.items()))


def _launch(query, fp_k, fp_v, key_pages, value_pages, key_codec, value_codec, sink, body, recent,
            scaling, key_mask, num_splits, num_warps, body_stages, fp_stages, registry, idx64=None,
            block_t=None):
    """Check the arguments, launch the split kernel then the reduce: (B, 1, H_q, D) in query's dtype, or
    None when the registry refuses the variant (it cannot be built here, or its self-check failed)."""
    bsz, h_q, d = _check_query(query)
    ext = _extent(query, fp_k, fp_v, key_pages, key_codec, value_codec, sink, body, recent)
    registry = registry or default_registry()
    b_start = int(getattr(body, "start", ext.s_len)) if ext.t_body else 0  # position of body token 0
    kb, k_consts = _body_args(key_codec if ext.t_body else None, key_pages, ext.h_kv, d, ext.bs, query,
                              registry, b_start + ext.t_body)
    vb, v_consts = _body_args(value_codec if ext.t_body else None, value_pages, ext.h_kv, d, ext.bs, query,
                              registry, b_start + ext.t_body)
    g, bh = h_q // ext.h_kv, bsz * ext.h_kv
    mask, s_mb, s_mt, has_mask = _mask_arg(key_mask, bsz, ext.total, query)
    scale = (1.0 / math.sqrt(d)) if scaling is None else float(scaling)
    out = torch.empty((bsz, 1, h_q, d), dtype=query.dtype, device=query.device)

    q3 = query[:, :, 0, :]  # (B, H_q, D)
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    # an absent region's table pointer is never read, but must be an int64 pointer like the others
    some_table = next(x.table for x in (sink, body, recent) if _length(x))
    st, rt, btab = (_table_args(x, bsz, some_table) for x in (sink, recent, body))
    fpk, fpv = (fp_k, fp_v) if ext.has_fp else (query, query)
    if idx64 is None:  # (the self-check's probe passes the checked call's, to compile the same variant)
        idx64 = max(t.numel() for t in (fpk, fpv, *kb, *vb)) >= 2**31
    # D=256 on 4 warps spills (255 registers), and so do bf16 -prerope keys (fp32 keys and their cos / sin)
    rope_bf16 = k_consts[_CODEC_CONSTS.index("ROPE")] and query.dtype == torch.bfloat16
    num_warps = num_warps or (4 if d <= 128 and not rope_bf16 else 8)

    def plan(bt: int):
        """(grid, args, constexprs, partials m, l, acc) of the split kernel at bt tokens per iteration."""
        splits = _splits(bh, ext, num_splits, query.device, bt)
        m = torch.empty((bh, splits.nsplit, g), dtype=torch.float32, device=query.device)  # running max
        l_ = torch.empty_like(m)  # running sum
        acc = torch.empty((bh, splits.nsplit, g, d), dtype=torch.float32, device=query.device)
        args = (
            q3, *q3.stride()[:2],
            fpk, fpv,
            st[0], st[1], st[2], ext.s_len,
            rt[0], rt[1], rt[2], ext.r_len, int(recent.offset) if ext.r_len else 0,
            btab[0], btab[1], btab[2], ext.t_body, int(body.offset) if ext.t_body else 0, b_start,
            *kb, *vb,
            mask, s_mb, s_mt,
            m, l_, acc,
            splits.n_body, splits.nsplit, splits.body_chunk, splits.fp_chunk, scale * _LOG2E,
        )
        return (splits.nsplit, bh), args, _at_block(consts, bt, num_warps), (m, l_, acc)

    consts = _constants(query, ext, g, k_consts, v_consts, has_mask, idx64, body_stages, fp_stages)
    variant = _variant(query, fpk, kb, vb, consts, num_warps)  # all but the block, which follows from it
    if block_t is None:
        block_t = _block_tokens(registry, d, (variant, str(query.device)), plan, num_warps)
    elif block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"decode_attention: block_t must be a power of two >= 16 (64 or 128), got {block_t}")
    grid, args, block_consts, (m, l_, acc) = plan(block_t)
    variant = (*variant, ("BLOCK_T", block_t))
    spec = _ProbeSpec(query.dtype, fpk.dtype, key_codec, value_codec, ext.h_kv, g, d, ext.bs, ext.fbs,
                      ext.t_body > 0, ext.has_fp, has_mask, num_warps, body_stages, fp_stages, idx64, block_t)
    if not _trusted(registry, variant, spec, query.device):
        return None
    if not registry.launch(_paged_split_kernel, grid, args, dict(block_consts, num_warps=num_warps), variant):
        return None
    o3 = out[:, 0]  # (B, H_q, D)
    reduce_args = (m, l_, acc, o3, *o3.stride()[:2], ext.h_kv, grid[0])
    if not registry.launch(_reduce_kernel, (bh, g), reduce_args, dict(G=g, D=d, SPLIT_BLOCK=SPLIT_BLOCK),
                           (query.dtype, g, d)):
        return None
    return out


def _block_tokens(registry, d: int, key: tuple, plan, num_warps: int) -> int:
    """Tokens per loop iteration of a split-kernel variant: WIDE_BLOCK_T (128) where, compiled, it spills
    nothing and its first loop (the body's; the FP loop's when there is no body) issues at most WIDE_GAIN
    of the instructions per token it issues at BLOCK_T (64), else 64. At 128 each warp's slab is 32
    tokens, so the accumulator's rescaling, the running max and sum and the loop's fixed cost are paid
    once per 32 tokens, not 16 (D = 128: int8 605 -> 404 SASS instructions per 64 tokens, int4-g64 686 ->
    552); but it holds twice the shared memory (fewer programs per SM: a gain of a few % does not pay for
    that), and it can spill (-prerope, -outP, TurboQuant's norm-corrected keys, GGUF blocks in bf16) or
    compile longer (nvfp4, mxfp4), which only the compiler's output shows. So both are compiled
    (`kvquant.kernels.compiled.resources` reads spills and the SASS loops) and the choice is kept per
    variant and device on the registry (`KernelRegistry.blocks`): two compiles and two reads of the
    binary on a variant's first call, nothing after. The interpreter (nothing is compiled) and D > 128
    (4 x 128 x 256 tiles do not fit in registers) take 64."""
    if d > 128 or _interpreting():
        return BLOCK_T
    blocks = getattr(registry, "blocks", None)  # key: (the variant but its block, the device)
    if blocks is not None and key in blocks:
        return blocks[key]
    from .compiled import resources
    from .registry import device_guard, is_build_failure, launch_device

    costs = {}
    for bt in (BLOCK_T, WIDE_BLOCK_T):
        grid, args, consts, _ = plan(bt)
        try:
            with device_guard(launch_device(args)):
                kernel = _paged_split_kernel.warmup(*args, grid=grid, **consts, num_warps=num_warps)
        except Exception as exc:  # noqa: BLE001 - filtered just below; anything else is re-raised
            if not is_build_failure(exc):
                raise
            continue  # (the launch of this size records and logs the failure itself)
        try:
            r = resources(kernel)
        except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as exc:  # no reader: 64
            why = str(exc).splitlines()[0][:200] if str(exc) else ""
            logger.warning("decode_attention: cannot read the compiled kernel (%s: %s); 64 tokens per "
                           "iteration", type(exc).__name__, why)
            costs = {}
            break
        loops = r.token_loops
        costs[bt] = (r.spill_bytes > 0, loops[0] / bt if loops else float("inf"))
    narrow, wide = costs.get(BLOCK_T), costs.get(WIDE_BLOCK_T)
    choice = BLOCK_T
    if wide is not None and (narrow is None or wide[0] < narrow[0]
                             or (wide[0] == narrow[0] and wide[1] <= WIDE_GAIN * narrow[1])):
        choice = WIDE_BLOCK_T
    logger.debug("decode_attention: %d tokens per iteration (spills, instructions per token: %s)", choice,
                 costs)
    if blocks is not None:
        blocks[key] = choice
    return choice


def _trusted(registry, variant: tuple, spec: _ProbeSpec, device: torch.device) -> bool:
    """Whether the registry lets this variant serve (its first-use self-check, `_probe`, agreed with the
    reference twin or is not wanted here). A stand-in registry (a benchmark's recorder) has no `trusted`."""
    trusted = getattr(registry, "trusted", None)
    if trusted is None:
        return True
    return trusted("decode_attention", variant, device, lambda: _probe(spec, device, registry))


# ----------------------------------------------------------------------------------------------- self-check

PROBE_ATOL = {torch.float16: 2e-4, torch.bfloat16: 2e-3, torch.float32: 2e-5}  # tests/kernels' atol


@dataclass(frozen=True)
class _ProbeSpec:
    """What makes a call compile its variant: a probe with the same fields compiles the same code."""

    dtype: torch.dtype
    fp_dtype: torch.dtype
    key_codec: object
    value_codec: object
    h_kv: int
    g: int
    d: int
    bs: int
    fbs: int
    has_body: bool
    has_fp: bool
    has_mask: bool
    num_warps: int
    body_stages: int | None
    fp_stages: int
    idx64: bool
    block_t: int = BLOCK_T


def _probe(spec: _ProbeSpec, device, registry) -> str | None:
    """The first-use self-check of one decode variant (`KernelRegistry.trusted`): a small layer of the same
    variant (2 sequences, two body blocks of its block_t tokens in two splits over shuffled pages, a sink
    of 2 and a window of 5 from mid-page when the variant has them, a left-padding mask when it has one)
    through the same launcher, against `decode_attention_ref`: None when |out - ref32| <= 2 |ref - ref32|
    + atol everywhere (the tests' bound), else what differed. None too when the variant cannot be built
    (the registry has recorded that; the caller takes the reference path)."""
    from .paged import make_paged_layer

    group = max(spec.key_codec.token_group, spec.value_codec.token_group) if spec.has_body else 1
    body = -(-2 * spec.block_t // group) * group if spec.has_body else 0
    fp = spec.has_fp
    layer = make_paged_layer(b=2, h_kv=spec.h_kv, d=spec.d, sink=2 if fp else 0, body=body,
                             recent=5 if fp else 0, recent_offset=3 if fp else 0, k=spec.key_codec,
                             v=spec.value_codec, dtype=spec.fp_dtype, block_size=spec.bs, spare=1, seed=1234,
                             device=device, fp_block_size=spec.fbs)
    gen = torch.Generator().manual_seed(99)
    q = torch.randn(2, spec.h_kv * spec.g, 1, spec.d, generator=gen).to(spec.dtype).to(device)
    mask = None
    if spec.has_mask:
        mask = torch.rand(2, layer.shape[2], generator=gen) < 0.8
        mask[1, :3] = False  # left padding
        mask[:, 0] = True
        mask = mask.to(device)
    args = layer.decode_args()
    out = _probe_launch(q, layer, mask, spec, device, registry)
    if out is None:
        return None
    ref32 = decode_attention_ref(q, *args, None, mask, upcast=True)
    ref = decode_attention_ref(q, *args, None, mask)
    return _compare(out, ref, ref32, PROBE_ATOL[spec.dtype])


def _probe_launch(q, layer, mask, spec: _ProbeSpec, device, registry) -> torch.Tensor | None:
    """The probe's call of the variant: the launcher, in the frames of its codecs (a GGUF block codec reads
    in the kernel's channel order, and llama.cpp's rotation when it has one), as `decode_attention` does."""
    kf = vf = None
    sink, recent, fp_k, fp_v = layer.sink, layer.recent, layer.fp_k, layer.fp_v
    if spec.has_body:
        kf, vf = _frames(layer.key_codec, layer.value_codec, device, registry)
        q, fp_k, fp_v, sink, recent = _into_frames(q, fp_k, fp_v, sink, recent, kf, vf)
    out = _launch(q, fp_k, fp_v, layer.key_pages, layer.value_pages, layer.key_codec, layer.value_codec, sink,
                  layer.body, recent, None, mask, 2, spec.num_warps, spec.body_stages, spec.fp_stages,
                  registry, idx64=spec.idx64, block_t=spec.block_t)
    return out if out is None or vf is None else vf.out_of(out)


def _compare(out: torch.Tensor, ref: torch.Tensor, ref32: torch.Tensor, atol: float) -> str | None:
    """None when out (B, 1, H_q, D) is within the float bound of ref32, else the largest miss and where."""
    err = (out.float() - ref32).abs()
    err = torch.where(torch.isfinite(out.float()), err, torch.full_like(err, float("inf")))
    bound = 2 * (ref.float() - ref32).abs().max().item() + atol
    worst = err.max().item()
    if worst <= bound:
        return None
    i = int(err.argmax())
    b, _, h, c = (int(x) for x in torch.unravel_index(torch.tensor(i), err.shape))
    return (f"max |out - ref32| = {worst:.3g} > bound {bound:.3g} at sequence {b}, query head {h}, "
            f"channel {c} (kernel {out[b, 0, h, c].item():.6g}, fp32 twin {ref32[b, 0, h, c].item():.6g}); "
            f"{int((err > bound).sum())} of {err.numel()} outputs over the bound")


# ----------------------------------------------------------------------------------------------- public


def decode_attention(
    query: torch.Tensor,
    fp_k: torch.Tensor | None,
    fp_v: torch.Tensor | None,
    key_pages: Mapping[str, torch.Tensor],
    value_pages: Mapping[str, torch.Tensor],
    key_codec,
    value_codec,
    sink,
    body,
    recent,
    scaling: float | None = None,
    key_mask: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    num_warps: int | None = None,
    body_stages: int | None = None,
    fp_stages: int = 1,
    registry: KernelRegistry | None = None,
    block_t: int | None = None,
) -> torch.Tensor | None:
    """Attention of one query token per sequence over the paged sink | body | recent of one layer.

    query: (B, H_q, 1, D), fp16/bf16/fp32, D a power of two >= 16 (64, 128, 256 in practice); H_q a
        multiple of H_kv (GQA; H_kv = 1 is MQA).
    fp_k, fp_v: FP pools (P_fp, H_kv, BS, D), float; may be None when sink and recent hold no token.
    key_pages / value_pages: the body pools by codec field name, (P_b, heads_f, BS // tokens_f, cols_f)
        (codecs.base); key_codec / value_codec: their codecs, with a kernel layout or `-rot` around one
        (`kvquant.codecs.transforms.kernel_frame`).
    sink, body, recent: regions (`.table` (B or 1, n) int64, `.offset`, `.length`) or None; sink and
        recent index the FP pools, body the body pools. The body offset and BS are multiples of each
        codec's token group.
    scaling: softmax scale; None = 1/sqrt(D).
    key_mask: (B, T) or (1, T) bool, T = S + T_body + R, True = attend, positions in sink | body | recent
        order; any pattern; any strides. num_splits: body splits per (sequence, KV head); None = fill
        the GPU. num_warps: None = 4 up to D=128, 8 at D=256; body_stages: None = 2 up to D=128, 1 at
        D=256 (shared memory). registry: where a variant that cannot be
        built is remembered (default: a shared one). block_t: body tokens per loop iteration, 64 or 128
        (a multiple of 16 that fits); None = `_block_tokens`' choice (64 in the interpreter and at D=256).
    Returns (B, 1, H_q, D) in query's dtype, or None when this variant cannot be built on the device
    (logged once per variant): the caller then takes the reference path.
    A sequence whose mask row is all False gets zeros (torch SDPA's math path does the same), not NaN.
    A rotated codec (`-rot` around a codec with a kernel layout) is served in its rotated frame (see the
    module docstring).
    """
    registry = registry or default_registry()
    kf = vf = None
    if _length(body):
        kf, vf = _frames(key_codec, value_codec, query.device, registry)
        key_codec, value_codec = kf.codec, vf.codec
        query, fp_k, fp_v, sink, recent = _into_frames(query, fp_k, fp_v, sink, recent, kf, vf)
    out = _launch(query, fp_k, fp_v, key_pages, value_pages, key_codec, value_codec, sink, body, recent,
                  scaling, key_mask, num_splits, num_warps, body_stages, fp_stages, registry, block_t=block_t)
    return out if out is None or vf is None else vf.out_of(out)  # (B, 1, H_q, D): T_v^T sum_j p_j (T_v v_j)


def _frames(key_codec, value_codec, device, registry) -> tuple[KernelFrame, KernelFrame]:
    """The frames the kernel reads the body codecs in (`kernels.layouts.decode_frame`); ValueError for a
    codec no kernel reads."""
    frames = tuple(decode_frame(c, device, registry) for c in (key_codec, value_codec))
    for codec, frame in zip((key_codec, value_codec), frames, strict=True):
        if frame is None:
            raise ValueError(f"decode_attention: no kernel reads the codec {codec}")
    return frames


def _into_frames(query, fp_k, fp_v, sink, recent, kf: KernelFrame, vf: KernelFrame):
    """The query in the keys' frame and the FP sink and window tokens in their frames, so that the whole
    softmax runs in one frame: (T_k q).(T_k k) = q.k. Unchanged when both frames are the identity."""
    if kf.identity and vf.identity:
        return query, fp_k, fp_v, sink, recent
    query = kf.into(query)  # (B, H_q, 1, D)
    return (query, *_rotated_fp(fp_k, fp_v, sink, recent, kf, vf))


@dataclass(frozen=True)
class _Region:
    """A region renumbered into another pool (the attributes the launcher reads)."""

    table: torch.Tensor  # (B or 1, n_pages) int64
    offset: int
    length: int


def _rotated_fp(fp_k, fp_v, sink, recent, kf: KernelFrame, vf: KernelFrame):
    """Copies of the FP pages that sink and recent use, K in kf's frame and V in vf's, as a small pool
    (n, H_kv, BS, D) of fp_k's dtype, and the two regions renumbered into it. Slots outside a region are
    copied too (rotation mixes channels, never tokens) and never read."""
    if _length(sink) + _length(recent) == 0:
        return fp_k, fp_v, sink, recent
    bs = fp_k.shape[2]
    ids, regions, base = [], [], 0
    for region in (sink, recent):
        if _length(region) == 0:
            regions.append(region)
            continue
        n = -(-(int(region.offset) + int(region.length)) // bs)  # the pages it uses
        used = region.table[:, :n]  # (B or 1, n)
        ids.append(used.reshape(-1))
        table = base + torch.arange(used.numel(), device=used.device).view(used.shape)
        regions.append(_Region(table, int(region.offset), int(region.length)))
        base += used.numel()
    pages = torch.cat(ids)  # (n,)
    k = kf.into(fp_k[pages])  # (n, H_kv, BS, D)
    v = vf.into(fp_v[pages])
    return k, v, regions[0], regions[1]


def gather_region(pool: torch.Tensor, region, tokens: int = 1) -> torch.Tensor:
    """The rows of a region from a pool (P, heads_f, BS // tokens, cols) -> (B, heads_f, n, cols).

    tokens: tokens per row of this field (a codec field's `tokens`); the region's offset and length
    are multiples of it. A copy (advanced indexing), for the reference path and tests."""
    bs = pool.shape[2] * tokens
    n = region.length // tokens
    j = int(region.offset) + torch.arange(n, device=pool.device) * tokens  # first token of each row
    table = region.table.to(pool.device)
    pages = table[:, j // bs]  # (B, n)
    rows = (j % bs) // tokens  # (n,)
    # (B, n, heads_f, cols) -> (B, heads_f, n, cols)
    return pool[pages, :, rows.expand_as(pages)].transpose(1, 2)


def _gather_fields(pages: Mapping[str, torch.Tensor], codec, region) -> dict[str, torch.Tensor]:
    fields = codec.fields()
    return {name: gather_region(pool, region, fields[name].tokens) for name, pool in pages.items()
            if name in fields}


def decode_attention_ref(
    query: torch.Tensor,
    fp_k: torch.Tensor | None,
    fp_v: torch.Tensor | None,
    key_pages: Mapping[str, torch.Tensor],
    value_pages: Mapping[str, torch.Tensor],
    key_codec,
    value_codec,
    sink,
    body,
    recent,
    scaling: float | None = None,
    key_mask: torch.Tensor | None = None,
    *,
    upcast: bool = False,
    **unused,
) -> torch.Tensor:
    """The reference twin of `decode_attention` (same arguments and shapes): gather the pages, decode
    the body with its codec, then plain attention.

    upcast=False computes in query's dtype, with K/V decoded to it (what the PyTorch path does);
    upcast=True computes everything in fp32 from K/V decoded straight to fp32 (the accuracy yardstick).
    A sequence with an all-False key_mask row gets zeros, as from the kernel.
    """
    dtype = torch.float32 if upcast else query.dtype
    bsz, h_q, _, d = query.shape
    keys, vals = [], []
    for part in ("sink", "body", "recent"):
        region = {"sink": sink, "body": body, "recent": recent}[part]
        if _length(region) == 0:
            continue
        if part == "body":  # decode_at: a position-dependent codec (-prerope keys) needs the body's start
            start = getattr(region, "start", _length(sink))
            k = key_codec.decode_at(_gather_fields(key_pages, key_codec, region), start, dtype)
            v = value_codec.decode_at(_gather_fields(value_pages, value_codec, region), start, dtype)
        else:
            k, v = gather_region(fp_k, region).to(dtype), gather_region(fp_v, region).to(dtype)
        keys.append(k.expand(bsz, -1, -1, -1))
        vals.append(v.expand(bsz, -1, -1, -1))
    k, v = torch.cat(keys, dim=2), torch.cat(vals, dim=2)  # (B, H_kv, T, D)
    g = h_q // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, H_q, T, D)
    scale = (1.0 / math.sqrt(d)) if scaling is None else scaling
    scores = (query.to(dtype) @ k.transpose(-1, -2)).float() * scale  # (B, H_q, 1, T)
    valid = torch.ones(bsz, k.shape[2], dtype=torch.bool, device=query.device)
    if key_mask is not None:
        valid = valid & key_mask.to(query.device)  # (B or 1, T) broadcasts
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # NaN on an all-False row: 0/0
    probs = probs.masked_fill(~valid.any(dim=1)[:, None, None, None], 0.0).to(dtype)
    return (probs @ v).transpose(1, 2)  # (B, 1, H_q, D)
