import math

import pytest
import torch
from kvquant.eval.measure import REFERENCE, FakeQuantCache, evaluate_document, make_buckets
from kvquant.eval.schemes import PeerScheme, parse_eval_scheme, scheme_label

import kvquant
from kvquant.scheme import SchemeError

LENGTH = 160


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(0)
    return torch.randint(0, 49152, (1, LENGTH))


def test_buckets():
    labels = [b.label for b in make_buckets(8192)]
    assert labels == ["0-256", "256-512", "512-1k", "1k-2k", "2k-4k", "4k-8k"]
    short = make_buckets(300)
    assert [(b.start, b.end) for b in short] == [(0, 256), (256, 300)]
    assert [b.label for b in make_buckets(20_000)][-1] == "16k-20000"
    with pytest.raises(ValueError):
        make_buckets(1)


def _run(model, ids, names, mode, chunk=64, buckets=None):
    buckets = buckets or make_buckets(ids.shape[1], edges=(0, 64, 128, 256))
    return evaluate_document(
        model, ids, [parse_eval_scheme(n) for n in names], mode=mode, chunk=chunk, buckets=buckets
    )


@pytest.mark.parametrize("mode", ["cache", "fake"])
def test_fp16_zero_drift_and_2bit_drift(tiny_model, ids, mode):
    out = _run(tiny_model, ids, ["fp16", "int2-g32"], mode)
    ref, fp, q = out[REFERENCE], out["kvquant:fp16"], out["int2-g32"]
    for b in ref:
        assert ref[b].tokens == fp[b].tokens == q[b].tokens > 0
        assert ref[b].kl == 0 and ref[b].top1 == ref[b].tokens
        # unquantized scheme through the kvquant path: equal up to fp32 rounding (the reference path folds
        # blocks of keys by their log-sum-exp instead of one SDPA call; measured 4e-9 relative, KL 1e-7/token)
        assert fp[b].nll == pytest.approx(ref[b].nll, rel=1e-7)
        assert 0 <= fp[b].kl <= 1e-6 * fp[b].tokens and fp[b].top1 == fp[b].tokens
        assert q[b].nll != ref[b].nll and q[b].kl > 0
    assert sum(s.tokens for s in ref.values()) == LENGTH - 1


def test_cache_mode_is_chunk_independent_and_fake_mode_is_not_decoding(tiny_model, ids):
    """cache mode gives what token-by-token decoding sees whatever the chunk (each query sees the window
    of its own position in FP); fake mode quantizes everything outside the window of the whole text, so
    its early queries see more quantized keys and its numbers differ."""
    scheme = "k=int4-channel-g32,v=int4-g32,sink=4,window=16"
    whole = _run(tiny_model, ids, [scheme], "cache", chunk=LENGTH)[scheme]
    chunked = _run(tiny_model, ids, [scheme], "cache", chunk=48)[scheme]
    for b in whole:
        # fp32 noise can flip a code at a rounding boundary; a real semantic difference is 1e-2 and up
        assert chunked[b].nll == pytest.approx(whole[b].nll, rel=1e-4)
    fake = _run(tiny_model, ids, [scheme], "fake")[scheme]
    noise = max(abs(chunked[b].nll - whole[b].nll) for b in whole)
    assert max(abs(fake[b].nll - whole[b].nll) for b in whole) > 20 * noise + 1e-6


def test_chunk_of_one(tiny_model, ids):
    short = ids[:, :24]
    one = _run(tiny_model, short, ["int8"], "cache", chunk=1, buckets=make_buckets(24, edges=(0, 256)))
    whole = _run(tiny_model, short, ["int8"], "cache", chunk=24, buckets=make_buckets(24, edges=(0, 256)))
    b = next(iter(one["fp16"]))
    assert one["fp16"][b].nll == pytest.approx(whole["fp16"][b].nll, rel=1e-4)
    assert one["int8"][b].tokens == 23


