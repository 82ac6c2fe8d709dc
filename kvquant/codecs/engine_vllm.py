"""vLLM's KV-cache formats as codecs (`--kv-cache-dtype`), in the arithmetic of vLLM's cache write.

    spec                        vLLM name              stored per (token, head)               bytes (D = 64)
    vllm:fp8_e4m3 (vllm:fp8)    fp8, fp8_e4m3          D float8_e4m3fn codes                  64
    vllm:fp8_e5m2               fp8_e5m2               D float8_e5m2 codes                    64
    vllm:int8_per_token_head    int8_per_token_head    D int8 codes + one fp32 scale          68
    vllm:fp8_per_token_head     fp8_per_token_head     D float8_e4m3fn codes + one fp32 scale 68
    vllm:int4_per_token_head    int4_per_token_head    D/2 bytes (two 4-bit codes) + one fp32     36
                                                       scale whose low 4 bits hold the zero point
    vllm:turboquant_k8v4        turboquant_k8v4        K: D E4M3 codes | V: D/2 + 4            64 + 36
    vllm:turboquant_4bit_nc     turboquant_4bit_nc     K: D/2 codes + fp16 norm | V: D/2 + 4   34 + 36
    vllm:turboquant_k3v4_nc     turboquant_k3v4_nc     K: 3D/8 + 2 | V: D/2 + 4                26 + 36
    vllm:turboquant_3bit_nc     turboquant_3bit_nc     K: 3D/8 + 2 | V: 3D/8 + 4               26 + 28

    field    heads_f   tokens_f   cols_f   dtype
    codes    H         1          D        int8 (int8_per_token_head) or uint8 (float8 bit patterns);
                                           D / 2 uint8 for int4_per_token_head
    scale    H         1          1        float32 (per-token-head formats only)

The CacheDType list is vllm/config/cache.py of vllm-project/vllm at commit
002f10e0cfa1373a19a0d2756598a34b700d20e5 (`CacheDType = Literal["auto", ..., "fp8", "fp8_e4m3",
"fp8_e5m2", ..., "int8_per_token_head", "fp8_per_token_head", ...]`; `fp8` means fp8_e4m3 on CUDA).

fp8 / fp8_e4m3 / fp8_e5m2, one per-tensor (per layer, K and V apart) scale. The cache write divides by the
scale and converts with round-to-nearest-even, saturating: `__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE,
__NV_E4M3)` in the CUDA `reshape_and_cache_flash` (csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh), and
`key_load / tl.load(k_scale)` stored into a float8 pointer in the Triton twin
(`reshape_and_cache_kernel_flash` of vllm/v1/attention/ops/triton_reshape_and_cache_flash.py,
commit 027e07f2fab2722388a526a49d5353945775d256).
So |x / s| beyond the format's largest finite value (448; 57344 for e5m2) stores +-max, +-Inf too, and NaN
stays NaN. The scale is the checkpoint's k_scale / v_scale, and 1.0 when the checkpoint has none
(docs/features/quantization/quantized_kvcache.md: "All quantization scales are set to 1.0"); this codec uses
the fixed scale 1.0 unless one is bound (`set_scale`), so nothing per token is stored. Reading back: the code
times the scale.

int8_per_token_head / fp8_per_token_head, one float32 scale per (token, head), computed as the write happens
(`_reshape_cache_per_token` of triton_reshape_and_cache_flash.py at commit 027e07f, per token there and per
(token, head) in the later `triton_reshape_and_cache_flash_per_token_head_quant` with the same arithmetic):

    scale = max(max|x| / QUANT_MAX, 1e-6)          fp32; QUANT_MAX 127 (int8), 448 (fp8 e4m3)
    q     = clamp(x * (1.0 / scale), QUANT_MIN, QUANT_MAX)        QUANT_MIN -128, -448
    int8: q stored into an int8 pointer, Triton's float -> int conversion, which truncates toward zero
          (vLLM's test tests/quantization/test_per_token_kv_cache.py: "INT8 Triton stores truncate")
    fp8:  q stored into a float8_e4m3fn pointer: round to nearest even (already within +-448)
    read: q * scale

Note the reciprocal: the per-token-head write multiplies by 1/scale (the per-tensor fp8 write divides), so a
value can land just below an integer and truncate one code lower than x / scale would. Non-finite input: the
absmax (and so the scale) of its head becomes NaN and the head decodes to NaN; vLLM leaves this undefined (a
NaN -> int8 conversion), so it is not claimed to match.

TurboQuant presets (`TQ_PRESETS` of vllm/model_executor/layers/quantization/turboquant/config.py at commit
1471680b24719d9d3b2fe1235878196142af89cc; the store kernels of vllm/v1/attention/ops/
triton_turboquant_store.py at c0fda2d6553d72a428fa8138f3bfb03d30db2daa, the reads of
triton_turboquant_decode.py at 4ac35091c0b5918afa02709128985282681db45f, the rotation set-up of
vllm/v1/attention/backends/turboquant_attn.py at bcbe0bc87502ab0f12208c359954c8940fe0aec8). vLLM packs a
(token, head) as one slot [key bytes | value bytes], rounded up to an even size; kvquant stores the two
parts as the K and V codecs' `slot` fields, byte for byte (D = 64: no padding):

    keys, 3 / 4 bits ("MSE"): norm = |k| (fp32), y = (k / (norm + 1e-8)) @ PiT, PiT = diag(s) H with H the
        orthonormal Sylvester Hadamard matrix and s = +-1 signs from torch.randint seeded 42 + 1337 * layer;
        each y_j coded as the number of midpoints of 2^b Lloyd-Max levels (for N(0, 1/D), `tq_centroids`)
        at or below it; codes packed LSB first, then fp16(norm). "nc" (norm correction) is a decode-side
        flag: the centroid vector is renormalized to unit length before it is scaled by the norm.
    keys, 8 bits (k8v4): the key cast to E4M3 (round to nearest even, saturating), no scale, no rotation.
    values: per (token, head) min / max: scale = (max - min) / (2^b - 1) (floor 1e-8), code =
        int((v - min) / scale + 0.5); codes packed, then fp16 scale and fp16 min.
    prefill: vLLM attends a prompt's first chunk over the raw K/V (flash attention) and stores them
        quantized: kvquant's `prefill` mode; `cache` mode is its decoding.
    boundary layers: `--kv-cache-dtype turboquant_*` adds the first 2 and last 2 layers (at most half the
        layers) to --kv-cache-dtype-skip-layers (arg_utils.py), unquantized: `vllm_cache_scheme` gives the
        layers= scheme vLLM serves; the uniform spec has every layer quantized, for contrast.
Not bit-exact with a GPU run: the rotation GEMM's and the norm's fp32 summation order, and Triton's
approximate fp32 division in the value store, can move a code across a boundary it lies within a few ulp
of; Ampere / Ada GPUs store float8e4b15 keys (k8v4), not reproduced.

int4_per_token_head (vllm/v1/attention/ops/int4_per_token_head.py at commit
a7f284a2e24b86c171ef714c5ff492acf0baee6d; the arithmetic is the same at
055e47c28003156421365af985d676fc921cb075 and in the earlier `_reshape_cache_int4_packed` of
triton_reshape_and_cache_flash.py; page bytes: `AttentionSpec.real_page_size_bytes` / `page_size_bytes` of
vllm/v1/kv_cache_interface.py, head_size // 2 bytes per K and V plus two fp32 scales per (token, head)).
`reshape_and_cache_int4` rotates K and V, then `_reshape_cache_int4_kernel` stores each (token, head):

    rot   = single_rht(x.float()).to(x.dtype)      H (D1 x): D1 = diag of +-1 signs, 2 * torch.bernoulli(0.5)
                                                   - 1 from a CPU generator seeded 0x9E3779B9 (round 0: the
                                                   same for every layer, K and V); H the unnormalized
                                                   Sylvester Walsh-Hadamard matrix (H H = D I), D a power of 2
    scale = max((max(rot) - min(rot)) / 15, 1e-6)                       fp32
    zp    = clamp(round_half_away(-min(rot) / scale), 0, 15)
    q     = clamp(round_half_away(rot * (1.0 / scale) + zp), 0, 15)    round_half_away(t): int(t + 0.5) for
                                                                        t >= 0, else int(t - 0.5) (truncating)
    bytes = q[2i] | q[2i + 1] << 4;   stored scale = bits(scale) & ~0xF | zp   (the zero point in the low 4
                                                                           mantissa bits of the fp32 scale)
    read  (unified_attention_int4): s' = bits & ~0xF (the truncated scale), z = bits & 0xF; the kernel scores
          (RHT q) . (q - z) * s' * softmax_scale / D and rotates the output back, D1 H out / D; so the K and V
          attention sees are D1 H ((q - z) s') / D, which `decode` returns in the model's frame.

The zero point is clamped into [0, 15], so a (token, head) whose values are all positive (or all negative)
clips its top (bottom) codes: vLLM's arithmetic, reproduced. All of it in IEEE fp32 as the source is written
(the Triton interpreter's semantics). A compiled GPU run can differ in a code where a value lies within a few
ulp of a rounding boundary: Triton lowers the three fp32 divisions to approximate div.full / div.approx and
contracts `rot * inv + zp` into one fma (PTX of the kernel compiled for sm_90 here), and on CUDA sm_80+ vLLM
computes the Hadamard transform with hadacore in bf16 (fp32 inputs rounded to bf16 first), where this codec
follows vLLM's CPU path (the fp32 butterfly of `fast_hadamard_transform`, tier 3). vLLM reads this cache in
every attention call, the prompt's included (`cache` mode is what it serves; `prefill` mode is measured for
comparison).

Not reproduced here (the recommendation lists them as skipped, with this reason): `nvfp4` (FlashInfer's
arithmetic; kvquant's `nvfp4` is ggml's block of the same 4.5 bits), `fp8_inc` (Intel Gaudi) and the
MLA-only `fp8_ds_mla` / `nvfp4_ds_mla`.

The Triton decode kernel reads the per-(token, head) formats and the per-tensor FP8 ones at the scale 1.0 in
place (`kvquant.kernels.layouts.decode_layout`); TurboQuant and a bound scale other than 1 take the PyTorch
reference path. `kernel_layout` stays None (no pack kernel: appends take `encode`).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..scheme import QuantSpec, SchemeError, parse_scheme
from ..spec_types import VLLMCacheDtype
from .base import Codec, Field, register
from .packing import pack, unpack
from .transforms import wht_stages

__all__ = [
    "INT4_PER_TOKEN_HEAD",
    "TURBOQUANT_PRESETS",
    "TurboQuantCodec",
    "TurboQuantPreset",
    "VLLM_FORMATS",
    "VLLMCodec",
    "VLLMFormat",
    "VLLMInt4Codec",
    "boundary_skip_layers",
    "int4_dequantize",
    "int4_load",
    "int4_quantize",
    "int4_rht",
    "int4_rht_signs",
    "int4_store",
    "sylvester_wht",
    "tq_centroids",
    "tq_dequantize_key",
    "tq_dequantize_value",
    "tq_quantize_key",
    "tq_quantize_value",
    "tq_rotation",
    "tq_signs",
    "vllm_cache_scheme",
    "vllm_dequantize",
    "vllm_quantize",
]

# vllm/v1/attention/ops/triton_reshape_and_cache_flash.py
VLLM_COMMIT = "027e07f2fab2722388a526a49d5353945775d256"
CACHE_COMMIT = "002f10e0cfa1373a19a0d2756598a34b700d20e5"  # vllm/config/cache.py (CacheDType)
SCALE_FLOOR = 1e-6  # tl.maximum(absmax / QUANT_MAX, 1e-6)


@dataclass(frozen=True)
class VLLMFormat:
    """One vLLM cache dtype: per-tensor (`per_token_head` False) or per-(token, head) scaled codes."""

    name: str  # vLLM's --kv-cache-dtype value
    per_token_head: bool
    qmax: float
    qmin: float
    fp8: torch.dtype | None  # the float8 dtype of the codes, None for int8

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.fp8 is None else torch.uint8


VLLM_FORMATS: dict[str, VLLMFormat] = {
    "vllm:fp8_e4m3": VLLMFormat("fp8_e4m3", False, 448.0, -448.0, torch.float8_e4m3fn),
    "vllm:fp8_e5m2": VLLMFormat("fp8_e5m2", False, 57344.0, -57344.0, torch.float8_e5m2),
    "vllm:int8_per_token_head": VLLMFormat("int8_per_token_head", True, 127.0, -128.0, None),
    "vllm:fp8_per_token_head": VLLMFormat("fp8_per_token_head", True, 448.0, -448.0, torch.float8_e4m3fn),
}


def _format(name: str) -> VLLMFormat:
    try:
        return VLLM_FORMATS[name]
    except KeyError:
        raise SchemeError(f"unknown vLLM format {name!r}; known: {', '.join(VLLM_FORMATS)}") from None


def _store(q: torch.Tensor, fmt: VLLMFormat) -> torch.Tensor:
    """What storing fp32 `q` into the cache's pointer type does: int8 truncates toward zero (NaN -> 0,
    x86-like; vLLM leaves it undefined), float8 rounds to nearest even (NaN stays NaN)."""
    if fmt.fp8 is None:
        return torch.where(torch.isnan(q), torch.zeros_like(q), torch.trunc(q)).to(torch.int8)
    return q.to(fmt.fp8).view(torch.uint8)


def _load(codes: torch.Tensor, fmt: VLLMFormat) -> torch.Tensor:
    if fmt.fp8 is None:
        return codes.view(torch.int8).float()
    return codes.view(fmt.fp8).float()


def vllm_quantize(
    x: torch.Tensor, fmt: str, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (..., D) -> (codes (..., D), per-(token, head) scale (..., 1) fp32 or None) as vLLM's cache write
    stores them (fmt "vllm:fp8_e4m3", "vllm:int8_per_token_head", ...; `scale`: the per-tensor scale of the
    fp8 formats). x is read in fp32, as the kernels load it."""
    f = _format(fmt)
    x = x.float()
    if not f.per_token_head:
        # x / scale (IEEE division), then the saturating conversion (__NV_SATFINITE; +-Inf -> +-max)
        q = (x / torch.tensor(scale, dtype=torch.float32)).clamp(f.qmin, f.qmax)
        return _store(q, f), None
    amax = x.abs().amax(dim=-1, keepdim=True)  # NaN propagates: the head decodes to NaN
    s = torch.clamp_min(amax / f.qmax, SCALE_FLOOR)  # fp32, as tl.maximum(tl.max(|x|) / QUANT_MAX, 1e-6)
    q = (x * (1.0 / s)).clamp(f.qmin, f.qmax)  # the reciprocal, then clamp (NaN passes clamp)
    return _store(q, f), s


