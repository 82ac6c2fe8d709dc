"""Per-layer K/V bit allocation: the MILP picks the best valid scheme under the budget, the result is an
ordinary scheme that round-trips, and the whole path (sensitivity -> choice -> cache) runs on the tiny
model."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from kvquant.eval import allocation as A
from tiny_models import make_tiny_model

import kvquant
from kvquant import memory
from kvquant.memory import KVShape
from kvquant.scheme import FP16, Scheme, parse_scheme, parse_spec

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=64)
K = ("int8", "int4-channel-g64", "int2-channel-g32")
V = ("int8", "int4-g64", "int2-g32")


def _synthetic(seed: int = 0) -> A.Sensitivity:
    g = torch.Generator().manual_seed(seed)
    sens = A.Sensitivity()
    for role, cands in (("k", K), ("v", V)):
        for s in cands:
            sens.bits[(role, s)] = A.spec_bits(parse_spec(s), SHAPE)
        for layer in range(SHAPE.num_layers):
            base = float(torch.rand((), generator=g)) * 10
            for s in cands:  # fewer bits, more KL
                sens.kl[(layer, role, s)] = (
                    base * 4.0 ** -sens.bits[(role, s)] * (1 + float(torch.rand((), generator=g)))
                )
    return sens


@pytest.mark.parametrize("budget", [3.0, 3.6, 4.5, 6.0])
def test_milp_is_the_best_choice_under_the_budget(budget):
    sens = _synthetic()
    chosen, predicted = A.allocate(sens, SHAPE.num_layers, budget)
    groups = [(i, r) for i in range(SHAPE.num_layers) for r in ("k", "v")]
    best = math.inf
    for combo in itertools.product(*[K if r == "k" else V for _, r in groups]):
        bits = sum(sens.bits[(r, s)] for (_, r), s in zip(groups, combo, strict=True)) / len(groups)
        if bits <= budget + 1e-9:
            best = min(best, sum(sens.kl[(i, r, s)] for (i, r), s in zip(groups, combo, strict=True)))
    assert predicted == pytest.approx(best, rel=1e-9)
    scheme = A.scheme_from_choice(chosen, SHAPE.num_layers, Scheme(FP16, FP16, window=16))
    assert parse_scheme(str(scheme)) == scheme
    assert memory.effective_bits(SHAPE, scheme) <= budget + 1e-9
    assert A.predicted_kl(sens, scheme, SHAPE.num_layers) == pytest.approx(predicted)


def test_budget_below_every_candidate_is_refused():
    with pytest.raises(ValueError, match="below the cheapest"):
        A.allocate(_synthetic(), SHAPE.num_layers, 2.5)


def test_per_layer_scheme_merges_equal_layers_and_uniform_collapses():
    i8, i4 = parse_spec("int8"), parse_spec("int4-g64")
    s = A.per_layer_scheme([(i8, i4), (i8, i4), (i4, i4)], Scheme(FP16, FP16, sink=4))
    assert str(s) == "layers=0-1:int8/int4-g64+2:int4-g64,sink=4"
    assert str(A.per_layer_scheme([(i4, i4)] * 3)) == "int4-g64"


def test_sensitivity_allocation_and_cache_on_the_tiny_model(tmp_path):
    """End to end with uniform candidates: every (layer, K/V, spec) measured, the choice under budget is a
    valid scheme the cache runs with, and its measured KL is of the order the additive model predicts."""
    model = make_tiny_model(seed=2)
    docs = [torch.randint(1, 5000, (1, 48), generator=torch.Generator().manual_seed(1))]
    kc, vc = ("int8", "int2-channel-g16"), ("int8", "int2-g16")
    sens = A.measure_sensitivity(model, docs, kc, vc, Scheme(FP16, FP16))
    assert len(sens.kl) == 2 * 2 * 2 and all(v >= 0 for v in sens.kl.values())
    assert all(sens.kl[(i, r, s)] > sens.kl[(i, r, "int8")] for (i, r, s) in sens.kl if s != "int8")
    shape = KVShape.from_config(model.config)
    budget = (A.spec_bits(parse_spec("int8"), shape) + A.spec_bits(parse_spec("int2-g16"), shape)) / 2
    chosen, predicted = A.allocate(sens, 2, budget)
    scheme = A.scheme_from_choice(chosen, 2, Scheme(FP16, FP16))
    assert memory.effective_bits(model.config, scheme) <= budget + 1e-9
    refs = A.reference_logprobs(model, docs)
    measured = A.scheme_kl(model, docs, refs, scheme)
    assert 0.2 * predicted < measured < 5 * predicted
    assert A.scheme_kl(model, docs, refs, scheme, chunk=7) == pytest.approx(measured, rel=1e-3, abs=1e-7)
    cache = kvquant.QuantizedCache(scheme, model.config)
    model(docs[0], cache=cache)
    assert cache.nbytes() == memory.cache_bytes(model.config, scheme, 48, dtype=torch.float32)
    assert A.Sensitivity.from_json(sens.to_json()).kl == sens.kl


def test_grouped_layers_share_a_choice_and_respect_the_budget():
    """group=2 on 3 layers: groups {0, 1} and {2}; bits are weighted by the layers each group holds."""
    sens = _synthetic()
    sens.group = 2
    sens.kl = {k: v for k, v in sens.kl.items() if k[0] < 2}  # groups 0 and 1
    chosen, predicted = A.allocate(sens, 3, 3.6)
    assert chosen[(0, "k")] == chosen[(1, "k")] and chosen[(0, "v")] == chosen[(1, "v")]
    scheme = A.scheme_from_choice(chosen, 3, Scheme(FP16, FP16))
    assert memory.effective_bits(SHAPE, scheme) <= 3.6 + 1e-9
    assert A.predicted_kl(sens, scheme, 3) == pytest.approx(predicted)
    best = math.inf
    for combo in itertools.product(K, V, K, V):
        bits = (
            2 * sens.bits[("k", combo[0])]
            + 2 * sens.bits[("v", combo[1])]
            + sens.bits[("k", combo[2])]
            + sens.bits[("v", combo[3])]
        ) / 6
        if bits <= 3.6 + 1e-9:
            best = min(
                best,
                sens.kl[(0, "k", combo[0])]
                + sens.kl[(0, "v", combo[1])]
                + sens.kl[(1, "k", combo[2])]
                + sens.kl[(1, "v", combo[3])],
            )
    assert predicted == pytest.approx(best, rel=1e-9)


def test_joint_sensitivity_at_the_operating_point_on_the_tiny_model():
    """Joint: every layer at the around recipe, one layer switched: around's own spec costs exactly 0, more
    bits cost less KL than around (negative deltas), fewer bits more; the choice's prediction,
    KL(around) + deltas, is near its measured KL, and at the around recipe's own bits it is no worse."""
    model = make_tiny_model(seed=2)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 5000, (1, 48), generator=g) for _ in range(2)]
    around = parse_scheme("k=int4-channel-g16,v=int4-g16")
    kc, vc = ("int8", "int4-channel-g16", "int2-channel-g16"), ("int8", "int4-g16", "int2-g16")
    sens, base_kl = A.measure_joint_sensitivity(model, docs, kc, vc, around)
    refs = A.reference_logprobs(model, docs)
    assert base_kl == pytest.approx(A.scheme_kl(model, docs, refs, around))
    for layer in range(2):
        assert sens.kl[(layer, "k", "int4-channel-g16")] == 0 and sens.kl[(layer, "v", "int4-g16")] == 0
        assert sens.kl[(layer, "v", "int8")] < 0 < sens.kl[(layer, "v", "int2-g16")]
    bits = memory.effective_bits(model.config, around)
    chosen, delta = A.allocate(sens, 2, bits)
    assert delta <= 1e-12  # around itself is feasible at its own bits, with delta 0
    scheme = A.scheme_from_choice(chosen, 2, around)
    assert memory.effective_bits(model.config, scheme) <= bits + 1e-9
    measured = A.scheme_kl(model, docs, refs, scheme)
    assert A.predicted_kl(sens, scheme, 2, joint=True) == pytest.approx(delta, abs=1e-12)
    assert abs(measured - (base_kl + delta)) < 0.5 * base_kl


