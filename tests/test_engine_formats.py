"""Engine block formats (kvquant.codecs.engine) against a second implementation: the `gguf` package's
`gguf.quants.quantize` / `dequantize` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 both ways; IQ4_NL and NVFP4 decode
only, plus its UE4M3 conversions) and, where it installs, torchao's MX / NVFP4 reference. Bytes are compared
with np.array_equal: bit for bit."""

from __future__ import annotations

import logging
import math
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES

import kvquant
from kvquant.codecs.base import codec_for
from kvquant.codecs.engine import (
    BLOCK_TYPES,
    IQ4_NL_VALUES,
    attn_rotate,
    ggml_dequantize,
    ggml_quantize,
    ue4m3_from_fp32,
    ue4m3_to_fp32,
)
from kvquant.scheme import ENGINE_FORMATS, SchemeError, parse_scheme, parse_spec

QUANTIZED_BY_GGUF = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4")
GT_OF = {f: getattr(GT, bt.name) for f, bt in BLOCK_TYPES.items()}


def _gguf(x: np.ndarray, fmt: str) -> np.ndarray:
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpy warns on its NaN -> uint8 casts
        return gq.quantize(np.ascontiguousarray(x, dtype=np.float32), GT_OF[fmt])


def _ours(x: np.ndarray, fmt: str) -> np.ndarray:
    return ggml_quantize(torch.from_numpy(np.asarray(x, dtype=np.float32)), fmt).numpy()


def _rows(seed: int, n: int = 256, d: int = 128) -> np.ndarray:
    """Gaussian rows at magnitudes 1e-4 .. 1e3, some with one outlier channel."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-4, 3, (n, 1))
    x[::7, 5] *= 40
    return x.astype(np.float32)


def _ties() -> np.ndarray:
    """Blocks whose scale is exactly 1 (or 1/2): values land exactly on each format's rounding midpoints."""
    rows = []
    t = np.arange(32) % 16 - 7.5
    t[0] = -8  # q4_0: d = 1, x + 8.5 an integer
    rows.append(t)
    t = np.arange(32) - 15.5
    t[0] = -16  # q5_0: d = 1
    rows.append(t)
    t = (np.arange(32) - 16) + 0.5
    t[0] = 127  # q8_0: d = 1, roundf of k + 0.5
    rows.append(t)
    t = np.arange(32) % 15 + 0.5
    t[:2] = 0, 15  # q4_1: min 0, d = 1
    rows.append(t)
    t = np.arange(32) % 31 + 0.5
    t[:2] = 0, 31  # q5_1
    rows.append(t)
    mid = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # E2M1 midpoints at d = 1/2 (mxfp4 amax 6)
    rows.append(np.array(mid + [-m for m in mid] + mid + [-m for m in mid] + [6, -6, 0.0, -0.0]))
    return np.array(rows, dtype=np.float32)


def _near_pow2() -> np.ndarray:
    """The largest float below a power of two as the block's absmax (mxfp4's floor(log2f(amax)))."""
    x = np.full((8, 32), 0.1, dtype=np.float32)
    for i, k in enumerate([1, 2, 4, 8, 0.5, 2**-20, 2**20, 6]):
        x[i, 3] = np.nextafter(np.float32(k), np.float32(0))
    return x


def _inf_rows() -> np.ndarray:
    x = np.random.default_rng(3).standard_normal((3, 32)).astype(np.float32)
    x[0, 5] = np.inf
    x[1, 0] = -np.inf
    x[2, 3], x[2, 9] = np.inf, -np.inf
    return x


CASES = {
    "random": _rows(0),
    "ties": _ties(),
    "zeros": np.zeros((2, 64), dtype=np.float32),
    "constant": np.repeat(np.array([[0.3], [-7.0], [1e4], [5e-5]], dtype=np.float32), 32, axis=1),
    "large": (np.linspace(-1, 1, 64)[None] * np.array([[6e4], [1e5], [1e30], [3e38]])).astype(np.float32),
    "small": (np.linspace(-1, 1, 32)[None] * np.array([[1e-5], [1e-8], [1e-30], [1e-39], [1e-44]])).astype(
        np.float32
    ),
    "near_pow2": _near_pow2(),
    "inf": _inf_rows(),
}


# ----------------------------------------------------------------------------------- layout and bytes


