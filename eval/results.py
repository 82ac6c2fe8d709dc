"""A run directory: config.json, results.jsonl (append-only, one line per measured point), summary.csv,
report.md and plots. Summaries are recomputed from results.jsonl, so a resumed run reports everything."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "SUMMARY_COLUMNS",
    "ResultsFile",
    "summarize",
    "write_summary",
    "markdown_table",
    "known_shapes_table",
    "write_plots",
]

logger = logging.getLogger(__name__)

SUMMARY_COLUMNS = (
    "scheme,mode,bucket,bucket_start,bucket_end,tokens,ppl,ppl_fp16,drift,kl,top1_agree,"
    "bytes_per_token_measured,bytes_per_token_formula,saving,effective_bits,status"
).split(",")


class ResultsFile:
    """results.jsonl: appended and flushed (fsync) line by line, so an interrupted run keeps every point."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict] = []
        if path.is_file():
            with path.open(encoding="utf-8") as f:
                for n, line in enumerate(f):
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        self.rows.append(json.loads(line))
                    except json.JSONDecodeError:  # a line cut by a kill: dropped, it will be measured again
                        logger.warning("%s:%d: unreadable line dropped", path, n + 1)
        self._done = {self.key(r) for r in self.rows if r.get("status") == "ok"}

    @staticmethod
    def key(row: dict) -> tuple:
        return row["scheme"], row["mode"], row["doc"], row["bucket"]

    def has(self, scheme: str, mode: str, doc: int, bucket: str) -> bool:
        return (scheme, mode, doc, bucket) in self._done

    def append(self, row: dict) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(row)
        if row.get("status") == "ok":
            self._done.add(self.key(row))


def _nan(x) -> float:
    return float("nan") if x is None else float(x)


def summarize(
    rows: Iterable[dict],
    formula: dict[str, float],
    fp16_formula: float,
    values_per_token: int,
    reference: str = "fp16",
) -> list[dict]:
    """summary.csv rows: per (scheme, mode, bucket), sums over documents, then one `all` row per
    (scheme, mode). Drift compares with the reference over the same documents."""
    ok = [r for r in rows if r.get("status") == "ok"]
    ref = {(r["mode"], r["doc"], r["bucket"]): r for r in ok if r["scheme"] == reference}
    groups: dict[tuple, list[dict]] = defaultdict(list)
    order: list[tuple] = []
    for r in ok:
        k = (r["scheme"], r["mode"])
        if k not in order:
            order.append(k)
        groups[k].append(r)
    failed = {(r["scheme"], r["mode"]): r for r in rows if r.get("status") in ("failed", "skipped")}
    for k in failed:
        if k not in order:
            order.append(k)
    order.sort(key=lambda k: (k[1], k[0] != reference))
    out = []
    for scheme, mode in order:
        bucket_rows: dict[tuple, list[dict]] = defaultdict(list)
        for r in groups.get((scheme, mode), []):
            if (mode, r["doc"], r["bucket"]) in ref:
                bucket_rows[(r["bucket_start"], r["bucket_end"], r["bucket"])].append(r)
        f_bytes = formula.get(scheme, float("nan"))
        eff = f_bytes * 8 / values_per_token
        status = failed[(scheme, mode)]["status"] if (scheme, mode) in failed else "ok"
        if not bucket_rows:
            out.append(
                dict(
                    scheme=scheme,
                    mode=mode,
                    bucket="all",
                    bucket_start=0,
                    bucket_end=0,
                    tokens=0,
                    ppl=math.nan,
                    ppl_fp16=math.nan,
                    drift=math.nan,
                    kl=math.nan,
                    top1_agree=math.nan,
                    bytes_per_token_measured=math.nan,
                    bytes_per_token_formula=f_bytes,
                    saving=fp16_formula / f_bytes if f_bytes else math.nan,
                    effective_bits=eff,
                    status=status,
                )
            )
            continue
        keys = sorted(bucket_rows)
        for key in [*keys, None]:
            if key is None:
                bs, be, label = keys[0][0], keys[-1][1], "all"
                rs = [r for k in keys for r in bucket_rows[k]]
            else:
                bs, be, label = key
                rs = bucket_rows[key]
            nll = sum(r["nll_sum"] for r in rs)
            tokens = sum(r["tokens"] for r in rs)
            nll_ref = sum(ref[(mode, r["doc"], r["bucket"])]["nll_sum"] for r in rs)
            kl = sum(r["kl_sum"] for r in rs)
            top1 = sum(r["top1"] for r in rs)
            ppl = math.exp(nll / tokens) if tokens else math.nan
            ppl_ref = math.exp(nll_ref / tokens) if tokens else math.nan
            # bytes held at the end of the bucket (at the end of the document for `all`)
            last = rs if label != "all" else bucket_rows[keys[-1]]
            measured = [
                r["cache_bytes"] / r["cache_tokens"]
                for r in last
                if r.get("cache_bytes") is not None and r.get("cache_tokens")
            ]
            ref_measured = [
                ref[(mode, r["doc"], r["bucket"])]["cache_bytes"]
                / ref[(mode, r["doc"], r["bucket"])]["cache_tokens"]
                for r in last
                if ref[(mode, r["doc"], r["bucket"])].get("cache_bytes")
            ]
            m = sum(measured) / len(measured) if measured and mode == "cache" else math.nan
            m_ref = sum(ref_measured) / len(ref_measured) if ref_measured and mode == "cache" else math.nan
            saving = m_ref / m if m == m and m else (fp16_formula / f_bytes if f_bytes else math.nan)
            out.append(
                dict(
                    scheme=scheme,
                    mode=mode,
                    bucket=label,
                    bucket_start=bs,
                    bucket_end=be,
                    tokens=tokens,
                    ppl=ppl,
                    ppl_fp16=ppl_ref,
                    drift=ppl / ppl_ref - 1 if ppl_ref else math.nan,
                    kl=kl / tokens if tokens else math.nan,
                    top1_agree=top1 / tokens if tokens else math.nan,
                    bytes_per_token_measured=m,
                    bytes_per_token_formula=f_bytes,
                    saving=saving,
                    effective_bits=eff,
                    status=status,
                )
            )
    return out


