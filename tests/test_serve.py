"""The serving simulation end to end on the tiny model (a stub tokenizer), its CLI's fail-fast checks, and
the capacity calculator against the 130 GB figure and against bytes measured in the shared store."""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvquant.eval import serve
from serving_checks import Engines, ids
from tiny_models import make_tiny_model

from kvquant import memory

REPO = Path(__file__).resolve().parents[1]


class _Tokenizer:
    """Text -> ids without a vocabulary file: one id per word (hashed into the tiny model's vocabulary)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + sum(map(ord, w)) * 7919 % 5000 for w in text.split()]}


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=5)


def test_simulation_writes_a_run_directory(model, tmp_path):
    config = serve.ServeConfig(
        schemes=("fp16", "int4-g32"),
        requests=5,
        context=64,
        shared_fraction=0.5,
        reply=4,
        policies=("lru", "radix-lru", "sliding:24"),
        fit_fp16_requests=2,
        fit_max=12,
        budget_fraction=0.0,  # the running requests' peak (and a margin): cached units must go
        out=str(tmp_path / "run"),
    )
    run_dir, summary = serve.run(config, model=model, tokenizer=_Tokenizer())
    rows = list(csv.DictReader((run_dir / "summary.csv").open()))
    assert [c for c in serve.SUMMARY_COLUMNS[:11]] == [
        "scheme",
        "prefix_cache",
        "policy",
        "requests",
        "ttft_mean_s",
        "ttft_after_first_s",
        "computed_tokens",
        "reused_tokens",
        "hit_rate",
        "ttft_hit_s",
        "ttft_miss_s",
    ]
    assert list(rows[0]) == serve.SUMMARY_COLUMNS
    assert [(r["scheme"], r["prefix_cache"], r["policy"]) for r in rows] == [
        (s, p, q)
        for s in ("fp16", "int4-g32")
        for p, q in (
            ("off", "none"),
            ("radix", "none"),
            ("radix", "lru"),
            ("radix", "radix-lru"),
            ("radix", "sliding:24"),
        )
    ]
    for r in rows:
        assert r["failed_requests"] == "0" and r["requests"] == "5"
        if r["budget_bytes"]:
            assert int(r["peak_bytes"]) <= int(r["budget_bytes"])
        if r["prefix_cache"] == "off":
            assert r["reused_tokens"] == "0" and int(r["computed_tokens"]) == 5 * 64
        else:
            assert int(r["reused_tokens"]) == 4 * 32  # requests 2..5 reuse the 32-token system prompt
        if r["policy"] == "none":
            assert int(r["fit_requests"]) == min(int(r["fit_formula"]), 12) >= 2  # the probe stops at fit_max
    fp16 = {r["prefix_cache"]: r for r in rows if r["scheme"] == "fp16" and r["policy"] == "none"}
    assert float(fp16["off"]["agreement"]) >= 0.75
    assert int(fp16["radix"]["fit_requests"]) > int(fp16["off"]["fit_requests"])
    assert any(int(r["evicted_pages"]) > 0 for r in rows if r["policy"] in ("lru", "radix-lru"))
    kinds = {json.loads(line)["kind"] for line in (run_dir / "results.jsonl").read_text().splitlines()}
    assert kinds == {"request", "timeline", "fit", "ttft_pair", "row"}  # "row": a point measured whole
    assert (run_dir / "serve.png").is_file() and (run_dir / "config.json").is_file()
    assert "TTFT of a prefix hit / a miss" in (run_dir / "report.md").read_text()
    # the same command again resumes: every row is there, nothing is measured, the summary is the same
    before = (run_dir / "results.jsonl").read_text()
    _, again = serve.run(config, model=None, tokenizer=None)  # no model needed: nothing is left to measure
    assert again == summary and (run_dir / "results.jsonl").read_text() == before
    with pytest.raises(serve.ServeError, match="different configuration .*reply: 4 -> 5.*pass --force"):
        serve.run(dataclasses.replace(config, reply=5), model=model, tokenizer=_Tokenizer())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policies", "lru,fifo"], "unknown eviction policy 'fifo'"),
        (["--schemes", "int5"], "bad scheme 'int5'"),
        (["--index", "hash", "--policies", "radix-lru"], "radix-lru policy needs --index radix"),
        (["--shared-fraction", "1.5"], "--shared-fraction must be in [0, 1)"),
        (["--requests", "0"], "--requests must be an integer >= 1"),
        (["--capacity", "--model", "llama-3-70b", "--gpu-gb", "80"], "weights take 141.2 GB"),
        (["--capacity", "--model", "gpt-5"], "unknown model 'gpt-5'"),
    ],
)
def test_cli_fails_fast_without_torch(argv, message):
    heavy = ("transformers", "matplotlib", "wandb")
    if (
        "--capacity" not in argv
    ):  # the calculator needs kvquant.memory (torch); the simulation's checks do not
        heavy = ("torch", *heavy)
    probe = (
        "import sys; sys.path.insert(0, {exp!r}); import serve; rc = serve.cli({argv!r}); "
        "heavy = [m for m in {heavy!r} if m in sys.modules]; "
        "print('HEAVY', heavy); sys.exit(rc)"
    ).format(exp=str(REPO / "experiments"), argv=argv, heavy=heavy)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "HEAVY []" in r.stdout


def test_capacity_cli_prints_the_table():
    probe = (
        "import sys; sys.path.insert(0, {exp!r}); import serve; sys.exit(serve.cli(['--capacity', '--model', "
        "'llama-3-70b', '--gpu-gb', '80', '--weight-bits', '4', '--schemes', 'fp16,int4-g64', '--context', "
        "'4096', '--shared-prefix', '2000']))"
    ).format(exp=str(REPO / "experiments"))
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| fp16 | 1,342.2 MB | 655.4 MB | 33 | 64 |" in r.stdout
    assert "| int4-g64 | 377.5 MB | 184.3 MB | 118 | 230 |" in r.stdout


# ------------------------------------------------------------------------------------------- capacity


def test_capacity_matches_the_llama_70b_figure():
    """320 KiB per token: 100 requests of 4,096 tokens = 134 GB ("about 130 GB")."""
    shape = memory.KNOWN_SHAPES["llama-3-70b"]
    c = memory.capacity(shape, "fp16", 134_217_728_000, 4096)
    assert c.request_bytes == 4096 * 327_680 and c.requests == c.requests_unshared == 100
    assert memory.capacity(shape, "fp16", 134_217_728_000 - 1, 4096).requests == 99
    int4 = memory.capacity(shape, "int4-g64", 134_217_728_000, 4096)
    assert int4.requests == 355  # 128 / 36 bytes per value group: 3.56x
    shared = memory.capacity(shape, "int4-g64", 134_217_728_000, 4096, shared_prefix=2048)
    assert shared.shared_bytes == int4.request_bytes // 2  # half the pages held once: twice the requests
    assert shared.requests == (134_217_728_000 - shared.shared_bytes) // (int4.request_bytes // 2) == 710
    assert memory.weights_bytes(memory.KNOWN_PARAMS["llama-3-70b"]) == 141_200_000_000


@pytest.mark.parametrize("scheme", ["fp16", "int4-g32", "k=int4-channel-g8,v=int4-g16,sink=4,window=8"])
def test_capacity_formula_equals_bytes_held_in_the_store(model, scheme):
    """N requests sharing a system prompt, held at once in one store: the bytes held are exactly the
    formula's shared + window copy + N x private, so `capacity` of those bytes is N."""
    engines = Engines(model)
    engine = engines(scheme, prefix_cache="radix")
    system, n, context = ids(40, 81), 5, 64
    caches = []
    for k in range(n):
        cache = engine.open()
        engine.prefill(cache, system + ids(context - 40, 90 + k), boundaries=[40])
        caches.append(cache)
    c = memory.capacity(model.config, scheme, engine.store.held_bytes(), context, shared_prefix=40)
    assert engine.store.held_bytes() == c.shared_bytes + c.window_copy_bytes + n * c.private_bytes
    assert (c.window_copy_bytes > 0) == ("window" in scheme)
    assert c.requests == n and c.requests_unshared < n
    for cache in caches:
        engine.close(cache)
    engines.check_released()


