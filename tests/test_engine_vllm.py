"""vLLM's cache dtypes (kvquant.codecs.engine_vllm): no vLLM runs here (its kernels need a GPU build), so each
format is checked on hand-derived vectors, each naming the vLLM source line it follows."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from kvquant.codecs.base import codec_for
from kvquant.codecs.engine_vllm import VLLM_FORMATS, vllm_dequantize, vllm_quantize
from kvquant.codecs.packing import unpack
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


# ------------------------------------------------------------------------------------ TurboQuant presets
# Source followed: vllm/model_executor/layers/quantization/turboquant/config.py (TQ_PRESETS, slot sizes,
# get_boundary_skip_layers), .../turboquant/centroids.py (solve_lloyd_max), .../turboquant/quantizer.py
# (generate_wht_signs), vllm/v1/attention/backends/turboquant_attn.py (_build_hadamard, _ensure_on_device),
# vllm/v1/attention/ops/triton_turboquant_store.py (_tq_fused_store_mse, _store_quantized_value) and
# triton_turboquant_decode.py (_tq_full_dequant_kv); commits in kvquant.codecs.engine_vllm.

from kvquant.codecs.engine_vllm import (  # noqa: E402
    TURBOQUANT_PRESETS,
    boundary_skip_layers,
    tq_centroids,
    tq_dequantize_key,
    tq_dequantize_value,
    tq_quantize_key,
    tq_quantize_value,
    tq_rotation,
    vllm_cache_scheme,
)


def test_turboquant_presets_are_vllms():
    """config.py TQ_PRESETS: key_quant_bits, value_quant_bits, norm_correction."""
    got = {n: (p.key_bits, p.value_bits, p.norm_correction) for n, p in TURBOQUANT_PRESETS.items()}
    assert got == {
        "turboquant_k8v4": (8, 4, False),
        "turboquant_4bit_nc": (4, 4, True),
        "turboquant_k3v4_nc": (3, 4, True),
        "turboquant_3bit_nc": (3, 3, True),
    }


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("preset", sorted(TURBOQUANT_PRESETS))
def test_turboquant_bytes_are_the_slot(preset, head_dim):
    """config.py: key_packed_size = D (FP8) or ceil(D * b / 8) + 2 (fp16 vec_norm); value_packed_size =
    ceil(D * b / 8) + 4 (fp16 scale + zero); slot_size_aligned rounds K + V up to even. The two codecs'
    bytes per (token, head) add up to the slot (even at these head_dims, so no padding byte)."""
    p = TURBOQUANT_PRESETS[preset]
    k = codec_for(f"vllm:{preset}.k", 2, head_dim, role="k")
    v = codec_for(f"vllm:{preset}.v", 2, head_dim, role="v")
    per_head = (k.bytes(16) + v.bytes(16)) // (16 * 2)
    expect_k = head_dim if p.key_bits == 8 else -(-head_dim * p.key_bits // 8) + 2
    assert per_head == expect_k + -(-head_dim * p.value_bits // 8) + 4 == p.slot_bytes(head_dim)


def test_turboquant_centroids_follow_solve_lloyd_max():
    """centroids.py: Lloyd-Max for N(0, 1/d) by trapezoidal integration. Symmetric, ascending, and within
    the trapezoid's error of an independent Gaussian Lloyd-Max (closed-form bin means via scipy); the
    4-bit d=64 levels begin -0.34136527734668864, -0.2585558898353186 (float64, as vLLM computes them)."""
    assert tq_centroids(64, 4)[:2] == (-0.34136527734668864, -0.2585558898353186)
    from scipy import stats

    for d, bits in ((64, 4), (64, 3), (128, 4)):
        c = np.array(tq_centroids(d, bits))
        assert np.all(np.diff(c) > 0) and np.allclose(c, -c[::-1], atol=1e-12)
        sigma = 1 / math.sqrt(d)
        ref = np.linspace(-3.5, 3.5, 2**bits) * sigma  # independent iteration, exact bin means
        for _ in range(300):
            t = np.concatenate([[-np.inf], (ref[1:] + ref[:-1]) / 2, [np.inf]]) / sigma
            mass = stats.norm.cdf(t[1:]) - stats.norm.cdf(t[:-1])
            ref = sigma * (stats.norm.pdf(t[:-1]) - stats.norm.pdf(t[1:])) / mass
        # vLLM stops after 200 iterations on a 200-point trapezoid: its outer levels sit up to ~0.2% of
        # sigma from the exact ones (0.34137 vs 0.34158 at d=64, 4 bits), which is what vLLM stores
        assert np.abs(c - ref).max() < 5e-3 * sigma


def test_turboquant_rotation_is_signed_sylvester_hadamard():
    """turboquant_attn.py _ensure_on_device: PiT = signs.unsqueeze(1) * H (H orthonormal Sylvester);
    quantizer.py generate_wht_signs: torch.randint(0, 2, (d,)) from a CPU generator seeded 42 + 1337 * layer,
    * 2 - 1."""
    pit = tq_rotation(4, 0)
    gen = torch.Generator().manual_seed(42)
    signs = torch.randint(0, 2, (4,), generator=gen).float() * 2 - 1
    h = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]) / 2.0
    assert torch.equal(pit, signs[:, None] * h)
    p64 = tq_rotation(64, 3)
    assert torch.allclose(p64 @ p64.T, torch.eye(64), atol=1e-6)
    assert not torch.equal(p64, tq_rotation(64, 0))  # each layer its own signs


def test_turboquant_key_store_vectors():
    """_tq_fused_store_mse after the launcher's `norms = k.norm(); x_hat = k / (norms + 1e-8);
    y = x_hat @ PiT`: codes = #{midpoints <= y} (binary search `y >= mid`), packed LSB first, then the fp16
    norm. A key along a row of Pi has y = e_j: code 15 at j (the largest level), the code of 0 elsewhere."""
    d = 64
    pit = tq_rotation(d, 0)
    k = 3.0 * pit[:, 5]  # y = k / |k| @ PiT = e_5 (up to rounding)
    b = tq_quantize_key(k, "turboquant_4bit_nc")
    assert b.shape == (34,)
    codes = unpack(b[:32], 4, d)
    c = torch.tensor(tq_centroids(d, 4), dtype=torch.float32)
    zero_code = int((((c[:-1] + c[1:]) / 2) <= 0).sum())  # 8: the midpoint 0 of the symmetric levels is <= 0
    assert zero_code == 8
    assert codes[5].item() == 15 and set(codes[:5].tolist() + codes[6:].tolist()) <= {7, 8}
    assert b[32:].view(torch.float16).item() == 3.0
    assert (b[0] & 0x0F).item() == codes[0].item() and (b[2] >> 4).item() == codes[5].item()


def test_turboquant_key_decode_norm_correction():
    """_tq_full_dequant_kv: c = centroids[code]; NORM_CORRECTION: c *= 1 / sqrt(sum c^2 + 1e-16);
    k = fp16 norm * c, then `k @ Pi` (_continuation_prefill). With the correction the decoded key has the
    stored norm exactly up to rounding; the key direction is close to the input's."""
    x = torch.randn(64, 64) * 2.5
    for preset in ("turboquant_4bit_nc", "turboquant_3bit_nc"):
        y = tq_dequantize_key(tq_quantize_key(x, preset, 2), preset, 64, 2)
        norms = x.norm(dim=-1).half().float()
        assert torch.allclose(y.norm(dim=-1), norms, rtol=1e-5)
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
        assert cos.min() > (0.97 if "4bit" in preset else 0.9)


def test_turboquant_fp8_keys_are_a_plain_cast():
    """_tq_fused_store_fp8: `k_vals.to(tl.float8e4nv)`: no scale, round to nearest even, saturating."""
    x = torch.tensor([1.0625, 500.0, -0.0, 3.0])
    b = tq_quantize_key(x, "turboquant_k8v4")
    assert tq_dequantize_key(b, "turboquant_k8v4", 4).tolist() == [1.0, 448.0, -0.0, 3.0]


def test_turboquant_value_store_vectors():
    """_store_quantized_value (VQB 4): scale = (max - min) / 15 (floor 1e-8), q = clamp(int((v - min) /
    scale + 0.5), 0, 15), two codes a byte (element 2i in the low nibble), then fp16 scale, fp16 zero (min).
    Read back: code * scale + zero (triton_turboquant_decode.py)."""
    v = torch.arange(16, dtype=torch.float32) * 0.5 + 1.0  # min 1, max 8.5: scale 0.5, codes 0..15 exactly
    v[3] = 1.0 + 2.5 * 0.5  # halfway between codes 2 and 3: +0.5 then truncation goes up, to 3
    b = tq_quantize_value(v, "turboquant_4bit_nc")
    assert b.shape == (12,)
    assert b[:2].tolist() == [0x10, 0x32]  # codes 0 | 1 << 4, 2 | 3 << 4
    assert b[8:10].view(torch.float16).item() == 0.5 and b[10:12].view(torch.float16).item() == 1.0
    expect = v.clone()
    expect[3] = 2.5
    assert tq_dequantize_value(b, "turboquant_4bit_nc", 16).tolist() == expect.tolist()


def test_turboquant_value_3bit_and_constant_rows():
    """VQB 3: scale = (max - min) / 7; 8 codes in 3 bytes (code j at bit 3j of the 24-bit word). A constant
    row has max == min: scale takes the 1e-8 floor (fp16 0), every code 0, and it decodes to fp16(min)."""
    v = torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 7])
    b = tq_quantize_value(v, "turboquant_3bit_nc")
    word = b[0].item() | b[1].item() << 8 | b[2].item() << 16
    assert [(word >> (3 * j)) & 7 for j in range(8)] == list(range(8))
    assert tq_dequantize_value(b, "turboquant_3bit_nc", 8).tolist() == v.tolist()
    c = tq_quantize_value(torch.full((8,), 0.3), "turboquant_3bit_nc")
    assert unpack(c[:3], 3, 8).tolist() == [0] * 8
    assert tq_dequantize_value(c, "turboquant_3bit_nc", 8).unique().item() == torch.tensor(0.3).half().item()


@pytest.mark.parametrize("preset", sorted(TURBOQUANT_PRESETS))
def test_turboquant_codec_round_trip_and_layers(preset):
    """The codecs store exactly the store's bytes for their layer, do not depend on chunking (per token),
    and decode close to the input."""
    x = torch.randn(1, 2, 8, 64)
    for role in ("k", "v"):
        codec = codec_for(f"vllm:{preset}.{role}", 2, 64, torch.float32, role=role, layer=7)
        slot = codec.encode(x)["slot"]
        ref = tq_quantize_key(x, preset, 7) if role == "k" else tq_quantize_value(x, preset)
        assert torch.equal(slot, ref)
        parts = torch.cat([codec.encode(x[:, :, i : i + 1])["slot"] for i in range(8)], dim=2)
        assert torch.equal(parts, slot)
        y = codec.decode({"slot": slot}, torch.float32)
        assert (y - x).norm() / x.norm() < 0.25


def test_turboquant_scheme_names():
    s = parse_scheme("vllm:turboquant_4bit_nc")
    assert (s.key.engine, s.value.engine) == ("vllm:turboquant_4bit_nc.k", "vllm:turboquant_4bit_nc.v")
    assert str(s) == "vllm:turboquant_4bit_nc" and parse_scheme(str(s)) == s
    lay = parse_scheme("layers=0-1:fp16+2-27:vllm:turboquant_k3v4_nc+28-29:fp16")
    assert str(lay) == "layers=0-1:fp16+2-27:vllm:turboquant_k3v4_nc+28-29:fp16" and lay.num_layers == 30
    with pytest.raises(SchemeError, match="stores keys and values differently"):
        parse_scheme("k=vllm:turboquant_4bit_nc,v=fp16")
    with pytest.raises(SchemeError, match="key half"):
        codec_for("vllm:turboquant_4bit_nc.k", 1, 64, role="v")
    with pytest.raises(SchemeError, match="not a power of two"):
        parse_scheme("vllm:turboquant_4bit_nc").check_head_dim(96)
    parse_scheme("vllm:turboquant_k8v4").check_head_dim(96)  # FP8 keys need no Hadamard matrix
    with pytest.raises(SchemeError, match="head_size <= 256"):
        parse_scheme("vllm:turboquant_k8v4").check_head_dim(512)


def test_kv_cache_dtype_skip_layers():
    """vllm/engine/arg_utils.py: a turboquant_* dtype merges TurboQuantConfig.get_boundary_skip_layers
    (first 2 and last 2, at most half the layers) into --kv-cache-dtype-skip-layers; skipped layers are
    unquantized; `sliding_window` names the sliding layers (vllm/config/cache.py)."""
    assert boundary_skip_layers(32) == [0, 1, 30, 31]
    assert boundary_skip_layers(4) == [0, 1, 2, 3] and boundary_skip_layers(3) == [0, 2]
    assert vllm_cache_scheme("turboquant_4bit_nc", 30) == (
        "layers=0-1:fp16+2-27:vllm:turboquant_4bit_nc+28-29:fp16"
    )
    assert vllm_cache_scheme("turboquant_k8v4", 30, ["5"]) == (
        "layers=0-1:fp16+2-4:vllm:turboquant_k8v4+5:fp16+6-27:vllm:turboquant_k8v4+28-29:fp16"
    )
    assert vllm_cache_scheme("fp8", 30) == "vllm:fp8"
    assert vllm_cache_scheme("fp8", 30, [0, 29]) == "layers=0:fp16+1-28:vllm:fp8+29:fp16"
    assert vllm_cache_scheme("fp8", 4, ["sliding_window"], sliding_layers=[0, 1, 2]) == (
        "layers=0-2:fp16+3:vllm:fp8"
    )
    assert vllm_cache_scheme("turboquant_3bit_nc", 2) == "fp16"
    for text in (vllm_cache_scheme("turboquant_4bit_nc", 30), vllm_cache_scheme("fp8", 30, [0, 29])):
        parse_scheme(text).check_num_layers(30)
    with pytest.raises(SchemeError, match="layer indices"):
        vllm_cache_scheme("fp8", 30, ["30"])
    with pytest.raises(SchemeError, match="no sliding layers"):
        vllm_cache_scheme("fp8", 30, ["sliding_window"])


@pytest.mark.parametrize("scheme", ["vllm:turboquant_4bit_nc", "layers=0:fp16+1:vllm:turboquant_k8v4"])
def test_cache_serves_turboquant(tiny_model, scheme):
    """A tiny model runs with a TurboQuant preset in kvquant's cache; layer 1's stored key bytes are vLLM's
    store of the model's layer-1 keys with layer 1's rotation (its input does not depend on layer 1's cache
    only when layer 0 is unquantized, so the second scheme checks the bytes)."""
    from transformers import DynamicCache

    from kvquant import QuantizedCache

    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dyn = DynamicCache(config=tiny_model.config)
        ref = tiny_model(ids, cache=dyn).logits
        cache = QuantizedCache(parse_scheme(scheme), tiny_model.config, backend="torch")
        out = tiny_model(ids, cache=cache).logits
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()
    if scheme.startswith("layers="):
        layer = cache.layers[1]
        st = layer.stored()
        n = st.key_fields["slot"].shape[2]
        k_ref = tq_quantize_key(dyn.layers[1].keys[:, :, :n], "turboquant_k8v4", 1)
        v_ref = tq_quantize_value(dyn.layers[1].values[:, :, :n], "turboquant_k8v4")
        assert torch.equal(st.key_fields["slot"], k_ref)
        assert torch.equal(st.value_fields["slot"], v_ref)


# ------------------------------------------------------------------------------------ int4_per_token_head
# Source followed: vllm/v1/attention/ops/int4_per_token_head.py at a7f284a2e24b86c171ef714c5ff492acf0baee6d
# (pack_int4_nibbles, _reshape_cache_int4_kernel, _attn_packed, reshape_and_cache_int4,
# unified_attention_int4, fast_hadamard_transform, _get_rht_signs, single_rht) and
# vllm/v1/kv_cache_interface.py (AttentionSpec.real_page_size_bytes / page_size_bytes with
# KVQuantMode.INT4_PER_TOKEN_HEAD).

from kvquant.codecs.engine_vllm import (  # noqa: E402
    int4_dequantize,
    int4_load,
    int4_quantize,
    int4_rht,
    int4_rht_signs,
    int4_store,
    sylvester_wht,
)

INT4 = "vllm:int4_per_token_head"


def _bits(scale: torch.Tensor) -> list[int]:
    return [v & 0xFFFFFFFF for v in scale.contiguous().view(torch.int32).flatten().tolist()]


def test_int4_name_is_served_not_refused():
    assert INT4 not in ENGINE_REFUSED
    spec = parse_spec(INT4)
    assert str(spec) == INT4 and spec.family.bits == 4
    with pytest.raises(SchemeError, match="power-of-two dim.*head_dim 96"):  # fast_hadamard_transform
        parse_scheme(INT4).check_head_dim(96)
    parse_scheme(INT4).check_head_dim(256)


def test_int4_rht_signs_follow_get_rht_signs():
    """_get_rht_signs(d, round_idx=0): `gen.manual_seed(0x9E3779B9 + round_idx * 0x517CC1B7)`, then
    `2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0`; single_rht always asks round 0, so
    one vector serves every layer, K, V and Q."""
    gen = torch.Generator(device="cpu").manual_seed(0x9E3779B9)
    expect = 2.0 * torch.bernoulli(torch.full((64,), 0.5), generator=gen) - 1.0
    assert torch.equal(int4_rht_signs(64), expect)
    assert int4_rht_signs(8).tolist() == [1.0, -1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0]


def test_int4_hadamard_is_the_unnormalized_sylvester_butterfly():
    """fast_hadamard_transform, tier 3: for h = 1, 2, ...: `torch.stack([a + b, a - b], dim=-2)` of the halves
    h apart: H x with H the Sylvester matrix, unnormalized (H H = d I). [1, 2, 3, 4] -> h = 1: [3, -1, 7, -1]
    -> h = 2: [10, -2, -4, 0]."""
    assert sylvester_wht(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [10.0, -2.0, -4.0, 0.0]
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    h8 = torch.kron(torch.kron(h2, h2), h2)
    x = torch.randn(5, 8)
    assert torch.allclose(sylvester_wht(x), x @ h8.T, atol=1e-6)
    assert torch.allclose(sylvester_wht(sylvester_wht(x)), 8 * x, atol=1e-5)
    # single_rht: H (D1 x); inverse: (H x) * D1, so inverse(forward(x)) = d x
    assert torch.allclose(int4_rht(int4_rht(x), inverse=True), 8 * x, atol=1e-5)


def test_int4_store_vectors():
    """_reshape_cache_int4_kernel on a rotated vector: `k_scale = tl.maximum((k_max - k_min) / 15.0, 1e-6)`,
    `k_zp_f = clamp(round_half_away(-k_min / k_scale), 0, 15)`, `k_q = clamp(round_half_away(k * (1.0 /
    k_scale) + k_zp_f), 0, 15)`; `pack_int4_nibbles(lo, hi) = (lo & 0xF) | ((hi & 0xF) << 4)` with the even
    element low; `k_scale_packed = (k_scale_bits & -16) | (k_zp_int & 0xF)`.
    [-3 .. 3, 12]: scale 15 / 15 = 1.0 (0x3F800000), zp 3, codes 0..6 and 15."""
    y = torch.tensor([-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 12.0])
    codes, scale = int4_store(y)
    assert codes.dtype == torch.uint8 and scale.dtype == torch.float32 and scale.shape == (1,)
    assert codes.tolist() == [0x10, 0x32, 0x54, 0xF6]
    assert _bits(scale) == [0x3F800003]
    # _attn_packed: `k_zp = (ks_bits & 0xF)`, scale `(ks_bits & -16)`: (q - 3) * 1.0 gives y back exactly
    assert int4_load(codes, scale).tolist() == y.tolist()


def test_int4_rounds_half_away_from_zero():
    """`tl.where(s >= 0, (s + 0.5).to(tl.int32), (s - 0.5).to(tl.int32))` (the cast truncates): ties go up.
    min -3.375, max 11.625: scale 1.0; -min / scale = 3.375 -> int(3.875) = zp 3; s = x + 3:
    0.5 -> 3.5 -> 4, -2.5 -> 0.5 -> 1, 2.5 -> 5.5 -> 6, 1.5 -> 4.5 -> 5, -0.5 -> 2.5 -> 3,
    -3.375 -> -0.375 -> int(-0.875) = 0, 11.625 -> 14.625 -> 15, 0 -> 3."""
    x = torch.tensor([0.5, -2.5, 2.5, 1.5, -0.5, -3.375, 11.625, 0.0])
    codes, scale = int4_store(x)
    assert _bits(scale) == [0x3F800003]
    assert unpack(codes, 4, 8).tolist() == [4, 1, 6, 5, 3, 0, 15, 3]


def test_int4_zero_point_is_clamped_so_one_sided_rows_clip():
    """`tl.clamp(..., 0.0, 15.0)` on the zero point: [2, 4, ..., 14, 32] has scale (32 - 2) / 15 = 2.0 and
    -min / scale = -1 -> int(-1.5) = -1 -> zp 0; 32 * 0.5 + 0 = 16 clips to code 15 and reads back as 30."""
    x = torch.tensor([2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 32.0])
    codes, scale = int4_store(x)
    assert _bits(scale) == [0x40000000]  # 2.0, zero point 0
    assert unpack(codes, 4, 8).tolist() == [1, 2, 3, 4, 5, 6, 7, 15]
    assert int4_load(codes, scale).tolist() == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 30.0]


def test_int4_scale_bits_hold_the_zero_point_and_read_truncated():
    """The zero point replaces the scale's 4 lowest mantissa bits, and the reader uses the scale with those
    bits cleared (`ks_bits & -16`), not the one the writer divided by. Range 1 over [-0.25, 0.75]: scale =
    fp32(1 / 15) = 0x3D888889, -min / scale = 3.75 -> zp int(4.25) = 4: stored 0x3D888884, read 0x3D888880."""
    x = torch.tensor([-0.25, 0.75, 0.0, 0.5])
    codes, scale = int4_store(x)
    assert _bits(torch.tensor([1.0]) / 15.0) == [0x3D888889]
    assert _bits(scale) == [0x3D888884]
    q = unpack(codes, 4, 4)
    s_read = torch.tensor([0x3D888880], dtype=torch.int32).view(torch.float32)
    assert torch.equal(int4_load(codes, scale), (q.float() - 4.0) * s_read)
    assert int4_load(codes, scale)[1].item() != 0.75  # 15 - 4 = 11 steps of the truncated scale


def test_int4_write_path_rotates_first():
    """reshape_and_cache_int4: `key = single_rht(key.float()).to(key.dtype)` before the kernel. A key built as
    D1 H y / 8 rotates to y exactly (H D1 D1 H = 8 I), so it stores test_int4_store_vectors' bytes, and
    reading it back (the attention's inverse rotation, / head_size) gives the key exactly."""
    y = torch.tensor([-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 12.0])
    x = int4_rht_signs(8) * sylvester_wht(y) / 8
    assert torch.equal(int4_rht(x), y)
    codes, scale = int4_quantize(x)
    assert codes.tolist() == [0x10, 0x32, 0x54, 0xF6] and _bits(scale) == [0x3F800003]
    assert torch.equal(int4_dequantize(codes, scale), x)
    # .to(key.dtype): a half-precision model's rotated K is rounded to fp16 before the store reads it
    z = torch.randn(4, 64)
    assert torch.equal(int4_quantize(z, torch.float16)[0], int4_store(int4_rht(z).half().float())[0])


def test_int4_attention_reads_the_rotated_frame():
    """unified_attention_int4: q is rotated (single_rht), softmax_scale / head_size, and _attn_packed scores
    `(dot(Q_s0, K_s0) + dot(Q_s1, K_s1) - Q_sum * k_zp) * (scale * k_scale)` on the even / odd nibble streams;
    the output `acc += dot(P_v, V_s) - sum(P_v * v_zp)` (P_v = P * v_scale) is rotated back,
    single_rht(out, inverse=True) / head_size. The codec's decode (the model-frame K and V) gives the same
    scores and output."""
    d, t = 64, 9
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, d, generator=g) * 2 for n in (3, t, t))
    kc, ks = int4_quantize(k)
    vc, vs = int4_quantize(v)
    softmax_scale = d**-0.5
    qr = int4_rht(q)  # (3, D)
    bits = ks.view(torch.int32)
    k_zp, k_s = (bits & 0xF).float()[:, 0], (bits & -16).view(torch.float32)[:, 0]
    kq = unpack(kc, 4, d).float()  # (t, D): even elements are the low nibbles (stream 0)
    raw = qr[:, 0::2] @ kq[:, 0::2].T + qr[:, 1::2] @ kq[:, 1::2].T
    s_kernel = (raw - qr.sum(-1, keepdim=True) * k_zp) * (softmax_scale / d * k_s)
    s_codec = q @ int4_dequantize(kc, ks).T * softmax_scale
    assert torch.allclose(s_kernel, s_codec, rtol=1e-4, atol=1e-5)
    p = torch.softmax(s_kernel, dim=-1)
    vbits = vs.view(torch.int32)
    v_zp, v_s = (vbits & 0xF).float()[:, 0], (vbits & -16).view(torch.float32)[:, 0]
    p_v = p * v_s
    vq = unpack(vc, 4, d).float()
    acc = torch.empty(3, d)
    acc[:, 0::2] = p_v @ vq[:, 0::2] - (p_v * v_zp).sum(-1, keepdim=True)
    acc[:, 1::2] = p_v @ vq[:, 1::2] - (p_v * v_zp).sum(-1, keepdim=True)
    out_kernel = int4_rht(acc, inverse=True) / d
    assert torch.allclose(out_kernel, p @ int4_dequantize(vc, vs), rtol=1e-4, atol=1e-5)


def test_int4_codec_layout_bytes_and_chunking():
    """kv_cache_interface.py: `head_dim = self.head_size // 2` for INT4_PER_TOKEN_HEAD (one byte holds two
    codes) and `page_size_bytes` adds `2 * block_size * num_kv_heads * 4` for the fp32 scales: per K (or V),
    (D / 2 + 4) bytes a (token, head). Scales are per token, so codes do not depend on how tokens arrive."""
    heads, d = 3, 64
    codec = codec_for(INT4, heads, d, torch.float32)
    assert {n: (f.cols, f.dtype) for n, f in codec.fields().items()} == {
        "codes": (d // 2, torch.uint8), "scale": (1, torch.float32)}
    block = 16
    vllm_page = 2 * block * heads * (d // 2) + 2 * block * heads * 4
    assert 2 * codec.bytes(block) == vllm_page
    x = torch.randn(1, heads, 6, d) * 3
    whole = codec.encode(x)
    parts = [codec.encode(x[:, :, i : i + 1]) for i in range(6)]
    for key, value in whole.items():
        assert torch.equal(value, torch.cat([p[key] for p in parts], dim=2))
    y = codec.decode(whole, torch.float32)
    assert (x - y).norm() / x.norm() < 0.12  # 4-bit min/max over a rotated 64-vector: ~9% relative error


def test_cache_serves_int4_per_token_head(tiny_model):
    """A tiny model runs with vLLM's int4 cache on layer 1 (layer 0 unquantized); layer 1's stored bytes are
    vLLM's write of the model's layer-1 K/V."""
    from transformers import DynamicCache

    from kvquant import QuantizedCache

    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dyn = DynamicCache(config=tiny_model.config)
        ref = tiny_model(ids, cache=dyn).logits
        cache = QuantizedCache(parse_scheme(f"layers=0:fp16+1:{INT4}"), tiny_model.config, backend="torch")
        out = tiny_model(ids, cache=cache).logits
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()
    st = cache.layers[1].stored()
    n = st.key_fields["codes"].shape[2]
    for fields, ref_kv in ((st.key_fields, dyn.layers[1].keys), (st.value_fields, dyn.layers[1].values)):
        codes, scale = int4_quantize(ref_kv[:, :, :n])
        assert torch.equal(fields["codes"], codes)
        assert torch.equal(fields["scale"].view(torch.int32), scale.view(torch.int32))
