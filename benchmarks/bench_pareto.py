"""Bits per value vs quality (issue 24): uniform recipes, TurboQuant, the calibrated rotation (-crot) and the
per-layer allocation (budget=B) at 2.0 / 2.3 / 2.5 / 3.0 / 3.5 / 4.5 effective bits, on one table and one
two-panel plot (KL and the longest bucket's drift against bits) with 95% intervals.

Measure with the run harness (cache mode: decode-exact), then tabulate the run directories:

    python experiments/run.py --max-length 1024 --docs 4 --mode cache --out runs/pareto_base_1k \\
        --scheme int2-g64-rot --scheme turbo2 --scheme turbo2.25 --scheme k=int2-channel-g32,v=int2-g32 \\
        --scheme turbo2.5 \\
        --scheme 'k=nuq3-channel-g64-prerope,v=int2-g64-rot,calib=calib/smollm2-nuq.safetensors' \\
        --scheme k=int4-channel-g64-rot,v=int2-g64-rot --scheme turbo3 \\
        --scheme 'k=nuq3-channel-g64-prerope,v=nuq3-g64,calib=calib/smollm2-nuq.safetensors'
    python experiments/run.py --max-length 1024 --docs 4 --mode cache --out runs/pareto_crot_1k \\
        --scheme int2-g64-crot,calib=calib/smollm2-crot.safetensors \\
        --scheme budget=3.0,calib=calib/smollm2-crot.safetensors \\
        --scheme budget=3.5,calib=calib/smollm2-crot.safetensors
    python benchmarks/bench_pareto.py runs/pareto_base_1k runs/pareto_crot_1k

and at the issue's scale (4 articles x 8,192 tokens, with sink=4,window=128; two shards, then --merge; the
3.0-bit rows are runs/alloc30_8k's, docs/research.md section 4; the 9 schemes are section 5's):

    python experiments/run.py --mode cache --max-length 8192 --docs 4 --out runs/pareto_8k --shard I/2 \\
        --scheme 'k=nuq2-channel-g128-prerope,v=int2-g64-sym-crot,sink=4,window=128,calib=calib/LOW' ...
    python benchmarks/bench_pareto.py runs/pareto_8k runs/alloc30_8k --name pareto_8k

(calib/LOW: calib/smollm2-low.safetensors.) Writes benchmarks/results/NAME.{md,csv} (and NAME.png when
matplotlib is there): per scheme its family, effective bits (FP16 scales, steady state: sink and window
tokens, kept FP, are not counted; without them the bits are the codec's own), perplexity drift per position
bucket with its 95% interval (bootstrap over documents, then tokens: the harness's), KL with its interval,
same-top-1, and whether it is on the Pareto front (no other row has fewer or equal bits and a KL interval
entirely below its own). Only documents every run shares are compared (the harness picks documents in a
seeded order, so equal --docs and --max-length share them).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from issue10_targets import Row, load, pct  # noqa: E402  (one reader of run directories)

OUT = Path(__file__).resolve().parent / "results"
LEVELS = (2.0, 2.3, 2.5, 3.0, 3.5, 4.5)  # issue 24's budgets (2.3: where OSCAR-style INT2 stands)


MARKERS = {  # every family() value, in the plot's legend order: a family without a marker fails loudly
    "uniform": "o", "TurboQuant": "s", "calibrated rotation": "^", "allocation (budget=B)": "D",
    "saliency (salient=N/G)": "v", "RoPE blocks (rbq)": "P", "codebook K + TurboQuant V": "X",
    "KIVI preset": "<", "vLLM preset": "h", "transformers peer": "*",
}


def family(scheme: str) -> str:
    if scheme.startswith("hf-"):  # transformers' QuantizedCache (quanto, HQQ): the peer a user would pick
        return "transformers peer"
    if scheme.startswith("vllm:") or ":vllm:" in scheme:  # vLLM's --kv-cache-dtype values, bit for bit (as
        return "vLLM preset"  # deployed: `vllm_cache_scheme`'s layers= form, its boundary layers unquantized)
    if scheme.startswith("kivi-") or re.fullmatch(r"k=int(\d)-channel-g32,v=int\1-g32,window=128", scheme):
        return "KIVI preset"  # by name, or as a run records it (kvquant.scheme's kivi-2 / kivi-4)
    if "salient=" in scheme:
        return "saliency (salient=N/G)"
    if scheme.startswith("layers="):
        return "allocation (budget=B)"
    if "rbq" in scheme:
        return "RoPE blocks (rbq)"
    if scheme.startswith("k=nuq") and ",v=turbo" in scheme:
        return "codebook K + TurboQuant V"
    if scheme.startswith("turbo") or ",v=turbo" in scheme or scheme.startswith("k=turbo"):
        return "TurboQuant"
    if "-crot" in scheme:
        return "calibrated rotation"
    return "uniform"


def level(bits: float) -> float | None:
    """The budget a row competes at: the smallest of LEVELS it fits under, with 0.07 bit of slack (turbo2.5 is
    3.06 bits at D = 64: its two fp16 norms; turbo3.5 is 4.06, at 4.5; a 2.375-bit row is not at 2.3); the
    table shows the exact bits, and the targets (issue10_targets.py) take none."""
    for b in LEVELS:
        if bits <= b + 0.07 + 1e-9:
            return b
    return None


def short(scheme: str) -> str:
    if scheme.startswith("layers=") and ":vllm:" not in scheme:
        return f"per-layer ({scheme.split(',')[0].count('+') + 1} ranges; in the CSV)"
    return re.sub(r",calib=[^,]+", ",calib=…", scheme)


def front(rows: list[Row]) -> set[str]:
    """Rows no other row beats: fewer-or-equal bits and a KL upper bound below this row's lower bound."""
    out = set()
    for r in rows:
        if not any(o is not r and o.bits <= r.bits + 1e-9 and o.kl[2] < r.kl[1] for o in rows):
            out.add(r.scheme)
    return out


