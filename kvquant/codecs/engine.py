"""Engine block formats as codecs, bit for bit: llama.cpp's KV cache types (`llama.cpp:q8_0`, `q4_0`, `q4_1`,
`q5_0`, `q5_1`, `iq4_nl`) and the FP4 block formats `mxfp4` (OCP MX) and `nvfp4`, in the byte layout of the
GGUF / ggml block structs.

Each (token, head) vector of D channels is cut into blocks along D (32 elements; 64 for nvfp4) and each block
stored as the bytes of its C struct, so one field holds everything and bytes per token are the engine's:

    field    heads_f   tokens_f   cols_f                         dtype
    blocks   H         1          D / block * type_size          uint8 (the GGUF block bytes, in order)

    format   block  bytes  struct (little-endian, in order)                             bits / value
    q8_0     32     34     d fp16 | qs int8[32]                                         8.5
    q4_0     32     18     d fp16 | qs[16]: element j low nibble, j + 16 high nibble    4.5
    q4_1     32     20     d fp16 | m fp16 | qs[16]                                     5.0
    q5_0     32     22     d fp16 | qh uint32 (bit j: 5th bit of element j) | qs[16]    5.5
    q5_1     32     24     d fp16 | m fp16 | qh uint32 | qs[16]                         6.0
    iq4_nl   32     18     d fp16 | qs[16]: indices into kvalues_iq4nl                  4.5
    mxfp4    32     17     e E8M0 | qs[16]: E2M1 codes                                  4.25
    nvfp4    64     36     d UE4M3[4] (one per 16) | qs[32]: per 16, j low, j + 8 high   4.5

The arithmetic follows ggml/src/ggml-quants.c of ggml-org/llama.cpp at commit
01243c587feceaa5d6a6c2305535ef2f549c48b8 (`quantize_row_q4_0_ref`, ..., `quantize_row_iq4_nl_ref`,
`quantize_row_mxfp4_ref`, `quantize_row_nvfp4_ref`, `best_index_int8`, `best_index_mxfp4`; the E8M0 / UE4M3
conversions of ggml/src/ggml-impl.h), in fp32 as the C code computes it: the scale is computed in fp32, its
reciprocal taken from the fp32 value (`id = d ? 1/d : 0`), the codes rounded against that reciprocal, and
only then the scale stored as fp16 (so the decoder's scale is not the one the codes were rounded with,
exactly as in llama.cpp). Rounding as in C: `(int8_t)(x * id + 8.5f)` (truncation of a biased value) for
q4/q5, `roundf` (half away from zero) for q8_0, nearest table entry with ties going up for iq4_nl
(`best_index_int8`), nearest E2M1 value with ties going to the lower index, i.e. toward zero, for mxfp4 /
nvfp4 (`best_index_mxfp4`; the OCP spec and torchao round ties to even).

What llama.cpp's cache does with these bytes: `ggml_set_rows` / `ggml_cpy` from F32 into the cache type. The
CUDA copy kernels (`ggml/src/ggml-cuda/cpy-utils.cuh`) repeat the reference arithmetic for q4/q5/q8 (up to
NaN handling); the CPU backend's q8_0 `from_float` is a SIMD routine that rounds half to even with
`id = 127 / amax` and can differ from the reference in the last code on ties; iq4_nl's CUDA kernel
sums its weighted moments in another order. The C compiler may contract `sumqx += w * q * x` into an FMA
(GCC's default `-ffp-contract=fast` with `-march=native`); this module does not, so iq4_nl's stored scale
can differ in its last fp16 bit from an FMA build.

Non-finite input, as the C reference (compiled for x86-64) does it, not as the `gguf` package's numpy port:
- the absmax / min / max loops compare with `<` / `>`, so a NaN element is skipped (q4_0, q4_1, q5_0, q5_1,
  iq4_nl, mxfp4, nvfp4); q8_0's `MAX(amax, fabsf(v))` macro keeps NaN only when it is the block's last element
  (a NaN in the middle is replaced by the next element's magnitude);
- a float -> int8 / uint8 cast of NaN or +-Inf (undefined in C) yields 0, as x86's cvttss2si does, so a NaN
  element gets code 0 (q4_0: -8 * d, the block's largest magnitude), and an Inf absmax gives d = Inf, id = 0;
- `gguf.quants` instead lets NaN win numpy's argmax / max and writes a NaN scale for the block; it also
  stores +0 (C: -0) as q4_0 / q5_0's scale of an all -0 block and NaN (C: +Inf) as q4_1 / q5_1's scale of an
  all +Inf block. tests/test_engine_formats.py checks the agreement everywhere else (+-Inf included) and
  each of these differences.

nvfp4 here is ggml's block_nvfp4: block scales in UE4M3 (E4M3 without the sign; `ggml_fp32_to_ue4m3` rounds
half up and saturates at 448) of amax / 6, and no per-tensor scale in the blocks. vLLM and TensorRT-LLM add
one FP32 per-tensor (per-layer K or V) scale on top, which in a cache that appends must be fixed before the
first token: vLLM takes k_scale / v_scale from the checkpoint and uses 1.0 when there are none
(docs/features/quantization/quantized_kvcache.md: "All quantization scales are set to 1.0"); FlashInfer's
`nvfp4_quantize_paged_kv_cache` computes 448 / amax over the whole cache when not given one, which is not
appendable. This codec uses the fixed scale 1.0 (the uncalibrated engine default), so the stored bytes are
exactly ggml's; a calibrated per-layer scale s would divide K/V by s before these blocks and multiply after.

llama.cpp's attention rotation (PR #21038, merged 2026-04-01; src/llama-kv-cache.cpp and src/llama-graph.cpp):
with a quantized cache type and head_dim % 64 == 0, llama.cpp multiplies Q and K by a Hadamard matrix of
order n_k (the largest power of two dividing head_dim) and V by one of order 64, blockwise along head_dim,
before K/V are written, and rotates the attention output back; LLAMA_ATTN_ROT_DISABLE=1 turns it off. The
plain `llama.cpp:*` names do the same (`EngineCodec`: gguf's blocks of the rotated rows, rotated back on
decode), `-norot` is the variable set, `-rot` insists on it (refused at head_dim % 64 != 0). The rotation
is fp32 matrix arithmetic, whose summation order differs between backends: rotated rows can differ from a
llama.cpp build's in the last bit, and then a code; the blocks of given rows are gguf's exactly.

The Triton decode kernel reads these blocks in place (`kvquant.kernels.engine_blocks`; which codec it reads
and in which frame, llama.cpp's rotation included, is `kvquant.kernels.layouts.decode_frame`); `kernel_layout`
stays None. Appends with the Triton backend are packed by `kvquant.kernels.pack_engine` (these bytes, from
`rows`); the PyTorch reference path is this module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..scheme import ENGINE_FORMATS, QuantSpec, SchemeError
from ..spec_types import EngineFormat
from .base import Codec, Field, register

__all__ = [
    "BLOCK_TYPES",
    "BlockType",
    "EngineCodec",
    "IQ4_NL_VALUES",
    "MXFP4_VALUES",
    "attn_rotate",
    "attn_rotation_size",
    "ggml_dequantize",
    "ggml_quantize",
    "hadamard",
    "llama_rotation_default",
    "ue4m3_from_fp32",
    "ue4m3_to_fp32",
]

GGML_COMMIT = "01243c587feceaa5d6a6c2305535ef2f549c48b8"  # ggml-org/llama.cpp, ggml/src/ggml-quants.c
GROUP_MAX_EPS = 1e-15  # ggml-quants.c: below this absmax an iq4_nl block is all zero
FLT_MAX = 3.4028234663852886e38
# kvalues_iq4nl (ggml-common.h): the non-linear 4-bit levels
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# kvalues_mxfp4 (ggml-common.h): E2M1 values doubled, in code order (code 8 is -0)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


# ------------------------------------------------------------------------------------------------ helpers


def _c_int(v: torch.Tensor) -> torch.Tensor:
    """C's float -> (u)int8 cast as x86-64 compiles it: truncation toward zero; NaN or +-Inf -> 0 (cvttss2si
    gives INT_MIN, whose low byte is 0). Finite values here are always in range. fp32 in, fp32 out."""
    return torch.where(torch.isfinite(v), torch.trunc(v), torch.zeros_like(v))


def _signed_absmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` from amax = max = 0: the first element of largest
    magnitude, NaN skipped. x (N, G) fp32 -> (amax (N,), max (N,))."""
    a = x.abs()
    a = torch.where(torch.isnan(a), torch.full_like(a, -1.0), a)
    idx = a.argmax(dim=-1, keepdim=True)  # first maximal index
    amax = a.gather(-1, idx).squeeze(-1)
    vmax = x.gather(-1, idx).squeeze(-1)
    zero = torch.zeros_like(amax)
    return torch.where(amax > 0, amax, zero), torch.where(amax > 0, vmax, zero)


