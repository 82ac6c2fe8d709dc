"""Per-layer K/V bit allocation: the MILP picks the best valid scheme under the budget, the result is an
ordinary scheme that round-trips, and the whole path (sensitivity -> choice -> cache) runs on the tiny
model."""

from __future__ import annotations

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
