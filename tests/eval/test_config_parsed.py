"""Configs hold their schemes parsed once validated (issue 19, item 4): `validate` / `check_config` return a
copy holding them, the run and serve paths parse no scheme string past validation, bad schemes still fail as
RunError / ServeError listing the known ones, and internal functions refuse a string with a TypeError."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from kvquant.eval import serve
from kvquant.eval.config import RunConfig, RunError, check_inputs, validate
from kvquant.eval.schemes import KVQuantScheme, PeerScheme
from tiny_models import make_tiny_model

import kvquant
from kvquant.scheme import Scheme


@pytest.fixture
def string_parses(monkeypatch):
    """Every parse_scheme call given a string, wherever kvquant's modules bound the function."""
    import kvquant.eval.measure
    import kvquant.eval.retrieval
    import kvquant.eval.runner

    import kvquant.cache
    import kvquant.diagnose
    import kvquant.memory
    import kvquant.scheme
    import kvquant.serving  # noqa: F401 - bound here before the spy, as a run finds it

    real = kvquant.scheme.parse_scheme
    calls: list[str] = []

    def spy(text):
        if isinstance(text, str):
            calls.append(text)
        return real(text)

    def bound(value):
        return [m for name, m in list(sys.modules.items())
                if name.split(".")[0] == "kvquant" and getattr(m, "parse_scheme", None) is value]

    for module in bound(real):
        monkeypatch.setattr(module, "parse_scheme", spy)
    yield calls
    for module in bound(spy):  # a module first imported during the test bound the spy: unbind it
        module.parse_scheme = real


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("some text " * 50)
    return path


# ------------------------------------------------------------------------------------------- RunConfig


def test_validate_returns_a_copy_holding_the_parsed_schemes(corpus_file):
    config = RunConfig(schemes=("int8", "kivi-2", "int8"), corpus=str(corpus_file))
    with pytest.raises(RunError, match="holds no parsed schemes: validate it first"):
        _ = config.parsed
    checked = validate(config, check_model=False)
    assert checked == config and checked is not config and config.parsed_schemes is None
    assert [s.label for s in checked.parsed] == ["int8", "k=int2-channel-g32,v=int2-g32,window=128"]
    assert all(isinstance(s, KVQuantScheme) and isinstance(s.scheme, Scheme) for s in checked.parsed)
    assert checked.parsed[1].scheme == kvquant.parse_scheme("kivi-2")
    assert checked.schemes == config.schemes  # what was given stays as given
    assert check_inputs(config, check_model=False) == list(checked.parsed)


def test_the_parsed_schemes_follow_the_config_through_replace(corpus_file):
    checked = validate(RunConfig(schemes=("int8",), corpus=str(corpus_file)), check_model=False)
    assert dataclasses.replace(checked, max_length=4096).parsed == checked.parsed
    assert dataclasses.replace(checked, schemes=("int4-g64",)).parsed_schemes is None  # stale: dropped
    with pytest.raises(TypeError, match="parsed_schemes is set by validation"):
        RunConfig(schemes=("int8",), parsed_schemes=("int8",))


def test_validation_keeps_a_default_chunk_a_default():
    """A peer's own chunk (its residual, 128) applies when --chunk is not given: the validated copy must not
    read the filled-in default as given (dataclasses.replace would)."""
    config = RunConfig(schemes=("int8",))
    checked = validate(config, check_model=False)
    assert (config.chunk_given, checked.chunk_given) == (False, False)
    peer = PeerScheme("quanto", 4)
    assert checked.chunk_for(peer) == 128 and checked.chunk_for(checked.parsed[0]) == checked.chunk


def test_a_validated_config_is_validated_again_without_parsing_a_string(corpus_file, string_parses):
    config = RunConfig(schemes=("int8", "kivi-2", "k=int4-channel-g64,v=int4-g64"), corpus=str(corpus_file))
    checked = validate(config, check_model=False)
    assert len(string_parses) >= 3  # the spy sees the parses of validation
    string_parses.clear()
    again = validate(checked, check_model=False)
    assert again.parsed == checked.parsed and string_parses == []


@pytest.mark.parametrize("bad", ["bogus", "int5"])
def test_a_bad_scheme_is_still_a_run_error_listing_the_known_ones(bad, corpus_file):
    with pytest.raises(RunError, match=f"(?s)bad scheme '{bad}'.*Known schemes and presets: fp16, int8"):
        validate(RunConfig(schemes=("int8", bad), corpus=str(corpus_file)), check_model=False)


