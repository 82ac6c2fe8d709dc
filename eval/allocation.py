"""Per-layer K/V bit allocation under an average-bits budget (KVTuner-style), measured on calibration text.

1. Sensitivity, two ways. Joint (`measure_joint_sensitivity`, `--around RECIPE`): every layer quantized with
   a uniform recipe at the budget (the operating point) and one group's K or V switched to a candidate; the
   cost is the KL change, measured on several documents, so the errors of all other layers are present
   when a layer is judged. Alone (`measure_sensitivity`, the first version): for every layer l, role r
   (K or V) and candidate spec s, the mean KL(p_fp || p) per predicted token when only layer l's r is
   quantized with s (everything else FP). Both in cache mode (decode-exact, one forward per document), on
   calibration documents (never evaluation text; `kvquant.eval.calibration`).
2. Choice: minimize the predicted KL, sum over (l, r) of sensitivity[l, r, s], subject to the average
   effective bits (scales counted at FP16, steady state) over all K and V values <= the budget; exact with
   `scipy.optimize.milp` (one binary per (l, r, s), one choice per (l, r), one knapsack row).
3. The result is an ordinary scheme (`layers=0:k1/v1+1:...`), so every tool accepts it; the additive model's
   prediction (joint: KL(around) + the deltas) is reported beside the KL measured with the whole scheme.
   `--write-calib` stores it in the calibration file, and `budget=B,calib=FILE` then resolves to it
   (`kvquant.scheme._resolve_budget`, through `kvquant.calibfile.stored_allocation`).

    python experiments/allocate.py --budget-bits 3.0 --calib calib/smollm2-nuq.safetensors
    python experiments/allocate.py --budget-bits 3.0 --calib calib/smollm2-crot.safetensors \
        --around 'k=nuq3-channel-g64-crot-prerope,v=int2-g64-crot' --docs 2 --group 5 --write-calib
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import kvquant
from kvquant.memory import KVShape, spec_bytes
from kvquant.scheme import FP16, LayerSpecs, QuantSpec, Scheme, parse_spec, require_scheme

logger = logging.getLogger(__name__)

DEFAULT_KEY_CANDIDATES = (
    "int8",
    "int4-channel-g64",
    "int2-channel-g32",
    "nuq4-channel-g64-prerope",
    "nuq3-channel-g64-prerope",
    "nuq2-channel-g64-prerope",
)
DEFAULT_VALUE_CANDIDATES = ("int8", "int4-g64", "int2-g32", "nuq4-g64", "nuq3-g64", "nuq2-g64")
# candidates without codebooks, for runs without a calibration file
UNIFORM_KEY_CANDIDATES = (
    "int8",
    "int4-channel-g64",
    "int4-channel-g32",
    "int2-channel-g32",
    "int2-channel-g16",
)
UNIFORM_VALUE_CANDIDATES = ("int8", "int4-g64", "int4-g32", "int2-g32", "int2-g16")


def spec_bits(spec: QuantSpec, shape: KVShape) -> float:
    """Effective bits per value of one layer's K or V under spec (FP16 scales, steady state)."""
    n = 1024 * spec.tokens_per_group
    return (
        spec_bytes(spec, n, shape.num_kv_heads, shape.head_dim, torch.float16)
        * 8
        / (n * shape.num_kv_heads * shape.head_dim)
    )


def per_layer_scheme(specs: Sequence[tuple[QuantSpec, QuantSpec]], base: Scheme | None = None) -> Scheme:
    """A scheme from one (key, value) per layer (adjacent equal layers merged into one range); sink, window
    and calib from base. All layers equal gives the uniform scheme."""
    base = base or Scheme(FP16, FP16)
    ranges: list[LayerSpecs] = []
    for i, (k, v) in enumerate(specs):
        if ranges and (ranges[-1].key, ranges[-1].value) == (k, v):
            ranges[-1] = dataclasses.replace(ranges[-1], last=i)
        else:
            ranges.append(LayerSpecs(i, i, k, v))
    if len(ranges) == 1:
        return Scheme(ranges[0].key, ranges[0].value, base.sink, base.window, calib=base.calib)
    return Scheme(
        ranges[0].key, ranges[0].value, base.sink, base.window, layers=tuple(ranges), calib=base.calib
    )


