"""benchmarks/bench_generate.py's core on a tiny model: every requested row, positive numbers, no timing
bounds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_generate", ROOT / "benchmarks" / "bench_generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_generate"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


bench = _bench()
needs_proc = pytest.mark.skipif(
    not Path("/proc/self/statm").is_file(), reason="needs Linux /proc/self/statm (resident set size)"
)


@needs_proc
def test_core_gives_every_row_with_positive_numbers():
    model = make_tiny_model()
    ids = torch.randint(0, 1000, (1, 200))  # > WARMUP_TOKENS, > the peers' residual of 128
    schemes = ["int8", "int4-g64", "k=int4-channel-g64-rot,v=int4-g64-rot,sink=4,window=128"]
    specs = bench.cache_specs(schemes, ["hf-hqq-int4"])

    def broken(config):
        raise RuntimeError("this cache cannot be built")

    specs.append(bench.CacheSpec("broken", "peer", broken))
    specs.append(bench.CacheSpec("missing", "peer", lambda c: None, unavailable="pip install nothing"))
    rows = bench.run_bench(model, ids, [192], steps=3, specs=specs, memory="inprocess")

    assert [r.cache for r in rows] == [s.name for s in specs]
    by = {r.cache: r for r in rows}
    assert by["broken"].status.startswith("failed: RuntimeError: this cache cannot be built")
    assert by["missing"].status == "unavailable: pip install nothing"
    ok = [r for r in rows if r.status == "ok"]
    assert len(ok) == len(specs) - 2, [r.status for r in rows]
    for r in ok:
        assert r.length == 192
        assert r.prefill_tok_s > 0 and r.decode_ms_median > 0, r
        assert r.decode_ms_p10 <= r.decode_ms_median <= r.decode_ms_p90, r
        assert r.nbytes > 0 and r.peak_prefill_bytes is not None, r
        assert r.prefill_ratio > 0 and r.decode_ratio > 0 and r.saving_nbytes > 0, r
    base = by[bench.BASELINE]
    assert base.prefill_ratio == 1.0 and base.decode_ratio == 1.0
    # 2 layers x 2 KV heads x 64 x 195 tokens x K and V x fp32: DynamicCache holds exactly these tensors
    assert base.nbytes == 2 * 2 * 64 * (192 + 3) * 2 * 4
    for r in ok:
        if r.kind == "kvquant":
            assert r.reserved_bytes >= r.nbytes > 0
        else:
            assert r.reserved_bytes is None
    table = bench.markdown(rows, "inprocess")
    for r in rows:
        assert f"| {r.cache} |" in table
    assert "unavailable: pip install nothing" in table


def test_unknown_peer_and_scheme_are_named():
    spec = bench.peer_spec("hf-nothing-int4")
    assert spec.unavailable and "unknown peer backend" in spec.unavailable
    with pytest.raises(Exception, match="int5"):
        bench.kvquant_spec("int5-nothing")


def test_cli_defaults_and_quick():
    a = bench.parse_args([])
    assert a.lengths == [1024, 4096, 8192] and a.steps == 64 and a.threads == 1
    assert a.schemes == list(bench.DEFAULT_SCHEMES) and a.peers == list(bench.DEFAULT_PEERS)
    q = bench.parse_args(["--quick", "--peers", "none", "--schemes", "int8,k=int4-g64,v=int8,sink=4"])
    assert q.lengths == [1024] and q.steps == 8 and q.peers == []
    assert q.schemes == ["int8", "k=int4-g64,v=int8,sink=4"]


@needs_proc
def test_subprocess_memory_fields_come_from_the_worker(tmp_path):
    """memory='subprocess': the worker's fields replace the in-process ones (here a stand-in worker), the
    ratios use them, and the CSV takes every row under its fixed header."""
    model = make_tiny_model()
    ids = torch.randint(0, 1000, (1, 170))
    specs = bench.cache_specs(["int8"], [])
    calls = []

    def worker(spec, length):
        calls.append((spec.name, length))
        held = 4 << 20 if spec.kind == "baseline" else 1 << 20
        return {"held_bytes": held, "growth_bytes": held, "peak_prefill_bytes": 2 * held, "peak_method": "w"}

    rows = bench.run_bench(model, ids, [164], steps=1, specs=specs, memory="subprocess", worker=worker)
    assert calls == [(s.name, 164) for s in specs]
    assert [r.held_bytes for r in rows] == [4 << 20, 1 << 20]
    assert rows[1].saving_real == 4.0
    path = tmp_path / "b.csv"
    tags = dict.fromkeys(bench.TAGS, "x")
    bench.write_csv(path, rows, tags)
    bench.write_csv(path, rows, tags)
    bench.check_csv(path)  # the same columns: accepted
    assert len(path.read_text().splitlines()) == 1 + 2 * len(rows)
    path.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="other columns"):
        bench.check_csv(path)
