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
