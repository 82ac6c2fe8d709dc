"""vLLM's cache dtypes (kvquant.codec_engine_vllm): no vLLM runs here (its kernels need a GPU build), so each
format is checked on hand-derived vectors, each naming the vLLM source line it follows."""

from __future__ import annotations

import math
import re

import pytest
import torch

from kvquant.codec import codec_for
from kvquant.codec_engine_vllm import VLLM_FORMATS, vllm_dequantize, vllm_quantize
from kvquant.scheme import ENGINE_REFUSED, SchemeError, parse_scheme, parse_spec

NAN = float("nan")
INF = float("inf")


def _fp8(codes: torch.Tensor, fmt: str) -> list[float]:
    return vllm_dequantize(codes, fmt).tolist()


# ------------------------------------------------------------------------------------------------ names


def test_names_as_vllm_spells_them():
    assert parse_spec("vllm:fp8").engine == "vllm:fp8_e4m3"  # vllm/config/cache.py: fp8 (=fp8_e4m3) on CUDA
    for name in VLLM_FORMATS:
        spec = parse_spec(name)
        assert str(spec) == name and parse_spec(str(spec)) == spec
    skip = parse_scheme("layers=0:fp16+1-28:vllm:fp8+29:fp16")  # --kv-cache-dtype-skip-layers 0,29
    assert str(skip) == "layers=0:fp16+1-28:vllm:fp8_e4m3+29:fp16"
    assert parse_scheme(str(skip)) == skip


@pytest.mark.parametrize("name", sorted(ENGINE_REFUSED))
def test_formats_not_reproduced_are_refused_with_the_reason(name):
    with pytest.raises(SchemeError, match="not available: " + re.escape(ENGINE_REFUSED[name][:20])):
        parse_spec(name)


def test_unknown_vllm_name_lists_the_known():
    with pytest.raises(SchemeError, match="unknown vLLM cache dtype 'fp9'.*vllm:int8_per_token_head"):
        parse_spec("vllm:fp9")


def test_engine_formats_take_no_options():
    with pytest.raises(SchemeError):
        parse_spec("vllm:fp8-head")


# ------------------------------------------------------------------- fp8 with one per-tensor scale


def test_fp8_e4m3_vectors():
    """csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh, scaled_vec_conversion:
    `__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3)`: round to nearest even, saturating."""
    x = torch.tensor([1.0625, 1.1875, 500.0, -INF, 2.0**-9, 2.0**-11, NAN, -0.0])
    codes, scale = vllm_quantize(x, "vllm:fp8_e4m3")
    assert scale is None and codes.dtype == torch.uint8
    got = _fp8(codes, "vllm:fp8_e4m3")
    # 1.0625 lies halfway between 1.0 and 1.125: even mantissa 1.0; 1.1875 between 1.125 and 1.25: 1.25;
    # 500 and -Inf saturate to +-448 (SATFINITE); 2^-9 is the smallest subnormal; 2^-11 rounds to 0
    assert got[:6] == [1.0, 1.25, 448.0, -448.0, 2.0**-9, 0.0]
    assert math.isnan(got[6]) and codes[7].item() == 0x80  # -0 keeps its sign bit


def test_fp8_e4m3_divides_by_the_scale():
    """quant_utils.cuh: x / scale (the checkpoint's k_scale); triton_reshape_and_cache_flash.py
    reshape_and_cache_kernel_flash: `key_tile = key_load / tl.load(k_scale)`; read back times the scale."""
    x = torch.tensor([3.0, 1000.0, -2.125])
    codes, _ = vllm_quantize(x, "vllm:fp8_e4m3", scale=2.0)
    # 3 / 2 = 1.5 exact; 1000 / 2 = 500 saturates at 448; -2.125 / 2 = -1.0625 ties to even -1.0
    assert vllm_dequantize(codes, "vllm:fp8_e4m3", 2.0).tolist() == [3.0, 896.0, -2.0]


def test_fp8_e5m2_vectors():
    """quant_utils.cuh with __NV_E5M2: 2 mantissa bits, largest finite 57344."""
    x = torch.tensor([1.125, 1.375, 60000.0, INF])
    got = _fp8(vllm_quantize(x, "vllm:fp8_e5m2")[0], "vllm:fp8_e5m2")
    # 1.125 halfway between 1.0 (even) and 1.25; 1.375 halfway between 1.25 and 1.5 (even); saturation
    assert got == [1.0, 1.5, 57344.0, 57344.0]


# ------------------------------------------------------------------------- per (token, head) scales


def test_int8_per_token_head_vectors():
    """triton_reshape_and_cache_flash.py (_reshape_cache_per_token; per head in
    triton_reshape_and_cache_flash_per_token_head_quant):
    `k_scale = tl.maximum(tl.max(tl.abs(k_all)) / QUANT_MAX, 1e-6)` and
    `k_q = tl.clamp(k_all * (1.0 / k_scale), QUANT_MIN, QUANT_MAX)` stored into an int8 pointer, which
    truncates toward zero (tests/quantization/test_per_token_kv_cache.py: "INT8 Triton stores truncate")."""
    x = torch.tensor([[127.0, -63.5, 1.99, -0.99], [-254.0, 127.0, 3.0, -1.5]])  # two heads
    codes, scale = vllm_quantize(x, "vllm:int8_per_token_head")
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (2, 1)
    assert scale.flatten().tolist() == [1.0, 2.0]  # absmax / 127 per head
    # truncation, not rounding: -63.5 -> -63, 1.99 -> 1, -0.99 -> 0; second head: -127, 63, 1, 0
    assert codes.tolist() == [[127, -63, 1, 0], [-127, 63, 1, 0]]


