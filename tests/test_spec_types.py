"""Typed specs (issue 19 item 4): QuantSpec stores its family, grain and transforms as objects
(`kvquant.spec_types`), parses and prints exactly as the flat form did, and `codec_for` dispatches on the
objects' types through a registry that each family module fills (a new family needs no edit of base.py)."""

from __future__ import annotations

import ast
import copy
import dataclasses
import itertools
import pickle
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from kvquant import scheme as scheme_module
from kvquant import spec_types
from kvquant.codecs import base
from kvquant.codecs.base import Codec, Field, block_extent, codec_for, register
from kvquant.codecs.quantize import quantize
from kvquant.codecs.transforms import RotationCodec
from kvquant.scheme import (
    FP16,
    Granularity,
    QuantSpec,
    SchemeError,
    list_schemes,
    parse_scheme,
    parse_spec,
)
from kvquant.spec_types import (
    FP8,
    CalibRotate,
    Center,
    ChannelGroups,
    Codebook,
    Dense,
    EngineFormat,
    Outliers,
    PerHead,
    PerToken,
    Rotate,
    TokenGroups,
    TurboSpec,
    UniformInt,
    VLLMCacheDtype,
)

CODECS = Path(__file__).resolve().parents[1] / "kvquant" / "codecs"
FLAT = ("bits", "granularity", "group_size", "symmetric", "scale_dtype", "codebook", "prerope", "fp8",
        "center", "rotate", "outliers", "unit_scale", "engine", "turbo", "rotate_calib")


def _spec_strings() -> list[str]:
    """A broad grid of spec strings (families x grains x symmetry x scale dtype x transforms x prerope); the
    ones that parse."""
    heads = ["fp16", "int8", "int4", "int2", "nuq4", "nuq3", "nuq2", "fp8-e4m3", "fp8-e5m2"]
    grains = ["", "-head", "-g32", "-g64", "-channel-g16", "-channel-g48", "-tensor"]
    syms = ["", "-sym", "-asym"]
    scales = ["", "-sbf16", "-sfp32"]
    transforms = ["", "-center", "-center32", "-rot", "-rot7", "-crot", "-out1", "-out0.5",
                  "-center-rot-out1", "-center16-crot-out2", "-rot3-out0.5"]
    out = []
    for parts in itertools.product(heads, grains, syms, scales, transforms, ["", "-prerope"]):
        text = "".join(parts)
        try:
            parse_spec(text)
        except SchemeError:
            continue
        out.append(text)
    out += ["llama.cpp:q4_0", "llama.cpp:q8_0-rot", "mxfp4", "nvfp4-prerope", "vllm:fp8", "vllm:fp8_e5m2",
            "vllm:int8_per_token_head", "vllm:turboquant_4bit_nc.k", "turbo3", "turbo2.5-qjl-had-nc-seed3",
            "turbo3.5-block32-prerope"]
    return out


SPECS = _spec_strings()


def test_grid_is_broad():
    assert len(SPECS) > 1500  # the grid is not vacuous: every family, grain and transform parses somewhere
    kinds = {type(parse_spec(s).family) for s in SPECS}
    assert kinds == {Dense, UniformInt, Codebook, FP8, EngineFormat, VLLMCacheDtype, TurboSpec}


@pytest.mark.parametrize("text", list_schemes())
def test_list_schemes_round_trip(text):
    s = parse_scheme(text)
    assert parse_scheme(str(s)) == s and hash(parse_scheme(str(s))) == hash(s)
    for spec in s.specs():
        assert parse_spec(str(spec)) == spec
        _check_typed_matches_flat(spec)


def test_grid_round_trip_and_flat_meaning():
    for text in SPECS:
        s = parse_spec(text)
        assert parse_spec(str(s)) == s and hash(parse_spec(str(s))) == hash(s), text
        _check_typed_matches_flat(s)


def _check_typed_matches_flat(s: QuantSpec) -> None:
    """The typed parts say what the flat fields say, and both forms rebuild the same spec."""
    flat = {name: getattr(s, name) for name in FLAT}
    assert QuantSpec(**flat) == s, s  # the flat keyword form of the flat view is the spec
    typed = QuantSpec(family=s.family, grain=s.grain, scale_dtype=s.scale_dtype, transforms=s.transforms,
                      prerope=s.prerope)
    assert typed == s and str(typed) == str(s)
    fam = s.family
    assert isinstance(fam, Codebook) == s.codebook
    assert (fam.kind if isinstance(fam, FP8) else None) == s.fp8
    assert isinstance(fam, FP8) and fam.unit_scale or not s.unit_scale
    assert (fam.format if isinstance(fam, EngineFormat) else None) == s.engine
    assert (fam if isinstance(fam, TurboSpec) else None) == s.turbo
    assert isinstance(fam, Dense) == (s.bits == 16)
    if isinstance(fam, (UniformInt, Codebook)):
        assert (fam.bits, fam.symmetric) == (s.bits, s.symmetric)
    # a grain exactly where the spec stores per-block scales of its own choosing
    assert (s.grain is None) == (isinstance(fam, (Dense, EngineFormat, TurboSpec)) or s.unit_scale)
    if s.grain is not None:
        assert s.grain.granularity is s.granularity
        want = {Granularity.GROUP: ChannelGroups, Granularity.CHANNEL: TokenGroups,
                Granularity.HEAD: PerHead, Granularity.TOKEN: PerToken}[s.granularity]
        assert type(s.grain) is want and s.grain.group_size == s.group_size
    else:
        assert s.granularity is Granularity.TOKEN and s.group_size is None
    by_kind = {type(t): t for t in s.transforms}
    assert (by_kind[Center].tokens if Center in by_kind else None) == s.center
    rot = by_kind.get(Rotate) or by_kind.get(CalibRotate)
    assert (rot.seed if rot else None) == s.rotate and (CalibRotate in by_kind) == s.rotate_calib
    assert (by_kind[Outliers].percent if Outliers in by_kind else None) == s.outliers
    assert [t.order for t in s.transforms] == sorted(t.order for t in s.transforms)  # outermost first


