"""The quantize+pack kernel for FP8, codebook (nuq2/3/4), -centerN and -outP codecs writes `codec.encode`'s
bits into the pages (kvquant.kernels.testing.check_pack: whole pools compared after kernel and twin wrote
into equal random pools, through a shuffled table, from mid-page), edge values included: float8 rounding
ties, subnormals, +-max, zeros, NaN / Inf blocks, overflowing scales, codebook midpoint ties, outliers with
equal magnitudes and NaN outliers."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kvquant.kernels.pack_layouts import pack_frame, pack_parts
from kvquant.kernels.quantize_pack import _fp8_unit
from kvquant.kernels.testing import check_pack, demo_levels, with_demo_levels

from kvquant.codecs.base import codec_for
from kvquant.codecs.fp8 import FP8_DTYPES


def _codec(spec: str, h: int, d: int, dtype=torch.float16):
    return with_demo_levels(codec_for(spec, h, d, dtype))


def _x(b, h, t, d, dtype, seed, scale=2.0):
    x = torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(seed)) * scale + 0.3
    x[0, 0, min(1, t - 1)] = 0.0  # a zero (token, head): scale 0 wherever it is a whole block
    return x.to(dtype)


# ----------------------------------------------------------------------------------------------- FP8 bits


@triton.jit
def _unit_kernel(x_ptr, out_ptr, n, E5M2: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + o, mask=o < n, other=0.0)
    tl.store(out_ptr + o, _fp8_unit(x, E5M2).to(tl.uint8), mask=o < n)


def _fp8_probe_values(kind: str) -> torch.Tensor:
    """fp32 values that decide a float8 cast: every fp16 and every bf16 bit pattern, each pair of neighbouring
    float8 values' midpoint and the fp32 values either side of it (ties to even, subnormals included),
    +-max and beyond, +-0, +-Inf, NaNs of both signs and odd payloads, random fp32 bit patterns."""
    fp8 = FP8_DTYPES[kind]
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    pos = codes[torch.isfinite(codes) & (codes >= 0)].unique().sort().values  # ascending, +0 first
    mids = (pos[1:] + pos[:-1]) / 2  # exact in fp32
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), pos])
    every16 = torch.arange(65536, dtype=torch.int32)
    fp16 = every16.to(torch.int16).view(torch.float16).float()
    bf16 = (every16 << 16).view(torch.float32)
    rand = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.int64).to(torch.int32).view(torch.float32)
    nans = torch.tensor([0x7FC00000, 0xFFC00000 - 2**32, 0x7F800001, 0xFF812345 - 2**32],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    big = torch.tensor([float(torch.finfo(fp8).max), 464.0, 480.0, 57344.0, 61440.0, 1e30, float("inf")])
    return torch.cat([near, -near, fp16, bf16, rand, nans, big, -big, torch.tensor([0.0, -0.0])])


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_fp8_cast_is_torchs_on_every_deciding_value(kind, device):
    """`_fp8_unit` (clamp to +-max, cast on the bits) against FP8Codec's torch cast, bit for bit."""
    x = _fp8_probe_values(kind)
    codec = codec_for(f"fp8-{kind}-tensor", 1, 64, torch.float32)
    want = codec._cast(x)
    out = torch.empty(x.numel(), dtype=torch.uint8, device=device)
    block = 8192
    _unit_kernel[(triton.cdiv(x.numel(), block),)](x.to(device), out, x.numel(), E5M2=kind == "e5m2",
                                                    BLOCK=block)
    bad = (out.cpu() != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} differ, e.g. x={x[bad[:4]].tolist()}: " \
                             f"{out.cpu()[bad[:4]].tolist()} vs {want[bad[:4]].tolist()}"