@pytest.mark.parametrize("fmt", list(BLOCK_TYPES))
def test_block_sizes_are_gguf(fmt):
    block, type_size = GGML_QUANT_SIZES[GT_OF[fmt]]
    assert (BLOCK_TYPES[fmt].block, BLOCK_TYPES[fmt].type_size) == (block, type_size)
    codec = codec_for(next(n for n in ENGINE_FORMATS if n.endswith(fmt)), 3, 128)
    assert codec.bytes(1) == 3 * 128 // block * type_size  # bytes per token: the engine's
    assert codec.kernel_layout() is None


# ---------------------------------------------------------------------- quantize: identical to gguf


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fmt", QUANTIZED_BY_GGUF)
def test_quantize_bytes_identical_to_gguf(fmt, case):
    x = CASES[case]
    assert np.array_equal(_ours(x, fmt), _gguf(x, fmt))


@pytest.mark.parametrize("fmt", QUANTIZED_BY_GGUF)
def test_nibble_order_is_the_c_structs(fmt):
    """Element j in the low nibble of byte j, element j + 16 in the high one (q8_0: one int8 per element)."""
    x = np.zeros((1, 32), dtype=np.float32)
    x[0, 20] = -1.0  # absmax at element 20: high nibble of byte 4 (mxfp4: d = 2^-3, -8 d is code 14)
    b = _ours(x, fmt)[0]
    qs = b[-16:] if fmt != "q8_0" else b[2:]
    code = {"q4_0": 0, "q5_0": 0, "q4_1": 0, "q5_1": 0, "mxfp4": 14, "q8_0": 129}[fmt]
    if fmt == "q8_0":
        assert qs[20] == code and (np.delete(qs, 20) == 0).all()
    else:
        assert qs[4] >> 4 == code % 16


# ------------------------------------------------------------- non-finite and signed zero: C, not numpy


def _zeroed(x: np.ndarray, where) -> np.ndarray:
    y = x.copy()
    y[where] = 0.0
    return y


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q5_0", "mxfp4"])
def test_nan_element_is_skipped_as_the_c_code_does(fmt):
    """The C loops compare with < / >, so NaN never becomes the absmax, min or max, and (int8_t)NaN is 0 on
    x86: the block is the block with NaN -> 0, except the NaN element's code is 0. gguf's numpy port lets
    NaN win argmax / max instead and writes a NaN scale (fp16 0x7E00) for the whole block."""
    x = np.random.default_rng(4).standard_normal((1, 32)).astype(np.float32)
    x[0, 5] = np.nan
    ours, ref_nan = _ours(x, fmt)[0], _gguf(x, fmt)[0]
    expect = _gguf(_zeroed(x, (0, 5)), fmt)[0].copy()
    first = len(expect) - 16
    expect[first + 5] &= 0xF0  # element 5: low nibble of qs[5], code 0
    if fmt == "q5_0":
        expect[2] &= ~np.uint8(1 << 5)  # and its 5th bit in qh
    assert np.array_equal(ours, expect)
    if fmt == "mxfp4":
        assert ref_nan[0] == 0  # gguf: e = 0 (amax NaN fails amax > 0)
    else:
        assert np.isnan(ref_nan[:2].view(np.float16)[0])


def test_q8_0_nan_follows_the_max_macro():
    """MAX(amax, fabsf(v)) is `amax > v ? amax : v`: a NaN amax is replaced by the next element's magnitude,
    so d comes from the elements after the last NaN; a NaN last element leaves d = NaN."""
    x = np.random.default_rng(5).standard_normal((2, 32)).astype(np.float32)
    x[0, 7] = np.nan
    x[1, 31] = np.nan
    ours = _ours(x, "q8_0")
    d0 = ours[0, :2].view(np.float16)[0]
    assert d0 == np.float16(np.float32(np.abs(x[0, 8:]).max()) / np.float32(127))
    assert ours[0, 2 + 7] == 0  # (int8_t)roundf(NaN) -> 0
    assert np.isnan(ours[1, :2].view(np.float16)[0])
    assert np.array_equal(ours[1], _gguf(x[1:], "q8_0")[0])  # last-element NaN: gguf agrees