def test_int8_per_token_head_multiplies_by_the_reciprocal():
    """`k_all * (1.0 / k_scale)`, not k_all / k_scale: with absmax 3, x = scale itself gives
    x * fp32(1 / scale) = 0.99999994, which truncates to 0 (x / scale would be exactly 1)."""
    s = torch.tensor(3.0) / 127.0
    x = torch.tensor([3.0, s.item(), 0.0, 0.0])
    codes, scale = vllm_quantize(x, "vllm:int8_per_token_head")
    assert scale.item() == s.item()
    assert codes.tolist() == [127, 0, 0, 0]
    assert torch.trunc(x[1] / s).item() == 1.0  # the division would have given code 1


def test_int8_per_token_head_scale_floor():
    """`tl.maximum(..., 1e-6)`: an all-zero head stores the scale 1e-6 (fp32) and zero codes."""
    codes, scale = vllm_quantize(torch.zeros(1, 8), "vllm:int8_per_token_head")
    assert scale.item() == torch.tensor(1e-6, dtype=torch.float32).item()
    assert codes.abs().sum().item() == 0


def test_fp8_per_token_head_vectors():
    """The same kernel with QUANT_MAX = 448 (float8_e4m3fn, _PER_TOKEN_QUANT_PARAMS) and a float8 store
    (round to nearest even)."""
    x = torch.tensor([896.0, 1.0, 3.0, -2.125])
    codes, scale = vllm_quantize(x, "vllm:fp8_per_token_head")
    assert scale.item() == 2.0  # 896 / 448
    # x * 0.5: 448, 0.5, 1.5, -1.0625 (tie -> even -1.0); read back times 2
    assert vllm_dequantize(codes, "vllm:fp8_per_token_head", scale).tolist() == [896.0, 1.0, 3.0, -2.0]


# -------------------------------------------------------------------------------------- as codecs


@pytest.mark.parametrize("name", sorted(VLLM_FORMATS))
def test_codec_layout_and_bytes(name):
    """Bytes per (token, head) as vLLM allocates them: D one-byte codes, plus a float32 scale for the
    per-token-head formats (k_scale_cache [num_blocks, block_size, num_kv_heads] float32)."""
    heads, d = 3, 64
    codec = codec_for(name, heads, d)
    per_head = d + (4 if "per_token_head" in name else 0)
    assert codec.bytes(16) == 16 * heads * per_head
    x = torch.randn(2, heads, 16, d)
    fields = codec.encode(x)
    assert set(fields) == set(codec.fields())
    y = codec.decode(fields, torch.float32)
    assert y.shape == x.shape
    err = (x - y).norm() / x.norm()
    assert err < (0.07 if name == "vllm:fp8_e5m2" else 0.04)


@pytest.mark.parametrize("name", sorted(VLLM_FORMATS))
def test_codes_do_not_depend_on_chunking(name):
    """Scales are per tensor or per token, so a token's codes are the same whether it arrives alone or in a
    batch (what an appending cache needs)."""
    codec = codec_for(name, 2, 32)
    x = torch.randn(1, 2, 6, 32) * 3
    whole = codec.encode(x)
    parts = [codec.encode(x[:, :, i : i + 1]) for i in range(6)]
    for key, value in whole.items():
        assert torch.equal(value, torch.cat([p[key] for p in parts], dim=2))


def test_bound_per_tensor_scale():
    codec = codec_for("vllm:fp8_e4m3", 1, 16)
    codec.set_scale(4.0)
    x = torch.full((1, 1, 1, 16), 960.0)  # 960 / 4 = 240, an E4M3 value (scale 1.0 would saturate at 448)
    assert codec.decode(codec.encode(x), torch.float32).unique().tolist() == [960.0]
    with pytest.raises(SchemeError, match="positive finite"):
        codec.set_scale(0.0)
    with pytest.raises(SchemeError, match="per \\(token, head\\)"):
        codec_for("vllm:int8_per_token_head", 1, 16).set_scale(2.0)


def test_cache_serves_a_vllm_scheme(tiny_model):
    """A tiny model runs with a per-layer vLLM scheme in kvquant's cache (skip layer 0, as
    --kv-cache-dtype-skip-layers 0) and stays close to the unquantized logits."""
    from kvquant import QuantizedCache

    ids = torch.randint(0, 1000, (1, 24))
    with torch.no_grad():
        ref = tiny_model(ids).logits
        cache = QuantizedCache(parse_scheme("layers=0:fp16+1:vllm:int8_per_token_head"), tiny_model.config)
        out = tiny_model(ids, past_key_values=cache, use_cache=True).logits
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