def _fp8_edge_tokens(kind: str) -> torch.Tensor:
    """(1, 1, T, 256) fp32 tokens, one block each (-head), whose first element is the format's max, so the
    scale is exactly 1 and x / scale is x: the midpoints between neighbouring float8 values (ties), the
    values either side, subnormals; then a zero token, a -0 token, NaN, +Inf, -Inf tokens, one whose
    scale overflows fp16 (1e8 / max) and one of fp32 subnormals."""
    fp8 = FP8_DTYPES[kind]
    fmax = float(torch.finfo(fp8).max)
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    pos = codes[torch.isfinite(codes) & (codes >= 0)].unique().sort().values
    mids = (pos[1:] + pos[:-1]) / 2
    vals = torch.cat([mids, -mids, torch.nextafter(mids, pos[1:]), -torch.nextafter(mids, pos[:-1]), pos])
    rows = -(-vals.numel() // 255)
    body = torch.cat([vals, torch.zeros(rows * 255 - vals.numel())]).view(rows, 255)
    tokens = torch.cat([torch.full((rows, 1), fmax), body], dim=1)
    special = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    special[0] = 0.0
    special[1] = -0.0
    special[2, 5] = float("nan")
    special[3, 7] = float("inf")
    special[4, 9] = float("-inf")
    special[5, 3] = 1e8  # amax / max beyond fp16: the block is poisoned (NaN scale, zero codes)
    special[6] = special[6] * 1e-41  # fp32 subnormals
    return torch.cat([tokens, special]).view(1, 1, -1, 256)


@pytest.mark.parametrize("spec", ["fp8-e4m3-head-sfp16", "fp8-e5m2-head-sbf16", "fp8-e4m3-head",
                                  "fp8-e5m2-tensor"])
def test_fp8_edge_values(spec, device):
    kind = spec.split("-")[1]
    x = _fp8_edge_tokens(kind)
    x = torch.cat([x, x.flip(2)], dim=0)  # B = 2
    check_pack(_codec(spec, 1, 256, torch.float32), x, 3, 16, device)


FP8_CASES = [  # (spec, K/V dtype, H_kv, D)
    ("fp8-e4m3", torch.float16, 3, 64),
    ("fp8-e5m2-head-sbf16", torch.bfloat16, 2, 128),
    ("fp8-e4m3-g32-sfp32", torch.float32, 1, 64),  # MQA
    ("fp8-e5m2-g16", torch.float16, 8, 64),
    ("fp8-e4m3-channel-g8", torch.float16, 3, 64),
    ("fp8-e5m2-channel-g16-sbf16", torch.bfloat16, 2, 256),
    ("fp8-e4m3-tensor", torch.float16, 2, 256),
    ("fp8-e5m2-tensor", torch.float32, 1, 128),
]


@pytest.mark.parametrize("spec,dtype,h,d", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_fp8_specs(spec, dtype, h, d, device):
    codec = _codec(spec, h, d, dtype)
    g = codec.token_group
    t = 2 * g if g > 1 else 5
    x = _x(2, h, t, d, dtype, seed=d + h, scale=50.0)
    x[1, -1, -1, 3] = 3e4  # a large value in one block
    name = check_pack(codec, x, start=g if g > 1 else 3, block_size=max(16, g), device=device)
    assert name == ("_quantize_channel_kernel" if g > 1 else "_quantize_token_kernel")


# ----------------------------------------------------------------------------------------------- codebooks


CODEBOOK_CASES = [  # (spec, K/V dtype, H_kv, D)
    ("nuq4", torch.float16, 2, 64),
    ("nuq3-head-sbf16", torch.bfloat16, 3, 64),
    ("nuq2-g32", torch.float16, 8, 64),
    ("nuq3-g64", torch.float16, 1, 128),
    ("nuq4-sym-g16-sfp32", torch.float32, 2, 64),
    ("nuq3-sym-head", torch.float16, 2, 256),
    ("nuq3-channel-g16", torch.float16, 2, 64),
    ("nuq4-channel-g8-sym", torch.bfloat16, 1, 128),
    ("nuq2-channel-g64", torch.float16, 1, 256),  # 64 tokens x 256 channels: two D slices per group
]


@pytest.mark.parametrize("spec,dtype,h,d", CODEBOOK_CASES, ids=[c[0] for c in CODEBOOK_CASES])
def test_codebook_specs(spec, dtype, h, d, device):
    codec = _codec(spec, h, d, dtype)
    g = codec.token_group
    t = g if g > 16 else 2 * g if g > 1 else 5
    x = _x(2 if g <= 16 else 1, h, t, d, dtype, seed=d * h)
    check_pack(codec, x, start=g if g > 1 else 5, block_size=max(16, g), device=device)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("sym", ["", "-sym"])
def test_codebook_ties_and_non_finite_blocks(bits, sym, device):
    """Blocks whose normalized values fall exactly on the midpoints between levels (a tie goes to the
    lower level, as torch.bucketize), just beside them, on the levels, at +-0; then a constant block, NaN and
    Inf blocks and one whose scale overflows fp16."""
    codec = _codec(f"nuq{bits}-head{sym}", 1, 64, torch.float32)
    levels = demo_levels(bits)
    mids = codec.midpoints(torch.device("cpu"))
    vals = torch.cat([mids, torch.nextafter(mids, levels[1:]), torch.nextafter(mids, levels[:-1]), levels,
                      torch.tensor([0.0, -0.0])])
    rows = -(-vals.numel() // 62)
    body = torch.cat([vals, torch.zeros(rows * 62 - vals.numel())]).view(rows, 62)
    tokens = torch.cat([torch.ones(rows, 1), -torch.ones(rows, 1), body], dim=1)  # zero 0, scale 1
    special = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    special[0] = 0.75  # constant: scale 0
    special[1, 3] = float("nan")
    special[2, 4] = float("inf")
    special[3, 5] = float("-inf")
    special[4, 6] = 1e6  # beyond an fp16 scale: the block is poisoned (with -sfp16)
    x = torch.cat([tokens, special]).view(1, 1, -1, 64)
    check_pack(codec, torch.cat([x, x.flip(2)]), 1, 16, device)
    check_pack(_codec(f"nuq{bits}-head{sym}-sfp16", 1, 64, torch.float32), x, 0, 16, device)


# ------------------------------------------------------------------------------------------ -center, -outP


CENTER_OUT_CASES = [  # (spec, K/V dtype, H_kv, D)
    ("int4-g32-center16", torch.float16, 2, 64),
    ("int8-center16-out1", torch.bfloat16, 2, 64),  # the rest rounded to bf16 by hand
    ("int4-g32-out2", torch.float16, 8, 64),
    ("int2-channel-g16-center32-out2", torch.float16, 2, 64),  # channel-wise base: groups of 16 in 32
    ("fp8-e4m3-g16-out3", torch.float16, 3, 64),
    ("fp8-e5m2-tensor-center16-out1", torch.float32, 1, 128),  # outliers around a unit scale: filled with 0
    ("fp8-e4m3-channel-g16-center16", torch.bfloat16, 2, 64),
    ("nuq3-g64-center16-out1", torch.float16, 1, 128),
    ("nuq4-channel-g16-out2", torch.float16, 2, 256),
    ("nuq2-sym-head-center16", torch.float32, 2, 64),
    ("int4-channel-g64-out2", torch.float16, 1, 256),  # two D slices: the first writes the outliers
    ("int4-g32-rot-out1", torch.float16, 2, 64),  # -rot outside -outP: rotated, then packed
]


@pytest.mark.parametrize("spec,dtype,h,d", CENTER_OUT_CASES, ids=[c[0] for c in CENTER_OUT_CASES])
def test_center_and_outliers(spec, dtype, h, d, device):
    codec = _codec(spec, h, d, dtype)
    g = codec.token_group
    x = _x(2 if g < 64 else 1, h, g if g > 1 else 5, d, dtype, seed=h + d, scale=3.0)
    x[..., 5] += 4.0  # an offset channel, as keys have
    x[-1, -1, -1, 7] = 40.0  # an outlier
    x[0, -1, 0, 9] = -40.0
    check_pack(codec, x, start=g if g > 1 else 3, block_size=max(16, g), device=device)


@pytest.mark.parametrize("spec", ["int4-g16-out3", "nuq3-channel-g8-out2", "fp8-e4m3-tensor-out2"])
def test_outliers_with_equal_magnitudes_nan_and_inf(spec, device):
    """Equal magnitudes (x and -x, repeats) at the top-k boundary: the index order is torch's topk's, which
    the kernel takes from `OutlierCodec.select`; NaN and Inf count as largest (NaN poisons the block it
    fills; Inf is kept exact)."""
    codec = _codec(spec, 2, 64, torch.float16)
    x = _x(2, 2, 8, 64, torch.float16, seed=3)
    x[0, 0, :, 10] = 9.0
    x[0, 0, :, 20] = -9.0
    x[0, 0, :, 30] = 9.0
    x[1, 1, 2, 4] = float("nan")
    x[1, 1, 3, 5] = float("inf")
    x[1, 0, 4, 6] = float("-inf")
    check_pack(codec, x, 8, 16, device)


def test_what_the_pack_kernels_serve():
    dev = torch.device("cpu")
    served = ["int4-g32", "fp8-e5m2-channel-g16", "fp8-e4m3-tensor", "nuq3-g64", "int4-g32-center16-out1",
              "nuq2-channel-g16-rot", "llama.cpp:q4_0", "nvfp4", "fp16"]
    for spec in served:
        assert pack_frame(_codec(spec, 2, 64), dev) is not None, spec
    # no levels bound; 3-bit groups of 4 codes are not whole units; a rotation inside -center; pre-RoPE keys
    for spec in ["nuq3-g32", "nuq3-g4", "int4-g1", "int4-g32-center-rot", "int4-g32-prerope"]:
        codec = codec_for(spec, 2, 64) if spec == "nuq3-g32" else _codec(spec, 2, 64)
        assert pack_frame(codec, dev) is None, spec
    parts = pack_parts(_codec("nuq3-g64-center16-out2", 2, 64))
    assert parts.center.n == 16 and parts.outliers.k == 2 and parts.base.spec.bits == 3
