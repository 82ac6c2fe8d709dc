"""Scheme grammar: parse/format round trips, presets, helpful errors, and head_dim checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tiny_models import make_tiny_config

import kvquant
from kvquant.scheme import (
    FP16,
    PRESETS,
    SCALE_DTYPES,
    Granularity,
    QuantSpec,
    Scheme,
    SchemeError,
    format_spec,
    list_schemes,
    parse_scheme,
    parse_spec,
    scheme_help,
)

# ---------------------------------------------------------------------------------------- the examples


@pytest.mark.parametrize("text", list_schemes())
def test_every_listed_scheme_parses_and_round_trips(text):
    s = parse_scheme(text)
    assert isinstance(s, Scheme)
    assert parse_scheme(str(s)) == s
    assert text in scheme_help()


@pytest.mark.parametrize(
    "text, key, value, sink, window",
    [
        ("fp16", FP16, FP16, 0, 0),
        ("int8", QuantSpec(8, Granularity.TOKEN, None, True), None, 0, 0),
        ("int8-head", QuantSpec(8, Granularity.HEAD, None, True), None, 0, 0),
        ("int4-g64", QuantSpec(4, Granularity.GROUP, 64, False), None, 0, 0),
        ("int4-g32", QuantSpec(4, Granularity.GROUP, 32, False), None, 0, 0),
        ("int2-g32", QuantSpec(2, Granularity.GROUP, 32, False), None, 0, 0),
        ("int4-g64-sym", QuantSpec(4, Granularity.GROUP, 64, True), None, 0, 0),
        ("int8-asym-sbf16", QuantSpec(8, Granularity.TOKEN, None, False, torch.bfloat16), None, 0, 0),
        (
            "k=int4-channel-g64,v=int4-g64,sink=4,window=128",
            QuantSpec(4, Granularity.CHANNEL, 64, False),
            QuantSpec(4, Granularity.GROUP, 64, False),
            4,
            128,
        ),
        (
            " K=INT4-channel-g64 , v=int2-g32-sfp32 ",
            QuantSpec(4, Granularity.CHANNEL, 64),
            QuantSpec(2, Granularity.GROUP, 32, False, torch.float32),
            0,
            0,
        ),
        ("kivi-4", QuantSpec(4, Granularity.CHANNEL, 32), QuantSpec(4, Granularity.GROUP, 32), 0, 128),
        ("kivi-2", QuantSpec(2, Granularity.CHANNEL, 32), QuantSpec(2, Granularity.GROUP, 32), 0, 128),
    ],
)
def test_grammar(text, key, value, sink, window):
    s = parse_scheme(text)
    assert s.key == key
    assert s.value == (key if value is None else value)
    assert (s.sink, s.window) == (sink, window)


def test_presets():
    assert set(PRESETS) == {"kivi-4", "kivi-2"}
    for name, s in PRESETS.items():
        assert s.name == name
        assert parse_scheme(name) == s
        assert s.tokens_per_flush == 32
        assert name in list_schemes()


def test_defaults_sym_for_int8_asym_below():
    assert parse_spec("int8").symmetric
    assert not parse_spec("int4").symmetric
    assert not parse_spec("int2-g32").symmetric
    assert not parse_spec("int8-asym").symmetric
    assert parse_spec("int2-sym").symmetric


def test_scheme_passes_through():
    s = parse_scheme("int4-g64")
    assert parse_scheme(s) is s


# ---------------------------------------------------------------------------------------- round trips

_specs = st.one_of(
    st.just(FP16),
    st.builds(
        QuantSpec,
        bits=st.sampled_from([8, 4, 2]),
        granularity=st.sampled_from([Granularity.TOKEN, Granularity.HEAD]),
        group_size=st.none(),
        symmetric=st.booleans(),
        scale_dtype=st.sampled_from([None, *SCALE_DTYPES]),
    ),
    st.builds(
        QuantSpec,
        bits=st.sampled_from([8, 4, 2]),
        granularity=st.sampled_from([Granularity.GROUP, Granularity.CHANNEL]),
        group_size=st.integers(1, 4096),
        symmetric=st.booleans(),
        scale_dtype=st.sampled_from([None, *SCALE_DTYPES]),
    ),
)
_schemes = st.builds(
    Scheme, key=_specs, value=_specs, sink=st.integers(0, 10_000), window=st.integers(0, 10_000)
)


@given(_specs)
def test_spec_round_trip_property(spec):
    assert parse_spec(format_spec(spec)) == spec


@given(_schemes)
def test_scheme_round_trip_property(scheme):
    text = str(scheme)
    assert parse_scheme(text) == scheme
    assert str(parse_scheme(text)) == text  # canonical: formatting is a fixed point


def test_fp16_spec_takes_no_options():
    """An fp16 spec with a scale dtype or symmetry would print as `fp16` and parse back as something else."""
    with pytest.raises(SchemeError, match="fp16"):
        QuantSpec(16, symmetric=True)
    with pytest.raises(SchemeError, match="fp16"):
        QuantSpec(16, scale_dtype="fp32")
    with pytest.raises(SchemeError, match="fp16"):
        QuantSpec(16, Granularity.GROUP, 32)


# ---------------------------------------------------------------------------------------- bad strings


@pytest.mark.parametrize(
    "text, bad",
    [
        ("int4-g64-foo", "-foo"),
        ("int5", "int5"),
        ("int3-g64", "int3"),
        ("k=int4-g64", "k= needs a matching v="),
        ("v=int4-g64", "k= needs a matching v="),
        ("int8,sink=-1", "sink='-1'"),
        ("int8,window=abc", "window='abc'"),
        ("", "empty"),
        ("   ", "empty"),
        ("float8", "float8"),
        ("int4-channel", "-channel needs a token group"),
        ("int4-g0", "at least 1"),
        ("int4,int8", "two specs"),
        ("int8,k=int4,v=int4", "not both"),
        ("kivi-2,sink=4", "preset"),
        ("int8,foo=3", "'foo'"),
        ("int4-head-g32", "-g32 conflicts with -head"),
        ("int4-sym-asym", "-asym conflicts with -sym"),
        ("int4-sfp16-sbf16", "-sbf16 conflicts with -sfp16"),
    ],
)
def test_bad_schemes_name_the_bad_part_and_list_valid_ones(text, bad):
    with pytest.raises(SchemeError) as e:
        parse_scheme(text)
    msg = str(e.value)
    assert bad in msg
    for known in ("int8", "int4-g64", "kivi-2"):  # lists what is valid
        assert known in msg
    assert "Grammar" in msg


def test_scheme_error_is_a_value_error():
    assert issubclass(SchemeError, ValueError)
    with pytest.raises(ValueError):
        parse_scheme("int7")


@pytest.mark.parametrize("bad", [dict(sink=-1), dict(window=-3), dict(sink=1.5)])
def test_scheme_refuses_negative_counts(bad):
    with pytest.raises(SchemeError, match="non-negative"):
        Scheme(FP16, FP16, **bad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=5), "bits=5"),
        (dict(bits=4, granularity=Granularity.GROUP), "group size"),
        (dict(bits=4, granularity=Granularity.CHANNEL, group_size=0), "group size"),
        (dict(bits=4, granularity=Granularity.TOKEN, group_size=32), "takes no group size"),
        (dict(bits=4, scale_dtype=torch.int8), "scale_dtype"),
    ],
)
def test_quantspec_validates(kwargs, match):
    with pytest.raises(SchemeError, match=match):
        QuantSpec(**kwargs)


def test_unknown_granularity_lists_known():
    with pytest.raises(ValueError, match="token"):
        QuantSpec(4, "rows")


# ---------------------------------------------------------------------------------------- head_dim


@pytest.mark.parametrize("text", ["int4-g48", "k=int8,v=int4-g128", "int2-g40-sym"])
def test_group_not_dividing_head_dim_refused_with_config(text):
    config = make_tiny_config()  # head_dim 64
    group = parse_scheme(text).value.group_size
    with pytest.raises(SchemeError) as e:
        kvquant.QuantizedCache(text, config)
    assert f"group size {group}" in str(e.value) and "head_dim 64" in str(e.value)


def test_group_not_dividing_head_dim_refused_at_first_update():
    cache = kvquant.QuantizedCache("int4-g48")  # no config: checked when the model writes
    k = torch.randn(1, 2, 3, 64)
    with pytest.raises(SchemeError) as e:
        cache.update(k, k, 0)
    assert "group size 48" in str(e.value) and "head_dim 64" in str(e.value)


def test_group_dividing_head_dim_accepted():
    kvquant.QuantizedCache("int4-g32", make_tiny_config())
    cache = kvquant.QuantizedCache("int4-g16")
    k = torch.randn(1, 2, 3, 64)
    cache.update(k, k, 0)
    assert cache.get_seq_length() == 3


# ---------------------------------------------------------------------------------------- compatibility

_GOLDEN = json.loads((Path(__file__).parent / "scheme_golden.json").read_text(encoding="utf-8"))["schemes"]


@pytest.mark.parametrize("text", sorted(_GOLDEN))
def test_strings_that_parsed_before_parse_the_same(text):
    """Every scheme string of the examples, presets and the repository's code that parsed before the grammar
    was tightened (issue 21) parses to the same scheme now (tests/scheme_golden.json: text -> the canonical
    form the earlier parser gave). Only the refused forms (duplicates, bf16/fp32/none/int16, empty items,
    out-of-bound numbers) and calib paths with spaces (kept now) are absent from it."""
    s = parse_scheme(text)
    assert str(s) == _GOLDEN[text]
    assert s == parse_scheme(_GOLDEN[text]) and parse_scheme(str(s)) == s


def test_the_compatibility_table_holds_the_earlier_examples_and_presets():
    earlier = [t for t in list_schemes() if t in _GOLDEN]
    assert len(_GOLDEN) >= 150 and len(earlier) >= 28 and {"kivi-2", "kivi-4", "fp16-rot"} <= set(earlier)