@pytest.mark.parametrize("fmt", ["q4_1", "q5_1"])
def test_all_inf_block_keeps_flt_max_min(fmt):
    """min starts at FLT_MAX and +inf < FLT_MAX is false, so an all-+inf block has min FLT_MAX (stored fp16
    +inf) and d = inf; gguf's min is inf, inf - inf = NaN."""
    x = np.full((1, 32), np.inf, dtype=np.float32)
    ours = _ours(x, fmt)[0]
    assert ours[:2].view(np.float16)[0] == np.inf and ours[2:4].view(np.float16)[0] == np.inf
    assert np.isnan(_gguf(x, fmt)[0, :2].view(np.float16)[0])


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0"])
def test_negative_zero_block(fmt):
    """max starts at +0.0f and -0 never beats it, so d = 0.0f / -8 = -0 (fp16 0x8000) even for a block of -0;
    gguf takes the block's first element (-0) and stores +0. Both decode to zeros."""
    x = np.full((1, 32), -0.0, dtype=np.float32)
    ours = _ours(x, fmt)[0]
    assert ours[:2].tolist() == [0x00, 0x80]
    assert _gguf(x, fmt)[0, :2].tolist() == [0x00, 0x00]
    assert (ggml_dequantize(torch.from_numpy(ours[None]), fmt) == 0).all()


# ------------------------------------------------------------------------ decode: identical to gguf


@pytest.mark.parametrize("fmt", list(BLOCK_TYPES))
def test_dequantize_identical_to_gguf_on_every_byte_pattern(fmt):
    """Random bytes (any scale bits: NaN, Inf, subnormal fp16; any UE4M3 / E8M0 byte) decode as gguf does."""
    bt = BLOCK_TYPES[fmt]
    b = np.random.default_rng(6).integers(0, 256, (512, 4 * bt.type_size), dtype=np.uint8)
    ref = gq.dequantize(b, GT_OF[fmt])
    ours = ggml_dequantize(torch.from_numpy(b), fmt).numpy()
    assert ours.shape == ref.shape
    assert np.array_equal(ours, ref, equal_nan=True)


@pytest.mark.parametrize("fmt", list(BLOCK_TYPES))
def test_round_trip_error_is_small(fmt):
    x = _rows(7, n=64)
    if fmt == "nvfp4":  # per-tensor scale 1: block scales saturate at 448, so |x| beyond 6 * 448 clips
        x = x / np.abs(x).max(-1, keepdims=True) * 100
    y = ggml_dequantize(ggml_quantize(torch.from_numpy(x), fmt), fmt).numpy()
    sqnr = 10 * np.log10((x**2).sum() / ((x - y) ** 2).sum())
    assert sqnr > {"q8_0": 35, "q5_0": 22, "q5_1": 22}.get(fmt, 14), sqnr


# ------------------------------------------------------------------------------------ iq4_nl, nvfp4


def test_iq4_nl_hand_vector():
    """quantize_row_iq4_nl_ref on levels * s: id = 1 / (max / -127) maps every value onto its own level, and
    the least-squares scale is s; codes are the level indices in the C struct's nibble order."""
    levels = np.array(IQ4_NL_VALUES, dtype=np.float32)
    s = np.float32(0.0625)  # exact in fp16
    x = np.concatenate([levels, levels[::-1]])[None] * s
    b = _ours(x, "iq4_nl")[0]
    assert b[:2].view(np.float16)[0] == np.float16(s)
    idx = np.concatenate([np.arange(16), np.arange(16)[::-1]])
    assert np.array_equal(b[2:] & 0x0F, idx[:16]) and np.array_equal(b[2:] >> 4, idx[16:])
    assert np.array_equal(gq.dequantize(b[None], GT.IQ4_NL)[0], x[0])


def test_iq4_nl_ties_go_up_and_tiny_blocks_are_zero():
    x = np.zeros((2, 32), dtype=np.float32)
    x[0, 0] = -127.0  # d0 = 1: values are compared with the levels directly
    x[0, 1] = (-10 + 1) / 2  # midpoint of -10 and 1 -> the upper level (index 8)
    x[0, 2] = (-127 + -104) / 2  # -> index 1
    x[1, :] = 1e-16  # absmax below GROUP_MAX_EPS
    b = _ours(x, "iq4_nl")
    assert b[0, 3] & 0x0F == 8 and b[0, 4] & 0x0F == 1
    assert (b[1] == 0).all()