def _min_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`min = FLT_MAX; max = -FLT_MAX; if (v < min) min = v; if (v > max) max = v;` (NaN skipped; an Inf
    beyond the initial value does not replace it on the side it cannot beat)."""
    nan = torch.isnan(x)
    lo = torch.where(nan, torch.full_like(x, FLT_MAX), x).amin(dim=-1).clamp(max=FLT_MAX)
    hi = torch.where(nan, torch.full_like(x, -FLT_MAX), x).amax(dim=-1).clamp(min=-FLT_MAX)
    return lo, hi


def _recip(d: torch.Tensor) -> torch.Tensor:
    """`id = d ? 1.0f/d : 0.0f` (NaN is true in C)."""
    return torch.where(d != 0, 1.0 / d, torch.zeros_like(d))


def _fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """fp32 (N,) -> (N, 2) uint8: GGML_FP32_TO_FP16 (round to nearest even), little-endian."""
    return v.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _fp16_from(b: torch.Tensor) -> torch.Tensor:
    """(N, 2) uint8 -> (N, 1) fp32."""
    return b.contiguous().view(torch.float16).float().reshape(-1, 1)


def _nibbles(codes: torch.Tensor, half: int) -> torch.Tensor:
    """(N, 2 * half) codes 0..15 -> (N, half) bytes: element j in the low nibble of byte j, j + half high."""
    c = codes.to(torch.uint8)
    return c[:, :half] | (c[:, half:] << 4)


def _unnibble(qs: torch.Tensor) -> torch.Tensor:
    """The inverse of `_nibbles`: (N, half) bytes -> (N, 2 * half) codes (int64)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1).long()