def test_capacity_refuses_bad_input():
    shape = memory.KNOWN_SHAPES["llama-3-8b"]
    with pytest.raises(ValueError, match="context must be at least 1"):
        memory.capacity(shape, "fp16", 10**9, 0)
    with pytest.raises(ValueError, match="shared_prefix must be >= 0"):
        memory.capacity(shape, "fp16", 10**9, 16, shared_prefix=-1)
    assert memory.capacity(shape, "fp16", 0, 16).requests == 0


def test_store_bytes_are_fp16_whatever_the_compute_dtype(model):
    """The budget is in deployment (FP16) bytes: a float32 model's pages count as FP16 ones."""
    engines = Engines(model)
    engine = engines("int4-g32", prefix_cache=None)
    assert model.dtype == torch.float32
    cache = engine.open()
    engine.prefill(cache, ids(33, 99))
    assert engine.store.held_bytes() == memory.cache_bytes(model.config, "int4-g32", 33, dtype=torch.float16)
    assert cache.nbytes() == memory.cache_bytes(model.config, "int4-g32", 33, dtype=torch.float32)
    engine.close(cache)
    engines.check_released()


def test_serve_results_log_to_wandb_offline(tmp_path, monkeypatch):
    """The serve run directory becomes one offline W&B run (summary table and plot); no account, no
    network."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with (run_dir / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=serve.SUMMARY_COLUMNS)
        w.writeheader()
        w.writerow({c: "1" for c in serve.SUMMARY_COLUMNS})
    (run_dir / "config.json").write_text(json.dumps({"schemes": ["int4-g64"]}))
    serve.log_to_wandb(run_dir, "offline", project="kvquant-test")
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(list(r.glob("*.wandb")) for r in runs)  # one per scheme, one comparison
    serve.log_to_wandb(run_dir, "disabled")  # writes nothing more
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2