def test_typed_and_flat_constructors_agree():
    assert QuantSpec(family=UniformInt(4), grain=ChannelGroups(64)) == parse_spec("int4-g64")
    assert QuantSpec(4, Granularity.GROUP, 64) == parse_spec("int4-g64")
    typed = QuantSpec(family=UniformInt(4), grain=TokenGroups(32), transforms=(Center(), Rotate(7)))
    assert typed == parse_spec("int4-channel-g32-center-rot7")
    assert QuantSpec(family=FP8("e4m3")) == parse_spec("fp8-e4m3")  # the default grain: per token
    assert QuantSpec(family=FP8("e4m3", unit_scale=True)) == parse_spec("fp8-e4m3-tensor")
    assert QuantSpec(family=Dense(), transforms=(Rotate(),)) == parse_spec("fp16-rot")
    assert FP16.family == Dense() and FP16.grain is None
    s = parse_spec("nuq3-g64-center-crot-out1-prerope")
    assert (s.family, s.grain) == (Codebook(3), ChannelGroups(64))
    assert s.transforms == (Center(64), CalibRotate(), Outliers(1.0)) and s.prerope
    # dataclasses.replace takes the typed parts and the flat keywords alike
    assert dataclasses.replace(s, prerope=False) == parse_spec("nuq3-g64-center-crot-out1")
    assert dataclasses.replace(s, transforms=s.transforms[1:]) == parse_spec("nuq3-g64-crot-out1-prerope")
    assert dataclasses.replace(parse_spec("int4-g64-rot"), rotate=None) == parse_spec("int4-g64")
    assert dataclasses.replace(parse_spec("nuq3-g64"), bits=4) == parse_spec("nuq4-g64")


def test_typed_form_refusals():
    with pytest.raises(SchemeError, match="outermost first"):
        QuantSpec(family=UniformInt(4), transforms=(Rotate(), Center()))
    with pytest.raises(SchemeError, match="outermost first"):
        QuantSpec(family=UniformInt(4), transforms=(Rotate(), CalibRotate()))
    with pytest.raises(SchemeError, match="takes no grain"):
        QuantSpec(family=EngineFormat("llama.cpp:q4_0"), grain=PerHead())
    # the flat checks run on the typed form too, with their messages
    with pytest.raises(SchemeError, match="3 bits exist only as a codebook"):
        QuantSpec(family=UniformInt(3))
    with pytest.raises(SchemeError, match="does not divide head_dim"):
        QuantSpec(family=UniformInt(4), grain=ChannelGroups(48)).check_head_dim(64)
    with pytest.raises(TypeError, match="bits"):
        QuantSpec()


