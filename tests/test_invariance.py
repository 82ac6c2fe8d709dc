"""Invariance goldens (issue 19): the numbers the code computed before the refactor, bit for bit.

The goldens are what record.REFERENCE_COMMIT computes, per kind of machine (tests/goldens/<machine>/, or
recorded from that commit on first use on a new kind: bit-identical holds on one CPU kind only; see
tests/goldens/record.py, which also says how to re-record for an intended change). Each test recomputes
one artifact with the same function and compares: hashes of the fp32 bytes of every layer's dequantized K/V
and of every generate step's logits, and the measured columns of the quick runs' summary.csv (wall-clock
columns excluded). A mismatch names the scheme and layer and shows how far apart the float statistics are."""

from __future__ import annotations

import functools
import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

GOLDENS = Path(__file__).resolve().parent / "goldens"
_spec = importlib.util.spec_from_file_location("kvquant_goldens_record", GOLDENS / "record.py")
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)


@functools.cache
def golden(part: str):
    """This machine's golden of `part` (record.goldens_dir: bit-identical holds on one kind of CPU)."""
    return json.loads((record.goldens_dir() / f"{part}.json").read_text())


@pytest.fixture(scope="module")
def model_ids(default_model):
    model, tok = default_model
    return model, record.prompt_ids(tok)


def test_goldens_cover_the_schemes_asked_for():
    """Rotated, channel-wise, codebook, FP8, pre-RoPE and per-layer schemes, each in both goldens."""
    for part in ("kv", "logits"):
        assert sorted(golden(part)) == sorted(record.SCHEMES)
    joined = " ".join(record.SCHEMES)
    for feature in ("-rot", "-channel-", "nuq", "fp8-", "-prerope", "layers=", "kivi-", "sink="):
        assert feature in joined, feature


def test_dequantized_kv_per_layer(model_ids):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # QuantizedLayer.keys warns that it decodes a whole layer: intended
        got = record.record_kv(*model_ids)
    want = golden("kv")
    bad = []
    for scheme, layers in want.items():
        assert len(got[scheme]) == len(layers), scheme
        for i, (g, w) in enumerate(zip(got[scheme], layers, strict=True)):
            for kv in ("k", "v"):
                if g[kv] != w[kv]:
                    bad.append(f"{scheme} layer {i} {kv}: {g[f'{kv}_stats']} != {w[f'{kv}_stats']}")
    assert not bad, f"{len(bad)} dequantized K/V differ from the golden:\n" + "\n".join(bad[:20])


def test_greedy_generate_logits(model_ids):
    got = record.record_logits(*model_ids)
    want = golden("logits")
    for scheme, w in want.items():
        g = got[scheme]
        assert g["tokens"] == w["tokens"], scheme
        steps = [i for i, (a, b) in enumerate(zip(g["logits"], w["logits"], strict=True)) if a != b]
        assert not steps, (
            f"{scheme}: logits differ at steps {steps} (sums {[g['logits_sum'][i] for i in steps]} vs "
            f"{[w['logits_sum'][i] for i in steps]})"
        )


def _same_rows(part: str) -> None:
    got, want = record.compute(part), golden(part)
    assert len(got) == len(want), f"{part}: {len(got)} rows, golden {len(want)}"
    for g, w in zip(got, want, strict=True):
        diff = {k: (g.get(k), v) for k, v in w.items() if g.get(k) != v}
        assert not diff, f"{part} row {w.get('scheme')}: (now, golden) {diff}"


def test_quick_run_table():
    """`experiments/run.py --scheme int4-g64 --quick`: every summary.csv number as before."""
    _same_rows("quick")


def test_passkey_run():
    _same_rows("passkey")


def test_serve_quick_summary():
    _same_rows("serve")


def test_hashes_are_of_fp32_bytes():
    """The hash itself: equal tensors hash equal, a change of one ulp or of element order does not."""
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert record.sha(x) == record.sha(x.clone()) != record.sha(x + 1e-6)
    assert record.sha(x.t()) != record.sha(x)