def vllm_dequantize(codes: torch.Tensor, fmt: str, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """The inverse: codes times the per-tensor or per-(token, head) scale, fp32 (..., D)."""
    f = _format(fmt)
    s = scale if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=torch.float32)
    return _load(codes, f) * s.float()


@register(VLLMCacheDtype)
class VLLMCodec(Codec):
    """A vLLM cache dtype (`vllm:fp8_e4m3`, `vllm:int8_per_token_head`, ...); see the module docstring.

    The per-tensor fp8 formats use the scale 1.0 (vLLM's default without a calibrated checkpoint) until
    `set_scale` binds a layer's k_scale / v_scale (or `bind` takes it from a calibration object with
    `kv_scale(layer, role)`, e.g. `kvquant.export.KVScales`). A TurboQuant half (`vllm:turboquant_*.k/.v`)
    constructs a `TurboQuantCodec` instead, `vllm:int4_per_token_head` a `VLLMInt4Codec`."""

    def __new__(cls, spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype):
        if cls is VLLMCodec and spec.engine is not None and spec.engine.startswith("vllm:turboquant_"):
            return TurboQuantCodec(spec, heads, head_dim, dtype)  # not a VLLMCodec: __init__ is not re-run
        if cls is VLLMCodec and spec.engine == INT4_PER_TOKEN_HEAD:
            return VLLMInt4Codec(spec, heads, head_dim, dtype)
        return super().__new__(cls)

    def __init__(self, spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__(spec, heads, head_dim, dtype)
        self.format = _format(spec.engine)
        self.scale = 1.0

    def set_scale(self, scale: float) -> None:
        """A per-tensor fp8 format's scale (k_scale or v_scale of this layer): positive and finite."""
        if self.format.per_token_head:
            raise SchemeError(f"{self.spec} computes its scales per (token, head); it takes no fixed scale")
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise SchemeError(
                f"{self.spec}: a per-tensor scale must be a positive finite number, got {scale!r}"
            )
        self.scale = float(scale)

    def bind(self, *, layer: int | None, role: str | None, calib, spec: QuantSpec) -> None:
        """A per-tensor fp8 format takes this layer's k_scale / v_scale from `calib` when it has them."""
        get = getattr(calib, "kv_scale", None)
        if get is not None and not self.format.per_token_head and layer is not None and role is not None:
            self.set_scale(float(get(layer, role)))

    def fields(self) -> dict[str, Field]:
        out = {"codes": Field(self.heads, 1, self.head_dim, self.format.code_dtype)}
        if self.format.per_token_head:
            out["scale"] = Field(self.heads, 1, 1, torch.float32)
        return out

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, s = vllm_quantize(x.to(self.dtype), self.spec.engine, self.scale)  # (B, H, T, D), (B, H, T, 1)
        out = {"codes": codes.contiguous()}
        if s is not None:
            out["scale"] = s.contiguous()
        return out

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        scale = fields["scale"] if self.format.per_token_head else self.scale
        return vllm_dequantize(fields["codes"], self.spec.engine, scale).to(dtype or self.dtype)

    def batches_with(self, other: Codec) -> bool:
        return super().batches_with(other) and getattr(other, "scale", None) == self.scale


# ------------------------------------------------------------------------------ int4_per_token_head


INT4_PER_TOKEN_HEAD = "vllm:int4_per_token_head"
INT4_COMMIT = "a7f284a2e24b86c171ef714c5ff492acf0baee6d"  # vllm/v1/attention/ops/int4_per_token_head.py
RHT_SEED = 0x9E3779B9  # _get_rht_signs: manual_seed(0x9E3779B9 + round_idx * 0x517CC1B7), round_idx 0
INT4_LEVELS = 15.0  # codes 0..15
INT4_SCALE_FLOOR = 1e-6  # tl.maximum((k_max - k_min) / 15.0, 1e-6)
ZP_BITS = 0xF  # the zero point sits in the scale's 4 lowest mantissa bits


@functools.lru_cache(maxsize=16)
def int4_rht_signs(head_dim: int) -> torch.Tensor:
    """D1 (D,) fp32 of `_get_rht_signs(d, 0)`: 2 * torch.bernoulli(full(d, 0.5)) - 1 drawn from a CPU
    generator seeded 0x9E3779B9 (one vector for every layer, K and V). Cached (pure): never write to it."""
    gen = torch.Generator(device="cpu").manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((head_dim,), 0.5), generator=gen) - 1.0


