"""quantize/dequantize: error bounds from the stored scale, SQNR floors, exact corners, non-finite policy."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvquant.codecs.base import torch_dtype
from kvquant.codecs.packing import unpack
from kvquant.codecs.quantize import dequantize, fake_quantize, quantize, scale_shape, sqnr_db
from kvquant.scheme import Granularity, QuantSpec, parse_spec

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GRANULARITIES = [
    (Granularity.TOKEN, None),
    (Granularity.HEAD, None),
    (Granularity.GROUP, 16),
    (Granularity.CHANNEL, 8),
]
ALL_SPECS = [
    QuantSpec(bits, gran, n, sym)
    for bits, (gran, n), sym in itertools.product([8, 4, 2], GRANULARITIES, [True, False])
]


def _ids(spec):
    return str(spec)


def _kv(shape=(2, 3, 16, 32), dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _expand(stat: torch.Tensor, spec: QuantSpec, shape) -> torch.Tensor:
    """A scale/zero of scale_shape broadcast against (B, H, T, D), computed independently of the module."""
    b, h, t, d = shape
    if spec.granularity is Granularity.GROUP:
        return stat.repeat_interleave(spec.group_size, dim=-1)
    if spec.granularity is Granularity.CHANNEL:
        return stat.repeat_interleave(spec.group_size, dim=2)
    return stat.expand(b, h, t, d)


def _step(q) -> torch.Tensor:
    """The quantization step of every element, derived from the stored scale: asym step = scale;
    sym step = absmax / qmax."""
    scale = _expand(q.scale.float(), q.spec, q.shape)
    return scale if not q.spec.symmetric else scale / q.spec.qmax


def _ulp_half(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of `dtype` at |x|: the rounding of the dequantized value to the output dtype."""
    return x.abs() * torch.finfo(dtype).eps / 2 + torch.finfo(dtype).tiny