def test_ue4m3_conversions_match_gguf():
    """ggml_fp32_to_ue4m3 / ggml_ue4m3_to_fp32 (gguf's NVFP4 helpers port them from ggml-impl.h)."""
    u = np.arange(256, dtype=np.uint8)
    assert np.array_equal(
        ue4m3_to_fp32(torch.from_numpy(u)).numpy(), gq.NVFP4.ue4m3_to_fp32(u).astype(np.float32)
    )
    rng = np.random.default_rng(8)
    vals = ue4m3_to_fp32(torch.from_numpy(u)).numpy().astype(np.float32) * 2  # every UE4M3 value
    mids = (vals[:-1] + vals[1:]) / 2
    x = np.concatenate(
        [vals, mids, 10.0 ** rng.uniform(-5, 3, 4000), [0.0, -1.0, 448.0, 500.0, 1e30, np.inf, np.nan]]
    ).astype(np.float32)
    ours = ue4m3_from_fp32(torch.from_numpy(x)).numpy()
    with np.errstate(all="ignore"):
        ref = gq.NVFP4.fp32_to_ue4m3(np.nan_to_num(x, nan=0.0))  # its port clips NaN to NaN; C: !(x > 0) -> 0
    assert np.array_equal(ours, ref)


def _nvfp4_from_gguf_parts(x: np.ndarray) -> np.ndarray:
    """quantize_row_nvfp4_ref restated with gguf's pieces: its UE4M3 conversions and MXFP4's first-minimum
    nearest-value search, packed as block_nvfp4 (4 scales, then 8 bytes per 16 values: j low, j + 8 high)."""
    sub = x.reshape(-1, 16)
    ue = gq.NVFP4.fp32_to_ue4m3(np.abs(sub).max(-1) / np.float32(6)).astype(np.uint8)
    d = gq.NVFP4.ue4m3_to_fp32(ue).astype(np.float32)
    kv = np.array(gq.NVFP4.kvalues, dtype=np.float32)
    codes = np.abs(d[:, None, None] * kv - sub[..., None]).argmin(-1).astype(np.uint8)
    qs = (codes[:, :8] | (codes[:, 8:] << 4)).reshape(-1, 32)
    return np.concatenate([ue.reshape(-1, 4), qs], axis=-1).reshape(x.shape[0], -1)


@pytest.mark.parametrize("case", ["random", "ties", "zeros", "large", "small"])
def test_nvfp4_quantize_matches_gguf_parts(case):
    x = CASES[case]
    if x.shape[1] % 64:
        x = np.concatenate([x, x], axis=1)
    x = np.clip(x, -1e30, 1e30)
    assert np.array_equal(_ours(x, "nvfp4"), _nvfp4_from_gguf_parts(x))
    assert np.array_equal(
        gq.dequantize(_ours(x, "nvfp4"), GT.NVFP4),
        ggml_dequantize(torch.from_numpy(_ours(x, "nvfp4")), "nvfp4"),
    )


# ------------------------------------------------------------------------------------------ torchao


@pytest.fixture(scope="module")
def torchao_mx():
    pytest.importorskip("torchao", reason="torchao (the MX / NVFP4 reference) is not installed")
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    return to_mx, to_dtype, nvfp4_quantize, f4_unpacked_to_f32, unpack_uint4


def test_mxfp4_matches_torchao(torchao_mx):
    """OCP MX: E8M0 scale 2^(floor(log2 amax) - 2) and E2M1 elements, as torchao's FLOOR mode (random rows:
    no element ties, where ggml rounds toward zero and torchao to even)."""
    to_mx, to_dtype, *_ = torchao_mx
    x = torch.from_numpy(_rows(9))
    scale, data = to_mx(x, torch.float4_e2m1fn_x2, 32)
    ours = ggml_quantize(x, "mxfp4").reshape(x.shape[0], -1, 17)
    assert torch.equal(ours[..., 0], scale.view(torch.uint8).reshape(x.shape[0], -1))
    ref = to_dtype(data, scale, torch.float4_e2m1fn_x2, 32, torch.float32)
    assert torch.equal(ggml_dequantize(ours.reshape(x.shape[0], -1), "mxfp4"), ref)


