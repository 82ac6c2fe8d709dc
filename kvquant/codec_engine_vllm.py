"""vLLM's KV-cache formats as codecs (`--kv-cache-dtype`), in the arithmetic of vLLM's cache write.

    spec                        vLLM name              stored per (token, head)               bytes (D = 64)
    vllm:fp8_e4m3 (vllm:fp8)    fp8, fp8_e4m3          D float8_e4m3fn codes                  64
    vllm:fp8_e5m2               fp8_e5m2               D float8_e5m2 codes                    64
    vllm:int8_per_token_head    int8_per_token_head    D int8 codes + one fp32 scale          68
    vllm:fp8_per_token_head     fp8_per_token_head     D float8_e4m3fn codes + one fp32 scale 68

    field    heads_f   tokens_f   cols_f   dtype
    codes    H         1          D        int8 (int8_per_token_head) or uint8 (float8 bit patterns)
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

Not reproduced here (the recommendation lists them as skipped, with this reason): `int4_per_token_head` (its
codebook levels and the Hadamard rotation of its keys changed between vLLM versions and are not readable
offline: the version documented latest stores a zero point inside the scale's low mantissa bits),
the TurboQuant presets, `nvfp4` (FlashInfer's arithmetic; kvquant's `nvfp4` is ggml's block of the same
4.5 bits), `fp8_inc` (Intel Gaudi) and the MLA-only `fp8_ds_mla` / `nvfp4_ds_mla`.

No kernel reads these codecs here (`kernel_layout` None): attention takes the PyTorch reference path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .codec import Codec, Field
from .scheme import QuantSpec, SchemeError

__all__ = ["VLLM_FORMATS", "VLLMCodec", "VLLMFormat", "vllm_dequantize", "vllm_quantize"]

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


class VLLMCodec(Codec):
    """A vLLM cache dtype (`vllm:fp8_e4m3`, `vllm:int8_per_token_head`, ...); see the module docstring.

    The per-tensor fp8 formats use the scale 1.0 (vLLM's default without a calibrated checkpoint) until
    `set_scale` binds a layer's k_scale / v_scale."""

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
