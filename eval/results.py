"""A run directory: config.json, results.jsonl (append-only, one line per measured point), summary.csv,
report.md and plots. Summaries are recomputed from results.jsonl, so a resumed run reports everything."""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import metrics

__all__ = [
    "Memory",
    "TokenStore",
    "distribution_table",
    "SUMMARY_COLUMNS",
    "ResultsFile",
    "summarize",
    "write_summary",
    "markdown_table",
    "known_shapes_table",
    "PlotInfo",
    "plot_bytes",
    "plot_drift",
    "position_label",
    "write_plots",
]

logger = logging.getLogger(__name__)

SUMMARY_COLUMNS = metrics.SUMMARY_COLUMNS  # declared once, in kvquant.eval.metrics


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


@dataclass(frozen=True)
class Memory:
    """A scheme's bytes at the storage dtype (--kv-dtype): steady state per token, and held after n tokens
    (pages counted); values_per_token = 2 L H_kv d, for effective bits."""

    formula: float
    held: Callable[[int], float]
    values_per_token: int


class TokenStore:
    """tokens/<mode>/doc<id>/<scheme digest>-<bucket>.npz: per-token values of one measured point
    (`measure.TOKEN_FIELDS`), written before its results.jsonl line, so a line never lacks its tokens."""

    def __init__(self, root: Path):
        self.root = root

    def path(self, scheme: str, mode: str, doc: int, bucket: str) -> Path:
        digest = hashlib.sha1(scheme.encode()).hexdigest()[:12]
        return self.root / mode / f"doc{doc}" / f"{digest}-{bucket}.npz"

    def write(self, scheme: str, mode: str, doc: int, bucket: str, values: Mapping) -> None:
        import numpy as np

        path = self.path(scheme, mode, doc, bucket)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, **{k: np.asarray(v) for k, v in values.items()})
        tmp.replace(path)

    def read(self, scheme: str, mode: str, doc: int, bucket: str) -> dict | None:
        import numpy as np

        path = self.path(scheme, mode, doc, bucket)
        if not path.is_file():
            return None
        with np.load(path) as z:
            return {k: z[k] for k in z.files}