def sylvester_wht(x: torch.Tensor) -> torch.Tensor:
    """H x along the last dim (D a power of two), H the unnormalized Sylvester Walsh-Hadamard matrix
    (H H = D I), by the butterfly of vLLM's `fast_hadamard_transform` (tier 3, its CPU path): for h = 1, 2, 4,
    ... the pairs (a, b) h apart become (a + b, a - b), in that order, so the fp32 sums round as vLLM's do."""
    d = x.shape[-1]
    if d & (d - 1):
        raise SchemeError(f"vLLM's Hadamard transform needs a power-of-two head_dim, got {d}")
    return wht_stages(x, d)


def int4_rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`single_rht`: H (D1 x), or D1 (H x) with inverse (D1 H H D1 x = D x: divide by D after it)."""
    signs = int4_rht_signs(x.shape[-1]).to(x.device)
    return sylvester_wht(x) * signs if inverse else sylvester_wht(x * signs)


def _round_half_away(t: torch.Tensor) -> torch.Tensor:
    """`tl.where(t >= 0, (t + 0.5).to(tl.int32), (t - 0.5).to(tl.int32))` as fp32: the +-0.5 rounds in fp32,
    the int32 conversion truncates (a NaN gives 0 here; vLLM leaves it undefined)."""
    r = torch.where(t >= 0, torch.trunc(t + 0.5), torch.trunc(t - 0.5))
    return torch.where(torch.isnan(r), torch.zeros_like(r), r)


def int4_store(rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_reshape_cache_int4_kernel` on already-rotated values: rot (..., D) fp32 -> (codes (..., D / 2) uint8,
    scale (..., 1) fp32 with the zero point in its low 4 bits). See the module docstring for the formulas."""
    rot = rot.float()
    lo, hi = rot.amin(dim=-1, keepdim=True), rot.amax(dim=-1, keepdim=True)  # (..., 1)
    scale = torch.clamp_min((hi - lo) / INT4_LEVELS, INT4_SCALE_FLOOR)
    zp = _round_half_away(-lo / scale).clamp(0.0, INT4_LEVELS)
    inv = 1.0 / scale  # the reciprocal, then a multiply (the compiled kernel fuses `rot * inv + zp`)
    q = _round_half_away(rot * inv + zp).clamp(0.0, INT4_LEVELS).to(torch.uint8)
    bits = scale.view(torch.int32) & ~ZP_BITS | zp.to(torch.int32)
    return pack(q, 4), bits.view(torch.float32)


