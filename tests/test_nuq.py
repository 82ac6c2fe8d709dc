"""Non-uniform codebooks (nuqN): 3-bit packing bit-exact, codec SQNR floors, bytes held == bits claimed,
calibration files (safetensors + JSON, no pickle), the cache end to end, and the grammar's new items."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from tiny_models import make_tiny_model
from transformers import DynamicCache

import kvquant
from kvquant import memory
from kvquant.calibration import (
    CalibrationError,
    entries_for,
    fit_codebook,
    load_calibration,
    metadata,
    save_calibration,
)
from kvquant.codecs.base import CodebookCodec, codec_for
from kvquant.codecs.packing import pack, packed_size, unpack
from kvquant.codecs.quantize import fake_quantize, sqnr_db
from kvquant.fitting import calibrate
from kvquant.memory import KVShape
from kvquant.scheme import QuantSpec, SchemeError, parse_scheme, parse_spec

# ---------------------------------------------------------------------------------------- 3-bit packing


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 24, 64, 65, 129])
def test_pack3_round_trip_bit_exact(n):
    codes = torch.randint(0, 8, (2, 3, 5, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = pack(codes, 3)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == packed_size(n, 3) == -(-n // 8) * 3
    assert torch.equal(unpack(packed, 3, n), codes)


def test_pack3_layout_is_eight_codes_in_three_bytes_little_endian():
    codes = torch.arange(8, dtype=torch.uint8)  # 0..7
    word = sum(c << (3 * i) for i, c in enumerate(range(8)))
    assert pack(codes, 3).tolist() == [word & 255, (word >> 8) & 255, word >> 16]


def test_pack3_bytes_equal_bits():
    assert packed_size(64, 3) == 64 * 3 // 8 == 24
    with pytest.raises(ValueError, match="units of 3 bytes"):
        unpack(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack(torch.zeros(3, dtype=torch.uint8), 3, 9)


# ---------------------------------------------------------------------------------------- the codec


def _codec(spec: str, heads: int = 3, head_dim: int = 64, seed: int = 0) -> CodebookCodec:
    """A codebook codec whose levels are fitted on Gaussian data normalized as the codec normalizes."""
    c = codec_for(parse_spec(spec), heads, head_dim, torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    xn = c.normalize(torch.randn(2, heads, 64, head_dim, generator=g))[0]
    c.set_levels(fit_codebook(xn, c.spec.bits))
    return c


# (spec, SQNR floor in dB on Gaussian data, the uniform spec at the same bits it must beat, or None)
FLOORS = [
    ("nuq4-g64", 20.5, "int4-g64"),
    ("nuq3-g64", 14.5, None),
    ("nuq2-g64", 8.5, "int2-g64"),
    ("nuq3-channel-g16", 16.0, None),
    ("nuq4-head-sym", 20.0, "int4-head-sym"),
    ("nuq2-g32-sym", 8.0, None),
    ("nuq3", 13.5, None),
]


@pytest.mark.parametrize("spec, floor, uniform", FLOORS)
def test_codebook_sqnr_floor(spec, floor, uniform):
    c = _codec(spec)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(7))
    got = sqnr_db(x, c.decode(c.encode(x)))
    assert got > floor
    if uniform is not None:
        assert got > sqnr_db(x, fake_quantize(x, uniform))


@pytest.mark.parametrize(
    "spec", ["nuq4-g64", "nuq3-g32", "nuq2-channel-g16", "nuq3-head-sym", "nuq3-g64-sfp16"]
)
def test_bytes_held_equal_bits_claimed(spec):
    c = _codec(spec)
    t = 32
    fields = c.encode(torch.randn(1, 3, t, 64))
    declared = c.fields()
    assert set(fields) == set(declared)
    for name, f in declared.items():
        assert (
            tuple(fields[name].shape) == (1, f.heads, t // f.tokens, f.cols) and fields[name].dtype == f.dtype
        )
    held = sum(v.nbytes for v in fields.values())
    assert held == c.bytes(t)
    codes_bits = fields["codes"].nbytes * 8
    assert codes_bits == t * 3 * 64 * c.spec.bits  # codes: exactly bits per value, no padding


def test_constant_and_nonfinite_blocks():
    c = _codec("nuq3-g32")
    x = torch.full((1, 3, 2, 64), 0.75)
    assert torch.equal(c.decode(c.encode(x)), x)  # scale 0: the block's zero, exactly
    x = torch.randn(1, 3, 2, 64)
    x[0, 1, 0, 5] = float("nan")
    y = c.decode(c.encode(x))
    assert torch.isnan(y[0, 1, 0, :32]).all() and torch.isfinite(y[0, 1, 0, 32:]).all()
    assert torch.isfinite(y[0, 0]).all()


def test_codec_without_codebook_sizes_but_refuses_to_encode():
    c = codec_for("nuq3-g64", 3, 64, torch.float32)
    assert c.bytes(16) == 16 * 3 * 24 + 16 * 3 * 1 * 4 * 2  # codes + fp32 scale and zero
    with pytest.raises(SchemeError, match="experiments/calibrate.py"):
        c.encode(torch.randn(1, 3, 4, 64))


def test_fit_codebook_is_sorted_and_seeded():
    v = torch.randn(50_000)
    a, b = fit_codebook(v, 3, seed=1), fit_codebook(v, 3, seed=1)
    assert torch.equal(a, b) and a.shape == (8,) and bool((a[1:] > a[:-1]).all())
    pts = torch.tensor([-1.0] * 100 + [1.0] * 100)  # two point masses, four levels: still strictly ascending
    lv = fit_codebook(pts, 2)
    assert lv.shape == (4,) and bool((lv[1:] > lv[:-1]).all())


# ---------------------------------------------------------------------------------------- calibration files


@pytest.fixture(scope="module")
def model64():
    return make_tiny_model(seed=3).double()


def _docs(n: int = 2, t: int = 96) -> list[torch.Tensor]:
    return [
        torch.randint(1, 5000, (1, t), generator=torch.Generator().manual_seed(100 + i)) for i in range(n)
    ]


SCHEME = "k=nuq3-channel-g16-prerope,v=nuq4-g32"
PER_LAYER = "layers=0:int8/nuq2-g32+1:nuq3-channel-g16-prerope/nuq4-g32,sink=2,window=5"


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory, model64):
    path = tmp_path_factory.mktemp("calib") / "tiny.safetensors"
    shape = KVShape.from_config(model64.config)
    schemes = [
        parse_scheme(f"{s},calib={path}") for s in (SCHEME, PER_LAYER, "nuq4-g32", "nuq3-g64-sym", "nuq2-g32")
    ]
    entries = {e.name: e for s in schemes for e in entries_for(s, shape.num_layers)}
    tables = calibrate(model64, _docs(), entries.values(), max_samples=20_000)
    save_calibration(path, tables, metadata("tiny", shape, [str(s) for s in schemes], list(entries.values())))
    return path


def test_calibration_file_is_safetensors_and_json_loaded_without_pickle(calib_file, monkeypatch):
    def no_pickle(*a, **k):
        raise AssertionError("a calibration file must load without pickle")

    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    monkeypatch.setattr(torch, "load", no_pickle)
    cal = load_calibration(calib_file)
    meta = json.loads(calib_file.with_suffix(".json").read_text())
    assert meta["format"] == "kvquant-calibration/1" and meta["num_layers"] == 2 and meta["head_dim"] == 64
    assert sorted(cal.tables) == meta["tables"]
    lv = cal.codebook(1, "k", parse_spec("nuq3-channel-g16-prerope"))
    assert lv.shape == (8,) and bool((lv[1:] > lv[:-1]).all())
    assert calib_file.read_bytes()[:8] != b"\x80\x04\x95"[:8]  # not a pickle stream


def test_missing_calibration_file_says_how_to_make_it(model64, tmp_path):
    with pytest.raises(CalibrationError, match="experiments/calibrate.py") as e:
        kvquant.QuantizedCache(f"nuq4-g64,calib={tmp_path / 'none.safetensors'}", model64.config)
    assert "does not exist" in str(e.value)


def test_calibration_lacking_a_table_or_for_another_model_is_refused(calib_file, model64):
    with pytest.raises(CalibrationError, match="no codebook for nuq2-g64"):
        kvquant.QuantizedCache(f"nuq2-g64,calib={calib_file}", model64.config)
    other = make_tiny_model(num_hidden_layers=3).config
    with pytest.raises(CalibrationError, match="this model has"):
        kvquant.QuantizedCache(f"{SCHEME},calib={calib_file}", other)


# ---------------------------------------------------------------------------------------- the cache


def _run(model, ids, cache, chunk):
    return torch.cat(
        [model(ids[:, i : i + chunk], cache=cache).logits for i in range(0, ids.shape[1], chunk)], 1
    )


@pytest.mark.parametrize(
    "scheme", [SCHEME, PER_LAYER, "nuq2-g32,window=8", "k=int4-channel-g16,v=nuq3-g64-sym"]
)
def test_cache_end_to_end(model64, calib_file, scheme):
    """Chunked == token by token (decode-exact), bytes held == the formula, and close to FP."""
    scheme = f"{scheme},calib={calib_file}"
    ids = torch.randint(1, 5000, (2, 45), generator=torch.Generator().manual_seed(5))
    one = kvquant.QuantizedCache(scheme, model64.config)
    decoded = _run(model64, ids, one, 1)
    chunked = _run(model64, ids, kvquant.QuantizedCache(scheme, model64.config), 17)
    torch.testing.assert_close(chunked, decoded, atol=1e-9, rtol=0)
    assert one.nbytes() == memory.cache_bytes(model64.config, scheme, 45, batch=2, dtype=torch.float64)
    fp = model64(ids, cache=DynamicCache(config=model64.config)).logits
    assert 1e-4 < (decoded - fp).abs().max() < 2.0


def test_per_layer_scheme_builds_each_layer_with_its_specs(model64, calib_file):
    cache = kvquant.QuantizedCache(f"{PER_LAYER},calib={calib_file}", model64.config)
    model64(torch.randint(1, 5000, (1, 40)), cache=cache)
    l0, l1 = cache.layers
    assert str(l0.key_codec.spec) == "int8" and str(l0.value_codec.spec) == "nuq2-g32"
    assert str(l1.key_codec.spec) == "nuq3-channel-g16-prerope" and l1.key_codec.kernel_layout() is None
    bits = memory.effective_bits(model64.config, f"{PER_LAYER},calib={calib_file}")
    assert bits == pytest.approx((8 + 16 / 128 + 2 + 32 / 32 + 3 + 32 / 16 + 4 + 32 / 32) / 4)
    with pytest.raises(SchemeError, match="covers 2 layers, but the model has 3"):
        kvquant.QuantizedCache(f"{PER_LAYER},calib={calib_file}", make_tiny_model(num_hidden_layers=3).config)
    with pytest.raises(ValueError, match="model's config"):
        kvquant.QuantizedCache(f"{PER_LAYER},calib={calib_file}")


def test_key_and_value_of_one_layer_use_their_own_codebooks(model64, calib_file):
    """K and V with the same nuq spec have different tables: the batched encode must not share them."""
    cache = kvquant.QuantizedCache(f"nuq4-g32,calib={calib_file}", model64.config)
    ids = torch.randint(1, 5000, (1, 40))
    model64(ids, cache=cache)
    kc, vc = cache.layers[1].key_codec, cache.layers[1].value_codec
    assert kc.spec == vc.spec and not torch.equal(kc.levels, vc.levels) and not kc.batches_with(vc)


# ---------------------------------------------------------------------------------------- grammar


@pytest.mark.parametrize(
    "text",
    [
        "nuq4-g64,calib=calib/X.safetensors",
        "k=nuq3-channel-g64-prerope,v=nuq3-g64-sym-sfp16,calib=a/b c.safetensors",
        "nuq2,calib=Mixed/Case.safetensors",
        "layers=0-3:int8+4-29:int4-g64",
        "layers=0:int8/int4-g64+1-2:nuq3-g64+3:fp16,sink=4,window=128,calib=c.safetensors",
        "layers=0-1:int4-channel-g64-prerope/int4-g64+2:int8",
    ],
)
def test_new_items_round_trip(text):
    s = parse_scheme(text)
    assert parse_scheme(str(s)) == s and str(parse_scheme(str(s))) == str(s)


def test_layer_separator_semicolon_accepted_and_calib_keeps_case():
    s = parse_scheme("layers=0-3:int8;4-29:int4-g64,calib=Dir/File.safetensors")
    assert str(s) == "layers=0-3:int8+4-29:int4-g64,calib=Dir/File.safetensors"
    assert (
        s.num_layers == 30 and s.for_layer(4).key == parse_spec("int4-g64") and s.for_layer(2).key.bits == 8
    )
    assert QuantSpec(3, codebook=True).bits == 3


@pytest.mark.parametrize(
    "text, bad",
    [
        ("nuq5", "nuq5"),
        ("nuq4-g64", "calibrate.py"),
        ("int3-g64", "int3"),
        ("nuq3,calib=", "calib= needs a file"),
        ("layers=0-3:int8+3-29:int4-g64", "overlap"),
        ("layers=0-3:int8+5-29:int4-g64", "layer 4 missing"),
        ("layers=1-3:int8+4-29:int4-g64", "layer 0 missing"),
        ("layers=0-3:int8", "uniform"),
        ("layers=0-3", "bad layer range"),
        ("int8,layers=0:int8+1:int4", "not both"),
        ("layers=0:int8+1:int4-g64/int4-g64-prerope", "keys only"),
    ],
)
def test_bad_new_items_fail_with_the_valid_forms(text, bad):
    with pytest.raises(SchemeError) as e:
        parse_scheme(text)
    msg = str(e.value)
    assert bad in msg and "Grammar" in msg and "layers=" in msg and "calib=" in msg