def test_nvfp4_matches_torchao(torchao_mx):
    """NVFP4 with per-tensor scale 1: E4M3 block scale amax / 6 and E2M1 elements, as torchao's
    nvfp4_quantize, on blocks whose scale is a normal E4M3 value (torchao clamps smaller scales up to 2^-6;
    ggml stores UE4M3 subnormals and flushes below 2^-10 to zero)."""
    *_, nvfp4_quantize, f4_to_f32, unpack_uint4 = torchao_mx
    g = torch.Generator().manual_seed(10)
    x = torch.randn(256, 128, generator=g) * torch.logspace(0, 2, 256)[:, None]
    scale, data = nvfp4_quantize(x, block_size=16)
    ours = ggml_quantize(x, "nvfp4").reshape(256, 2, 36)
    assert torch.equal(ours[..., :4].reshape(256, 8), scale.view(torch.uint8).reshape(256, 8))
    ref = f4_to_f32(unpack_uint4(data.contiguous().view(torch.uint8))).reshape(256, 8, 16)
    ref = ref * scale.float().reshape(256, 8, 1)
    assert torch.equal(ggml_dequantize(ours.reshape(256, -1), "nvfp4").reshape(256, 8, 16), ref)


# ------------------------------------------------------------------------------------------- grammar


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("llama.cpp:q4_0", "llama.cpp:q4_0"),
        ("llama.cpp:k=q8_0,v=q4_0", "k=llama.cpp:q8_0,v=llama.cpp:q4_0"),
        ("LLAMA.CPP:K=Q8_0, v=iq4_nl,window=32", "k=llama.cpp:q8_0,v=llama.cpp:iq4_nl,window=32"),
        ("mxfp4", "mxfp4"),
        ("nvfp4,sink=4", "nvfp4,sink=4"),
        ("k=llama.cpp:q5_1-prerope,v=mxfp4", "k=llama.cpp:q5_1-prerope,v=mxfp4"),
        ("layers=0:llama.cpp:q8_0+1:nvfp4/llama.cpp:q4_1", "layers=0:llama.cpp:q8_0+1:nvfp4/llama.cpp:q4_1"),
        ("llama.cpp:q4_0-norot", "llama.cpp:q4_0-norot"),
        ("llama.cpp:k=q8_0-norot,v=q4_0-rot", "k=llama.cpp:q8_0-norot,v=llama.cpp:q4_0-rot"),
        ("k=llama.cpp:q5_1-norot-prerope,v=mxfp4", "k=llama.cpp:q5_1-norot-prerope,v=mxfp4"),
    ],
)
def test_engine_names_parse_and_round_trip(text, canonical):
    s = parse_scheme(text)
    assert str(s) == canonical
    assert parse_scheme(str(s)) == s


def test_engine_spec_fields():
    s = parse_spec("llama.cpp:q5_0")
    assert (s.engine, s.bits, s.is_quantized) == ("llama.cpp:q5_0", 5, True)
    assert parse_spec("nvfp4").bits == 4 and parse_spec("llama.cpp:q8_0").bits == 8


@pytest.mark.parametrize(
    "text, needle",
    [
        ("llama.cpp:q3_k", "unknown llama.cpp cache type 'q3_k'"),
        ("llama.cpp:q4_0-head", "unknown llama.cpp cache type"),
        ("mxfp4-g32", "mxfp4-g32"),
    ],
)
def test_bad_engine_names_fail_clearly(text, needle):
    with pytest.raises(SchemeError, match=needle.replace(".", r"\.")):
        parse_scheme(text)


@pytest.mark.parametrize("spec, head_dim, block", [("llama.cpp:q4_0", 48, 32), ("nvfp4", 96, 64)])
def test_head_dim_not_a_multiple_of_the_block_is_refused(spec, head_dim, block):
    with pytest.raises(SchemeError, match=f"blocks of {block} values.*head_dim {head_dim}"):
        codec_for(spec, 2, head_dim)


# --------------------------------------------------------------------------------------------- cache


