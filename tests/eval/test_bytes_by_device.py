"""Pages held per device in a perplexity run (issue 25): recorded with each document's measured memory
(`nbytes_by_device` in results.jsonl, `bytes_per_token_by_device` in the summary rows) and shown in the
report's memory section only when the cache spans more than one device.

On the CPU a device map puts every layer on `cpu` (one device; the cuda:0 / CPU split is the GPU check's),
so the run test checks what is recorded, and the report tests use summary rows with two devices."""

from __future__ import annotations

import json
import math

import pytest
from kvquant.eval import results as res
from kvquant.eval.runner import RunConfig, run

import kvquant
from kvquant import models

LENGTH = 300
SCHEMES = ("int8", "int4-g32,window=16")
TITLE = "pages held per device"


def cpu_map(layers: int) -> dict[str, str]:
    """Every module of the tiny Llama on the CPU (as tests/test_device_map.py builds one)."""
    names = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(layers))]
    return {**dict.fromkeys(names, "cpu"), "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


def test_a_mapped_run_records_pages_per_device(
    tmp_path, tiny_model_dir, tiny_model, tiny_corpus, monkeypatch
):
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps(cpu_map(tiny_model.config.num_hidden_layers)))
    loaded = []
    real_load = kvquant.load_model

    def spy(*args, **kwargs):  # the run loads its model through the map (harness.load_model)
        model, tokenizer = real_load(*args, **kwargs)
        loaded.append((kwargs.get("device_map"), set(map(str, models.layer_devices(model)))))
        return model, tokenizer

    monkeypatch.setattr(kvquant, "load_model", spy)
    config = RunConfig(schemes=SCHEMES, corpus=str(tiny_corpus), max_length=LENGTH, chunk=128, docs=2,
                       out=str(tmp_path / "run"), model=str(tiny_model_dir), device_map=str(map_file))
    run_dir, summary = run(config)
    assert loaded == [(str(map_file), {"cpu"})]

    rows = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["bucket"] == "256-300"]
    assert {r["scheme"] for r in last} == {"fp16", *SCHEMES} and len(last) == 2 * 3
    for r in rows:
        if r["bucket"] != "256-300" or r["scheme"] == "fp16":  # memory rides on the last bucket; no pages
            assert "nbytes_by_device" not in r, r
            continue
        by_device = r["nbytes_by_device"]
        assert by_device == {"cpu": r["cache_bytes"]} and r["cache_bytes"] > 0, r
        assert sum(by_device.values()) == r["cache_bytes"]

    alls = {r["scheme"]: r for r in summary if r["bucket"] == "all"}
    for scheme in SCHEMES:
        got = alls[scheme][res.BY_DEVICE]
        assert list(got) == ["cpu"]
        assert got["cpu"] == pytest.approx(alls[scheme]["bytes_per_token_measured"], rel=1e-12)
    assert res.BY_DEVICE not in alls["fp16"]
    report = (run_dir / "report.md").read_text()
    assert "**Memory: the formula" in report and TITLE not in report  # one device: nothing new


def _doc_rows(scheme: str, doc: int, **extra) -> dict:
    return {"scheme": scheme, "mode": "cache", "doc": doc, "bucket": "0-100", "bucket_start": 0,
            "bucket_end": 100, "nll_sum": 200.0 + doc, "ref_nll_sum": 0.0, "tokens": 99, "kl_sum": 0.5,
            "top1": 90, "dp_sum": 0.0, "dp_sq_sum": 0.0, "cache_tokens": 100, "status": "ok", **extra}


def test_summary_averages_pages_per_device_over_documents():
    """Per device, bytes per token averaged over the documents: 600 and 200 B/token on cuda:0, 200 and 100
    on the CPU; their sum is bytes_per_token_measured. A document without the field: none recorded."""
    rows = [_doc_rows("fp16", d) for d in (0, 1)]
    rows += [_doc_rows("q", 0, cache_bytes=80_000, nbytes_by_device={"cuda:0": 60_000, "cpu": 20_000}),
             _doc_rows("q", 1, cache_bytes=30_000, nbytes_by_device={"cuda:0": 20_000, "cpu": 10_000})]
    q = next(r for r in res.summarize(rows, {}, "fp16") if r["scheme"] == "q" and r["bucket"] == "all")
    assert q[res.BY_DEVICE] == {"cuda:0": pytest.approx(400.0), "cpu": pytest.approx(150.0)}
    assert sum(q[res.BY_DEVICE].values()) == pytest.approx(q["bytes_per_token_measured"])
    del rows[-1]["nbytes_by_device"]
    q = next(r for r in res.summarize(rows, {}, "fp16") if r["scheme"] == "q" and r["bucket"] == "all")
    assert res.BY_DEVICE not in q and math.isfinite(q["bytes_per_token_measured"])


def _summary_row(scheme: str, by_device: dict | None) -> dict:
    row = {"scheme": scheme, "mode": "cache", "bucket": "all", "status": "ok",
           "bytes_per_token_formula_run": 400.0, "bytes_per_token_measured": 400.0,
           "bytes_per_token_reserved": 512.0, "mem_held_per_token": 520.0, "mem_peak": 1e6}
    if by_device is not None:
        row[res.BY_DEVICE] = by_device
    return row


def test_report_shows_two_devices():
    summary = [_summary_row("int8", {"cuda:0": 300.0, "cpu": 100.0}),
               _summary_row("kivi-2", {"cuda:0": 150.0, "cpu": 150.0})]
    table = res.memory_table(summary, {"int8": "int8 (g128)"}, "cuda:0: memory_allocated")
    assert TITLE in table
    assert "| scheme | `cuda:0` | `cpu` |" in table
    assert "| `int8 (g128)` | 300 (75%) | 100 (25%) |" in table
    assert "| `kivi-2` | 150 (50%) | 150 (50%) |" in table
    # the per-device table follows its mode's memory table
    assert table.index("**mode: cache**") < table.index(TITLE)


def test_report_says_nothing_new_for_one_device():
    plain = res.memory_table([_summary_row("int8", None)], probe="cpu: rss")
    one = res.memory_table([_summary_row("int8", {"cuda:0": 400.0})], probe="cpu: rss")
    assert plain and one == plain and TITLE not in one