# ---------------------------------------------------------------------------------------- error bound


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", ALL_SPECS, ids=_ids)
def test_per_element_error_within_half_step(spec, dtype):
    x = _kv(dtype=dtype) * 3
    q = quantize(x, spec)
    x_hat = dequantize(q)
    assert x_hat.dtype == dtype and x_hat.shape == x.shape
    assert q.scale.dtype == dtype  # default scale dtype: the input's
    err = (x_hat.float() - x.float()).abs()
    bound = (
        _step(q) / 2 * (1 + 1e-5)
        + _ulp_half(torch.maximum(x.float().abs(), x_hat.float().abs()), dtype)
        + 1e-6
    )
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", ALL_SPECS, ids=_ids)
def test_codes_uint8_in_range_and_shapes(spec, dtype):
    shape = (2, 3, 16, 32)
    q = quantize(_kv(shape, dtype), spec)
    assert q.codes.dtype == torch.uint8
    assert q.codes.shape == (2, 3, 16, 32 * spec.bits // 8)
    codes = unpack(q.codes, spec.bits, 32).int()
    lo = (1 << (spec.bits - 1)) - spec.qmax if spec.symmetric else 0  # sym codes: offset +- qmax
    assert codes.min() >= lo and codes.max() <= (1 << spec.bits) - 1
    if spec.symmetric:
        assert codes.max() <= (1 << (spec.bits - 1)) + spec.qmax
        assert q.zero is None
    else:
        assert q.zero is not None and q.zero.shape == q.scale.shape
    expected = {
        Granularity.TOKEN: (2, 1, 16, 1),
        Granularity.HEAD: (2, 3, 16, 1),
        Granularity.GROUP: (2, 3, 16, 32 // 16),
        Granularity.CHANNEL: (2, 3, 16 // 8, 32),
    }[spec.granularity]
    assert q.scale.shape == expected == scale_shape(shape, spec)
    assert q.nbytes == q.codes.nbytes + q.scale.nbytes + (0 if q.zero is None else q.zero.nbytes)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=_ids)
def test_stated_scale_arithmetic(spec):
    """The scale is absmax (sym) or (max - min) / qmax with zero = min (asym), per block."""
    x = _kv()
    q = quantize(x, spec)
    b, h, t, d = x.shape
    if spec.granularity is Granularity.TOKEN:
        blocks = x.transpose(1, 2).reshape(b, t, h * d)
        blocks = blocks.unsqueeze(1)  # (B, 1, T, H*D)
    elif spec.granularity is Granularity.HEAD:
        blocks = x
    elif spec.granularity is Granularity.GROUP:
        blocks = x.reshape(b, h, t, d // spec.group_size, spec.group_size)
    else:
        blocks = x.reshape(b, h, t // spec.group_size, spec.group_size, d).transpose(-1, -2)
    if spec.granularity in (Granularity.TOKEN, Granularity.HEAD):
        blocks = blocks.unsqueeze(-2) if spec.granularity is Granularity.HEAD else blocks.unsqueeze(-2)
    if spec.symmetric:
        torch.testing.assert_close(q.scale, blocks.abs().amax(-1).reshape(q.scale.shape), rtol=0, atol=0)
    else:
        lo, hi = blocks.amin(-1).reshape(q.scale.shape), blocks.amax(-1).reshape(q.scale.shape)
        torch.testing.assert_close(q.zero, lo, rtol=0, atol=0)
        torch.testing.assert_close(q.scale, (hi - lo) / spec.qmax)


# ---------------------------------------------------------------------------------------- SQNR floors


def _outlier_keys(shape=(2, 4, 256, 64), seed=0) -> torch.Tensor:
    """Heavy-tailed (Student-t, 3 dof) with a few channels 11x larger, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    t = torch.distributions.StudentT(3.0).sample(shape)
    outliers = torch.zeros(shape[-1])
    outliers[torch.randperm(shape[-1], generator=g)[: shape[-1] // 10]] = 10.0
    return t * (1 + outliers)


# floors: measured (gaussian, heavy) on these seeds minus ~2-3 dB margin
SQNR_FLOORS = {
    "int8": (40, 30),
    "int8-head": (41, 34),
    "int8-g32": (42, 36),
    "int8-channel-g32": (42, 38),
    "int4": (17, 8),
    "int4-g64": (18, 13),
    "int4-g32": (19, 16),
    "int4-g32-sym": (18, 15),
    "int4-channel-g32": (19, 17),
    "int2-g32": (6, 3),
    "int2-channel-g32": (6, 4),
}


@pytest.mark.parametrize("name", list(SQNR_FLOORS))
def test_sqnr_floors(name):
    spec = parse_spec(name)
    gauss_floor, heavy_floor = SQNR_FLOORS[name]
    g = _kv((2, 4, 256, 64), seed=1)
    h = _outlier_keys()
    assert sqnr_db(g, fake_quantize(g, spec)) > gauss_floor
    assert sqnr_db(h, fake_quantize(h, spec)) > heavy_floor


def test_sqnr_ordered_by_bits():
    x = _kv((2, 4, 64, 64), seed=2)
    s8, s4, s2 = (sqnr_db(x, fake_quantize(x, parse_spec(f"int{b}-g32"))) for b in (8, 4, 2))
    assert s8 > s4 + 15 > s2 + 25


def test_per_channel_beats_per_token_on_outlier_channel_keys():
    k = _outlier_keys()
    for bits in (4, 2):
        per_channel = sqnr_db(k, fake_quantize(k, parse_spec(f"int{bits}-channel-g32")))
        per_token = sqnr_db(k, fake_quantize(k, parse_spec(f"int{bits}")))
        per_head = sqnr_db(k, fake_quantize(k, parse_spec(f"int{bits}-head")))
        assert per_channel > per_token + 5
        assert per_channel > per_head + 3


def test_sqnr_db():
    x = torch.ones(100)
    assert sqnr_db(x, x) > 200
    assert sqnr_db(x, x * 0.9) == pytest.approx(20.0)


# ---------------------------------------------------------------------------------------- exact cases


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", ALL_SPECS, ids=_ids)
@pytest.mark.parametrize("value", [0.0, 1.5, -0.3, 1000.0, -7.0])
def test_zero_and_constant_blocks_exact(spec, dtype, value):
    x = torch.full((1, 2, 8, 16), value, dtype=dtype)
    x_hat = dequantize(quantize(x, spec))
    assert torch.equal(x_hat, x)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=_ids)
def test_some_constant_blocks_among_others(spec):
    x = _kv((1, 2, 8, 32))
    x[:, 1] = 0.25  # head 1 constant: exact for head/group/channel granularities
    x_hat = dequantize(quantize(x, spec))
    if spec.granularity is not Granularity.TOKEN:
        assert torch.equal(x_hat[:, 1], x[:, 1])


# ---------------------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("spec", ALL_SPECS, ids=_ids)
def test_non_finite_poisons_only_its_block(spec, bad):
    x = _kv((1, 2, 16, 32))
    x[0, 1, 9, 5] = bad
    q = quantize(x, spec)
    x_hat = dequantize(q)
    # the block holding (head 1, token 9, channel 5) under each granularity
    in_block = torch.zeros(x.shape, dtype=torch.bool)
    if spec.granularity is Granularity.TOKEN:
        in_block[0, :, 9, :] = True
    elif spec.granularity is Granularity.HEAD:
        in_block[0, 1, 9, :] = True
    elif spec.granularity is Granularity.GROUP:
        in_block[0, 1, 9, 0:16] = True
    else:
        in_block[0, 1, 8:16, 5] = True
    assert torch.isnan(x_hat[in_block]).all()
    assert torch.isfinite(x_hat[~in_block]).all()
    clean = x.clone()
    clean[0, 1, 9, 5] = 0.0
    clean_hat = dequantize(quantize(clean, spec))
    assert torch.equal(x_hat[~in_block], clean_hat[~in_block])


@pytest.mark.parametrize("text", ["int8-sfp16", "int4-g16-sfp16", "int4-channel-g8-sbf16-sym"])
def test_statistic_overflowing_the_scale_dtype_poisons_its_block(text):
    """A finite fp32 value beyond the scale dtype's range would give an infinite scale or zero and
    undefined codes; the block is poisoned (NaN) like a non-finite one instead."""
    spec = parse_spec(text)
    x = _kv((1, 2, 16, 32))
    x[0, 1, 9, 5] = 3.4e38 if "bf16" in text else 1e6  # bf16's largest finite value is 3.39e38
    x_hat = dequantize(quantize(x, spec))
    assert torch.isnan(x_hat[0, 1, 9, 5])
    assert torch.isfinite(x_hat[:, :, :8]).all()  # tokens 0-7 share no block with token 9


# ---------------------------------------------------------------------------------------- errors


def test_errors():
    with pytest.raises(ValueError, match="fp16"):
        quantize(_kv(), parse_spec("fp16"))
    with pytest.raises(ValueError, match=r"\(B, H_kv, T, D\)"):
        quantize(torch.randn(3, 8), parse_spec("int8"))
    with pytest.raises(TypeError, match="floating"):
        quantize(torch.ones(1, 1, 1, 8, dtype=torch.int32), parse_spec("int8"))
    with pytest.raises(ValueError, match="T=12 is not a multiple"):
        quantize(_kv((1, 1, 12, 8)), parse_spec("int4-channel-g8"))
    with pytest.raises(ValueError, match="group size 16 does not divide head_dim 24"):
        quantize(_kv((1, 1, 4, 24)), parse_spec("int4-g16"))


def test_fake_quantize_keeps_incomplete_channel_group():
    x = _kv((1, 2, 13, 16))
    spec = parse_spec("int4-channel-g8")
    y = fake_quantize(x, spec)
    assert torch.equal(y[:, :, 8:], x[:, :, 8:])
    assert torch.equal(y[:, :, :8], dequantize(quantize(x[:, :, :8], spec)))
    assert torch.equal(fake_quantize(x[:, :, :5], spec), x[:, :, :5])
    assert fake_quantize(x, parse_spec("fp16")) is x


# ---------------------------------------------------------------------------------------- properties


@st.composite
def _case(draw):
    bits = draw(st.sampled_from([8, 4, 2]))
    gran = draw(st.sampled_from(list(Granularity)))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    d = 4 * draw(st.integers(1, 20))
    n = None
    if gran is Granularity.GROUP:
        n = draw(st.sampled_from([g for g in range(1, d + 1) if d % g == 0]))
    if gran is Granularity.CHANNEL:
        n = draw(st.integers(1, 5))
        t = n * draw(st.integers(1, 3))
    else:
        t = draw(st.integers(1, 9))
    spec = QuantSpec(bits, gran, n, draw(st.booleans()))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([1e-3, 1.0, 300.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    return spec, (b, h, t, d), dtype, scale, seed


@settings(max_examples=150, deadline=None)
@given(_case())
def test_quantize_property(case):
    spec, shape, dtype, scale, seed = case
    x = (_kv(shape, seed=seed) * scale).to(dtype)
    q = quantize(x, spec)
    x_hat = dequantize(q)
    assert x_hat.shape == x.shape and x_hat.dtype == dtype
    assert q.scale.shape == scale_shape(shape, spec)
    codes = unpack(q.codes, spec.bits, shape[-1]).int()
    assert codes.max() < (1 << spec.bits)
    err = (x_hat.float() - x.float()).abs()
    bound = _step(q) / 2 * (1 + 1e-5) + _ulp_half(torch.maximum(x.float().abs(), x_hat.float().abs()), dtype)
    bound += 1e-6 * scale
    assert (err <= bound).all()
    # quantizing what was dequantized changes nothing (a fixed point), up to output rounding
    again = dequantize(quantize(x_hat, spec))
    assert (
        (again.float() - x_hat.float()).abs() <= _step(q) * 0.5 + _ulp_half(x_hat.float(), dtype) * 2
    ).all()


@pytest.mark.parametrize("scale_dtype", ["sbf16", "sfp16"])
@pytest.mark.parametrize("base", ["int8", "int8-asym", "int4-g16", "int2-head", "int4-channel-g8-sym"])
def test_narrow_scale_dtype_never_clips(base, scale_dtype):
    """fp32 K/V with bf16/fp16 scales and an offset (so min rounds): still within half a step of the
    stored scale, because the stored zero rounds down and the scale up."""
    spec = parse_spec(f"{base}-{scale_dtype}")
    x = _kv((2, 3, 16, 32), seed=3) + 100.3
    q = quantize(x, spec)
    assert q.scale.dtype == torch_dtype(spec.scale_dtype)
    err = (dequantize(q) - x).abs()
    assert (err <= _step(q) / 2 * (1 + 1e-5) + 1e-4).all()