# ------------------------------------------------------------------------------------------------ KL


@torch.inference_mode()
def reference_logprobs(model, documents: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """FP log-probabilities (T, V) of every document (a plain forward, DynamicCache)."""
    from transformers import DynamicCache

    out = []
    for ids in documents:
        logits = model(input_ids=ids, cache=DynamicCache(config=model.config)).logits[0].float()
        out.append(torch.log_softmax(logits, dim=-1))
    return out


@torch.inference_mode()
def scheme_kl(
    model,
    documents: Sequence[torch.Tensor],
    refs: Sequence[torch.Tensor],
    scheme: Scheme,
    chunk: int = 0,
) -> float:
    """Mean KL(p_fp || p_scheme) per predicted token over the documents, through a QuantizedCache in cache
    mode (decode-exact: one forward, or `chunk` tokens at a time; the result does not depend on it)."""
    require_scheme(scheme, "scheme_kl")  # parsed once, where the text came in (experiments/allocate.py)
    total, tokens = 0.0, 0
    for ids, ref in zip(documents, refs, strict=True):
        cache = kvquant.QuantizedCache(scheme, model.config, backend="torch")
        step = chunk or ids.shape[1]
        logits = torch.cat(
            [
                model(input_ids=ids[:, i : i + step], cache=cache).logits[0]
                for i in range(0, ids.shape[1], step)
            ]
        )
        lp = torch.log_softmax(logits.float(), dim=-1)
        kl = (ref.exp() * (ref - lp)).sum(-1).clamp_min(0)[:-1]  # the last position predicts nothing
        total += float(kl.double().sum())
        tokens += kl.numel()
    return total / tokens


# ------------------------------------------------------------------------------------------------ allocation


@dataclass
class Sensitivity:
    """KL per token when only (layer, role) is quantized with a spec; the bits of each spec."""

    kl: dict[tuple[int, str, str], float] = field(default_factory=dict)  # (group, "k"/"v", spec) -> KL
    bits: dict[tuple[str, str], float] = field(default_factory=dict)  # (role, spec) -> bits per value
    group: int = 1  # consecutive layers measured (and chosen) together: group g is layers g*group ..

    def to_json(self) -> dict:
        return {
            "kl": [[g, r, s, v] for (g, r, s), v in sorted(self.kl.items())],
            "bits": [[r, s, v] for (r, s), v in sorted(self.bits.items())],
            "group": self.group,
        }

    @classmethod
    def from_json(cls, d: dict) -> Sensitivity:
        return cls(
            {(g, r, s): v for g, r, s, v in d["kl"]}, {(r, s): v for r, s, v in d["bits"]}, d.get("group", 1)
        )

    def layers_of(self, g: int, num_layers: int) -> range:
        return range(g * self.group, min((g + 1) * self.group, num_layers))

    def num_groups(self, num_layers: int) -> int:
        return -(-num_layers // self.group)


def measure_sensitivity(
    model,
    documents: Sequence[torch.Tensor],
    key_candidates: Sequence[str],
    value_candidates: Sequence[str],
    base: Scheme,
    progress=None,
    group: int = 1,
) -> Sensitivity:
    """Sensitivity of every layer's (or group of `group` consecutive layers') K and V to every candidate (one
    forward per document each)."""
    shape = KVShape.from_config(model.config)
    refs = reference_logprobs(model, documents)
    sens = Sensitivity(group=group)
    cands = [("k", parse_spec(s)) for s in key_candidates] + [("v", parse_spec(s)) for s in value_candidates]
    for role, spec in cands:
        sens.bits[(role, str(spec))] = spec_bits(spec, shape)
    n, total = 0, sens.num_groups(shape.num_layers) * len(cands)
    for gi in range(sens.num_groups(shape.num_layers)):
        for role, spec in cands:
            specs = [(FP16, FP16)] * shape.num_layers
            for layer in sens.layers_of(gi, shape.num_layers):
                specs[layer] = (spec, FP16) if role == "k" else (FP16, spec)
            sens.kl[(gi, role, str(spec))] = scheme_kl(model, documents, refs, per_layer_scheme(specs, base))
            n += 1
            if progress is not None:
                progress(n, total)
    return sens


def measure_joint_sensitivity(
    model,
    documents: Sequence[torch.Tensor],
    key_candidates: Sequence[str],
    value_candidates: Sequence[str],
    around: Scheme,
    progress=None,
    group: int = 1,
    refs: Sequence[torch.Tensor] | None = None,
    known: dict[tuple[int, str, str], float] | None = None,
    base_kl: float | None = None,
) -> tuple[Sensitivity, float]:
    """Sensitivities at the operating point rather than alone: every other layer stays quantized as in
    `around` (a uniform recipe, or an allocation when re-measuring around one: `run_allocation`'s rounds)
    while one group's K (or V) switches to a candidate; the cost of (g, r, s) is KL(scheme with the switch) -
    KL(around), so what a layer costs is measured with the error of all the others already in the residual
    stream (the interactions that made alone-measured sensitivities not add). The around spec itself costs 0
    and needs no forward; `known` deltas (measured before at the same operating point and text) and
    `base_kl` (KL(around), when known) are taken as given. Returns (sensitivity of deltas, KL(around))."""
    shape = KVShape.from_config(model.config)
    refs = refs if refs is not None else reference_logprobs(model, documents)
    base = [(around.for_layer(i).key, around.for_layer(i).value) for i in range(shape.num_layers)]
    base_kl = base_kl if base_kl is not None else scheme_kl(model, documents, refs, around)
    known = known or {}
    sens = Sensitivity(group=group)
    cands = [("k", parse_spec(s)) for s in key_candidates] + [("v", parse_spec(s)) for s in value_candidates]
    for role, spec in cands:
        sens.bits[(role, str(spec))] = spec_bits(spec, shape)
    n, total = 0, sens.num_groups(shape.num_layers) * len(cands)
    for gi in range(sens.num_groups(shape.num_layers)):
        for role, spec in cands:
            layers = sens.layers_of(gi, shape.num_layers)
            at = {str(base[i][0 if role == "k" else 1]) for i in layers}
            if at == {str(spec)}:
                sens.kl[(gi, role, str(spec))] = 0.0
            elif (gi, role, str(spec)) in known:
                sens.kl[(gi, role, str(spec))] = known[(gi, role, str(spec))]
            else:
                specs = list(base)
                for layer in layers:
                    specs[layer] = (spec, base[layer][1]) if role == "k" else (base[layer][0], spec)
                kl = scheme_kl(model, documents, refs, per_layer_scheme(specs, around))
                sens.kl[(gi, role, str(spec))] = kl - base_kl
            n += 1
            if progress is not None:
                progress(n, total)
    return sens, base_kl


def allocate(
    sens: Sensitivity, num_layers: int, budget_bits: float
) -> tuple[dict[tuple[int, str], str], float]:
    """The spec per (layer, role) minimizing the summed KL with mean bits <= budget (exact MILP; layers of one
    measured group get the same spec). Returns ({(layer, role): spec}, predicted KL)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    groups = [(g, r) for g in range(sens.num_groups(num_layers)) for r in ("k", "v")]
    size = {g: len(sens.layers_of(g[0], num_layers)) for g in groups}
    var = [(g, s) for g in groups for (r, s) in sens.bits if r == g[1] and (g[0], g[1], s) in sens.kl]
    cost = np.array([sens.kl[(g[0], g[1], s)] for g, s in var])
    bits = np.array([sens.bits[(g[1], s)] * size[g] for g, s in var])  # bits summed over the group's layers
    one = np.zeros((len(groups), len(var)))
    for j, (g, _) in enumerate(var):
        one[groups.index(g), j] = 1
    n_parts = 2 * num_layers
    cheapest = sum(min(sens.bits[(g[1], s)] for gg, s in var if gg == g) * size[g] for g in groups) / n_parts
    if cheapest > budget_bits + 1e-9:
        raise ValueError(
            f"budget {budget_bits} bits is below the cheapest candidates' {cheapest:.3f} bits; "
            "add lower-bit candidates"
        )
    res = milp(
        cost,
        constraints=[
            LinearConstraint(one, 1, 1),
            LinearConstraint(bits[None, :], -np.inf, budget_bits * n_parts),
        ],
        integrality=np.ones(len(var)),
        bounds=Bounds(0, 1),
    )
    if not res.success:
        raise RuntimeError(f"the allocation MILP failed: {res.message}")
    chosen = {
        (layer, g[1]): s
        for j in np.flatnonzero(res.x > 0.5)
        for g, s in [var[j]]
        for layer in sens.layers_of(g[0], num_layers)
    }
    return chosen, float(cost[res.x > 0.5].sum())


def scheme_from_choice(chosen: dict[tuple[int, str], str], num_layers: int, base: Scheme) -> Scheme:
    specs = [(parse_spec(chosen[(i, "k")]), parse_spec(chosen[(i, "v")])) for i in range(num_layers)]
    return per_layer_scheme(specs, base)


def predicted_kl(sens: Sensitivity, scheme: Scheme, num_layers: int, joint: bool = False) -> float:
    """The additive model's KL for a scheme whose specs were all measured and are equal within each measured
    group of layers (nan otherwise). joint: the sum of the deltas (add KL(around) for the prediction)."""
    total = 0.0
    for g in range(sens.num_groups(num_layers)):
        layers = sens.layers_of(g, num_layers)
        for role in ("k", "v"):
            specs = {str(getattr(scheme.for_layer(i), "key" if role == "k" else "value")) for i in layers}
            if len(specs) != 1:
                return math.nan
            spec = specs.pop()
            if joint or parse_spec(spec).is_quantized:
                total += sens.kl.get((g, role, spec), math.nan)
    return total


# ------------------------------------------------------------------------------------------------ the command


def evaluation_documents(tokenizer, docs: int, length: int, seed: int = 0, exclude_titles=()) -> list:
    """Held-out articles: at least 8,192 tokens (the 8k evaluation's kind; never calibration text), cut to
    `length` tokens, in a seeded order."""
    from .calibration import calibration_documents

    text = calibration_documents(
        tokenizer, "wikipedia", docs, 8192, exclude_from=None, seed=seed, exclude_titles=exclude_titles
    )
    return [t[:, :length] for t in text.ids], text.titles


def run_allocation(
    budget_bits: float,
    key_candidates: Sequence[str],
    value_candidates: Sequence[str],
    base: Scheme,
    *,
    model_path: str | None = None,
    docs: int = 1,
    length: int = 1024,
    eval_docs: int = 0,
    eval_length: int = 2048,
    compare: Sequence[Scheme] = (),
    seed: int = 0,
    group: int = 1,
    out=None,
    model=None,
    tokenizer=None,
    around: Scheme | None = None,
    write_calib: bool = False,
    rounds: int = 1,
) -> dict:
    """Sensitivities (reused from out/sensitivity.json as far as its setup matches), the MILP choice, and the
    predicted vs measured KL; writes out/allocation.json. around: a uniform recipe: joint sensitivities at
    that operating point (`measure_joint_sensitivity`) instead of alone. rounds > 1 (joint only): measure
    again around each round's choice (out/sensitivity_round<r>.json) and choose again, until the choice
    repeats or the rounds are spent, so interactions are measured where the allocation moves; the result
    is the choice with the lowest measured calibration KL (the around recipe's counts: when no allocation
    beats it, the uniform recipe is the result). write_calib: store the allocation in base's calibration
    file (`budget=B,calib=FILE` then resolves to it)."""
    import json
    from pathlib import Path

    from kvquant.memory import effective_bits

    from .calibration import EXCLUDE_FROM, calibration_documents

    if write_calib and base.calib is None:  # refused before any measurement
        raise ValueError("--write-calib stores the allocation in the calibration file: give --calib FILE")
    if rounds < 1 or (rounds > 1 and around is None):
        raise ValueError(f"rounds={rounds}: at least 1, and more than 1 only with --around (joint)")
    if model is None:
        model, tokenizer = kvquant.load_model(model_path)
    shape = KVShape.from_config(model.config)
    calib_text = calibration_documents(
        tokenizer, "wikipedia", docs, length, exclude_from=EXCLUDE_FROM, seed=seed
    )
    setup = _allocation_setup(
        model_path, key_candidates, value_candidates, base, calib_text.titles, length, group, around
    )
    out = Path(out) if out is not None else None
    steps = _rounds(model, calib_text.ids, setup, out, key_candidates, value_candidates, base, around, group,
                    rounds, budget_bits, shape.num_layers)
    best = min(steps, key=lambda st: st.measured)
    scheme, sens, base_kl = best.scheme, best.sens, best.base_kl
    result = {
        "scheme": str(scheme),
        "budget_bits": budget_bits,
        "effective_bits": effective_bits(model.config, scheme),
        "predicted_kl": best.predicted,
        "measured_kl_calibration": best.measured,
        "calibration": {"documents": calib_text.titles, "tokens_each": length, "mode": "cache"},
        "rounds": [st.row(model.config) for st in steps],
    }
    if eval_docs:
        result["evaluation"] = _evaluation(
            model, tokenizer, eval_docs, eval_length, seed, calib_text.titles, [scheme, *compare], sens,
            shape.num_layers, around is not None, base_kl,
        )
    result["choice"] = {f"{i}.{r}": str(getattr(scheme.for_layer(i), "key" if r == "k" else "value"))
                        for i in range(shape.num_layers) for r in ("k", "v")}
    if around is not None:
        result["around"] = {"scheme": str(around), "measured_kl_calibration": steps[0].base_kl}
    if write_calib:
        result["written_to"] = _write_calib(base, budget_bits, scheme, result, calib_text.titles, setup)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "allocation.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


@dataclass
class _Round:
    """One round of the allocation: the operating point it was measured around (None: alone), its
    sensitivities and KL, the MILP's choice with the additive prediction, and the KL measured with it."""

    around: Scheme | None
    sens: Sensitivity
    base_kl: float
    scheme: Scheme
    predicted: float
    measured: float

    def row(self, config) -> dict:
        from kvquant.memory import effective_bits

        return {"around": None if self.around is None else str(self.around), "around_kl": self.base_kl,
                "scheme": str(self.scheme), "effective_bits": effective_bits(config, self.scheme),
                "predicted_kl": self.predicted, "measured_kl_calibration": self.measured}


def _rounds(
    model, ids, setup: dict, out, key_candidates, value_candidates, base: Scheme, around: Scheme | None,
    group: int, rounds: int, budget_bits: float, num_layers: int,
) -> list[_Round]:
    """Round 1 around `around` (or alone); each further round around the last choice. The around recipe is
    also a candidate result: its row (a choice equal to it, predicted = measured = its KL) comes first."""
    refs = reference_logprobs(model, ids)
    steps: list[_Round] = []
    point, point_kl = around, None
    for r in range(rounds):
        name = "sensitivity.json" if r == 0 else f"sensitivity_round{r + 1}.json"
        step_setup = setup if r == 0 else {**setup, "around": str(point)}
        sens, base_kl = _sensitivities(model, ids, step_setup, out, key_candidates, value_candidates, base,
                                       point, group, name=name, refs=refs, base_kl=point_kl)
        if r == 0 and around is not None:
            steps.append(_Round(around, sens, base_kl, around, base_kl, base_kl))
        chosen, predicted = allocate(sens, num_layers, budget_bits)
        scheme = scheme_from_choice(chosen, num_layers, base if point is None else point)
        seen = next((st for st in steps if str(st.scheme) == str(scheme)), None)
        measured = seen.measured if seen is not None else scheme_kl(model, ids, refs, scheme)
        steps.append(_Round(point, sens, base_kl, scheme, predicted + base_kl, measured))
        logger.info("round %d: %s predicted %.4g measured %.4g", r + 1, scheme, predicted + base_kl, measured)
        if point is None or seen is not None:
            break
        point, point_kl = scheme, measured
    return steps


def _allocation_setup(model_path: str | None, key_candidates: Sequence[str], value_candidates: Sequence[str],
                      base: Scheme, titles: list, length: int, group: int, around: Scheme | None) -> dict:
    """What the sensitivities were measured with: out/sensitivity.json is reused only when its setup is this
    one, and --write-calib stores it beside the allocation."""
    setup = {
        "model": model_path or "embedded SmolLM2-135M",
        "key_candidates": list(key_candidates),
        "value_candidates": list(value_candidates),
        "base": str(base),
        "documents": titles,
        "length": length,
        "mode": "cache",
        "group": group,
    }
    if around is not None:
        setup["around"] = str(around)
    return setup


def _evaluation(model, tokenizer, docs: int, length: int, seed: int, calib_titles, schemes: Sequence[Scheme],
                sens: Sensitivity, num_layers: int, joint: bool, base_kl: float) -> dict:
    """allocation.json's "evaluation": predicted vs measured KL of `schemes` (the allocation first) on `docs`
    held-out articles of `length` tokens, none of them a calibration article."""
    ids, titles = evaluation_documents(tokenizer, docs, length, seed, exclude_titles=calib_titles)
    return {
        "documents": titles,
        "tokens_each": length,
        "mode": "cache",
        "rows": _evaluate(model, ids, schemes, sens, num_layers, joint, base_kl),
    }


_CANDIDATE_KEYS = ("key_candidates", "value_candidates")


def _sensitivities(model, ids, setup: dict, out, key_candidates, value_candidates, base: Scheme,
                   around: Scheme | None, group: int, *, name: str = "sensitivity.json", refs=None,
                   base_kl: float | None = None) -> tuple[Sensitivity, float]:
    """(sensitivities, KL of `around`), saved to out/name. Reused from that file: all of it when its setup
    is this one; with `around` (joint), every delta it holds for a setup that differs only in the candidate
    lists (a candidate added costs its own forwards only); the rest is measured."""
    import json

    path = out / name if out is not None else None
    saved = json.loads(path.read_text()) if path is not None and path.is_file() else None
    if saved is not None and saved.get("setup") == setup:
        logger.info("reusing %s", path)
        return Sensitivity.from_json(saved), saved.get("around_kl", 0.0)
    known: dict = {}
    if saved is not None and around is not None and _same_but_candidates(saved.get("setup", {}), setup):
        known = Sensitivity.from_json(saved).kl
        base_kl = base_kl if base_kl is not None else saved.get("around_kl")
        logger.info("reusing %d deltas of %s", len(known), path)
    progress = (lambda n, total: logger.info("%s %d/%d", name, n, total))
    if around is not None:
        sens, base_kl = measure_joint_sensitivity(model, ids, key_candidates, value_candidates, around,
                                                  progress=progress, group=group, refs=refs, known=known,
                                                  base_kl=base_kl)
    else:
        sens, base_kl = measure_sensitivity(model, ids, key_candidates, value_candidates, base,
                                            progress=progress, group=group), 0.0
    if path is not None:
        out.mkdir(parents=True, exist_ok=True)
        kl = {**known, **sens.kl}  # deltas of candidates not in this run's lists stay for a later one
        saved = {"setup": setup, **Sensitivity(kl, sens.bits, sens.group).to_json(), "around_kl": base_kl}
        path.write_text(json.dumps(saved) + "\n")
    return sens, base_kl


def _same_but_candidates(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in _CANDIDATE_KEYS} == {
        k: v for k, v in b.items() if k not in _CANDIDATE_KEYS}


def _evaluate(model, ids, schemes: Sequence[Scheme], sens: Sensitivity, num_layers: int, joint: bool,
              base_kl: float) -> list[dict]:
    """Each scheme's predicted and measured KL on held-out documents `ids` (cache mode)."""
    from kvquant.memory import effective_bits

    refs = reference_logprobs(model, ids)
    rows = []
    for s in schemes:
        rows.append(
            {
                "scheme": str(s),
                "effective_bits": effective_bits(model.config, s),
                "predicted_kl": predicted_kl(sens, s, num_layers, joint=joint) + base_kl,
                "measured_kl_eval": scheme_kl(model, ids, refs, s),
            }
        )
        logger.info("%s", rows[-1])
    return rows


def _write_calib(base: Scheme, budget_bits: float, scheme: Scheme, result: dict, titles, setup: dict) -> str:
    """Store the allocation in base's calibration file (`budget=B,calib=FILE` then resolves to it)."""
    from kvquant.calibration import store_allocation

    facts = {k: result[k] for k in ("effective_bits", "predicted_kl", "measured_kl_calibration")}
    return str(store_allocation(base.calib, budget_bits, scheme, **facts, documents=titles,
                                around=setup.get("around")))
