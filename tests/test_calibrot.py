"""`-crot`: the calibrated rotation (kvquant.codecs.calibrot): grammar, codec, fitting, file, cache."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

import kvquant
from kvquant.calibration import entries_for, load_calibration, save_calibration
from kvquant.codecs.base import codec_for
from kvquant.codecs.calibrot import CalibRotationCodec, hadamard_matrix
from kvquant.codecs.transforms import hadamard_signs, rotate
from kvquant.rotfit import attention_error, capture, fit_rotation, surrogate_roundtrip
from kvquant.scheme import SchemeError, parse_scheme, parse_spec


def _orthogonal(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


@pytest.fixture(scope="module")
def outlier_model():
    """The tiny model with SmolLM2-like per-channel offsets in K and V (4 channels per head at +-4, about
    2x the spread after the input norm): a random Hadamard spreads each offset over every channel and widens
    every token's range; a rotation that maps the offset onto the all-equal direction lets the asymmetric
    zero point absorb it. Structure a calibration can learn and a held-out document shares."""
    model = make_tiny_model(seed=3, attention_bias=True)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            a.q_proj.bias.zero_()
            for proj in (a.k_proj, a.v_proj):
                proj.bias.zero_()
                for h in range(2):
                    chans = h * 64 + torch.randperm(64, generator=g)[:4]
                    proj.bias[chans] = 4.0 * torch.randn(4, generator=g).sign()
    return model


@pytest.fixture(scope="module")
def docs():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 49152, (1, 256), generator=g) for _ in range(5)]  # 3 to fit, 2 held out


# ---------------------------------------------------------------------------------------------- grammar


@pytest.mark.parametrize(
    "text",
    ["int2-g64-crot", "int4-channel-g64-crot", "nuq3-channel-g64-crot-prerope", "int4-g64-center-crot-out1"],
)
def test_grammar_round_trip(text):
    spec = parse_spec(text)
    assert spec.rotate_calib and spec.rotate == 0 and str(spec) == text and parse_spec(str(spec)) == spec
    assert parse_spec(text.replace("crot", "rot")) != spec


@pytest.mark.parametrize(
    "text, why",
    [
        ("fp16-crot", "fp16 takes no -crot"),
        ("int2-g64-crot-rot", "conflicts"),
        ("int2-g64-crot", "fitted offline"),
    ],
)
def test_grammar_refusals(text, why):
    with pytest.raises(SchemeError, match=why):
        parse_scheme(text)


def test_needs_calibration_and_entries():
    s = parse_scheme("k=nuq3-channel-g64-crot-prerope,v=int2-g64-crot,calib=x.safetensors")
    assert s.needs_calibration
    names = {e.name for e in entries_for(s, 2)}
    assert names == {
        f"{kind}/{i}/{r}/{spec}"
        for i in range(2)
        for r, spec, kinds in (("k", s.key, ("rotation", "codebook")), ("v", s.value, ("rotation",)))
        for kind in kinds
    }


# ---------------------------------------------------------------------------------------------- codec


def test_hadamard_start_is_minus_rot():
    x = torch.randn(2, 3, 5, 64)
    m0 = hadamard_matrix(64)
    torch.testing.assert_close(m0 @ m0.T, torch.eye(64), atol=1e-6, rtol=0)
    torch.testing.assert_close(x @ m0, rotate(x, hadamard_signs(0, 64)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("text", ["int2-g64-crot", "int4-channel-g16-crot", "int8-head-crot"])
def test_codec_is_inner_in_rotated_frame(text):
    spec = parse_spec(text)
    codec = codec_for(spec, 3, 64, torch.float32)
    assert isinstance(codec, CalibRotationCodec) and codec.fields() == codec.inner.fields()
    x = torch.randn(1, 3, 32, 64)
    with pytest.raises(SchemeError, match="no calibrated rotation"):
        codec.encode(x)
    m = _orthogonal(64, 0)
    codec.set_matrix(m)
    inner = codec.inner
    want = inner.decode(inner.encode(x @ m), torch.float32) @ m.T
    torch.testing.assert_close(codec.decode(codec.encode(x), torch.float32), want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="orthogonal"):
        codec.set_matrix(m * 1.1)


@pytest.mark.parametrize("text", ["int2-g64", "int4-channel-g16", "int8", "int2-g32-sym"])
def test_surrogate_forward_exact_gradient_alive(text):
    codec = codec_for(parse_spec(text), 3, 64, torch.float32)
    y = torch.randn(1, 3, 16, 64, requires_grad=True)
    out = surrogate_roundtrip(codec, y)
    assert torch.equal(out.detach(), codec.decode(codec.encode(y.detach()), torch.float32))
    (out - y.detach() * 0.5).square().sum().backward()
    assert y.grad is not None and bool(torch.isfinite(y.grad).all()) and float(y.grad.abs().sum()) > 0


# ---------------------------------------------------------------------------------------------- fitting


@pytest.mark.parametrize("text, role", [("int2-g64-crot", "k"), ("int2-g64-crot", "v")])
def test_learned_rotation_beats_hadamard_on_held_out(outlier_model, docs, text, role):
    """The learned rotation lowers the attention-output error against `-rot`'s Hadamard on documents it
    never saw (both layers); it is orthogonal."""
    caps = capture(outlier_model, docs, queries=96)
    spec = parse_spec(text)
    for layer in caps:
        fit = fit_rotation(layer[:3], spec, role, steps=60)
        torch.testing.assert_close(fit.matrix @ fit.matrix.T, torch.eye(64), atol=1e-5, rtol=0)
        assert fit.loss < fit.start_loss
        held_rot = attention_error(layer[3:], spec, role, hadamard_matrix(64))
        held_crot = attention_error(layer[3:], spec, role, fit.matrix)
        assert held_crot < 0.7 * held_rot, (held_crot, held_rot)  # measured: 0.36-0.54 (K), 0.05-0.10 (V)


def test_capture_restores_attention(outlier_model, docs):
    before = outlier_model.config._attn_implementation
    caps = capture(outlier_model, docs[:1], queries=8)
    assert outlier_model.config._attn_implementation == before
    c = caps[0][0]
    assert c.query.shape == (1, 6, 8, 64) and c.key.shape == (1, 2, 256, 64) and c.positions.min() >= 64


# ---------------------------------------------------------------------------------------------- file + cache


@pytest.mark.parametrize(
    "scheme",
    [
        "int2-g64-crot,window=16",
        "k=int4-channel-g64-crot,v=int4-g64-crot",
        "k=nuq2-channel-g64-crot-prerope,v=nuq3-g64-crot,sink=4",
    ],
)
def test_file_round_trip_and_cache(outlier_model, docs, tmp_path, scheme):
    from kvquant.eval.allocation import reference_logprobs, scheme_kl

    from kvquant.calibration import metadata
    from kvquant.fitting import RotationFit, calibrate
    from kvquant.memory import KVShape

    path = str(tmp_path / "c.safetensors")
    base = parse_scheme(scheme + f",calib={path}")
    shape = KVShape.from_config(outlier_model.config)
    entries = entries_for(base, shape.num_layers)
    fit = RotationFit(docs=2, tokens=256, steps=10, queries=32)
    tables = calibrate(outlier_model, docs[:3], entries, rotation=fit)
    save_calibration(path, tables, metadata("tiny", shape, [str(base)], entries))
    calib = load_calibration(path)
    assert set(calib.tables) == set(tables)
    for e in entries:
        assert torch.equal(calib.table(e), tables[e.name].float())
        if e.kind == "rotation":
            m = calib.table(e)
            torch.testing.assert_close(m @ m.T, torch.eye(64), atol=1e-5, rtol=0)
    # the cache binds every layer's own rotation and runs decode-exact
    refs = reference_logprobs(outlier_model, docs[3:4])
    kl = scheme_kl(outlier_model, docs[3:4], refs, base, chunk=64)
    assert 0 < kl < 1.0
    cache = kvquant.QuantizedCache(base, outlier_model.config, backend="torch")
    outlier_model(input_ids=docs[4][:, :64], cache=cache)
    k0 = cache.layers[0].key_codec
    while not isinstance(k0, CalibRotationCodec):
        k0 = k0.inner
    assert torch.equal(k0.matrix, calib.rotation(0, "k", base.for_layer(0).key))
    assert not torch.equal(k0.matrix, calib.rotation(1, "k", base.for_layer(1).key))  # each layer its own


def test_run_calibration_fits_rotations_as_asked_and_records_it(outlier_model, docs, tmp_path, monkeypatch):
    """`experiments/calibrate.py --rotation-*` reach the fit (`RotationFit`) and the file's JSON says them."""
    import json

    from kvquant.eval import calibration

    from kvquant import rotfit
    from kvquant.fitting import RotationFit

    monkeypatch.setattr(calibration, "calibration_documents",
                        lambda *a, **k: calibration.CalibText(docs[:3], ["a", "b", "c"], "tiny"))
    seen = {}
    real = rotfit.fit_rotations

    def spy(model, fit_docs, entries, **kw):
        seen.update(kw, docs=len(fit_docs), tokens=fit_docs[0].shape[1], held_out=len(kw["held_out"]))
        return real(model, fit_docs, entries, **kw)

    monkeypatch.setattr(rotfit, "fit_rotations", spy)
    out = str(tmp_path / "r.safetensors")
    fit = RotationFit(docs=1, tokens=128, steps=3, queries=16)
    calibration.run_calibration([f"int2-g64-crot,calib={out}"], out, model=outlier_model, tokenizer=None,
                                rotation=fit)
    got = (seen["docs"], seen["tokens"], seen["steps"], seen["queries"], seen["held_out"])
    assert got == (1, 128, 3, 16, 1)
    meta = json.loads((tmp_path / "r.json").read_text())
    assert meta["rotation_fit"] == {"docs": 1, "tokens": 128, "steps": 3, "queries": 16}
    with pytest.raises(ValueError, match="steps = 0 must be at least 1"):
        RotationFit(steps=0)