@pytest.mark.parametrize(
    ("text", "scale"),
    [
        ("int4", (2, 1, 64, 1)),  # per token over all heads
        ("int4-head", (2, 3, 64, 1)),
        ("int4-g32", (2, 3, 64, 4)),  # 128 / 32 channel groups
        ("int4-channel-g32", (2, 3, 2, 128)),  # 64 / 32 token groups
    ],
)
def test_grain_extent_is_what_the_codecs_store(text, scale):
    spec = parse_spec(text)
    x = torch.randn(2, 3, 64, 128)
    assert tuple(quantize(x, spec).scale.shape) == scale
    heads, tokens, channels = spec.grain.extent(3, 128)
    assert block_extent(spec, 3, 128) == base.BlockExtent(heads, tokens, channels)
    for family in ("int4", "nuq4", "fp8-e4m3"):
        s = parse_spec(family + text[4:])
        f = codec_for(s, 3, 128).fields()["scale"]
        assert (f.heads, f.tokens, f.cols) == (3 // heads, tokens, 128 // channels)
        assert codec_for(s, 3, 128).token_group == s.grain.tokens == s.tokens_per_group


def test_transform_chain_outermost_first():
    c = codec_for("int4-g64-center-rot-out1-prerope", 2, 64)
    chain = []
    while c is not None:
        chain.append((type(c).__name__, str(c.spec)))
        c = getattr(c, "inner", None)
    assert chain == [
        ("PreRopeCodec", "int4-g64-center-rot-out1-prerope"),
        ("CenterCodec", "int4-g64-center-rot-out1"),
        ("RotationCodec", "int4-g64-rot-out1"),
        ("OutlierCodec", "int4-g64-out1"),
        ("AffineCodec", "int4-g64"),
    ]


@dataclasses.dataclass(frozen=True)
class Halves:
    """A toy family: values stored as round(2 x) / 2 in the K/V dtype; `halves` or `halvesN` (N a seed)."""

    seed: int = 0
    bits = 16

    @classmethod
    def parse(cls, text: str) -> Halves:
        if not text[6:].isdigit() and text != "halves":
            raise SchemeError("write halves or halvesN")
        return cls(int(text[6:] or 0))

    def name(self) -> str:
        return f"halves{self.seed or ''}"

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % 2:
            raise SchemeError("halves needs an even head_dim")


class HalvesCodec(Codec):
    def fields(self) -> dict[str, Field]:
        return {"values": Field(self.heads, 1, self.head_dim, self.dtype)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"values": (x.float() * 2).round().div(2).to(self.dtype)}

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        return fields["values"].to(dtype or self.dtype)


def test_a_new_family_is_one_registration(monkeypatch):
    monkeypatch.setattr(base, "_FAMILIES", dict(base._FAMILIES))  # the toy's registrations are undone after
    monkeypatch.setattr(spec_types, "SPEC_FAMILIES", dict(spec_types.SPEC_FAMILIES))
    monkeypatch.setattr(scheme_module, "SPEC_FAMILIES", spec_types.SPEC_FAMILIES)
    spec = QuantSpec(family=Halves())
    with pytest.raises(SchemeError, match="no codec is registered for Halves"):
        codec_for(spec, 2, 8)
    register(Halves)(HalvesCodec)
    x = torch.randn(1, 2, 5, 8)
    c = codec_for(spec, 2, 8, torch.float32)
    assert type(c) is HalvesCodec and str(spec) == "halves"
    assert torch.equal(c.decode(c.encode(x)), (x * 2).round() / 2)
    rotated = codec_for(QuantSpec(family=Halves(), transforms=(Rotate(3),)), 2, 8, torch.float32)
    assert type(rotated) is RotationCodec and type(rotated.inner) is HalvesCodec
    assert str(rotated.spec) == "halves-rot3"
    with pytest.raises(SchemeError, match="even head_dim"):
        codec_for(spec, 2, 7)
    with pytest.raises(ValueError, match="already has a codec"):
        register(Halves)(RotationCodec)
    # its own grammar: one more registration, and scheme strings parse, print and round-trip
    with pytest.raises(SchemeError, match="bad quantization spec 'halves3'"):
        parse_spec("halves3")
    spec_types.spec_family("halves")(Halves)
    s = parse_scheme("k=halves3-prerope,v=halves,window=16")
    assert s.key == QuantSpec(family=Halves(3), prerope=True) and s.value.family == Halves()
    assert str(s) == "k=halves3-prerope,v=halves,window=16" and parse_scheme(str(s)) == s
    with pytest.raises(SchemeError, match="write halves or halvesN"):
        parse_spec("halvesx")
    with pytest.raises(ValueError, match="overlaps"):
        spec_types.spec_family("int")(Halves)


def test_specs_pickle_and_copy():
    for text in ("int4-channel-g64-center-crot-out1-prerope", "turbo2.5-qjl", "fp8-e5m2-tensor", "vllm:fp8"):
        s = parse_spec(text)
        assert pickle.loads(pickle.dumps(s)) == s and copy.deepcopy(s) == s
        assert str(pickle.loads(pickle.dumps(s))) == str(s)


def _codec_import_graph() -> dict[str, set[str]]:
    """module of kvquant.codecs -> the kvquant.codecs modules it imports anywhere (inside functions too)."""
    names = {p.stem for p in CODECS.glob("*.py")}
    graph: dict[str, set[str]] = {n: set() for n in names}
    for name in names:
        tree = ast.parse((CODECS / f"{name}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            mods: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 1:  # from .x import y / from . import x
                mods = [node.module] if node.module else [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvquant.codecs."):
                mods = [node.module.split(".")[2]]
            elif isinstance(node, ast.Import):
                mods = [a.name.split(".")[2] for a in node.names if a.name.startswith("kvquant.codecs.")]
            graph[name] |= {m.split(".")[0] for m in mods if m.split(".")[0] in names and m != name}
    return graph


def test_no_import_circle_in_codecs():
    graph = _codec_import_graph()
    assert "fp8" in graph["__init__"] and "base" in graph["fp8"]  # the walk sees the registry's imports
    graph.pop("__init__")  # the package imports every family (the registry); no module imports the package
    seen: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if seen.get(node) == 1:
            raise AssertionError(f"import circle: {' -> '.join([*path, node])}")
        if node in seen:
            return
        seen[node] = 1
        for nxt in sorted(graph[node]):
            visit(nxt, [*path, node])
        seen[node] = 2

    for node in sorted(graph):
        visit(node, [])
    assert not graph["base"] & {"quantize", "fp8", "transforms", "calibrot", "turbo", "engine", "engine_vllm"}