def test_budget_item_resolves_through_the_calibration_file(tmp_path):
    """budget=B,calib=FILE parses to the allocation stored for B (with calib=FILE), round-trips as that
    scheme; a missing budget, a sink that differs from the allocation's and budget= beside specs are refused,
    naming the fix."""
    from kvquant.calibration import CalibrationError, metadata, save_calibration, store_allocation
    from kvquant.scheme import SchemeError

    path = str(tmp_path / "c.safetensors")
    levels = {"codebook/0/k/nuq2-g32": torch.linspace(-1, 1, 4)}
    st, js = save_calibration(path, levels, metadata("tiny", SHAPE, [], []))
    assert st.stat().st_mode & 0o777 == js.stat().st_mode & 0o777  # the tables as readable as the JSON
    alloc = parse_scheme("layers=0:int8/int2-g32+1-2:int4-channel-g64/int4-g64,sink=4,window=16")
    store_allocation(path, 4.0, alloc, predicted_kl=1e-3)
    store_allocation(path, 3.0, parse_scheme("int2-g32"))
    s = parse_scheme(f"budget=4,calib={path}")
    assert s == dataclasses.replace(alloc, calib=path) and parse_scheme(str(s)) == s
    assert parse_scheme(f"budget=3.0,sink=0,calib={path}").key == parse_spec("int2-g32")
    with pytest.raises(CalibrationError, match="holds no allocation for budget=2.5.*budget=3, budget=4"):
        parse_scheme(f"budget=2.5,calib={path}")
    with pytest.raises(CalibrationError, match="allocated with sink=4, not sink=0"):
        parse_scheme(f"budget=4.0,sink=0,calib={path}")
    with pytest.raises(SchemeError, match="add calib=FILE"):
        parse_scheme("budget=3.0")
    with pytest.raises(SchemeError, match="give no spec"):
        parse_scheme(f"int4-g64,budget=3.0,calib={path}")
    with pytest.raises(SchemeError, match="average bits"):
        parse_scheme(f"budget=x,calib={path}")
    crot = parse_scheme(f"layers=0:int4-g64/int2-g64-crot+1-2:int2-g64-crot,calib={path}")
    rot = torch.eye(64)
    save_calibration(path, {f"rotation/{i}/{r}/int2-g64-crot": rot.clone() for i in range(3) for r in "kv"},
                     metadata("tiny", SHAPE, [], []))  # a -crot allocation: its tables are in the file
    store_allocation(path, 2.5, crot)
    assert parse_scheme(f"budget=2.5,calib={path}") == crot
    with pytest.raises(CalibrationError, match="lacks 6 tables.*codebook/0/k/nuq3-g32"):
        store_allocation(path, 2.0, parse_scheme(f"nuq3-g32,calib={path}"))


