"""benchmarks/bench_pareto.py and benchmarks/issue10_targets.py on two small run directories written as
experiments/run.py writes them (config.json, summary.csv): levels, the Pareto front, the plot, and the
issue-24 verdicts judged on intervals (a point inside a target whose interval is not is "point only")."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up; bench_pareto imports issue10_targets by name
    spec.loader.exec_module(mod)
    return mod


targets = _module("issue10_targets")
pareto = _module("bench_pareto")

BUCKETS = ("0-256", "256-512", "4k-8k")
FIELDS = (
    "scheme",
    "mode",
    "bucket",
    "docs",
    "tokens",
    "ppl",
    "ppl_ref",
    "drift",
    "drift_lo",
    "drift_hi",
    "kl",
    "kl_lo",
    "kl_hi",
    "kl_p99",
    "top1_agree",
    "effective_bits",
    "status",
)


def _run(
    path: Path, docs: list[int], schemes: dict[str, tuple[float, list[tuple[float, float, float]], tuple]]
):
    """A run directory: per scheme its bits, (drift, lo, hi) per bucket and its (kl, lo, hi)."""
    path.mkdir()
    cfg = {"documents": [{"id": i, "title": f"article {i}"} for i in docs]}
    (path / "config.json").write_text(json.dumps(cfg))
    with open(path / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for scheme, (bits, drifts, kl) in {"fp16": (16.0, [(0, 0, 0)] * 3, (0, 0, 0)), **schemes}.items():
            for bucket, (d, lo, hi) in zip((*BUCKETS, "all"), [*drifts, drifts[-1]], strict=True):
                w.writerow(
                    dict(
                        scheme=scheme,
                        mode="cache",
                        bucket=bucket,
                        docs=len(docs),
                        tokens=1000,
                        ppl=10,
                        ppl_ref=10,
                        drift=d,
                        drift_lo=lo,
                        drift_hi=hi,
                        kl=kl[0],
                        kl_lo=kl[1],
                        kl_hi=kl[2],
                        kl_p99=1,
                        top1_agree=0.9,
                        effective_bits=bits,
                        status="ok",
                    )
                )
        # a prefill-mode row of another scheme is not read: the tables are cache mode's
        w.writerow(
            dict(
                scheme="int8",
                mode="prefill",
                bucket="all",
                docs=1,
                tokens=1,
                ppl=1,
                ppl_ref=1,
                drift=0,
                drift_lo=0,
                drift_hi=0,
                kl=0,
                kl_lo=0,
                kl_hi=0,
                kl_p99=0,
                top1_agree=1,
                effective_bits=8,
                status="ok",
            )
        )


@pytest.fixture
def runs(tmp_path, monkeypatch):
    for mod in (targets, pareto):
        monkeypatch.setattr(mod, "OUT", tmp_path / "out")
    flat = [(0.005, 0.001, 0.009)] * 3
    a = _run(
        tmp_path / "a",
        [1, 2, 3],
        {
            "k=nuq2-channel-g128-prerope,v=int2-g64-sym-crot,calib=calib/x.safetensors": (
                2.25,
                [(0.02, 0.01, 0.03), (0.05, 0.03, 0.07), (0.07, 0.06, 0.09)],
                (0.05, 0.04, 0.06),
            ),
            "turbo2": (2.25, [(1.0, 0.8, 1.2)] * 3, (0.9, 0.8, 1.0)),
            "int2-g64-rot": (
                2.5,
                [(0.02, 0.01, 0.025), (0.025, 0.02, 0.029), (0.02, 0.015, 0.028)],
                (0.03, 0.02, 0.035),
            ),
            "turbo3.5": (
                4.06,
                [(0.002, -0.003, 0.004), (0.001, -0.002, 0.004), (0.003, -0.001, 0.006)],
                (0.02, 0.018, 0.022),
            ),
            "turbo3.5,sink=4,window=128": (4.06, flat, (0.0017, 0.0015, 0.002)),
        },
    )
    b = _run(
        tmp_path / "b",
        [2, 3, 4],
        {
            "k=int4-channel-g64-rot,v=int2-g64-crot,calib=calib/y.safetensors": (
                3.5,
                flat,
                (0.002, 0.0017, 0.0024),
            ),
            "k=int4-channel-g64-rot,v=int4-g64-rot": (
                4.5,
                [(0.001, -0.001, 0.002)] * 3,
                (0.0012, 0.001, 0.0014),
            ),
        },
    )
    return tmp_path, a, b


def test_pareto_puts_each_row_at_its_budget_and_marks_the_front(runs):
    tmp, *_ = runs
    assert pareto.main([str(tmp / "a"), str(tmp / "b"), "--name", "p"]) == 0
    rows = list(csv.DictReader(open(tmp / "out" / "p.csv")))
    level = {r["scheme"]: float(r["level"]) for r in rows}
    assert level["turbo2"] == 2.3 and level["int2-g64-rot"] == 2.5 and level["turbo3.5"] == 4.5
    assert level["k=int4-channel-g64-rot,v=int2-g64-crot,calib=calib/y.safetensors"] == 3.5
    front = {r["scheme"] for r in rows if r["pareto"] == "True"}
    # turbo2 has the nuq row's bits and a KL interval entirely above it; turbo3.5 (4.06 b) is beaten by the
    # 3.5-bit row; the sink/window turbo3.5 is not (its interval overlaps) and stays on the front
    assert "turbo2" not in front and "turbo3.5" not in front and "turbo3.5,sink=4,window=128" in front
    assert "k=nuq2-channel-g128-prerope,v=int2-g64-sym-crot,calib=calib/x.safetensors" in front
    md = (tmp / "out" / "p.md").read_text()
    assert "documents shared: [2, 3] (article 2, article 3)" in md
    assert (
        "`k=nuq2-channel-g128-prerope,v=int2-g64-sym-crot,calib=…`" in md
    )  # any calibration file, shortened
    assert (
        "- **2.3 bits**: lowest KL `k=nuq2" in md
        and "- **4.5 bits**: lowest KL `k=int4-channel-g64-rot" in md
    )
    assert (
        "drift 4k-8k"
        in md.splitlines()[next(i for i, x in enumerate(md.splitlines()) if x.startswith("| bits"))]
    )
    if (tmp / "out" / "p.png").exists():  # matplotlib is a dev dependency; the plot is named in the report
        assert "Plot: benchmarks/results/p.png" in md


def test_issue24_targets_are_judged_on_intervals(runs):
    tmp, *_ = runs
    targets.main([str(tmp / "a"), str(tmp / "b"), "--name", "t"])
    md = (tmp / "out" / "t.md").read_text()
    verdict = {
        line.split(" | ")[0].lstrip("| ").removesuffix(" (issue 24)"): line.split(" | ")[1]
        for line in md.splitlines()
        if " (issue 24) | " in line
    }
    # <= 2.3 bits: the nuq row's worst upper bound is 9% > 8%, its worst point 7%: the point only
    assert verdict["best <= 2.3-bit: <= 8.0% every bucket"] == "point only (not the interval)"
    # <= 2.5 bits: int2-g64-rot's bounds are all <= 2.9% and its last bucket is not above 1k's: met
    assert verdict["best <= 2.5-bit: <= 3.0% every bucket, not growing 1k->8k"] == "MET"
    # <= 3.0 bits: the best there is that same 2.5-bit row (worst point 2.5%): missed
    assert verdict["best <= 3.0-bit: <= 1.0% every bucket"] == "MISSED"
    assert verdict["`turbo3.5` quality-neutral: every bucket's interval contains 0"] == "MET"
    assert (
        verdict["`turbo3.5,sink=4,window=128` quality-neutral: every bucket's interval contains 0"]
        == "MISSED"
    )
    line = next(x for x in md.splitlines() if x.startswith("| `turbo3.5` quality-neutral"))
    assert "kvquant's best at <= 4.06 b: `k=int4-channel-g64-rot,v=int2-g64-crot,calib=…` (3.50 b)" in line


def test_family_and_level_of_the_hybrid_recipes():
    """Codebook keys beside TurboQuant values are their own family; 0.07 bit of slack keeps turbo's norms
    (3.06, 4.06 bits) at their level but puts a 2.375-bit row at 2.5, not 2.3."""
    hybrid = "k=nuq2-channel-g256-prerope,v=turbo2-nc,sink=4,window=128"
    assert pareto.family(hybrid) == "codebook K + TurboQuant V"
    assert pareto.family("k=turbo3-qjl,v=turbo3") == "TurboQuant"
    assert pareto.family("layers=0-29:nuq2-channel-g64-prerope/turbo2-nc") == "allocation (budget=B)"
    assert pareto.level(2.375) == 2.5 and pareto.level(2.3) == 2.3 and pareto.level(3.06) == 3.0
    assert pareto.level(4.06) == 4.5 and pareto.level(4.6) is None
    assert pareto.family("hf-quanto-int2") == "transformers peer"
    assert pareto.family("vllm:turboquant_3bit_nc") == "vLLM preset"  # not "TurboQuant": vLLM's layout
    assert pareto.family("k=int2-channel-g32,v=int2-g32,window=128") == "KIVI preset"  # kivi-2 as run
    deployed = "layers=0-1:fp16+2-27:vllm:turboquant_3bit_nc+28-29:fp16"  # vllm_cache_scheme's, 30 layers
    assert pareto.family(deployed) == "vLLM preset" and pareto.short(deployed) == deployed
    assert pareto.family("k=int2-channel-g32,v=int2-g32,sink=4,window=128") == "uniform"  # not the preset
    every = ("int4-g64", "turbo3", "int2-g64-crot", "layers=0-29:int8", "int2-g64,salient=2/64",
             "k=rbq2-lf8b4-channel-g64-prerope,v=int2-g64", hybrid, "kivi-2", "vllm:turboquant_k8v4",
             "hf-hqq-int4")
    assert {pareto.family(s) for s in every} == set(pareto.MARKERS)  # each family is drawn with its marker
