"""Issue 10's small-scale comparison: KL and perplexity drift per bucket of several schemes on held-out
articles, in cache mode (decode-exact), plus the SQNR of K and V per spec on the same text; appends CSV rows.

    python experiments/compare_codecs.py --length 2048 --docs 1 --scheme int4-g64 \\
        --scheme nuq4-g64,calib=... --out benchmarks/results/issue10_small.csv

Held-out articles: Wikipedia articles of at least 8,192 tokens (the calibration files use shorter ones), cut
to --length tokens. One forward per scheme and document (decode-exact, so equal to any chunking up to float
noise). On a CPU shared with other jobs, run with OMP_NUM_THREADS=1: torch's threads then stop fighting (~8x
faster).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from kvquant.scheme import SchemeError, parse_scheme

BUCKETS = (0, 256, 512, 1024, 2048, 4096, 8192)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheme", action="append", required=True)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--docs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/issue10_small.csv")
    args = p.parse_args(argv)
    try:
        schemes = [parse_scheme(s) for s in args.scheme]
    except SchemeError as e:
        print(f"compare_codecs.py: {e}", file=sys.stderr)
        return 2
    import torch
    from kvquant.eval.allocation import evaluation_documents, reference_logprobs

    import kvquant
    from kvquant.memory import effective_bits

    model, tokenizer = kvquant.load_model()
    ids, titles = evaluation_documents(tokenizer, args.docs, args.length, args.seed)
    refs = reference_logprobs(model, ids)
    edges = [b for b in BUCKETS if b < args.length] + [args.length]
    rows = []
    for s in schemes:
        t0 = time.time()
        per_bucket = {(a, b): [0.0, 0.0, 0.0, 0] for a, b in zip(edges, edges[1:], strict=False)}
        for x, ref in zip(ids, refs, strict=True):
            with torch.inference_mode():
                lp = torch.log_softmax(
                    model(input_ids=x, cache=kvquant.QuantizedCache(s, model.config)).logits[0].float(), -1
                )
            tgt = x[0, 1:]
            n_s = -lp[:-1].gather(-1, tgt[:, None])[:, 0].double()
            n_r = -ref[:-1].gather(-1, tgt[:, None])[:, 0].double()
            k = (ref.exp() * (ref - lp)).sum(-1).clamp_min(0)[:-1].double()
            pos = torch.arange(1, x.shape[1])
            for (a, b), acc in per_bucket.items():
                m = (pos >= max(a, 1)) & (pos < b)
                acc[0] += float(n_s[m].sum())
                acc[1] += float(n_r[m].sum())
                acc[2] += float(k[m].sum())
                acc[3] += int(m.sum())
        drifts = {f"{a}-{b}": (acc[0] - acc[1]) / acc[3] for (a, b), acc in per_bucket.items()}
        import math

        drift_pct = {k: 100 * (math.exp(v) - 1) for k, v in drifts.items()}
        tokens = sum(acc[3] for acc in per_bucket.values())
        row = {
            "scheme": str(s),
            "effective_bits": round(effective_bits(model.config, s), 4),
            "kl": sum(acc[2] for acc in per_bucket.values()) / tokens,
            "max_drift_pct": max(drift_pct.values()),
            **{f"drift_pct_{k}": round(v, 3) for k, v in drift_pct.items()},
            "mode": "cache",
            "docs": len(ids),
            "length": args.length,
            "titles": "|".join(titles),
            "seconds": round(time.time() - t0, 1),
        }
        rows.append(row)
        print(row, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = sorted({k for r in rows for k in r}, key=lambda k: (k != "scheme", k))
    new = not out.exists()
    with out.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        if new:
            w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