def test_a_run_parses_its_scheme_strings_once(tmp_path, tiny_corpus, tiny_model, tokenizer, string_parses):
    """run(config) parses exactly what validation parses; a validated config is run without any parse."""
    from kvquant.eval.runner import run

    schemes = ("int8", "int4-g32,sink=2,window=8")
    config = RunConfig(schemes=schemes, corpus=str(tiny_corpus), max_length=64, chunk=32, docs=1,
                       mode="both", out=str(tmp_path / "a"))
    labels = {s.label for s in validate(config, check_model=False).parsed}
    once = list(string_parses)
    assert once
    string_parses.clear()
    _, summary = run(config, model=tiny_model, tokenizer=tokenizer)
    assert string_parses == once  # validation's parses, and none past it
    assert {r["scheme"] for r in summary} == {"fp16", *labels}
    string_parses.clear()
    checked = validate(dataclasses.replace(config, out=str(tmp_path / "b")), check_model=False)
    string_parses.clear()
    _, again = run(checked, model=tiny_model, tokenizer=tokenizer)
    assert string_parses == []
    numbers = lambda rows: [(r["scheme"], r["mode"], r["bucket"], r["kl"]) for r in rows]  # noqa: E731
    assert numbers(again) == numbers(summary)


# ----------------------------------------------------------------------------------------- ServeConfig


class _Tokenizer:
    """One id per word (as tests/test_serve.py): no vocabulary file."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + sum(map(ord, w)) * 7919 % 5000 for w in text.split()]}


def test_check_config_returns_a_copy_holding_the_parsed_schemes():
    config = serve.ServeConfig(schemes=("fp16", "kivi-4"))
    with pytest.raises(serve.ServeError, match="holds no parsed schemes"):
        _ = config.parsed
    checked = serve.check_config(config)
    assert checked == config and config.parsed_schemes is None
    assert checked.parsed == (kvquant.parse_scheme("fp16"), kvquant.parse_scheme("kivi-4"))
    assert checked.scheme_of("kivi-4").name == "kivi-4"
    # the run's identity and config.json hold the labels as given, never the parsed objects
    assert serve.identity(checked) == serve.identity(config)
    assert serve.identity(checked)["schemes"] == ["fp16", "kivi-4"]
    assert "parsed_schemes" not in serve._settings(checked)
    assert dataclasses.replace(checked, schemes=("int8",)).parsed_schemes is None


@pytest.mark.parametrize("bad", ["bogus", "int5"])
def test_a_bad_scheme_is_still_a_serve_error_listing_the_known_ones(bad):
    known = f"(?s)bad scheme '{bad}'.*Known schemes and presets: fp16, int8"
    with pytest.raises(serve.ServeError, match=known):
        serve.check_config(serve.ServeConfig(schemes=("fp16", bad)))
    with pytest.raises(serve.ServeError, match="name at least one scheme"):
        serve.check_config(serve.ServeConfig(schemes=()))


def test_a_serve_run_parses_no_scheme_string_past_validation(tmp_path, string_parses):
    model = make_tiny_model(seed=5)
    config = serve.ServeConfig(
        schemes=("int4-g32",), requests=2, context=32, reply=2, policies=("lru",), fit_fp16_requests=1,
        fit_max=4, out=str(tmp_path / "serve"),
    )
    checked = serve.check_config(config)
    assert string_parses == ["int4-g32"]
    string_parses.clear()
    with torch.no_grad():
        _, summary = serve.run(checked, model=model, tokenizer=_Tokenizer())
    assert string_parses == []  # Engine, the store, memory.capacity, the fp16 budget: all given Schemes
    assert [(r["scheme"], r["prefix_cache"], r["policy"]) for r in summary] == [
        ("int4-g32", "off", "none"), ("int4-g32", "radix", "none"), ("int4-g32", "radix", "lru"),
    ]


# --------------------------------------------------------------------------- internal functions: Scheme


def test_internal_functions_refuse_a_scheme_string():
    from kvquant.eval.allocation import scheme_kl
    from kvquant.eval.fakequant import FakeQuantCache

    from kvquant.diagnose import keys_at_risk

    with pytest.raises(TypeError, match=r"FakeQuantCache takes a parsed Scheme \(kvquant.parse_scheme\)"):
        FakeQuantCache("int8")
    with pytest.raises(TypeError, match=r"keys_at_risk takes a parsed Scheme .*, not str"):
        keys_at_risk("int4-g64")
    with pytest.raises(TypeError, match="scheme_kl takes a parsed Scheme"):
        scheme_kl(None, [], [], "int8")
    assert [str(s) for s in keys_at_risk(kvquant.parse_scheme("int4-g64"))] == ["int4-g64"]