def _pooled(parts: list[dict]) -> dict:
    import numpy as np

    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def summarize(
    rows: Iterable[dict],
    memory: Mapping[str, Memory],
    reference: str = "fp16",
    tokens: TokenStore | None = None,
    seed: int = 0,
    n_boot: int | None = None,
) -> list[dict]:
    """summary.csv rows: per (scheme, mode, bucket) over documents, then one `all` row per (scheme, mode).

    Every metric is computed as `kvquant.eval.metrics` declares it: sums over documents, then the metric's
    aggregate; distributions and 95% bootstrap intervals (documents, then tokens) from the per-token values in
    `tokens`, when every document's are there. Drift compares with the reference over the same tokens. A mode
    `<m>-shift` (a second realization, --noise-floor) gives mode <m>'s rows their `drift_noise`."""
    from .stats import N_BOOT, bootstrap_intervals, seed_for

    n_boot = n_boot or N_BOOT
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
        mem = memory.get(scheme)
        ref_mem = memory.get(reference)
        formula = mem.formula if mem else math.nan
        base = dict(
            scheme=scheme,
            mode=mode,
            bytes_per_token_formula=formula,
            effective_bits=formula * 8 / mem.values_per_token if mem else math.nan,
            status=failed[(scheme, mode)]["status"] if (scheme, mode) in failed else "ok",
        )
        bucket_rows: dict[tuple, list[dict]] = defaultdict(list)
        for r in groups.get((scheme, mode), []):
            if (mode, r["doc"], r["bucket"]) in ref:
                bucket_rows[(r["bucket_start"], r["bucket_end"], r["bucket"])].append(r)
        if not bucket_rows:
            empty = {c: math.nan for c in metrics.SUMMARY_COLUMNS if c not in base}
            out.append(empty | base | dict(bucket="all", bucket_start=0, bucket_end=0, docs=0, tokens=0,
                                           saving=ref_mem.formula / formula if mem and ref_mem else math.nan))
            continue
        keys = sorted(bucket_rows)
        for key in [*keys, None]:
            if key is None:
                bs, be, label = keys[0][0], keys[-1][1], "all"
                rs = [r for k in keys for r in bucket_rows[k]]
            else:
                bs, be, label = key
                rs = bucket_rows[key]
            totals = {f: sum(_nan(r.get(f)) for r in rs) for f in metrics.ROW_SUMS}
            totals["ref_nll_sum"] = sum(ref[(mode, r["doc"], r["bucket"])]["nll_sum"] for r in rs)
            per_doc = _doc_tokens(rs, scheme, mode, tokens)
            pooled = _pooled(list(per_doc.values())) if per_doc else None
            row = dict(base, bucket=label, bucket_start=bs, bucket_end=be, docs=len({r["doc"] for r in rs}))
            for m in metrics.BUCKET_METRICS:
                row[m.name] = m.value(totals, pooled)
            for m in metrics.INTERVAL_METRICS:
                row[f"{m.name}_lo"] = row[f"{m.name}_hi"] = math.nan
            if per_doc and scheme != reference:
                ci = bootstrap_intervals(
                    [d["nll_diff"] for d in per_doc.values()],
                    [d["kl"] for d in per_doc.values()],
                    n_boot=n_boot,
                    seed=seed_for(seed, scheme, mode, label),
                )
                for name, (lo, hi) in ci.items():
                    row[f"{name}_lo"], row[f"{name}_hi"] = lo, hi
            elif scheme == reference:
                for m in metrics.INTERVAL_METRICS:
                    row[f"{m.name}_lo"] = row[f"{m.name}_hi"] = row[m.name]
            # bytes held at the end of the bucket (at the end of the document for `all`)
            last = rs if label != "all" else bucket_rows[keys[-1]]
            measured = [r["cache_bytes"] / r["cache_tokens"] for r in last
                        if r.get("cache_bytes") is not None and r.get("cache_tokens")]
            row["bytes_per_token_measured"] = (
                sum(measured) / len(measured) if measured and mode != "fake" else math.nan
            )
            n = max(int(be), 1)
            row["bytes_per_token"] = mem.held(n) / n if mem else math.nan
            held_ref = ref_mem.held(n) if ref_mem else math.nan
            row["saving"] = held_ref / mem.held(n) if mem and mem.held(n) else math.nan
            row["drift_noise"] = math.nan
            out.append(row)
    _noise(out)
    return out


def _noise(out: list[dict]) -> None:
    """drift_noise of mode m's rows: |drift - drift of the same point in mode `m-shift`|."""
    shifted = {(r["scheme"], r["mode"].removesuffix("-shift"), r["bucket"]): r["drift"]
               for r in out if r["mode"].endswith("-shift")}
    for r in out:
        other = shifted.get((r["scheme"], r["mode"], r["bucket"]))
        if other is not None and not r["mode"].endswith("-shift"):
            r["drift_noise"] = abs(r["drift"] - other)


def _doc_tokens(rs: list[dict], scheme: str, mode: str, tokens: TokenStore | None) -> dict[int, dict] | None:
    """Per document, its per-token values over these rows' buckets (in position order); None if one is
    missing."""
    if tokens is None:
        return None
    parts: dict[int, list[tuple[int, dict]]] = defaultdict(list)
    for r in rs:
        t = tokens.read(scheme, mode, r["doc"], r["bucket"])
        if t is None:
            return None
        parts[r["doc"]].append((r["bucket_start"], t))
    return {doc: _pooled([t for _, t in sorted(ps, key=lambda x: x[0])]) for doc, ps in parts.items()}


def _nan(x) -> float:
    return float("nan") if x is None else float(x)


def write_summary(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()
                        if k in SUMMARY_COLUMNS})
    tmp.replace(path)


def _shown_modes(summary: list[dict]) -> list[str]:
    """Modes in tables and plots (a `-shift` realization only feeds the noise floor)."""
    return [m for m in dict.fromkeys(r["mode"] for r in summary) if not m.endswith("-shift")]


def _cell(r: dict | None, name: str) -> str:
    if r is None:
        return "–"
    m = metrics.metric(name)
    if m.interval:
        return metrics.format_interval(name, r.get(name), r.get(f"{name}_lo"), r.get(f"{name}_hi"))
    return metrics.format_value(name, r.get(name))


