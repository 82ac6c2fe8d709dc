"""TurboQuant (`turboB...`, kvquant.codecs.turbo): the Lloyd-Max levels against scipy integration and the
Gaussian limit, round-trip SQNR floors, the distortion the paper's Theorem 1 predicts, the QJL estimator's
unbiasedness, bytes held = the formula, the grammar, and the cache end to end on the tiny model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate

import kvquant
from kvquant import memory
from kvquant.codecs.base import codec_for
from kvquant.codecs.quantize import sqnr_db
from kvquant.codecs.turbo import TurboCodec, _pack, _unpack, lloyd_max_levels, turbo_density
from kvquant.scheme import QuantSpec, SchemeError, TurboSpec, parse_scheme, parse_spec

# ------------------------------------------------------------------------------------------------- levels


@pytest.mark.parametrize("d", [16, 48, 64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_levels_satisfy_the_centroid_condition(d, bits):
    """Each level is the mean of its bin (thresholds at the midpoints) under the density of a coordinate of
    a uniform unit vector in R^d, integrated by scipy.integrate.quad: within 1e-9 / sqrt(d) (measured: below
    1e-11 / sqrt(d); the levels are of order 1 / sqrt(d))."""
    c = lloyd_max_levels(d, bits)
    assert len(c) == 1 << bits and np.all(np.diff(c) > 0) and np.allclose(c, -c[::-1], atol=1e-12)
    total = integrate.quad(turbo_density, -1, 1, args=(d,), epsabs=1e-13)[0]
    assert total == pytest.approx(1, abs=1e-9)
    t = np.concatenate([[-1.0], (c[1:] + c[:-1]) / 2, [1.0]])
    for i, level in enumerate(c):
        mass = integrate.quad(turbo_density, t[i], t[i + 1], args=(d,), epsabs=1e-14, epsrel=1e-12)[0]
        first = integrate.quad(
            lambda x: x * turbo_density(x, d), t[i], t[i + 1], epsabs=1e-14, epsrel=1e-12
        )[0]
        assert abs(first / mass - level) < 1e-9 / math.sqrt(d), (i, first / mass, level)


# the classic Gaussian Lloyd-Max levels (Max 1960), positive half, for N(0, 1): rounded to 4 digits
GAUSSIAN = {1: [0.7979], 2: [0.4528, 1.510], 3: [0.2451, 0.7560, 1.344, 2.152]}
GAUSSIAN_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}  # their distortion per unit variance


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_levels_reach_the_gaussian_limit(bits):
    """At d = 16384 a coordinate is N(0, 1/d) up to O(1/d): sqrt(d) * levels match the Gaussian Lloyd-Max
    levels within 1e-3 (the references' rounding is 5e-4; measured: 3.8e-4)."""
    d = 16384
    c = lloyd_max_levels(d, bits) * math.sqrt(d)
    assert np.max(np.abs(c[len(c) // 2 :] - GAUSSIAN[bits])) < 1e-3


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_distortion_is_the_lloyd_max_cost(bits):
    """The paper's Theorem 1: a unit vector's MSE after a Haar rotation is d * C(f_d, b), the Lloyd-Max cost,
    whatever the input: 50 unit vectors (a spike, a flat vector, random ones) under 40 rotations (seeds)
    give within 3% of the cost integrated by scipy (measured: within 1%); and the cost at d = 64 lies within
    6% of the Gaussian limit the paper quotes (0.36, 0.117, 0.03, 0.009)."""
    d = 64
    c = lloyd_max_levels(d, bits)
    t = np.concatenate([[-1.0], (c[1:] + c[:-1]) / 2, [1.0]])
    cost = sum(
        integrate.quad(lambda x, ci=ci: (x - ci) ** 2 * turbo_density(x, d), t[i], t[i + 1])[0]
        for i, ci in enumerate(c)
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 50, d, generator=g)
    x[0, 0, 0] = torch.eye(d)[0]  # a spike
    x[0, 0, 1] = 1.0  # a flat vector
    x = x / x.norm(dim=-1, keepdim=True)  # unit vectors: the MSE is the direction's
    errs = []
    for seed in range(40):
        codec = codec_for(f"turbo{bits}-seed{seed}", 1, d, torch.float32)
        errs.append((codec.decode(codec.encode(x)) - x).pow(2).sum(-1).flatten())
    errs = torch.cat(errs).double().numpy()
    assert np.mean(errs) == pytest.approx(d * cost, rel=0.03), (np.mean(errs), d * cost)
    assert d * cost == pytest.approx(GAUSSIAN_MSE[bits], rel=0.06)


def test_levels_cached_in_the_codec_not_the_module():
    a, b = codec_for("turbo3", 2, 64), codec_for("turbo3", 2, 64)
    assert a.levels(64, 3) is a.levels(64, 3)  # computed once per (d, bits) in this codec
    assert a.levels(64, 3) is not b.levels(64, 3) and torch.equal(a.levels(64, 3), b.levels(64, 3))


# -------------------------------------------------------------------------------------------- round trips


def outlier_data(seed: int = 0) -> torch.Tensor:
    """(2, 3, 128, 64): Gaussian with two channels 8x wider and a per-channel offset (a key-like spread)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(64)
    scale[[3, 40]] = 8.0
    return torch.randn(2, 3, 128, 64, generator=g) * scale + torch.randn(64, generator=g)


FLOORS = {  # dB on outlier_data, fp32 and fp16 alike; measured values are 0.35-0.5 dB above
    "turbo1": 4.0,
    "turbo2": 9.0,
    "turbo3": 14.4,
    "turbo4": 20.0,
    "turbo2.25": 12.5,
    "turbo2.5": 13.2,
    "turbo3.5": 18.7,
    "turbo3.75": 19.5,
    "turbo3-had": 14.6,
    "turbo3-nc": 14.4,
    "turbo2.5-had": 13.4,
    "turbo3.5-nc": 19.0,
    "turbo4-had-nc-seed5": 20.5,
    # QJL trades MSE for unbiased inner products: its 1-bit sketch adds variance (the paper's Fig. 1)
    "turbo2-qjl": 2.0,
    "turbo3-qjl": 7.0,
    "turbo3.5-qjl": 11.0,
}


@pytest.mark.parametrize("spec", list(FLOORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_roundtrip_sqnr_floor(spec, dtype):
    x = outlier_data().to(dtype)
    c = codec_for(spec, 3, 64, dtype)
    assert sqnr_db(x.float(), c.decode(c.encode(x), torch.float32)) > FLOORS[spec]


def test_outlier_split_beats_the_lower_width_and_nc_keeps_norms():
    x = outlier_data()
    rt = {s: codec_for(s, 3, 64, torch.float32) for s in ("turbo2", "turbo2.5", "turbo3", "turbo3-nc")}
    db = {s: sqnr_db(x, c.decode(c.encode(x))) for s, c in rt.items()}
    assert db["turbo2"] + 3 < db["turbo2.5"] < db["turbo3"]
    c = rt["turbo3-nc"]
    y = c.decode(c.encode(x))
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=2e-3)  # fp16 norms: 2^-11 relative
    plain = rt["turbo3"].decode(rt["turbo3"].encode(x))
    assert (plain.norm(dim=-1) / x.norm(dim=-1)).mean() < 0.99  # Lloyd-Max levels shrink the direction


def test_hadamard_single_group_is_kvquants_rot():
    """turboB-had rotates with -rot's signs of the same seed (H diag(s)), so the rotated frame is shared."""
    from kvquant.codecs.transforms import hadamard_signs

    c = codec_for("turbo3-had-seed7", 1, 64)
    assert torch.equal(c.rotation(0), hadamard_signs(7, 64))


def test_non_finite_vectors_decode_to_nan_only_there():
    x = outlier_data()[:1]
    x[0, 1, 5, 7] = torch.inf
    x[0, 2, 9, 0] = torch.nan
    for spec in ("turbo3", "turbo2.5-qjl"):
        c = codec_for(spec, 3, 64, torch.float32)
        y = c.decode(c.encode(x))
        bad = ~torch.isfinite(y).all(dim=-1)
        assert bad[0, 1, 5] and bad[0, 2, 9] and int(bad.sum()) == 2, spec


def test_one_bit_packing_round_trips():
    g = torch.Generator().manual_seed(0)
    for n in (8, 13, 64):
        codes = torch.randint(0, 2, (2, 3, 5, n), generator=g, dtype=torch.uint8)
        packed = _pack(codes, 1)
        assert packed.shape[-1] == (n + 7) // 8 and torch.equal(_unpack(packed, 1, n), codes)
    assert int(_pack(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8), 1)) == 0b10000001


# ------------------------------------------------------------------------------------------------- QJL


def test_qjl_inner_product_estimator_is_unbiased():
    """E_S,P[<y, decode(x)>] = <y, x> for TurboQuant_prod (q . decode(k) is the paper's estimator). Over 400
    seeds (rotation and projection drawn afresh) the mean lies within 4 standard errors of <y, x>. The
    MSE-only 1-bit codec is biased, and the same test tells it apart: it shrinks inner products by 2/pi (the
    paper's example; with 600 seeds: 71 SE off, while turbo2-qjl / turbo3-qjl were 1.1 / 0.9 SE off)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1, 1, 64, generator=g)
    y = 0.5 * x.flatten() + torch.randn(64, generator=g)  # correlated: a large <y, x>, so a bias shows
    true = float(x.flatten() @ y)

    def estimates(spec: str) -> tuple[float, float]:
        out = []
        for seed in range(400):
            c = codec_for(f"{spec}-seed{seed}", 1, 64, torch.float32)
            out.append(float(c.decode(c.encode(x)).flatten() @ y))
        return float(np.mean(out)), float(np.std(out) / math.sqrt(len(out)))

    for spec in ("turbo2-qjl", "turbo3-qjl"):
        mean, se = estimates(spec)
        assert abs(mean - true) < 4 * se, (spec, mean, true, se)
    mean, se = estimates("turbo1")
    assert abs(mean - true) > 10 * se and mean / true == pytest.approx(2 / math.pi, rel=0.03)


def test_qjl_decode_is_the_papers_dequantization():
    """decode = x_mse + sqrt(pi/2)/D * gamma * S^T sign(S r), r the residual of the MSE stage."""
    x = outlier_data()[:1, :1, :4]
    c = codec_for("turbo3-qjl", 1, 64, torch.float32)
    f = c.encode(x)
    mse = TurboCodec(QuantSpec(2, turbo=TurboSpec(2)), 1, 64, torch.float32)
    x_mse = mse.decode({"codes": f["codes"], "norm": f["norm"]})
    r = x - x_mse
    s = c.projection()
    z = torch.where(r @ s.T >= 0, 1.0, -1.0)
    gamma = r.norm(dim=-1, keepdim=True).half().float()
    expect = x_mse + math.sqrt(math.pi / 2) / 64 * gamma * (z @ s)
    assert torch.allclose(c.decode(f), expect, atol=1e-5)


# ------------------------------------------------------------------------------------------------- bytes


def per_head_bytes(spec: str, d: int = 64) -> float:
    """The formula: per (token, head), each group's packed codes + 2 bytes of norm, QJL D/8 + 2 bytes,
    and the D/8-byte outlier mask per -blockN tokens."""
    t = parse_spec(spec).turbo
    n = sum(math.ceil(dg * b / 8) + 2 for dg, b in t.groups(d))
    return n + (d / 8 + 2) * t.qjl + (d / 8 / t.block if t.high else 0)


@pytest.mark.parametrize(
    "spec, bits",
    [("turbo3", 3.25), ("turbo4", 4.25), ("turbo1", 1.25), ("turbo3.5", 4.0625), ("turbo2.5", 3.0625),
     ("turbo2.25", 2.8125), ("turbo3-qjl", 3.5), ("turbo3.5-qjl-block32", 4.28125), ("turbo2-had-nc", 2.25)],
)
def test_bytes_held_equal_the_formula(spec, bits):
    c = codec_for(spec, 3, 64, torch.float16)
    x = outlier_data().to(torch.float16)
    fields = c.encode(x)
    assert list(fields) == list(c.fields())
    for name, t in fields.items():
        f = c.fields()[name]
        assert t.dtype == f.dtype and tuple(t.shape) == (2, f.heads, 128 // f.tokens, f.cols), name
    assert sum(t.nbytes for t in fields.values()) == 2 * c.bytes(128) == 2 * 3 * 128 * per_head_bytes(spec)
    assert c.bits_per_value() == bits
    assert c.kernel_layout() is None  # the reference attention path
    smollm = memory.KNOWN_SHAPES["smollm2-135m"]
    assert memory.effective_bits(smollm, spec) == pytest.approx(bits)


# ------------------------------------------------------------------------------------------------- grammar


@pytest.mark.parametrize(
    "text, canonical",
    [
        ("turbo3", "turbo3"),
        ("TURBO3.5", "turbo3.5"),
        ("turbo2.50", None),
        ("turbo2.25-qjl-had-nc-seed3-block32", "turbo2.25-qjl-had-nc-seed3-block32"),
        ("turbo3-seed0", "turbo3"),
        ("turbo2.5-block16", "turbo2.5"),
        ("turbo2.5-block64", "turbo2.5-block64"),
        ("k=turbo3-qjl-prerope,v=turbo3.5,sink=4", "k=turbo3-qjl-prerope,v=turbo3.5,sink=4"),
        ("layers=0:int8+1-29:turbo2.5", "layers=0:int8+1-29:turbo2.5"),
    ],
)
def test_parse_format_round_trip(text, canonical):
    if canonical is None:
        with pytest.raises(SchemeError):
            parse_scheme(text)
        return
    s = parse_scheme(text)
    assert str(s) == canonical and parse_scheme(str(s)) == s


def test_spec_fields():
    s = parse_spec("turbo3.5-qjl-had")
    assert s.turbo == TurboSpec(3, high=2, qjl=True, rotation="hadamard")
    assert s.bits == 4 and s.is_quantized and s.tokens_per_group == 16 and s.transforms == ()
    assert s.turbo.groups(64) == ((32, 3), (32, 2))  # the MSE stage's bits: one went to the sketch
    assert parse_spec("turbo3").tokens_per_group == 1
    assert parse_scheme("k=turbo2.5,v=turbo3,window=128").tokens_per_flush == 16


@pytest.mark.parametrize(
    "text, why",
    [
        ("turbo5", "1..4 bits"),
        ("turbo4.5", "bits \\+ 1 <= 4"),
        ("turbo1-qjl", "turbo2 or more"),
        ("turbo3-nc-qjl", "in this order"),
        ("turbo3-block32", "split specs only"),
        ("turbo3.3", "turbo<bits>"),
        ("turbo3-g64", "turbo<bits>"),
    ],
)
def test_bad_turbo_specs_say_why(text, why):
    with pytest.raises(SchemeError, match=why):
        parse_spec(text)


def test_head_dim_checks():
    with pytest.raises(SchemeError, match="power of two"):
        codec_for("turbo2.25-had", 2, 64)  # groups of 16 and 48 channels
    with pytest.raises(SchemeError, match="multiple of 8"):
        codec_for("turbo3", 2, 60)
    with pytest.raises(SchemeError, match="32 for an outlier split"):
        codec_for("turbo2.5", 2, 72)
    with pytest.raises(SchemeError, match="only -prerope"):
        QuantSpec(4, symmetric=True, turbo=TurboSpec(3))


# ------------------------------------------------------------------------------------------------- cache


@pytest.mark.parametrize(
    "scheme, max_kl",
    [  # measured KL on the tiny model: 3.6e-4, 4.1e-4, 2.5e-4, 5.5e-4 (int4-g64-rot: 3.0e-4); floors ~3x
        ("turbo4", 1e-3),
        ("k=turbo3-qjl,v=turbo3,window=16", 1.2e-3),
        ("turbo3.5,sink=4", 8e-4),
        ("turbo3-had-nc,sink=2,window=8", 1.5e-3),
    ],
)
def test_cache_end_to_end(tiny_model, scheme, max_kl):
    ids = torch.randint(0, 1000, (2, 160), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = tiny_model(ids).logits.log_softmax(-1)
        cache = kvquant.QuantizedCache(scheme, tiny_model.config)
        out = torch.cat([tiny_model(ids[:, i : i + 40], cache=cache).logits for i in range(0, 160, 40)], 1)
    kl = (ref.exp() * (ref - out.log_softmax(-1))).sum(-1).mean()
    assert 0 < kl < max_kl, kl
    assert cache.nbytes() == memory.cache_bytes(tiny_model.config, scheme, 160, batch=2, dtype=torch.float32)