def write_summary(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    tmp.replace(path)


def _fmt(x: float, spec: str) -> str:
    return "–" if x is None or x != x else format(x, spec)


def markdown_table(summary: list[dict]) -> str:
    """scheme x bucket: ppl (drift %), then KL, top-1, bytes per token and saving over the whole document."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in summary):
        rows = [r for r in summary if r["mode"] == mode]
        buckets = list(dict.fromkeys(r["bucket"] for r in rows if r["bucket"] != "all"))
        head = (
            ["scheme"] + [f"ppl {b}" for b in buckets] + ["KL (nats)", "top-1", "B/token", "saving", "bits"]
        )
        out += [
            f"**mode: {mode}** — cells are perplexity (drift vs FP16)",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for scheme in dict.fromkeys(r["scheme"] for r in rows):
            by = {r["bucket"]: r for r in rows if r["scheme"] == scheme}
            cells = [f"`{scheme}`"]
            for b in buckets:
                r = by.get(b)
                cells.append(
                    "–" if r is None else f"{_fmt(r['ppl'], '.3f')} ({_fmt(100 * r['drift'], '+.2f')}%)"
                )
            a = by.get("all", {})
            if a.get("status", "ok") != "ok":
                cells += [a["status"]] + [""] * 4
            else:
                b_tok = a.get("bytes_per_token_measured")
                if b_tok is None or b_tok != b_tok:
                    b_tok = a.get("bytes_per_token_formula")
                cells += [
                    _fmt(a.get("kl"), ".5f"),
                    _fmt(a.get("top1_agree"), ".4f"),
                    _fmt(b_tok, ",.0f"),
                    _fmt(a.get("saving"), ".2f") + "x",
                    _fmt(a.get("effective_bits"), ".2f"),
                ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def known_shapes_table(schemes: list, batch: int = 100, tokens: int = 4096) -> str:
    """Bytes per token and the cache of `batch` requests of `tokens` tokens for well-known models, at FP16."""
    import kvquant
    from kvquant.scheme import Scheme

    lines = [
        f"**Well-known shapes at FP16 K/V ({batch} requests x {tokens:,} tokens)**",
        "",
        "| model | scheme | KiB/token | cache GB (GiB) | saving |",
        "|---|---|---|---|---|",
    ]
    for name, shape in kvquant.memory.KNOWN_SHAPES.items():
        fp = kvquant.memory.fp16_bytes_per_token(shape)
        rows = [("fp16", fp)]
        for s in schemes:
            if isinstance(s, Scheme) and not s.is_fp16:
                rows.append((str(s), kvquant.memory.bytes_per_token(shape, s)))
            elif hasattr(s, "bytes_per_token"):
                rows.append((str(s), s.bytes_per_token(shape, 2)))
        for label, b in rows:
            total = b * batch * tokens
            lines.append(
                f"| {name} | `{label}` | {b / 1024:,.1f} | {total / 1e9:,.1f} ({total / 2**30:,.1f}) | "
                f"{fp / b:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def write_plots(run_dir: Path, summary: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    modes = list(dict.fromkeys(r["mode"] for r in summary))
    fig, axes = plt.subplots(1, max(len(modes), 1), figsize=(6.5 * max(len(modes), 1), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=False):
        rows = [r for r in summary if r["mode"] == mode and r["bucket"] != "all" and r["scheme"] != "fp16"]
        for scheme in dict.fromkeys(r["scheme"] for r in rows):
            pts = [(r["bucket_end"], 100 * r["drift"]) for r in rows if r["scheme"] == scheme]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=scheme)
        ax.set_xscale("log", base=2)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel("position (bucket end, tokens)")
        ax.set_ylabel("perplexity drift vs FP16 (%)")
        ax.set_title(f"mode: {mode}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    p = run_dir / "drift_vs_length.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    alls = [r for r in summary if r["bucket"] == "all" and r["mode"] == modes[0]] if modes else []
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(alls) + 2), 4.5))
    xs = range(len(alls))
    meas = [r["bytes_per_token_measured"] for r in alls]
    form = [r["bytes_per_token_formula"] for r in alls]
    ax.bar([x - 0.2 for x in xs], meas, width=0.4, label="measured (cache, full document)")
    ax.bar([x + 0.2 for x in xs], form, width=0.4, label="formula (steady state)")
    ax.set_xticks(list(xs), [r["scheme"] for r in alls], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("KV-cache bytes per token (run dtype)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = run_dir / "bytes_per_token.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