def markdown_table(
    summary: list[dict], names: Mapping[str, str] | None = None, kv_dtype: str = "float16"
) -> str:
    """scheme x bucket: drift with its 95% interval (and the noise floor where measured), then the whole
    document's KL with its interval, same top-1, bytes per token and saving at the storage dtype, bits.

    names: result label -> the name shown (a preset's name such as `kivi-2`; the reference's dtype)."""
    names = names or {}
    out = []
    for mode in _shown_modes(summary):
        rows = [r for r in summary if r["mode"] == mode]
        buckets = list(dict.fromkeys(r["bucket"] for r in rows if r["bucket"] != "all"))
        noisy = any(math.isfinite(float(r.get("drift_noise", math.nan))) for r in rows)
        run_cols = ["kl", "top1_agree", "bytes_per_token", "saving", "effective_bits"]
        head = (
            ["scheme"] + [f"drift {b}" for b in buckets] + [metrics.metric(c).title for c in run_cols]
        )
        noise = " ± noise floor (|drift − drift with shifted chunks|)" if noisy else ""
        out += [
            f"**mode: {mode}** — cells are perplexity drift vs the reference [95% bootstrap interval over "
            f"documents, then tokens]{noise}; KL and top-1 over the whole document; bytes at "
            f"{kv_dtype} K/V storage",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for scheme in dict.fromkeys(r["scheme"] for r in rows):
            by = {r["bucket"]: r for r in rows if r["scheme"] == scheme}
            cells = [f"`{names.get(scheme, scheme)}`"]
            for b in buckets:
                r = by.get(b)
                cell = _cell(r, "drift")
                if r is not None and math.isfinite(float(r.get("drift_noise", math.nan))):
                    cell += f" ±{100 * float(r['drift_noise']):.2f}"
                cells.append(cell)
            a = by.get("all", {})
            if a.get("status", "ok") != "ok":
                cells += [a["status"]] + [""] * (len(run_cols) - 1)
            else:
                cells += [_cell(a, c) + ("x" if c == "saving" else "") for c in run_cols]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


DISTRIBUTION_COLUMNS = ("kl", "kl_median", "kl_p90", "kl_p99", "kl_p999", "kl_max", "dp_mean", "dp_rms",
                        "top1_agree")


def distribution_table(summary: list[dict], names: Mapping[str, str] | None = None,
                       reference: str = "fp16") -> str:
    """Per mode, scheme and bucket: the error distribution (per-token KL percentiles, Δp, same top-1)."""
    names = names or {}
    out = []
    for mode in _shown_modes(summary):
        rows = [r for r in summary if r["mode"] == mode and r["scheme"] != reference and r.get("tokens")]
        if not rows:
            continue
        head = ["scheme", "bucket", *(metrics.metric(c).title for c in DISTRIBUTION_COLUMNS)]
        out += [f"**mode: {mode}** — error distribution per token (KL in nats; Δp: change of the correct "
                "token's probability)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cells = [f"`{names.get(r['scheme'], r['scheme'])}`", r["bucket"]]
            cells += [metrics.format_value(c, r.get(c)) for c in DISTRIBUTION_COLUMNS]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def known_shapes_table(schemes: list, batch: int = 100, tokens: int = 4096, kv_dtype: str = "float16") -> str:
    """Bytes per token and the cache of `batch` requests of `tokens` tokens for well-known models, at the
    storage dtype (every scheme through its protocol's bytes_per_token)."""
    import kvquant

    dbytes = {"float16": 2, "bfloat16": 2, "float32": 4}[kv_dtype]
    lines = [
        f"**Well-known shapes at {kv_dtype} K/V ({batch} requests x {tokens:,} tokens)**",
        "",
        "| model | scheme | KiB/token | cache GB (GiB) | saving |",
        "|---|---|---|---|---|",
    ]
    for name, shape in kvquant.memory.KNOWN_SHAPES.items():
        fp = kvquant.memory.fp16_bytes_per_token(shape, dbytes)
        rows = [(_DTYPE_SHORT[kv_dtype], fp)]
        for s in schemes:
            try:
                rows.append((s.name, s.bytes_per_token(shape, dbytes)))
            except kvquant.SchemeError:  # per-layer specs written for another depth: no figure to give
                rows.append((s.name, None))
        for label, b in rows:
            if b is None:
                lines.append(f"| {name} | `{label}` | — (its layers= ranges are for another depth) | — | — |")
                continue
            total = b * batch * tokens
            lines.append(
                f"| {name} | `{label}` | {b / 1024:,.1f} | {total / 1e9:,.1f} ({total / 2**30:,.1f}) | "
                f"{fp / b:.2f}x |"
            )
    return "\n".join(lines) + "\n"


_DTYPE_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass(frozen=True)
class PlotInfo:
    """What a plot says about its run, so the PNG stands alone: model, corpus, documents x length, dtype,
    the chunk of cache mode, display names of schemes (preset names), and whether the run is partial."""

    model: str
    corpus: str
    documents: int
    max_length: int
    dtype: str
    chunk: int | None = None
    names: Mapping[str, str] = field(default_factory=dict)
    partial: str | None = None  # "6 of 24 points" while the run is incomplete
    kv_dtype: str = "float16"  # the storage dtype bytes are reported at (--kv-dtype)

    def subtitle(self) -> str:
        docs = f"{self.documents} document{'s' if self.documents != 1 else ''}"
        return f"{self.model} · {self.corpus} · {docs} × {self.max_length:,} tokens · {self.dtype}"

    def name(self, label: str) -> str:
        if label in self.names:
            return self.names[label]
        return "fp16 (reference)" if label == "fp16" else label


def position_label(n: float) -> str:
    """256, 512, 1k, 2k, ... 32k (exact multiples of 1,024 in k; others as they are)."""
    n = int(n)
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return f"{n / 1024:.1f}k" if n >= 1024 else str(n)


def _title(fig, what: str, info: PlotInfo | None) -> None:
    """The figure's title: what it shows, the run it comes from, and (in red) whether the run is partial."""
    lines = [what]
    if info is not None:
        lines.append(info.subtitle())
        if info.partial:
            lines.append(f"PARTIAL: {info.partial} measured (run interrupted; rerun to resume)")
    color = "firebrick" if info is not None and info.partial else "black"
    fig.suptitle("\n".join(lines), fontsize=11, color=color)


def _num(v) -> float:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return math.nan
    return v if math.isfinite(v) else math.nan


def _band(row: dict, lo: str = "drift_lo", hi: str = "drift_hi") -> tuple[float, float] | None:
    """The interval of a point (default: its drift's, drift_lo and drift_hi), if the summary carries one."""
    a, b = _num(row.get(lo)), _num(row.get(hi))
    return (a, b) if math.isfinite(a) and math.isfinite(b) else None


def _positive(v: float) -> float:
    return v if v > 0 else math.nan  # a log axis cannot show 0


def plot_drift(summary: list[dict], info: PlotInfo | None = None, reference: str = "fp16"):
    """Perplexity drift (top) and KL (bottom: mean, dashed p99) vs the reference by position (the axis and
    title name it: `info.name(reference)`), one column per mode, log-x; a shaded band where a point has an
    interval (`drift_lo`/`drift_hi`, `kl_lo`/`kl_hi` in its summary row)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    info = info or PlotInfo("", "", 0, 0, "")
    ref_name = info.name(reference)  # e.g. "fp32 (reference)" when the run computes in float32
    modes = _shown_modes(summary) or ["cache"]
    fig, axes = plt.subplots(
        2, len(modes), figsize=(6.5 * len(modes), 8.6), squeeze=False, sharey="row", sharex="col",
        layout="constrained", height_ratios=(1.2, 1.0),
    )
    ticks: set[int] = set()
    for col, mode in enumerate(modes):
        ax, kax = axes[0][col], axes[1][col]
        rows = [r for r in summary if r["mode"] == mode and r["bucket"] != "all" and r["scheme"] != reference]
        has_band = False
        for scheme in dict.fromkeys(r["scheme"] for r in rows):
            pts = sorted((int(r["bucket_end"]), r) for r in rows if r["scheme"] == scheme)
            xs = [x for x, _ in pts]
            ticks.update(xs)
            (line,) = ax.plot(xs, [100 * r["drift"] for _, r in pts], marker="o", label=info.name(scheme))
            color = line.get_color()
            kax.plot(xs, [_positive(_num(r.get("kl"))) for _, r in pts], marker="o", color=color)
            kax.plot(xs, [_positive(_num(r.get("kl_p99"))) for _, r in pts], ls="--", lw=1, color=color)
            bands_of = ((ax, ("drift_lo", "drift_hi"), 100), (kax, ("kl_lo", "kl_hi"), 1))
            for target, (lo, hi), scale in bands_of:
                bands = [_band(r, lo, hi) for _, r in pts]
                if any(bands):
                    has_band = True
                    target.fill_between(
                        xs, [scale * b[0] if b else math.nan for b in bands],
                        [scale * b[1] if b else math.nan for b in bands], color=color, alpha=0.2, linewidth=0,
                    )
        ax.axhline(0, color="grey", lw=0.8)
        kax.set_xlabel("position (end of bucket, tokens)")
        chunk = f", chunk {info.chunk:,}" if mode == "cache" and info.chunk else ""
        ax.set_title(f"mode: {mode}{chunk}", fontsize=10)
        if rows:
            ax.legend(fontsize=8, title="shaded: interval" if has_band else None, title_fontsize=8)
            kax.set_yscale("log")
    axes[0][0].set_ylabel(f"perplexity drift vs {ref_name} (%)")
    axes[1][0].set_ylabel(f"KL({ref_name} || scheme), nats\nper token: mean (dashed: p99)")
    for ax in (a for row in axes for a in row):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(FixedLocator(sorted(ticks)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: position_label(x)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.tick_params(labelsize=9)
    _title(fig, f"Perplexity drift and KL vs {ref_name} by position", info)
    return fig


def plot_bytes(summary: list[dict], info: PlotInfo | None = None):
    """KV-cache bytes per token per scheme: measured from the cache (cache mode) beside the formula, each
    bar labelled with its value and each scheme with its saving vs FP16."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    info = info or PlotInfo("", "", 0, 0, "")
    modes = list(dict.fromkeys(r["mode"] for r in summary))
    mode = "cache" if "cache" in modes else (modes[0] if modes else "cache")
    alls = [r for r in summary if r["bucket"] == "all" and r["mode"] == mode]
    reference = "fp16"  # the results key of the reference (measure.REFERENCE)
    fig, ax = plt.subplots(figsize=(max(9.0, 1.6 * len(alls) + 2.5), 5.2), layout="constrained")
    xs = list(range(len(alls)))
    series = [
        ("held at the full length (pages counted)", "bytes_per_token", -0.2),
        ("formula (steady state)", "bytes_per_token_formula", 0.2),
    ]
    for label, key, dx in series:
        values = [float(r[key]) for r in alls]
        if not any(math.isfinite(v) for v in values):
            continue
        bars = ax.bar([x + dx for x in xs], values, width=0.4, label=label)
        ax.bar_label(bars, labels=[f"{v:,.0f}" if math.isfinite(v) else "" for v in values], fontsize=8)
    ticks = [
        info.name(r["scheme"]) + (f"\n{r['saving']:.2f}× smaller" if r["scheme"] != reference else "")
        for r in alls
    ]
    ax.set_xticks(xs, ticks, fontsize=9, rotation=20 if len(alls) > 5 else 0)
    ax.set_ylabel(f"KV-cache bytes per token (at {info.kv_dtype} K/V storage)")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}"))
    ax.margins(y=0.12)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _title(fig, "KV-cache bytes per token", info)
    return fig


def write_plots(run_dir: Path, summary: list[dict], info: PlotInfo | None = None) -> list[Path]:
    """drift_vs_length.png and bytes_per_token.png in run_dir."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, fig in (
        ("drift_vs_length.png", plot_drift(summary, info)),
        ("bytes_per_token.png", plot_bytes(summary, info)),
    ):
        path = run_dir / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def provenance_lines(config_json: dict, progress) -> list[str]:
    """The report's closing header lines, shared by every run kind: points measured (and failed), git commit
    and package versions."""
    failed = f" ({progress.failed} not measured: scheme failed)" if progress.failed else ""
    versions = ", ".join(f"{k} {v}" for k, v in config_json["versions"].items())
    resumed = config_json.get("resumed_git_commits")
    git = config_json["git_commit"] + (f" (resumed at {', '.join(resumed)})" if resumed else "")
    return [f"- points measured: {progress}{failed}", f"- git {git}; {versions}"]