@pytest.mark.parametrize(
    "scheme",
    ["llama.cpp:k=q8_0,v=q4_0", "llama.cpp:k=q8_0-norot,v=q4_0-norot", "mxfp4,sink=2,window=4", "nvfp4"],
)
def test_cache_round_trip_on_tiny_model(tiny_model, scheme):
    """A QuantizedCache stores the GGUF bytes of the model's own K/V (layer 0: its K/V do not depend on the
    cache), of the Hadamard-rotated rows where llama.cpp rotates (head_dim % 64 == 0, not -norot), and
    attends over their decode; logits stay finite and close to the unquantized model's."""
    from transformers import DynamicCache

    ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(11))
    s = parse_scheme(scheme)
    with torch.no_grad():
        dyn = DynamicCache(config=tiny_model.config)
        ref = tiny_model(ids, cache=dyn).logits.log_softmax(-1)
        cache = kvquant.QuantizedCache(scheme, tiny_model.config, backend="torch")
        out = tiny_model(ids, cache=cache).logits
    assert torch.isfinite(out).all()
    kl = (ref.exp() * (ref - out.log_softmax(-1))).sum(-1).mean()
    assert kl < 0.05, kl
    layer = cache.layers[0]
    st = layer.stored()
    body = slice(s.sink, s.sink + st.key_fields["blocks"].shape[2])
    k_fp, v_fp = dyn.layers[0].keys[:, :, body], dyn.layers[0].values[:, :, body]  # (B, H, T_body, D)
    codecs = (layer.key_codec, layer.value_codec)
    rows = ((st.key_fields, k_fp, s.key), (st.value_fields, v_fp, s.value))
    for (fields, x, spec), codec in zip(rows, codecs, strict=True):
        blocks = fields["blocks"]
        fmt = spec.engine
        rotates = fmt.startswith("llama.cpp:") and not fmt.endswith("-norot") and x.shape[-1] % 64 == 0
        assert (codec.rotation is not None) == rotates
        if rotates:  # llama.cpp's default: the cache holds the blocks of the rotated rows
            x = attn_rotate(x, codec.rotation)
        assert torch.equal(blocks, ggml_quantize(x, fmt))
        base = fmt.rpartition(":")[2].removesuffix("-norot")
        if base in QUANTIZED_BY_GGUF:
            ref_bytes = _gguf(x.reshape(-1, x.shape[-1]).numpy(), base)
            assert np.array_equal(blocks.reshape(ref_bytes.shape).numpy(), ref_bytes)
    view = layer.view()
    decoded = view.keys(torch.float32)[:, :, body]
    assert torch.equal(decoded, layer.key_codec.decode(st.key_fields, torch.float32))


@pytest.mark.slow
def test_real_kv_rows_of_the_default_model_identical_to_gguf(default_model):
    """Every layer's K and V of the embedded model on a short prompt: identical GGUF bytes for each format
    gguf quantizes."""
    from transformers import DynamicCache

    model, tok = default_model
    ids = tok("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt").input_ids
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache)
    rows = torch.cat(
        [torch.cat([lay.keys, lay.values]).reshape(-1, lay.keys.shape[-1]) for lay in cache.layers]
    )
    x = rows.float().numpy()
    for fmt in QUANTIZED_BY_GGUF:
        assert np.array_equal(_ours(x, fmt), _gguf(x, fmt)), fmt


# ------------------------------------------------------------------------- llama.cpp attention rotation
# Source: llama.cpp PR #21038 (merged 2026-04-01): src/llama-kv-cache.cpp (attn_rot_k / attn_rot_v,
# ggml_gen_hadamard, build_input_k_rot / build_input_v_rot) and src/llama-graph.cpp (build_attn:
# q_cur, k_cur = ggml_mul_mat_aux(..., self_k_rot); v_cur = ggml_mul_mat_aux(..., self_v_rot); the output
# rotated back with self_v_rot).

from kvquant.codecs.engine import attn_rotation_size, hadamard  # noqa: E402


def _ggml_gen_hadamard(n: int) -> np.ndarray:
    """The C loop, transcribed in float32: data[0] = 1.0 / sqrtf(n), then the three copies per doubling."""
    data = np.zeros((n, n), dtype=np.float32)
    data[0, 0] = np.float32(1.0 / np.float64(np.sqrt(np.float32(n))))
    s = 1
    while s < n:
        for i in range(s):
            for j in range(s):
                val = data[i, j]
                data[i + s, j], data[i, j + s], data[i + s, j + s] = val, val, -val
        s *= 2
    return data


@pytest.mark.parametrize("n", [64, 128, 256])
def test_hadamard_is_ggml_gen_hadamard(n):
    assert np.array_equal(hadamard(n).numpy(), _ggml_gen_hadamard(n))