def plot(rows: list[Row], last: str, path: Path) -> bool:
    """Two panels over effective bits, each point with its 95% interval: KL per token (log) and the drift of
    the longest bucket `last` (symlog: 0 and the collapses on one axis)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for fam in sorted({family(r.scheme) for r in rows}, key=list(MARKERS).index):  # unknown: ValueError
        mine, marker = [r for r in rows if family(r.scheme) == fam], MARKERS[fam]
        bits = [r.bits for r in mine]
        ax.errorbar(bits, [r.kl[0] for r in mine],
                    yerr=[[r.kl[0] - r.kl[1] for r in mine], [r.kl[2] - r.kl[0] for r in mine]],
                    fmt=marker, capsize=3, label=fam)
        d = [[100 * x for x in r.drift(last)] for r in mine]  # (point, lo, hi) in %
        bx.errorbar(bits, [x for x, _, _ in d], yerr=[[x - lo for x, lo, _ in d], [hi - x for x, _, hi in d]],
                    fmt=marker, capsize=3, label=fam)
    ax.set_yscale("log")
    ax.set_ylabel("KL(fp16 || scheme) per token, 95% interval")
    ax.set_title("bits vs KL (cache mode, decode-exact)")
    bx.set_yscale("symlog", linthresh=1.0)
    bx.axhline(0.0, color="grey", lw=0.8)
    bx.set_ylabel(f"perplexity drift at {last} (%), 95% interval")
    bx.set_title(f"bits vs drift of the longest bucket ({last})")
    for a in (ax, bx):
        a.set_xlabel("effective bits per K/V value (FP16 scales)")
        a.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _titles(run: Path, docs: list[int]) -> list[str]:
    """The titles of the documents `docs` (ids) as the run's config.json names them."""
    cfg = json.loads((run / "config.json").read_text())
    names = {int(d["id"]): d.get("title", str(d["id"])) for d in cfg["documents"]}
    return [names.get(i, str(i)) for i in docs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories of experiments/run.py")
    p.add_argument("--name", default="pareto", help="output file stem under benchmarks/results/")
    p.add_argument("--note", default="", help="a line on the machine and scale, written under the title")
    args = p.parse_args(argv)
    rows, buckets, docs = load(args.runs)
    rows = [r for r in rows if level(r.bits) is not None]
    if not rows:
        raise SystemExit(f"no finished cache-mode scheme at <= {LEVELS[-1] + 0.1} bits in "
                         + ", ".join(map(str, args.runs)))
    rows.sort(key=lambda r: (level(r.bits), r.kl[0]))
    on_front = front(rows)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / f"{args.name}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["level", "family", "scheme", "run", "bits", *(f"drift_{b}" for b in buckets),
                    *(f"drift_lo_{b}" for b in buckets), *(f"drift_hi_{b}" for b in buckets),
                    "kl", "kl_lo", "kl_hi", "ppl", "ppl_ref", "top1_agree", "pareto"])
        for r in rows:
            w.writerow([level(r.bits), family(r.scheme), r.scheme, r.run, r.bits,
                        *(r.drift(b)[0] for b in buckets), *(r.drift(b)[1] for b in buckets),
                        *(r.drift(b)[2] for b in buckets), *r.kl, r.whole.get("ppl"), r.whole.get("ppl_ref"),
                        r.whole.get("top1_agree"), r.scheme in on_front])
    head = ("| bits level | family | scheme | bits | " + " | ".join(f"drift {b}" for b in buckets)
            + " | KL [95%] | same top-1 | front |")
    lines = [head, "|" + "---|" * (len(buckets) + 7)]
    for r in rows:
        cells = [f"{pct(x)} [{100 * lo:+.1f}, {100 * hi:+.1f}]" for x, lo, hi in map(r.drift, buckets)]
        k = r.kl
        lines.append(
            f"| {level(r.bits)} | {family(r.scheme)} | `{short(r.scheme)}` | {r.bits:.2f} | "
            + " | ".join(cells)
            + f" | {k[0]:.3g} [{k[1]:.3g}, {k[2]:.3g}] | {float(r.whole['top1_agree']):.3f} | "
            + ("yes" if r.scheme in on_front else "") + " |"
        )
    best = []
    for lv in LEVELS:
        mine = [r for r in rows if level(r.bits) == lv]
        if mine:
            b = min(mine, key=lambda r: r.kl[0])
            rivals = [r for r in mine if r is not b]
            apart = rivals and all(b.kl[2] < r.kl[1] for r in rivals)
            best.append(f"- **{lv} bits**: lowest KL `{short(b.scheme)}` ({family(b.scheme)}, "
                        f"{b.bits:.2f} b): {b.kl[0]:.3g} [{b.kl[1]:.3g}, {b.kl[2]:.3g}]; intervals apart "
                        f"from every other row at this level: {'yes' if apart else 'no'}.")
    docs_of = {r.run: int(r.whole["docs"]) for r in rows}
    tokens = {r.run: int(float(r.whole["tokens"])) for r in rows}
    md = [
        "# Bits vs quality: uniform, TurboQuant, calibrated rotation, allocation (cache mode, decode-exact)",
        "",
        *([args.note, ""] if args.note else []),
        f"Runs: {', '.join(str(d) for d in args.runs)}; documents per run: "
        + ", ".join(f"{k} {v} ({tokens[k]:,} predicted tokens)" for k, v in docs_of.items())
        + f"; documents shared: {docs} ({', '.join(_titles(args.runs[0], docs))}). Default model "
        "(SmolLM2-135M); whether these articles are held out from a row's calibration text is the run's "
        "to say (the harness picks documents by length in a seeded order: at --max-length below 8,192 it "
        "can pick the calibration articles).",
        "Cells: perplexity drift vs FP16 with its 95% interval; KL(fp16 || scheme) per token with its 95% "
        "interval; bits: effective bits at FP16 scales in steady state (sink and window tokens, FP, not "
        "counted). `front`: no row with fewer or equal bits has a KL interval entirely below this one's.",
        "",
        *lines,
        "",
        *best,
        "",
    ]
    if plot(rows, buckets[-1], OUT / f"{args.name}.png"):
        md.append(f"Plot: benchmarks/results/{args.name}.png")
    (OUT / f"{args.name}.md").write_text("\n".join(md), encoding="utf-8")
    print("\n".join(md))
    return 0 if all(math.isfinite(r.kl[0]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