def test_rounds_measure_again_around_each_choice_and_keep_the_best_measured(tmp_path, monkeypatch):
    """Round 2 is measured around round 1's choice (its own file, that operating point in its setup) and its
    KL(around) is round 1's measured KL, not measured again; rounds stop when a choice repeats; the result
    rows carry the around recipe first; a rerun with one candidate more measures that candidate's forwards
    only."""
    import json

    model = make_tiny_model(seed=2)
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(1, 5000, (1, 48), generator=g) for _ in range(2)]
    around = parse_scheme("k=int2-channel-g16,v=int2-g16")
    kc, vc = ["int8", "int4-channel-g16", "int2-channel-g16"], ["int4-g16", "int2-g16"]
    setup = {"around": str(around), "key_candidates": kc, "value_candidates": vc, "documents": ["x"]}
    calls = []
    real = A.scheme_kl
    monkeypatch.setattr(A, "scheme_kl", lambda *a, **k: calls.append(str(a[3])) or real(*a, **k))
    bits = memory.effective_bits(model.config, around) + 2  # room to upgrade: round 1 moves
    steps = A._rounds(model, ids, setup, tmp_path, kc, vc, Scheme(FP16, FP16), around, 1, 3, bits, 2)
    assert str(steps[0].scheme) == str(around) and steps[0].measured == steps[0].base_kl
    assert steps[1].around == around and str(steps[1].scheme) != str(around)
    assert len(steps) == 3 and steps[2].around == steps[1].scheme and steps[2].base_kl == steps[1].measured
    assert str(steps[2].scheme) == str(steps[1].scheme)  # measured around it, the choice stays: converged
    assert calls.count(str(steps[1].scheme)) == 1
    saved = json.loads((tmp_path / "sensitivity_round2.json").read_text())
    assert saved["setup"]["around"] == str(steps[1].scheme)
    for st in steps[1:]:
        assert st.predicted == pytest.approx(st.base_kl + A.predicted_kl(st.sens, st.scheme, 2, joint=True))
        assert memory.effective_bits(model.config, st.scheme) <= bits + 1e-9
    calls.clear()
    more = [*vc, "int8"]
    A._rounds(model, ids, {**setup, "value_candidates": more}, tmp_path, kc, more, Scheme(FP16, FP16), around,
              1, 1, bits, 2)
    switched = [c for c in calls if c != str(around)]
    assert len(switched) <= 3 and all("int8" in c for c in switched[:2]), calls  # 2 groups + the choice