def _high_bits(codes: torch.Tensor) -> torch.Tensor:
    """(N, 32) 5-bit codes -> (N, 4) bytes of the uint32 qh: bit j is bit 4 of element j (little-endian)."""
    bits = ((codes.long() >> 4) & 1).reshape(-1, 4, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.long, device=codes.device)
    return (bits * weights).sum(-1).to(torch.uint8)


def _unhigh_bits(qh: torch.Tensor) -> torch.Tensor:
    """(N, 4) qh bytes -> (N, 32) values 0 or 16."""
    shifts = torch.arange(8, device=qh.device)
    return (((qh.long()[:, :, None] >> shifts) & 1) << 4).reshape(-1, 32)


def _table(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


# ------------------------------------------------------------------------------------------- llama.cpp


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_q8_0_ref: d = amax / 127, q = roundf(x * id)."""
    a = x.abs()
    nan = torch.isnan(a)
    pos = torch.arange(x.shape[-1], device=x.device)
    last_nan = torch.where(nan, pos, -1).amax(dim=-1, keepdim=True)
    # MAX(amax, fabsf(v)) = amax > v ? amax : v: a NaN is kept only until the next element replaces it
    amax = torch.where(pos > last_nan, a, torch.zeros_like(a)).amax(dim=-1)
    amax = torch.where(last_nan.squeeze(-1) == x.shape[-1] - 1, torch.full_like(amax, float("nan")), amax)
    d = amax / 127.0
    v = x * _recip(d)[:, None]
    t = torch.trunc(v)
    r = t + torch.where((v - t).abs() >= 0.5, torch.sign(v), torch.zeros_like(v))  # roundf: half away from 0
    qs = _c_int(r).to(torch.int8).view(torch.uint8)
    return torch.cat((_fp16_bytes(d), qs), dim=-1)


def _q8_0_dec(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _fp16_from(b[:, :2])


def _qx_0(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_0 / q5_0 (levels 16 / 32): d = max / -(levels / 2) (max: the signed value of largest magnitude),
    code = MIN(levels - 1, (int8_t)(x * id + levels / 2 + 0.5f))."""
    _, vmax = _signed_absmax(x)
    d = vmax / -(levels // 2)
    v = x * _recip(d)[:, None] + (levels // 2 + 0.5)
    return d, _c_int(v).clamp(0, levels - 1)


def _qx_1(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4_1 / q5_1: d = (max - min) / (levels - 1), code = (int8_t)((x - min) * id + 0.5f) (q4_1: MIN 15)."""
    lo, hi = _min_max(x)
    d = (hi - lo) / (levels - 1)
    v = (x - lo[:, None]) * _recip(d)[:, None] + 0.5
    return d, lo, _c_int(v).clamp(0, levels - 1)


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    d, codes = _qx_0(x, 16)
    return torch.cat((_fp16_bytes(d), _nibbles(codes, 16)), dim=-1)


def _q4_0_dec(b: torch.Tensor) -> torch.Tensor:
    return (_unnibble(b[:, 2:]) - 8).float() * _fp16_from(b[:, :2])


def _q4_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, codes = _qx_1(x, 16)
    return torch.cat((_fp16_bytes(d), _fp16_bytes(lo), _nibbles(codes, 16)), dim=-1)


def _q4_1_dec(b: torch.Tensor) -> torch.Tensor:
    return _unnibble(b[:, 4:]).float() * _fp16_from(b[:, :2]) + _fp16_from(b[:, 2:4])


def _q5_0(x: torch.Tensor) -> torch.Tensor:
    d, codes = _qx_0(x, 32)
    low = _nibbles(codes.long() & 0x0F, 16)
    return torch.cat((_fp16_bytes(d), _high_bits(codes), low), dim=-1)


def _q5_0_dec(b: torch.Tensor) -> torch.Tensor:
    q = _unnibble(b[:, 6:]) | _unhigh_bits(b[:, 2:6])
    return (q - 16).float() * _fp16_from(b[:, :2])


def _q5_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, codes = _qx_1(x, 32)
    low = _nibbles(codes.long() & 0x0F, 16)
    return torch.cat((_fp16_bytes(d), _fp16_bytes(lo), _high_bits(codes), low), dim=-1)


def _q5_1_dec(b: torch.Tensor) -> torch.Tensor:
    q = _unnibble(b[:, 8:]) | _unhigh_bits(b[:, 4:8])
    return q.float() * _fp16_from(b[:, :2]) + _fp16_from(b[:, 2:4])


def _best_index_int8(v: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """best_index_int8: the level whose midpoint with its lower neighbour x has reached, comparing 2x with the
    sum of the two levels (exact); ties go up, NaN gets 0. v (...) fp32 -> (...) int64."""
    mids = values[:-1] + values[1:]  # (15,)
    return ((v + v)[..., None] >= mids).sum(-1)


def _iq4_nl(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_iq4_nl_ref (quantize_row_iq4_nl_impl with ntry = -1, no importance weights): codes against
    id = 1 / (max / -127), then the least-squares scale d = sum(w q x) / sum(w q^2) with w = x^2, summed in
    element order; the codes are not re-chosen against d."""
    values = _table(IQ4_NL_VALUES, x.device)
    amax, vmax = _signed_absmax(x)
    d0 = vmax / float(IQ4_NL_VALUES[0])
    ident = 1.0 / d0
    codes = _best_index_int8(ident[:, None] * x, values)  # (N, 32)
    q = values[codes]
    w = x * x
    sumqx = torch.zeros_like(amax)
    sumq2 = torch.zeros_like(amax)
    for j in range(x.shape[-1]):  # the C loop's summation order
        wq = w[:, j] * q[:, j]
        sumqx = sumqx + wq * x[:, j]
        sumq2 = sumq2 + wq * q[:, j]
    d = torch.where(sumq2 > 0, sumqx / sumq2, torch.zeros_like(sumq2))
    small = ~(amax >= GROUP_MAX_EPS)  # amax < GROUP_MAX_EPS: scale 0, codes 0
    d = torch.where(small, torch.zeros_like(d), d)
    codes = torch.where(small[:, None], torch.zeros_like(codes), codes)
    return torch.cat((_fp16_bytes(d), _nibbles(codes, 16)), dim=-1)


def _iq4_nl_dec(b: torch.Tensor) -> torch.Tensor:
    return _fp16_from(b[:, :2]) * _table(IQ4_NL_VALUES, b.device)[_unnibble(b[:, 2:])]


# ------------------------------------------------------------------------------------------ MXFP4 / NVFP4


def _best_index_mxfp4(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """best_index_mxfp4: the first code minimising |kvalues_mxfp4[i] * d - x| (strict <, so ties go to the
    lower code: toward zero); NaN -> 0. x (N, G), d (N, 1) -> (N, G) int64."""
    kv = _table(MXFP4_VALUES, x.device)
    err = (kv * d[..., None] - x[..., None]).abs()  # (N, G, 16)
    best = err.argmin(dim=-1)
    return torch.where(torch.isnan(x), torch.zeros_like(best), best)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: 2^(e - 128) as fp32 bits (e < 2: the subnormal 0x00200000 << e)."""
    e = e.long()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.to(torch.int32).view(torch.float32)


def _mxfp4(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_mxfp4_ref: e = (uint8_t)(floorf(log2f(amax)) - 2 + 127), d = 2^(e - 127) / 2."""
    amax, _ = _signed_absmax(x)
    lg = torch.log2(amax.double()).float()  # log2f, correctly rounded to fp32 (a libm log2f's result)
    f = torch.floor(lg) - 2 + 127
    e = torch.where(torch.isfinite(f), f, torch.zeros_like(f)).long() & 0xFF  # (uint8_t) cast, x86
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    d = _e8m0_half(e)
    codes = _best_index_mxfp4(x, d[:, None])
    return torch.cat((e.to(torch.uint8)[:, None], _nibbles(codes, 16)), dim=-1)


def _mxfp4_dec(b: torch.Tensor) -> torch.Tensor:
    return _table(MXFP4_VALUES, b.device)[_unnibble(b[:, 1:])] * _e8m0_half(b[:, 0])[:, None]


def ue4m3_from_fp32(x: torch.Tensor) -> torch.Tensor:
    """ggml_fp32_to_ue4m3: unsigned E4M3 (bias 7) from fp32, rounding half up on the 4th mantissa bit,
    subnormals as (int)(x * 512 + 0.5), saturating to 0x7E (448); x <= 0 or NaN -> 0. fp32 -> uint8."""
    pos = x > 0
    x = torch.where(pos, x.clamp(max=448.0), torch.ones_like(x))
    bits = x.view(torch.int32).long()
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    man = ((bits >> 20) & 0x7) + ((bits >> 19) & 1)
    carry = man > 7
    exp = torch.where(carry, exp + 1, exp)
    man = torch.where(carry, torch.zeros_like(man), man)
    normal = torch.where(exp >= 15, torch.full_like(exp, 0x7E), (exp << 3) | man)
    sub = torch.trunc(x * 512.0 + 0.5).long().clamp(max=7)
    sub = torch.where(sub < 1, torch.zeros_like(sub), sub)
    first_exp = ((bits >> 23) & 0xFF) - 127 + 7
    out = torch.where(first_exp <= 0, sub, normal)
    return torch.where(pos, out, torch.zeros_like(out)).to(torch.uint8)


def ue4m3_to_fp32(u: torch.Tensor) -> torch.Tensor:
    """ggml_ue4m3_to_fp32: the UE4M3 value times 0.5 (kvalues_mxfp4 are doubled); 0 and 0x7F -> 0."""
    u = u.long()
    exp = (u >> 3) & 0xF
    man = (u & 0x7).double()
    raw = torch.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * torch.pow(2.0, (exp - 7).double()))
    raw = torch.where((u == 0) | (u == 0x7F), torch.zeros_like(raw), raw)
    return (raw * 0.5).float()  # exact: at most 4 significant bits


def _nvfp4(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_nvfp4_ref: per 16 elements, ue = fp32_to_ue4m3(amax / 6), codes against its value."""
    sub = x.reshape(-1, 16)  # (N * 4, 16)
    amax, _ = _signed_absmax(sub)
    ue = ue4m3_from_fp32(amax / 6.0)
    codes = _best_index_mxfp4(sub, ue4m3_to_fp32(ue)[:, None])
    qs = _nibbles(codes, 8).reshape(-1, 32)  # sub-block s at bytes 8s .. 8s + 7
    return torch.cat((ue.reshape(-1, 4), qs), dim=-1)


def _nvfp4_dec(b: torch.Tensor) -> torch.Tensor:
    d = ue4m3_to_fp32(b[:, :4]).reshape(-1, 1)  # (N * 4, 1)
    codes = _unnibble(b[:, 4:].reshape(-1, 8))  # (N * 4, 16)
    return (_table(MXFP4_VALUES, b.device)[codes] * d).reshape(-1, 64)


# --------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type: `block` elements along D stored as `type_size` bytes."""

    name: str  # the GGML type name (gguf.GGMLQuantizationType member)
    block: int
    type_size: int
    encode: Callable[[torch.Tensor], torch.Tensor]  # (N, block) fp32 -> (N, type_size) uint8
    decode: Callable[[torch.Tensor], torch.Tensor]  # (N, type_size) uint8 -> (N, block) fp32
    source: str  # the C function whose arithmetic `encode` follows


BLOCK_TYPES: dict[str, BlockType] = {
    "q8_0": BlockType("Q8_0", 32, 34, _q8_0, _q8_0_dec, "quantize_row_q8_0_ref"),
    "q4_0": BlockType("Q4_0", 32, 18, _q4_0, _q4_0_dec, "quantize_row_q4_0_ref"),
    "q4_1": BlockType("Q4_1", 32, 20, _q4_1, _q4_1_dec, "quantize_row_q4_1_ref"),
    "q5_0": BlockType("Q5_0", 32, 22, _q5_0, _q5_0_dec, "quantize_row_q5_0_ref"),
    "q5_1": BlockType("Q5_1", 32, 24, _q5_1, _q5_1_dec, "quantize_row_q5_1_ref"),
    "iq4_nl": BlockType("IQ4_NL", 32, 18, _iq4_nl, _iq4_nl_dec, "quantize_row_iq4_nl_ref"),
    "mxfp4": BlockType("MXFP4", 32, 17, _mxfp4, _mxfp4_dec, "quantize_row_mxfp4_ref"),
    "nvfp4": BlockType("NVFP4", 64, 36, _nvfp4, _nvfp4_dec, "quantize_row_nvfp4_ref"),
}


def _block_type(fmt: str) -> BlockType:
    key = fmt.rpartition(":")[2].lower().removesuffix("-norot").removesuffix("-rot")
    try:
        return BLOCK_TYPES[key]
    except KeyError:
        raise SchemeError(f"unknown block format {fmt!r}; known: {', '.join(BLOCK_TYPES)}") from None


def ggml_quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows x (..., D) -> their GGUF blocks (..., D / block * type_size) uint8, as ggml's reference
    quantizer writes them (fmt: "q4_0", "llama.cpp:q4_0", "mxfp4", ...). x is taken in fp32 (ggml quantizes
    from F32)."""
    bt = _block_type(fmt)
    d = x.shape[-1]
    if d % bt.block:
        raise SchemeError(f"{fmt} stores blocks of {bt.block} values: a row of {d} is not a multiple of it")
    blocks = x.float().reshape(-1, bt.block)
    return bt.encode(blocks).reshape(*x.shape[:-1], d // bt.block * bt.type_size)


def ggml_dequantize(b: torch.Tensor, fmt: str) -> torch.Tensor:
    """GGUF blocks (..., n * type_size) uint8 -> fp32 rows (..., n * block), as ggml's dequantize_row_*."""
    bt = _block_type(fmt)
    n = b.shape[-1]
    if b.dtype != torch.uint8 or n % bt.type_size:
        raise SchemeError(
            f"{fmt} blocks are uint8 rows of a multiple of {bt.type_size} bytes, got {b.dtype} x {n}"
        )
    out = bt.decode(b.contiguous().reshape(-1, bt.type_size))
    return out.reshape(*b.shape[:-1], n // bt.type_size * bt.block)


# ------------------------------------------------------------------------------ llama.cpp attention rotation

ATTN_ROT_COMMIT = "llama.cpp PR #21038 (2026-04-01), src/llama-kv-cache.cpp and src/llama-graph.cpp"
ATTN_ROT_MIN = 64  # llama_kv_cache: attn_rot_k/v need n_embd_head % 64 == 0; the smallest matrix is 64 x 64


def hadamard(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return _hadamard_cpu(n).to(device)


@functools.lru_cache(maxsize=16)
def _hadamard_cpu(n: int) -> torch.Tensor:
    """ggml_gen_hadamard (src/llama-kv-cache.cpp): the n x n orthonormal Walsh-Hadamard matrix in fp32,
    data[0] = 1.0 / sqrtf(n) (a double quotient of the fp32 root, stored as float) copied with the Sylvester
    signs: H[i, j] = data[0] * (-1)^popcount(i & j). Symmetric and self-inverse (H @ H == I up to
    rounding)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix of order {n}: n must be a power of two")
    root = float(torch.tensor(math.sqrt(n), dtype=torch.float32))  # sqrtf(n)
    val = float(torch.tensor(1.0 / root, dtype=torch.float32))  # the double quotient, stored as float
    i = torch.arange(n)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return torch.where(parity == 1, -val, val).to(torch.float32)  # cached: callers never write to it


def attn_rotation_size(head_dim: int, role: str | None) -> int:
    """The order of the rotation llama.cpp applies to K (and Q) or V of this head_dim: for K the largest
    power of two (>= 64) dividing head_dim (`build_input_k_rot`), for V always 64 (`build_input_v_rot`:
    "using smaller rotation matrices for V seems beneficial"). role None is taken as K."""
    if head_dim % ATTN_ROT_MIN:
        raise SchemeError(f"llama.cpp rotates only head_dim multiples of 64, not {head_dim}")
    if role == "v":
        return ATTN_ROT_MIN
    n = ATTN_ROT_MIN
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def attn_rotate(x: torch.Tensor, n: int) -> torch.Tensor:
    """`ggml_mul_mat_aux(ctx, cur, rot)`: every run of n consecutive values along the last dimension times
    the n x n Hadamard matrix, in fp32; its own inverse. x (..., D), D a multiple of n -> (..., D) fp32."""
    shape = x.shape
    y = x.float().reshape(*shape[:-1], shape[-1] // n, n) @ hadamard(n, x.device)
    return y.reshape(shape)


def llama_rotation_default(engine: str, head_dim: int) -> bool:
    """Whether llama.cpp rotates a cache of this type: `attn_rot_k = !LLAMA_ATTN_ROT_DISABLE &&
    ggml_is_quantized(type_k) && n_embd_head_k % 64 == 0` (the same for V). `-norot` is the environment
    variable set, `-rot` the rotation asked for (refused when head_dim % 64 != 0); mxfp4 / nvfp4 are not
    llama.cpp cache names here and are never rotated."""
    if not engine.startswith("llama.cpp:") or engine.endswith("-norot"):
        return False
    return engine.endswith("-rot") or head_dim % ATTN_ROT_MIN == 0


@register(EngineFormat)
class EngineCodec(Codec):
    """An engine's block format (`llama.cpp:q4_0`, ..., `mxfp4`, `nvfp4`): each (token, head) vector stored
    as its GGUF block bytes in one uint8 field `blocks`; see the module docstring for the formats and the
    source.

    llama.cpp's names rotate as llama.cpp does by default (since PR #21038, April 2026): when head_dim is a
    multiple of 64, K (with Q) and V are multiplied blockwise by a Hadamard matrix (`attn_rotate`, order
    `attn_rotation_size`) before they are quantized, and attention runs in the rotated frame; the output is
    rotated back. Here decode rotates back each decoded row instead ((H q) . k' = q . (H k') and
    sum p (H v') = H sum p v', H symmetric and self-inverse): the same attention up to fp32 rounding, with
    the stored bytes exactly gguf's blocks of the rotated rows. `-norot` (LLAMA_ATTN_ROT_DISABLE=1) stores
    gguf's blocks of the rows themselves. The role (K or V, from `bind`) sets the order for head_dim >= 128;
    an unbound codec (fake_quantize) takes K's."""

    def __init__(self, spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__(
            spec, heads, head_dim, dtype
        )  # spec.check_head_dim refuses D not a multiple of the block (and -rot below 64)
        if spec.engine not in ENGINE_FORMATS:
            raise SchemeError(f"{spec} is not an engine format; known: {', '.join(ENGINE_FORMATS)}")
        self.block_type = _block_type(spec.engine)
        self.rotated = llama_rotation_default(spec.engine, head_dim)
        self.rotation = attn_rotation_size(head_dim, None) if self.rotated else None

    def bind(self, *, layer: int | None, role: str | None, calib, spec: QuantSpec) -> None:
        if self.rotated:
            self.rotation = attn_rotation_size(self.head_dim, role)

    def fields(self) -> dict[str, Field]:
        bt = self.block_type
        return {"blocks": Field(self.heads, 1, self.head_dim // bt.block * bt.type_size, torch.uint8)}

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows the blocks quantize: x (B, H, T, D) in the K/V dtype, rotated as llama.cpp does
        (`attn_rotate`, fp32) when it does; quantized as fp32, as llama.cpp copies F32 rows into the cache.
        The kernel append (kvquant.kernels.pack_engine) takes its rows from here too."""
        x = x.to(self.dtype)
        return x if self.rotation is None else attn_rotate(x, self.rotation)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"blocks": ggml_quantize(self.rows(x), self.spec.engine).contiguous()}

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        y = ggml_dequantize(fields["blocks"], self.spec.engine)  # (B, H, T, D) fp32
        if self.rotation is not None:
            y = attn_rotate(y, self.rotation)
        return y.to(dtype or self.dtype)

    def batches_with(self, other: Codec) -> bool:
        return super().batches_with(other) and getattr(other, "rotation", None) == self.rotation