def test_fake_cache_returns_what_the_quantized_cache_stores(tiny_model):
    scheme = kvquant.parse_scheme("k=int2-channel-g16,v=int4-g32,sink=3,window=10")
    k, v = torch.randn(1, 2, 61, 64), torch.randn(1, 2, 61, 64)
    real = kvquant.QuantizedCache(scheme)
    view, _ = real.update(k, v, 0)
    fk, fv = FakeQuantCache(scheme).update(k, v, 0)
    assert torch.equal(view.keys(torch.float32), fk)
    assert torch.equal(view.values(torch.float32), fv)


def test_failing_scheme_is_reported_and_others_go_on(tiny_model, ids, monkeypatch):
    from kvquant.eval import measure

    real = measure.make_cache

    class Broken(kvquant.QuantizedCache):
        def update(self, *a, **k):
            raise RuntimeError("boom")

    monkeypatch.setattr(
        measure, "make_cache", lambda s, c, m: Broken(s, c) if str(s) == "int8" else real(s, c, m)
    )
    errors = []
    out = evaluate_document(
        tiny_model,
        ids,
        [parse_eval_scheme("int8"), parse_eval_scheme("int4-g64")],
        mode="cache",
        chunk=64,
        buckets=make_buckets(LENGTH),
        on_error=lambda label, e: errors.append(label),
    )
    assert errors == ["int8"] and "int8" not in out and "int4-g64" in out


def test_scheme_names():
    assert scheme_label(parse_eval_scheme("kivi-2")) == "k=int2-channel-g32,v=int2-g32,window=128"
    assert str(parse_eval_scheme("hf-quanto-int4")) == "hf-quanto-int4"
    assert isinstance(parse_eval_scheme("HF-quanto-int2"), PeerScheme)
    with pytest.raises(SchemeError, match="Known schemes"):
        parse_eval_scheme("int5-g64")
    with pytest.raises(SchemeError, match="quanto"):
        parse_eval_scheme("hf-foo-int4")


def test_peer_scheme_runs_if_installed(tiny_model, ids):
    peer = parse_eval_scheme("hf-quanto-int4")
    try:
        peer.check_available()
    except SchemeError:
        pytest.skip("optimum-quanto not installed")
    out = _run(tiny_model, ids, ["hf-quanto-int4"], "cache")
    assert all(math.isfinite(s.nll) for s in out["hf-quanto-int4"].values())
    with pytest.raises(ValueError, match="cache mode only"):
        from kvquant.eval.measure import make_cache

        make_cache(peer, tiny_model.config, "fake")


def test_fake_mode_follows_the_cache_sink_rule_on_sliding_layers():
    """One plan per layer: a sliding layer drops its sinks in the cache (its mask never lets a query see a
    key behind the window), and fake mode now measures that same cache (it used to keep them exact)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvquant.eval.fakequant import FakeQuantCache, _fake_quantize_stored
    from tiny_models import make_tiny_gemma

    model = make_tiny_gemma(sliding_window=64)
    ids = torch.randint(1, 500, (1, 48), generator=torch.Generator().manual_seed(0))
    scheme = kvquant.parse_scheme("int2-g32,sink=4")
    fake = FakeQuantCache(scheme, model.config)
    cache = kvquant.QuantizedCache(scheme, model.config, backend="torch")
    with torch.no_grad():
        model(ids, past_key_values=fake, use_cache=True)
        model(ids, past_key_values=cache, use_cache=True)
    for i, kind in enumerate(model.config.layer_types):
        lay = fake.layers[i]
        seen = _fake_quantize_stored(lay.keys, lay.plan, lay.scheme.key)
        sinks_exact = torch.equal(seen[:, :, :4], lay.keys[:, :, :4])
        assert sinks_exact == (kind == "full_attention")
        assert cache.layers[i].sink_len == (4 if kind == "full_attention" else 0)
        assert lay.plan.sink == cache.layers[i].plan.sink