def int4_load(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The rotated values attention reads: (q - z) * s' with s' = the scale with its low 4 bits cleared and
    z = those bits (`_attn_packed`'s `ks_bits & -16` and `ks_bits & 0xF`). codes (..., D / 2), scale (..., 1)
    -> (..., D) fp32."""
    bits = scale.contiguous().view(torch.int32)
    zp = (bits & ZP_BITS).float()
    s = (bits & ~ZP_BITS).view(torch.float32)
    return (unpack(codes.contiguous(), 4, 2 * codes.shape[-1]).float() - zp) * s


def int4_quantize(x: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`reshape_and_cache_int4`: K or V (..., D) -> (codes (..., D / 2), scale (..., 1)). The rotation runs in
    fp32 and its result is cast to `dtype` (the model's K/V dtype, `.to(key.dtype)`; default x's) before the
    store reads it back as fp32."""
    rot = int4_rht(x.float()).to(dtype or x.dtype)
    return int4_store(rot)


def int4_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The K or V attention uses, in the model's frame: D1 H ((q - z) s') / D, fp32 (..., D)."""
    rot = int4_load(codes, scale)
    return int4_rht(rot, inverse=True) / rot.shape[-1]


class VLLMInt4Codec(Codec):
    """vLLM's `int4_per_token_head` (`vllm:int4_per_token_head`): per (token, head) D / 2 bytes of 4-bit codes
    of the Hadamard-rotated vector and one fp32 scale carrying the zero point, byte for byte as vLLM's cache
    and scale cache hold them (module docstring)."""

    def fields(self) -> dict[str, Field]:
        return {
            "codes": Field(self.heads, 1, self.head_dim // 2, torch.uint8),
            "scale": Field(self.heads, 1, 1, torch.float32),
        }

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale = int4_quantize(x.to(self.dtype), self.dtype)  # (B, H, T, D / 2), (B, H, T, 1)
        return {"codes": codes.contiguous(), "scale": scale.contiguous()}

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        return int4_dequantize(fields["codes"], fields["scale"]).to(dtype or self.dtype)  # (B, H, T, D)


# --------------------------------------------------------------------------------------- TurboQuant


TQ_COMMIT = "bcbe0bc87502ab0f12208c359954c8940fe0aec8"  # vllm/v1/attention/backends/turboquant_attn.py
TQ_STORE_COMMIT = "c0fda2d6553d72a428fa8138f3bfb03d30db2daa"  # .../ops/triton_turboquant_store.py
TQ_DECODE_COMMIT = "4ac35091c0b5918afa02709128985282681db45f"  # .../ops/triton_turboquant_decode.py
TQ_CONFIG_COMMIT = "1471680b24719d9d3b2fe1235878196142af89cc"  # .../quantization/turboquant/config.py
TQ_SEED, TQ_LAYER_SEED_STRIDE = 42, 1337  # TurboQuantConfig.seed; Attention._init_turboquant_buffers
TQ_BOUNDARY_LAYERS = 2  # TurboQuantConfig.get_boundary_skip_layers(n=2)
TQ_NORM_EPS = 1e-8  # triton_turboquant_store: x_hat = k / (norms + 1e-8)
TQ_VALUE_SCALE_FLOOR = 1e-8  # _store_quantized_value: tl.where(v_scale > 1e-8, v_scale, 1e-8)


@dataclass(frozen=True)
class TurboQuantPreset:
    """One of vLLM's TQ_PRESETS (vllm/model_executor/layers/quantization/turboquant/config.py)."""

    name: str  # the --kv-cache-dtype value
    key_bits: int  # 8: FP8 keys (no rotation); 3 or 4: Hadamard rotation + Lloyd-Max codes + fp16 norm
    value_bits: int  # uniform min/max codes + fp16 scale and zero
    norm_correction: bool  # decode renormalizes the centroid vector to unit length before the norm

    def key_bytes(self, head_dim: int) -> int:
        """TurboQuantConfig.key_packed_size: D (FP8) or ceil(D * bits / 8) + 2 (fp16 vec_norm)."""
        return head_dim if self.key_bits == 8 else math.ceil(head_dim * self.key_bits / 8) + 2

    def value_bytes(self, head_dim: int) -> int:
        """TurboQuantConfig.value_packed_size: ceil(D * bits / 8) + 4 (fp16 scale, fp16 zero)."""
        return math.ceil(head_dim * self.value_bits / 8) + 4

    def slot_bytes(self, head_dim: int) -> int:
        """TurboQuantConfig.slot_size_aligned: K + V bytes of one (token, head), rounded up to even."""
        s = self.key_bytes(head_dim) + self.value_bytes(head_dim)
        return s + s % 2


TURBOQUANT_PRESETS: dict[str, TurboQuantPreset] = {
    p.name: p
    for p in (
        TurboQuantPreset("turboquant_k8v4", 8, 4, False),
        TurboQuantPreset("turboquant_4bit_nc", 4, 4, True),
        TurboQuantPreset("turboquant_k3v4_nc", 3, 4, True),
        TurboQuantPreset("turboquant_3bit_nc", 3, 3, True),
    )
}


def _tq_half(engine: str) -> tuple[TurboQuantPreset, str]:
    """`vllm:turboquant_4bit_nc.k` -> (its preset, "k")."""
    name, _, role = engine.partition(":")[2].rpartition(".")
    if name not in TURBOQUANT_PRESETS or role not in ("k", "v"):
        known = ", ".join(TURBOQUANT_PRESETS)
        raise SchemeError(f"{engine!r} is not a TurboQuant half; known presets: {known}")
    return TURBOQUANT_PRESETS[name], role


def _gaussian_pdf(x: float, sigma2: float) -> float:
    return (1.0 / math.sqrt(2 * math.pi * sigma2)) * math.exp(-x * x / (2 * sigma2))


def _trapz(f, a: float, b: float, n: int = 200) -> float:
    h = (b - a) / n
    result = 0.5 * (f(a) + f(b))
    for i in range(1, n):
        result += f(a + i * h)
    return result * h


@functools.lru_cache(maxsize=32)
def tq_centroids(d: int, bits: int) -> tuple[float, ...]:
    """vLLM's `get_centroids(d, bits)` (turboquant/centroids.py, `solve_lloyd_max`): Lloyd-Max levels for
    N(0, 1/d) by trapezoidal integration (200 points per bin) over [-10.5, 10.5] sigma, from evenly spaced
    starting levels in [-3.5, 3.5] sigma, at most 200 iterations or until no level moves by 1e-10 (the
    levels then stay the previous iterate's, as the source breaks before assigning). The same float64
    operations in the same order, so the float32 levels are vLLM's bit for bit. Pure function: cached."""
    n_levels, sigma2 = 2**bits, 1.0 / d
    sigma = math.sqrt(sigma2)
    lo, hi = -3.5 * sigma, 3.5 * sigma
    centroids = [lo + (hi - lo) * (i + 0.5) / n_levels for i in range(n_levels)]
    for _ in range(200):
        boundaries = [(centroids[i] + centroids[i + 1]) / 2.0 for i in range(n_levels - 1)]
        edges = [lo * 3] + boundaries + [hi * 3]
        new = []
        for i in range(n_levels):
            a, b = edges[i], edges[i + 1]
            num = _trapz(lambda x: x * _gaussian_pdf(x, sigma2), a, b)
            den = _trapz(lambda x: _gaussian_pdf(x, sigma2), a, b)
            new.append(num / den if den > 1e-15 else centroids[i])
        if max(abs(new[i] - centroids[i]) for i in range(n_levels)) < 1e-10:
            break
        centroids = new
    return tuple(centroids)


@functools.lru_cache(maxsize=256)
def tq_rotation(head_dim: int, layer: int) -> torch.Tensor:
    """PiT (D, D) fp32 of a layer: `signs.unsqueeze(1) * H` with H the orthonormal Sylvester Hadamard matrix
    (turboquant_attn.py `_build_hadamard_cached`) and signs `generate_wht_signs(D, 42 + 1337 * layer)`
    (turboquant/quantizer.py: torch.randint(0, 2, (D,)) from a CPU generator, * 2 - 1). The store computes
    y = x_hat @ PiT; reading back, y @ Pi with Pi = PiT^T. Cached (a pure function): never write to it."""
    h = torch.tensor([[1.0]])
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / math.sqrt(head_dim)
    return (tq_signs(head_dim, layer).unsqueeze(1) * h).contiguous()


@functools.lru_cache(maxsize=256)
def tq_signs(head_dim: int, layer: int) -> torch.Tensor:
    """The (D,) +-1 fp32 signs of a layer's rotation: `generate_wht_signs(D, 42 + 1337 * layer)` (a CPU
    generator). PiT = diag(signs) H, so y = x PiT = H (signs * x): `kvquant.codecs.transforms.rotate`'s R x
    with these signs (the decode kernel's frame for TurboQuant keys). Cached: never write to it."""
    gen = torch.Generator(device="cpu").manual_seed(TQ_SEED + layer * TQ_LAYER_SEED_STRIDE)
    return torch.randint(0, 2, (head_dim,), generator=gen, device="cpu").float() * 2 - 1


def _fp16_le(v: torch.Tensor) -> torch.Tensor:
    """(..., 1) fp32 -> (..., 2) uint8: the fp16 value's bytes, low byte first (as the kernels store them)."""
    return v.to(torch.float16).contiguous().view(torch.uint8)


def _fp16_of(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 -> (..., 1) fp32 (a copy: a slice at an odd byte offset cannot be viewed as fp16)."""
    return b.clone(memory_format=torch.contiguous_format).view(torch.float16).float()


def tq_quantize_key(x: torch.Tensor, preset: str, layer: int = 0) -> torch.Tensor:
    """Keys (..., D) -> their bytes (..., key_bytes) uint8 as `triton_turboquant_store` writes them.

    FP8 (k8v4): `k_vals.to(tl.float8e4nv)`: round to nearest even, saturating (Hopper and later; Ampere and
    Ada store float8e4b15 instead, not reproduced). MSE (3 / 4 bits), in fp32:
        norm = |k|;  y = (k / (norm + 1e-8)) @ PiT;  code_j = #{midpoints <= y_j}  (the kernel's binary search
        `y >= mid`, so a tie goes up; NaN -> 0);  bytes = codes packed LSB first (4 bits: element 2i low
        nibble; 3 bits: 8 codes in 24 bits) | fp16(norm), little-endian."""
    p = TURBOQUANT_PRESETS[preset]
    if p.key_bits == 8:
        return vllm_quantize(x, "vllm:fp8_e4m3")[0]
    k = x.float()
    d = k.shape[-1]
    norms = k.norm(dim=-1, keepdim=True)  # (..., 1)
    y = (k / (norms + TQ_NORM_EPS)) @ tq_rotation(d, layer).to(k.device)
    c = torch.tensor(tq_centroids(d, p.key_bits), dtype=torch.float32, device=k.device)
    mid = (c[:-1] + c[1:]) / 2  # _ensure_on_device: fp32 midpoints of the (sorted) fp32 centroids
    idx = torch.bucketize(y, mid, right=True)
    idx = torch.where(torch.isnan(y), torch.zeros_like(idx), idx)
    return torch.cat((pack(idx.to(torch.uint8), p.key_bits), _fp16_le(norms)), dim=-1)


def tq_dequantize_key(b: torch.Tensor, preset: str, head_dim: int, layer: int = 0) -> torch.Tensor:
    """The inverse, fp32 (..., D), in the model's frame: as `_tq_full_dequant_kv` then `@ Pi`
    (`_continuation_prefill`): c = centroids[code]; norm correction (the _nc presets) c *= 1 / sqrt(|c|^2 +
    1e-16); k = fp16 norm * c @ Pi. The decode kernel scores q @ PiT against norm * c instead: the same
    product up to rounding."""
    p = TURBOQUANT_PRESETS[preset]
    if p.key_bits == 8:
        return vllm_dequantize(b, "vllm:fp8_e4m3")
    nbytes = math.ceil(head_dim * p.key_bits / 8)
    idx = unpack(b[..., :nbytes].contiguous(), p.key_bits, head_dim).long()
    c = torch.tensor(tq_centroids(head_dim, p.key_bits), dtype=torch.float32, device=b.device)[idx]
    if p.norm_correction:
        c = c * (1.0 / torch.sqrt(c.square().sum(-1, keepdim=True) + 1e-16))
    k_rot = _fp16_of(b[..., nbytes : nbytes + 2]) * c
    return k_rot @ tq_rotation(head_dim, layer).to(b.device).T


def tq_quantize_value(x: torch.Tensor, preset: str) -> torch.Tensor:
    """Values (..., D) -> (..., value_bytes) uint8 as `_store_quantized_value` writes them, in fp32:
        scale = (max - min) / (2^b - 1), at least 1e-8;
        code = clamp(int((v - min) / scale + 0.5), 0, 2^b - 1)
        (the int32 cast truncates; the argument is >= 0.5, so it is floor);
        bytes = codes packed | fp16(scale) | fp16(min), little-endian.
    IEEE division here; Triton lowers an fp32 `/` to the approximate div.full.f32 (within 2 ulp), so on a GPU
    a code can differ by one when (v - min) / scale + 0.5 lies within 2 ulp of an integer."""
    p = TURBOQUANT_PRESETS[preset]
    v = x.float()
    levels = (1 << p.value_bits) - 1
    vmin, vmax = v.amin(dim=-1, keepdim=True), v.amax(dim=-1, keepdim=True)
    scale = (vmax - vmin) / float(levels)
    scale = torch.where(scale > TQ_VALUE_SCALE_FLOOR, scale, torch.full_like(scale, TQ_VALUE_SCALE_FLOOR))
    q = torch.trunc((v - vmin) / scale + 0.5).clamp(0, levels)
    q = torch.where(torch.isnan(q), torch.zeros_like(q), q)
    return torch.cat((pack(q.to(torch.uint8), p.value_bits), _fp16_le(scale), _fp16_le(vmin)), dim=-1)


def tq_dequantize_value(b: torch.Tensor, preset: str, head_dim: int) -> torch.Tensor:
    """code * fp16 scale + fp16 zero, fp32 (..., D) (the decode kernel's `v_idx * v_scales + v_zeros`)."""
    p = TURBOQUANT_PRESETS[preset]
    nbytes = math.ceil(head_dim * p.value_bits / 8)
    q = unpack(b[..., :nbytes].contiguous(), p.value_bits, head_dim).float()
    return q * _fp16_of(b[..., nbytes : nbytes + 2]) + _fp16_of(b[..., nbytes + 2 : nbytes + 4])


class TurboQuantCodec(Codec):
    """One half of a vLLM TurboQuant preset (`vllm:turboquant_4bit_nc.k` / `.v`): each (token, head) stored as
    the key or value part of vLLM's combined slot (`slot`, uint8), in its byte order. The layer index (vLLM
    seeds each layer's signs with 42 + 1337 * layer) comes from `bind`; an unbound codec (fake_quantize,
    byte counts) uses layer 0's, which is the same distribution."""

    def __init__(self, spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__(spec, heads, head_dim, dtype)
        self.preset, self.role = _tq_half(spec.engine)
        self.layer = 0

    def bind(self, *, layer: int | None, role: str | None, calib, spec: QuantSpec) -> None:
        if role is not None and role != self.role:
            raise SchemeError(
                f"{spec} is the {'key' if self.role == 'k' else 'value'} half of vLLM's {self.preset.name}; "
                f"it cannot store {'keys' if role == 'k' else 'values'} (write the preset as a whole: "
                f"vllm:{self.preset.name})"
            )
        self.layer = 0 if layer is None else layer

    def fields(self) -> dict[str, Field]:
        p, d = self.preset, self.head_dim
        nbytes = p.key_bytes(d) if self.role == "k" else p.value_bytes(d)
        return {"slot": Field(self.heads, 1, nbytes, torch.uint8)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x = x.to(self.dtype)  # (B, H, T, D): what the model hands vLLM's store, in its dtype
        if self.role == "k":
            return {"slot": tq_quantize_key(x, self.preset.name, self.layer).contiguous()}
        return {"slot": tq_quantize_value(x, self.preset.name).contiguous()}

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        b = fields["slot"]
        if self.role == "k":
            out = tq_dequantize_key(b, self.preset.name, self.head_dim, self.layer)
        else:
            out = tq_dequantize_value(b, self.preset.name, self.head_dim)
        return out.to(dtype or self.dtype)  # (B, H, T, D)

    def batches_with(self, other: Codec) -> bool:
        return super().batches_with(other) and getattr(other, "layer", None) == self.layer


# ----------------------------------------------------------------- --kv-cache-dtype(-skip-layers) as a scheme


def boundary_skip_layers(num_layers: int, n: int = TQ_BOUNDARY_LAYERS) -> list[int]:
    """TurboQuantConfig.get_boundary_skip_layers for a dense model: the first n and last n layers, n at
    most num_layers // 2 (a hybrid attention + Mamba model gets none in the source followed)."""
    if n <= 0 or num_layers <= 0:
        return []
    n = min(n, num_layers // 2)
    return sorted(set(range(n)) | set(range(num_layers - n, num_layers)))


def vllm_cache_scheme(
    kv_cache_dtype: str,
    num_layers: int,
    skip_layers: Sequence[int | str] = (),
    sliding_layers: Sequence[int] = (),
) -> str:
    """The kvquant scheme string of `vllm serve --kv-cache-dtype D --kv-cache-dtype-skip-layers S`.

    Skipped layers stay unquantized ("auto": the model dtype, kvquant's fp16). `skip_layers` takes layer
    indices or the attention-type name `sliding_window` (vllm/config/cache.py, kv_cache_dtype_skip_layers),
    which means `sliding_layers`. A TurboQuant dtype adds its two boundary layers at each end, merged with
    the given ones as vllm/engine/arg_utils.py does (`existing | set(boundary)`), so there is no way to
    quantize them: the uniform kvquant spec `vllm:turboquant_4bit_nc` exists for contrast only."""
    name = kv_cache_dtype.removeprefix("vllm:")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise SchemeError(f"num_layers must be a positive integer, got {num_layers!r}")
    spec = f"vllm:{name}"
    parse_scheme(spec)  # an unknown or refused dtype fails here, naming the known ones
    skip: set[int] = set()
    for s in skip_layers:
        if str(s) == "sliding_window":
            if not sliding_layers:
                raise SchemeError(
                    "--kv-cache-dtype-skip-layers sliding_window: this model has no sliding layers"
                )
            skip |= set(sliding_layers)
        elif re.fullmatch(r"\d+", str(s)) and int(s) < num_layers:
            skip.add(int(s))
        else:
            raise SchemeError(
                f"--kv-cache-dtype-skip-layers takes layer indices 0..{num_layers - 1} or 'sliding_window', "
                f"got {s!r}"
            )
    if name in TURBOQUANT_PRESETS:
        skip |= set(boundary_skip_layers(num_layers))
    if not skip:
        return spec
    if len(skip) == num_layers:
        return "fp16"
    ranges, start = [], 0
    for i in range(1, num_layers + 1):
        if i == num_layers or (i in skip) != (start in skip):
            rng = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            ranges.append(f"{rng}:{'fp16' if start in skip else spec}")
            start = i
    return "layers=" + "+".join(ranges)
