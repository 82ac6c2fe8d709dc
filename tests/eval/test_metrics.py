"""The metric schema, error distributions and bootstrap intervals, prefill mode, the reference cache, storage
dtype of reported bytes, the noise floor and the peer protocol (issue 11), on the tiny model."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from kvquant.eval import metrics, scoring, wandb_logger
from kvquant.eval.config import RunConfig, RunError
from kvquant.eval.measure import REFERENCE, evaluate_document, make_buckets, noise_shift, steps
from kvquant.eval.runner import memory_of, run
from kvquant.eval.schemes import EvalScheme, KVQuantScheme, PeerScheme, parse_eval_scheme
from kvquant.eval.stats import bootstrap_intervals

import kvquant
from kvquant.scheme import SchemeError

LENGTH = 160


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(0)
    return torch.randint(0, 49152, (1, LENGTH))


# ------------------------------------------------------------------------------------------------ schema


def test_every_writer_reads_one_schema():
    cols = metrics.SUMMARY_COLUMNS
    assert len(cols) == len(set(cols))
    for m in metrics.METRICS:
        assert m.name in cols
        assert (f"{m.name}_lo" in cols) == m.interval
    assert {"drift_lo", "drift_hi", "kl_lo", "kl_hi", "kl_p999", "dp_rms", "drift_noise"} <= set(cols)
    from kvquant.eval import results

    assert results.SUMMARY_COLUMNS is cols and wandb_logger.SUMMARY_COLUMNS is cols
    assert set(wandb_logger.METRICS) >= {"drift", "drift_lo", "kl_p99", "top1_agree"}
    assert "tokens" not in wandb_logger.METRICS  # declared wandb=False
    with pytest.raises(KeyError, match="known: tokens, ppl"):
        metrics.metric("perplexity")


def test_formats_and_targets():
    assert metrics.format_interval("drift", 0.0009, -0.0002, 0.0021) == "+0.09% [−0.02, +0.21]"
    assert metrics.format_value("drift", float("nan")) == "–"
    assert metrics.format_value("tokens", 1234.0) == "1,234"
    assert metrics.within({"drift_lo": -0.0009, "drift_hi": 0.0002}, "drift", 0.001) is True
    # the point is inside the target, the interval is not: the target is missed
    assert metrics.within({"drift": 0.0005, "drift_lo": -0.0002, "drift_hi": 0.0013}, "drift", 0.001) is False
    assert metrics.within({"drift": 0.0}, "drift", 0.001) is None


# ------------------------------------------------------------------------------------------------ bootstrap


def test_bootstrap_is_seeded_and_resamples_documents():
    rng = np.random.default_rng(1)
    same = [rng.normal(0.01, 0.05, 400) for _ in range(6)]
    a = bootstrap_intervals(same, [np.abs(x) for x in same], seed=3)
    assert a == bootstrap_intervals(same, [np.abs(x) for x in same], seed=3)
    lo, hi = a["drift"]
    point = math.expm1(np.concatenate(same).mean())
    assert lo < point < hi
    # the same tokens split into documents that disagree: token resampling alone would miss the spread
    apart = [x + (0.03 if i % 2 else -0.03) for i, x in enumerate(same)]
    b = bootstrap_intervals(apart, [np.abs(x) for x in apart], seed=3)
    assert b["drift"][1] - b["drift"][0] > 1.5 * (hi - lo)
    assert all(math.isnan(v) for v in bootstrap_intervals([], [], seed=0)["kl"])


def test_steps():
    assert steps(10, "fake", 3) == [0, 10]
    assert steps(10, "cache", 4) == [0, 4, 8, 10]
    assert steps(10, "cache", 4, shift=2) == [0, 2, 6, 10]
    assert steps(10, "prefill", 4, prefill=7) == [0, 7, 10]
    with pytest.raises(ValueError, match="prefill"):
        steps(10, "prefill", 4, prefill=10)


def test_noise_shift_moves_boundaries_to_odd_offsets():
    # chunk/2 would keep 512- and 1,024-row forwards, which the CPU computes row for row alike
    assert noise_shift(1024) == 513
    assert steps(2048, "cache", 1024, shift=noise_shift(1024)) == [0, 511, 1535, 2048]
    assert noise_shift(2) == 2 and steps(5, "cache", 2, shift=2) == [0, 1, 3, 5]
    with pytest.raises(ValueError, match="one realization"):
        noise_shift(1)


# ------------------------------------------------------------------------------------------------ measure


def _run(model, ids, names, mode, **kw):
    buckets = kw.pop("buckets", None) or make_buckets(ids.shape[1], edges=(0, 64, 128, 256))
    return evaluate_document(
        model, ids, [parse_eval_scheme(n) for n in names], mode=mode, chunk=32, buckets=buckets, **kw
    )


def test_prefill_mode_prompt_is_fp_and_continuation_is_quantized(tiny_model, ids):
    """Predictions inside the prompt see FP attention (equal to the reference's, KL 0); the continuation
    reads the prompt's K/V as stored (quantized): its error is nonzero, and differs from decode-exact cache
    mode, whose prompt positions saw their own past quantized."""
    out = _run(tiny_model, ids, ["int2-g32", "fp16"], "prefill", prefill=64)
    b0, b1, b2 = make_buckets(LENGTH, edges=(0, 64, 128, 256))
    q, fp = out["int2-g32"], out["kvquant:fp16"]
    assert q[b0].kl == 0 and q[b0].nll == out[REFERENCE][b0].nll and q[b0].top1 == q[b0].tokens
    assert q[b1].kl > 0 and q[b2].kl > 0
    assert fp[b1].nll == pytest.approx(out[REFERENCE][b1].nll, rel=1e-5)  # nothing quantized: no change
    cache = _run(tiny_model, ids, ["int2-g32"], "cache")["int2-g32"]
    assert cache[b0].kl > 0 and cache[b1].kl != pytest.approx(q[b1].kl, rel=1e-3)


@pytest.mark.parametrize("mode", ["cache", "prefill"])
def test_reference_reused_gives_the_same_numbers(tiny_model, ids, mode, monkeypatch):
    kept = []
    kw = dict(prefill=64) if mode == "prefill" else {}
    live = _run(tiny_model, ids, ["int4-g32"], mode, on_reference=kept.append, **kw)
    assert len(kept) == 1 and kept[0]["hidden"].shape[:2] == (1, LENGTH)
    assert all(len(kept[0][f]) == LENGTH - 1 for f in scoring.STAT_FIELDS)
    from kvquant.eval import measure

    calls, heads = [], []
    real, real_logits = measure._hidden, scoring.logits
    monkeypatch.setattr(
        measure, "_hidden", lambda m, x, c: (calls.append(type(c).__name__), real(m, x, c))[1]
    )
    monkeypatch.setattr(scoring, "logits", lambda m, h: (heads.append(len(h)), real_logits(m, h))[1])
    resaved = []
    reused = _run(tiny_model, ids, ["int4-g32"], mode, reference=kept[0], on_reference=resaved.append, **kw)
    assert "DynamicCache" not in calls or mode == "prefill"  # the reference forward is skipped
    # one forward per step for the scheme (in prefill mode the first through its own FP DynamicCache)
    assert len(calls) == len(steps(LENGTH, mode, 32, kw.get("prefill"))) - 1
    assert sum(heads) == LENGTH - 1  # the LM head runs for the scheme's predictions only
    assert not resaved  # nothing new to store
    # a file from before the statistics (hidden states only): they are computed once and handed back
    heads.clear()
    upgraded = _run(tiny_model, ids, ["int4-g32"], mode, reference={"hidden": kept[0]["hidden"]},
                    on_reference=resaved.append, **kw)
    assert sum(heads) == 2 * (LENGTH - 1) and len(resaved) == 1
    for f in scoring.STAT_FIELDS:
        assert torch.equal(resaved[0][f], kept[0][f])
    for out in (reused, upgraded):
        for label in (REFERENCE, "int4-g32"):
            for b, st in live[label].items():
                assert out[label][b].nll == pytest.approx(st.nll, rel=1e-9)
                assert out[label][b].kl == pytest.approx(st.kl, rel=1e-6, abs=1e-12)
                assert out[label][b].top1 == st.top1
    with pytest.raises(ValueError, match="do not match"):
        _run(tiny_model, ids, ["int8"], "cache", reference={"hidden": kept[0]["hidden"][:, :10]})


def test_prefill_schemes_share_one_fp_prompt_forward_and_equal_each_alone(tiny_model, ids, monkeypatch):
    """With the reference read from its cache, prefill mode runs the FP prompt forward once for every
    scheme (not once per scheme) and scores the prompt's predictions once; each scheme's numbers equal
    its own run alone, bit for bit."""
    from kvquant.eval import measure

    kept = []
    _run(tiny_model, ids, ["int8"], "prefill", prefill=64, on_reference=kept.append)
    names = ["int2-g32", "int4-g32", "k=int8,v=int4-g32"]
    alone = {n: _run(tiny_model, ids, [n], "prefill", prefill=64, reference=kept[0])[n] for n in names}
    forwards, heads = [], []
    real, real_logits = measure._hidden, scoring.logits
    monkeypatch.setattr(measure, "_hidden", lambda m, x, c: (forwards.append(x.shape[1]), real(m, x, c))[1])
    monkeypatch.setattr(scoring, "logits", lambda m, h: (heads.append(len(h)), real_logits(m, h))[1])
    together = _run(tiny_model, ids, names, "prefill", prefill=64, reference=kept[0])
    assert forwards.count(64) == 1  # the 64-token prompt: one FP forward for the three schemes
    assert forwards.count(32) == 3 * (LENGTH - 64) // 32  # each scheme decodes the rest in its own cache
    assert sum(heads) == 64 + 3 * (LENGTH - 1 - 64)  # the prompt chunk's 64 predictions scored once
    for n in names:
        for b, st in alone[n].items():
            got = together[n][b]
            assert (got.nll, got.kl, got.top1, got.dp_sq) == (st.nll, st.kl, st.top1, st.dp_sq)


def test_token_values_match_the_sums(tiny_model, ids):
    out = _run(tiny_model, ids, ["int2-g32"], "cache")
    for st in out["int2-g32"].values():
        t = st.token_values()
        assert len(t["kl"]) == st.tokens
        assert float(t["kl"].double().sum()) == pytest.approx(st.kl, rel=1e-5)
        assert float(t["nll_diff"].sum()) == pytest.approx(st.nll - st.ref_nll, rel=1e-9, abs=1e-9)
        assert st.dp_sq >= st.dp**2 / st.tokens  # RMS >= |mean|


# ------------------------------------------------------------------------------------------------ peers


def test_one_protocol_for_kvquant_and_peer_schemes():
    k, p = parse_eval_scheme("kivi-2"), parse_eval_scheme("hf-hqq-int8")
    assert isinstance(k, EvalScheme) and isinstance(p, EvalScheme)
    assert isinstance(k, KVQuantScheme) and k.name == "kivi-2" and k.modes == ("cache", "fake", "prefill")
    assert isinstance(p, PeerScheme) and p.modes == ("cache",) and p.package == "hqq"
    shape = kvquant.memory.KNOWN_SHAPES["llama-3-8b"]
    # hqq int8 at FP16 scales: 8 bits + 2 x 16 bits / 64 per value
    assert p.bytes_per_token(shape, 2) == pytest.approx(2 * 32 * 8 * 128 * (1 + 4 / 64))
    with pytest.raises(SchemeError, match="hqq: 1-4, 8 bits"):
        parse_eval_scheme("hf-hqq-int5")


@pytest.mark.parametrize("peer", ["hf-hqq-int4", "hf-quanto-int2"])
def test_peer_runs_through_the_protocol(tiny_model, ids, peer):
    s = parse_eval_scheme(peer)
    try:
        s.check_available()
    except SchemeError:
        pytest.skip(f"{s.package} not installed")
    out = _run(tiny_model, ids, [peer], "cache")
    assert all(math.isfinite(st.nll) and st.kl > 0 for st in out[peer].values())


# ------------------------------------------------------------------------------------------------ runs


def _cfg(out, corpus, **kw) -> RunConfig:
    base = dict(
        schemes=("int8", "int4-g32"), corpus=str(corpus), max_length=300, chunk=100, docs=2, out=str(out)
    )
    base.update(kw)
    return RunConfig(**base)


def _summary(run_dir) -> list[dict]:
    with (run_dir / "summary.csv").open() as f:
        return list(csv.DictReader(f))


def test_run_reports_distributions_intervals_and_storage_bytes(tmp_path, tiny_model, tokenizer, tiny_corpus):
    run_dir, summary = run(
        _cfg(tmp_path / "a", tiny_corpus, mode="all", prefill=128, noise_floor=True),
        model=tiny_model,
        tokenizer=tokenizer,
    )
    rows = _summary(run_dir)
    assert {r["mode"] for r in rows} == {"cache", "fake", "prefill", "cache-shift"}
    q = [r for r in rows if r["scheme"] == "int4-g32" and r["mode"] == "cache"]
    for r in q:
        lo, d, hi = float(r["drift_lo"]), float(r["drift"]), float(r["drift_hi"])
        assert lo <= d <= hi and lo < hi
        assert float(r["kl_lo"]) <= float(r["kl"]) <= float(r["kl_hi"])
        assert 0 <= float(r["kl_median"]) <= float(r["kl_p90"]) <= float(r["kl_p99"]) <= float(r["kl_p999"])
        assert float(r["kl_p999"]) <= float(r["kl_max"])
        assert float(r["dp_rms"]) >= abs(float(r["dp_mean"]))
        assert math.isfinite(float(r["drift_noise"]))  # the shifted realization was measured
    pre = {r["bucket"]: r for r in rows if r["scheme"] == "int4-g32" and r["mode"] == "prefill"}
    assert float(pre["0-256"]["kl"]) < float(pre["256-300"]["kl"])  # 0-127 of the first bucket see FP only
    # bytes at FP16 storage (the default --kv-dtype): reference and int8 (1 B + an FP16 scale per token)
    a8 = next(r for r in rows if r["scheme"] == "int8" and r["mode"] == "cache" and r["bucket"] == "all")
    ref = next(r for r in rows if r["scheme"] == REFERENCE and r["mode"] == "cache" and r["bucket"] == "all")
    assert float(ref["bytes_per_token"]) == 2 * 2 * 2 * 64 * 2 and float(ref["effective_bits"]) == 16
    held = kvquant.memory.cache_bytes(tiny_model.config, "int8", 300, dtype=torch.float16)
    assert float(a8["bytes_per_token"]) == pytest.approx(held / 300)
    assert float(a8["saving"]) == pytest.approx(2 * 2 * 2 * 64 * 2 * 300 / held)
    # measured at the run dtype (float32) from the cache: the formula's check
    held32 = kvquant.memory.cache_bytes(tiny_model.config, "int8", 300, dtype=torch.float32)
    assert float(a8["bytes_per_token_measured"]) == pytest.approx(held32 / 300)
    report = (run_dir / "report.md").read_text()
    assert "`fp32 (reference)`" in report and "KLD p99.9" in report and " [" in report
    assert "bytes at float16 K/V storage" in report
    assert json.loads((run_dir / "config.json").read_text())["scheme_names"][REFERENCE] == "fp32 (reference)"
    assert list(wandb_logger.read_summary(run_dir / "summary.csv")[0]) == metrics.SUMMARY_COLUMNS


def test_kv_dtype_changes_only_the_reported_bytes(tiny_model):
    m16 = memory_of([parse_eval_scheme("int4-g64")], tiny_model.config, "float16")
    m32 = memory_of([parse_eval_scheme("int4-g64")], tiny_model.config, "float32")
    # int4-g64 at FP16: 4 bits + 2 x 16-bit per 64 values = 4.5 bits: 16 / 4.5 = 3.56x
    assert m16[REFERENCE].formula / m16["int4-g64"].formula == pytest.approx(16 / 4.5)
    assert m32[REFERENCE].formula / m32["int4-g64"].formula == pytest.approx(32 / 5)
    with pytest.raises(RunError, match="kv-dtype"):
        RunConfig(schemes=("int8",), kv_dtype="fp8")
    with pytest.raises(RunError, match="--prefill 300 must be below --max-length 300"):
        RunConfig(schemes=("int8",), max_length=300, prefill=300)


def test_second_run_reads_the_reference_cache(tmp_path, tiny_model, tokenizer, tiny_corpus, monkeypatch):
    from kvquant.eval import measure

    first_dir, first = run(
        _cfg(tmp_path / "1", tiny_corpus, schemes=("int8",)), model=tiny_model, tokenizer=tokenizer
    )
    caches = []
    real = measure._hidden
    monkeypatch.setattr(
        measure, "_hidden", lambda m, x, c: (caches.append(type(c).__name__), real(m, x, c))[1]
    )
    _, second = run(
        _cfg(tmp_path / "2", tiny_corpus, schemes=("int8", "int2-g32")), model=tiny_model, tokenizer=tokenizer
    )
    assert caches and "DynamicCache" not in caches  # one forward per chunk and scheme, none for the reference
    by = {(r["scheme"], r["bucket"]): r for r in second}
    for r in first:
        assert by[(r["scheme"], r["bucket"])]["ppl"] == pytest.approx(r["ppl"], rel=1e-9)
    caches.clear()
    run(
        _cfg(tmp_path / "3", tiny_corpus, schemes=("int8",), reference_cache=False),
        model=tiny_model,
        tokenizer=tokenizer,
    )
    assert "DynamicCache" in caches