@pytest.mark.parametrize(
    "spec, head_dim, k_rot, v_rot",
    [
        ("llama.cpp:q4_0", 64, 64, 64),
        ("llama.cpp:q8_0", 128, 128, 64),  # K: the largest power of two dividing head_dim; V: always 64
        ("llama.cpp:q4_0", 256, 256, 64),
        ("llama.cpp:q4_0", 192, 64, 64),
        ("llama.cpp:q4_0", 96, None, None),  # 96 % 64 != 0: llama.cpp leaves the cache unrotated
        ("llama.cpp:q4_0-norot", 128, None, None),  # LLAMA_ATTN_ROT_DISABLE=1
        ("llama.cpp:q5_1-rot", 64, 64, 64),
        ("mxfp4", 64, None, None),
    ],
)
def test_rotation_default_follows_llama_cpp(spec, head_dim, k_rot, v_rot):
    """attn_rot_k = !LLAMA_ATTN_ROT_DISABLE && ggml_is_quantized(type_k) && n_embd_head_k % 64 == 0."""
    assert codec_for(spec, 2, head_dim, role="k").rotation == k_rot
    assert codec_for(spec, 2, head_dim, role="v").rotation == v_rot


def test_forced_rotation_on_a_head_dim_it_cannot_take_is_refused():
    with pytest.raises(SchemeError, match="only when head_dim is a multiple of 64.*head_dim 96"):
        parse_scheme("llama.cpp:q4_0-rot").check_head_dim(96)
    assert attn_rotation_size(320, "k") == 64 and attn_rotation_size(512, "k") == 512


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_rotated_blocks_are_gguf_blocks_of_the_rotated_rows(fmt):
    """With the rotation on, the cache holds exactly gguf.quants' blocks of H x (x in runs of n along D);
    with -norot, gguf's blocks of x itself."""
    x = torch.from_numpy(_rows(3, n=64, d=128)).reshape(2, 2, 16, 128)
    for role, n in (("k", 128), ("v", 64)):
        codec = codec_for(f"llama.cpp:{fmt}", 2, 128, torch.float32, role=role)
        blocks = codec.encode(x)["blocks"].reshape(64, -1).numpy()
        rot = attn_rotate(x, n).reshape(64, 128).numpy()
        assert np.array_equal(blocks, _gguf(rot, fmt))
    plain = codec_for(f"llama.cpp:{fmt}-norot", 2, 128, torch.float32, role="k").encode(x)["blocks"]
    assert np.array_equal(plain.reshape(64, -1).numpy(), _gguf(x.reshape(64, 128).numpy(), fmt))


def _attention(q, k, v):
    """q (T_q, D), k / v (T, D) -> softmax(q k^T / sqrt(D)) v, float64."""
    p = torch.softmax(q.double() @ k.double().T / math.sqrt(q.shape[-1]), dim=-1)
    return p @ v.double()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_rotated_attention_equals_llama_cpps_and_the_reference(fmt):
    """Attention over the decoded (rotated back) K/V equals llama.cpp's rotated-frame attention
    softmax((H q) . k'^T) v' then H, up to fp32 rounding (1e-5); against full precision it stays within the
    format's error, and with outlier channels the rotation cuts q4_0's error (what the rotation is for)."""
    g = torch.Generator().manual_seed(5)
    d, t = 128, 256
    k = torch.randn(t, d, generator=g)
    k[:, 7] *= 8  # an outlier channel, as real keys have
    v = torch.randn(t, d, generator=g)
    q = torch.randn(4, d, generator=g)

    def run(suffix: str):
        kc = codec_for(f"llama.cpp:{fmt}{suffix}", 1, d, torch.float32, role="k")
        vc = codec_for(f"llama.cpp:{fmt}{suffix}", 1, d, torch.float32, role="v")
        kf, vf = kc.encode(k[None, None]), vc.encode(v[None, None])
        out = _attention(q, kc.decode(kf, torch.float32)[0, 0], vc.decode(vf, torch.float32)[0, 0])
        return out, kc, vc, kf, vf

    ours, kc, vc, kf, vf = run("")
    k_stored = ggml_dequantize(kf["blocks"][0, 0], fmt)  # the rotated frame, as llama.cpp attends in it
    v_stored = ggml_dequantize(vf["blocks"][0, 0], fmt)
    engine = attn_rotate(_attention(attn_rotate(q, kc.rotation), k_stored, v_stored).float(), vc.rotation)
    assert (ours - engine.double()).abs().max() < 1e-5
    ref = _attention(q, k, v)
    err = (ours - ref).norm() / ref.norm()
    err_norot = (run("-norot")[0] - ref).norm() / ref.norm()
    # measured here: q8_0 0.0084 rotated vs 0.0111 without; q4_0 0.135 vs 0.172
    assert err < (0.015 if fmt == "q8_0" else 0.2)
    assert err < err_norot
