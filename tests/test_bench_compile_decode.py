"""benchmarks/bench_compile_decode.py's parts on a small layer: its shuffled pages hold the tokens in order,
its three paths compute one attention, and its rows compare them (torch.compile itself is not run here: a
compile takes seconds to minutes; the script's own max-diff column is the compiled path's twin check)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvquant import native

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_compile_decode",
                                               ROOT / "benchmarks" / "bench_compile_decode.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def ops():
    native.build()
    native.ops.cache_clear()
    assert native.ops() is not None
    return native.ops()


@pytest.mark.parametrize("spec", ["int4-g64", "int8"])
def test_paths_compute_the_attention_of_the_decoded_layer(ops, spec):
    codec, pages, region = bench.make_layer(spec, 256)
    assert not torch.equal(region.table[0], torch.arange(256 // bench.BS))  # pages really out of order
    q = torch.randn(1, bench.H_KV, bench.G, bench.D, generator=torch.Generator().manual_seed(3))
    k = codec.decode_pages(pages, region, torch.float32)  # (1, H_kv, T, D) in token order
    v = k  # the layer's one field set serves K and V alike here
    plain = torch.softmax(q @ k.transpose(-1, -2) * bench.D**-0.5, dim=-1) @ v
    for native_path in (False, True):
        got = bench.attend_fn(codec, pages, region, native_path)(q)
        torch.testing.assert_close(got, plain, atol=2e-5, rtol=1e-5)


def test_rows_compare_paths_and_say_when_a_compile_pays(ops, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the "compiled" path is eager itself
    rows = bench.bench("int4-g64", 256, calls=3)
    assert [r["path"] for r in rows] == ["eager", "compiled", "native"]
    for r in rows:
        assert r["median_ms"] > 0 and r["p10"] <= r["median_ms"] <= r["p90"]
        assert r["max_diff"] < 1e-4
    assert rows[1]["max_diff"] == 0  # the same function: the same bits
    assert rows[0]["vs_eager"] == 1.0 and rows[2]["vs_native"] == 1.0
    be = rows[1]["break_even_steps"]
    assert be == "never" or int(be) >= 0
    table = bench.markdown(rows, "header")
    assert table.count("\n| int4-g64 | 256 |") == 3
