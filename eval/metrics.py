"""Every metric of an evaluation, declared once: name, how it sums, how it aggregates, direction, format.

`measure.py` produces the per-token values and per-bucket sums named here, `runner.py` writes the sums into
results.jsonl, `results.py` aggregates them into summary.csv and the tables, and `wandb_logger.py` logs the
columns this module lists. None of them keeps its own column list. Imports nothing heavy (no torch, no numpy
at import time), so `experiments/run.py` may read it before its checks.

How a metric is computed, in two steps:
  sums       the results.jsonl fields it needs; each is a sum over the tokens of one (document, bucket),
             and summing them over documents gives the bucket's (or the whole run's) totals
  aggregate  a function of those totals (`Totals`), or, for a distribution metric (a percentile), of the
             per-token values (`measure.TOKEN_FIELDS`, kept in the run directory's tokens/ folder)

direction: "lower" / "higher" is better, "zero" (a signed error: closer to 0 is better), None (a count).
interval:  the summary carries `<name>_lo` / `<name>_hi`, a 95% bootstrap interval (documents, then tokens).
scope:     "bucket" (one value per position bucket, plotted against length) or "run" (bytes: one per scheme).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "Metric",
    "Totals",
    "METRICS",
    "BY_NAME",
    "ROW_SUMS",
    "MEMORY_FIELDS",
    "MEMORY_METRICS",
    "KEY_COLUMNS",
    "SUMMARY_COLUMNS",
    "TEXT_COLUMNS",
    "BUCKET_METRICS",
    "RUN_METRICS",
    "DISTRIBUTION_METRICS",
    "INTERVAL_METRICS",
    "RETRIEVAL_SUMS",
    "RETRIEVAL_METRICS",
    "RETRIEVAL_KEY_COLUMNS",
    "RETRIEVAL_COLUMNS",
    "metric",
    "format_value",
    "format_interval",
    "within",
]

# results.jsonl fields that are sums over a (document, bucket)'s tokens: summing them over documents is exact
ROW_SUMS = ("nll_sum", "ref_nll_sum", "tokens", "kl_sum", "top1", "dp_sum", "dp_sq_sum")
# results.jsonl fields of a document's last bucket, at the end of the document, in bytes at the run dtype
# (beside `cache_bytes`, the pages `nbytes()` counts, over `cache_tokens`):
#   cache_reserved  the pools' reserve, `cache.reserved_bytes()` (kvquant's caches only)
#   mem_held        measured on the device: what dropping the cache gave back (CUDA: memory_allocated
#                   before minus after; CPU: resident set size, after gc + malloc_trim, before minus after)
#   mem_peak        measured on the device: the highest of the document's forwards through this cache, above
#                   where that forward started (CUDA: max_memory_allocated, reset per forward; CPU: VmHWM)
# `mem_probe` (a string) says how they were read; `nbytes_by_device` ({device: bytes of the pages there}) is
# recorded with them. Measured values differ between two runs of one point, and so can whether a document's
# memory was recorded at all (it is dropped when its forwards cannot be attributed to the caches).
MEMORY_FIELDS = ("cache_reserved", "mem_held", "mem_peak", "mem_probe", "nbytes_by_device")

Totals = Mapping[str, float]  # ROW_SUMS summed over the documents of a bucket
Tokens = Mapping[str, "object"]  # per-token numpy arrays (measure.TOKEN_FIELDS), pooled over documents


@dataclass(frozen=True)
class Metric:
    """One column of summary.csv (and of W&B, and of the tables)."""

    name: str
    title: str  # table header
    doc: str  # one line: what it is
    sums: tuple[str, ...] = ()  # ROW_SUMS it reads
    aggregate: Callable[[Totals], float] | None = None  # from the totals
    from_tokens: Callable[[Tokens], float] | None = None  # from the per-token values (a distribution)
    direction: str | None = "lower"
    fmt: str = ".4g"  # a format spec; "%" means a signed percentage of a fraction (+0.09%)
    scope: str = "bucket"
    interval: bool = False
    wandb: bool = True

    def __post_init__(self) -> None:
        if self.direction not in ("lower", "higher", "zero", None):
            raise ValueError(f"metric {self.name}: direction {self.direction!r}")
        if self.scope not in ("bucket", "run"):
            raise ValueError(f"metric {self.name}: scope {self.scope!r}")
        if self.scope == "bucket" and (self.aggregate is None) == (self.from_tokens is None):
            raise ValueError(f"metric {self.name}: give exactly one of aggregate / from_tokens")

    def value(self, totals: Totals, tokens: Tokens | None) -> float:
        if self.aggregate is not None:
            return self.aggregate(totals)
        if tokens is None or self.from_tokens is None:
            return math.nan
        return self.from_tokens(tokens)


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


def _exp_mean(key: str) -> Callable[[Totals], float]:
    return lambda t: math.exp(t[key] / t["tokens"]) if t["tokens"] else math.nan


def _drift(t: Totals) -> float:
    """ppl / ppl_ref - 1 over the same tokens = exp(mean(nll - nll_ref)) - 1."""
    return math.expm1((t["nll_sum"] - t["ref_nll_sum"]) / t["tokens"]) if t["tokens"] else math.nan


def _quantile(q: float) -> Callable[[Tokens], float]:
    def f(tok: Tokens) -> float:
        import numpy as np

        kl = tok["kl"]
        return float(np.quantile(kl, q)) if len(kl) else math.nan

    return f


def _kl_max(tok: Tokens) -> float:
    return float(tok["kl"].max()) if len(tok["kl"]) else math.nan


METRICS: tuple[Metric, ...] = (
    Metric(
        "tokens",
        "tokens",
        "predictions in the bucket, over all documents",
        ("tokens",),
        lambda t: t["tokens"],
        direction=None,
        fmt=",d",
        wandb=False,
    ),
    Metric("ppl", "ppl", "perplexity", ("nll_sum", "tokens"), _exp_mean("nll_sum"), fmt=".3f"),
    Metric(
        "ppl_ref",
        "ppl ref",
        "perplexity of the unquantized reference over the same tokens",
        ("ref_nll_sum", "tokens"),
        _exp_mean("ref_nll_sum"),
        fmt=".3f",
    ),
    Metric(
        "drift",
        "drift",
        "ppl / ppl_ref - 1",
        ("nll_sum", "ref_nll_sum", "tokens"),
        _drift,
        direction="zero",
        fmt="%",
        interval=True,
    ),
    Metric(
        "kl",
        "KLD mean",
        "mean KL(p_ref || p_scheme) per token, nats",
        ("kl_sum", "tokens"),
        lambda t: _div(t["kl_sum"], t["tokens"]),
        fmt=".5f",
        interval=True,
    ),
    Metric("kl_median", "KLD median", "median per-token KL", from_tokens=_quantile(0.5), fmt=".5f"),
    Metric("kl_p90", "KLD p90", "90th percentile of per-token KL", from_tokens=_quantile(0.9), fmt=".5f"),
    Metric("kl_p99", "KLD p99", "99th percentile of per-token KL", from_tokens=_quantile(0.99), fmt=".4f"),
    Metric(
        "kl_p999", "KLD p99.9", "99.9th percentile of per-token KL", from_tokens=_quantile(0.999), fmt=".4f"
    ),
    Metric("kl_max", "KLD max", "largest per-token KL", from_tokens=_kl_max, fmt=".4f"),
    Metric(
        "dp_mean",
        "Δp mean",
        "mean change of the correct token's probability (scheme - ref)",
        ("dp_sum", "tokens"),
        lambda t: _div(t["dp_sum"], t["tokens"]),
        direction="zero",
        fmt="%",
    ),
    Metric(
        "dp_rms",
        "Δp RMS",
        "root mean square of that change",
        ("dp_sq_sum", "tokens"),
        lambda t: math.sqrt(t["dp_sq_sum"] / t["tokens"]) if t["tokens"] else math.nan,
        fmt=".3%",
    ),
    Metric(
        "top1_agree",
        "same top-1",
        "share of predictions whose argmax equals the reference's",
        ("top1", "tokens"),
        lambda t: _div(t["top1"], t["tokens"]),
        direction="higher",
        fmt=".4f",
    ),
    # per scheme (the `all` row): bytes
    Metric(
        "bytes_per_token_measured",
        "B/token pages",
        "cache.nbytes() / tokens at the end of the document, at the run dtype (the formula's check)",
        direction="lower",
        fmt=",.0f",
        scope="run",
    ),
    Metric(
        "bytes_per_token",
        "B/token",
        "bytes per token held at the full length, at the storage dtype (--kv-dtype), pages counted",
        direction="lower",
        fmt=",.0f",
        scope="run",
    ),
    Metric(
        "bytes_per_token_formula",
        "B/token steady",
        "steady-state bytes per token at the storage dtype",
        direction="lower",
        fmt=",.0f",
        scope="run",
    ),
    # memory as the process sees it (issue 20), at the run dtype, beside the formula and the pages
    Metric(
        "bytes_per_token_formula_run",
        "B/token formula",
        "kvquant.memory.cache_bytes (the scheme's held_bytes) after the full length / tokens, run dtype",
        direction="lower",
        fmt=",.0f",
        scope="run",
    ),
    Metric(
        "bytes_per_token_reserved",
        "B/token reserved",
        "cache.reserved_bytes() / tokens at the end of the document, at the run dtype: the pools, pages "
        "held plus their bounded growth reserve (kvquant's caches only)",
        direction="lower",
        fmt=",.0f",
        scope="run",
    ),
    Metric(
        "mem_held_per_token",
        "B/token measured",
        "measured on the device: memory the cache alone held at the end of the document / tokens (dropping "
        "it gave this back: CUDA memory_allocated, CPU resident set after malloc_trim)",
        direction="lower",
        fmt=",.0f",
        scope="run",
    ),
    Metric(
        "mem_peak",
        "forward peak MiB",
        "measured on the device: the highest one forward through this cache rose above its start (CUDA "
        "max_memory_allocated, CPU VmHWM): activations, attention temporaries and the cache's growth",
        direction="lower",
        fmt="MiB",
        scope="run",
    ),
    Metric(
        "saving",
        "saving",
        "reference bytes / scheme bytes, both at the storage dtype",
        direction="higher",
        fmt=".2f",
        scope="run",
    ),
    Metric(
        "effective_bits",
        "bits",
        "stored bits per K/V value (scales and zeros counted), steady state",
        direction="lower",
        fmt=".2f",
        scope="run",
    ),
)

# Retrieval (--task passkey|needle, kvquant.eval.retrieval): a point is one trial of one (length, depth) cell;
# these per-point fields of results.jsonl sum over trials (same_as_ref and logprob_delta are filled in by the
# summary, which pairs each point with the reference's point).
RETRIEVAL_SUMS = ("trials", "exact", "first_token", "answer_logprob", "same_as_ref", "logprob_delta")


def _per_trial(key: str) -> Callable[[Totals], float]:
    return lambda t: _div(t[key], t["trials"])


RETRIEVAL_METRICS: tuple[Metric, ...] = (
    Metric("trials", "trials", "keys tried in the cell", ("trials",), lambda t: t["trials"], direction=None,
           fmt=",d"),
    Metric("exact_match", "exact match", "share of trials whose greedy answer equals the key exactly",
           ("exact", "trials"), _per_trial("exact"), direction="higher", fmt=".2f"),
    Metric("first_token_match", "1st token", "share of trials whose first answer token is right",
           ("first_token", "trials"), _per_trial("first_token"), direction="higher", fmt=".2f"),
    Metric("answer_logprob", "log p(answer)", "mean log-probability of the answer (nats, teacher-forced)",
           ("answer_logprob", "trials"), _per_trial("answer_logprob"), direction="higher", fmt=".2f"),
    Metric("answer_logprob_delta", "Δ log p", "mean log p(answer) minus the reference's, same prompt",
           ("logprob_delta", "trials"), _per_trial("logprob_delta"), direction="zero", fmt="+.2f"),
    Metric("same_as_ref", "same as ref", "share of trials whose greedy answer tokens equal the reference's",
           ("same_as_ref", "trials"), _per_trial("same_as_ref"), direction="higher", fmt=".2f"),
)
RETRIEVAL_KEY_COLUMNS = ("task", "scheme", "mode", "length", "depth")
RETRIEVAL_COLUMNS: list[str] = [*RETRIEVAL_KEY_COLUMNS, *(m.name for m in RETRIEVAL_METRICS),
                                "bytes_per_token", "saving", "status"]

BY_NAME: dict[str, Metric] = {m.name: m for m in (*METRICS, *RETRIEVAL_METRICS)}
BUCKET_METRICS = tuple(m for m in METRICS if m.scope == "bucket")
RUN_METRICS = tuple(m for m in METRICS if m.scope == "run")
DISTRIBUTION_METRICS = tuple(m for m in METRICS if m.from_tokens is not None)
MEMORY_METRICS = tuple(BY_NAME[n] for n in (  # the report's memory table, in this order
    "bytes_per_token_formula_run", "bytes_per_token_measured", "bytes_per_token_reserved",
    "mem_held_per_token", "mem_peak"))
INTERVAL_METRICS = tuple(m for m in METRICS if m.interval)
# `name` is the scheme as the report shows it (a preset's name, "fp32 (reference)"); `scheme` the result label
KEY_COLUMNS = ("scheme", "name", "mode", "bucket", "bucket_start", "bucket_end", "docs")
TEXT_COLUMNS = ("scheme", "name", "mode", "bucket", "status")


def _columns() -> list[str]:
    cols = list(KEY_COLUMNS)
    for m in METRICS:
        cols.append(m.name)
        if m.interval:
            cols += [f"{m.name}_lo", f"{m.name}_hi"]
        if m.name == "drift":
            cols.append("drift_noise")  # |drift - drift of a perturbed realization| (--noise-floor), else nan
    return [*cols, "status"]


SUMMARY_COLUMNS: list[str] = _columns()


def metric(name: str) -> Metric:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; known: {', '.join(BY_NAME)}") from None


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def format_value(name: str, x, *, sign_minus: bool = True) -> str:
    """x as the metric's format says; a missing value is `–`. Percent metrics print `+0.09%`."""
    if not _finite(x):
        return "–"
    m = metric(name)
    x = float(x)
    if m.fmt == "%":
        text = f"{100 * x:+.2f}%"
    elif m.fmt == "MiB":  # bytes shown in MiB
        text = f"{x / 2**20:,.2f}"
    elif m.fmt.endswith("d"):
        text = format(int(round(x)), m.fmt)
    else:
        text = format(x, m.fmt)
    return text.replace("-", "−") if sign_minus else text


def format_interval(name: str, x, lo, hi) -> str:
    """`+0.09% [−0.02, +0.21]` (percent metrics) or `0.00123 [0.00110, 0.00140]`; the point alone without an
    interval."""
    point = format_value(name, x)
    if not (_finite(lo) and _finite(hi)):
        return point
    m = metric(name)
    if m.fmt == "%":
        a, b = f"{100 * float(lo):+.2f}", f"{100 * float(hi):+.2f}"
    else:
        a, b = format(float(lo), m.fmt), format(float(hi), m.fmt)
    return f"{point} [{a}, {b}]".replace("-", "−")


def within(row: Mapping, name: str, bound: float) -> bool | None:
    """Whether a row's interval of `name` lies within ±bound (a target is judged on the interval, not the
    point); None when the row has no interval."""
    lo, hi = row.get(f"{name}_lo"), row.get(f"{name}_hi")
    if not (_finite(lo) and _finite(hi)):
        return None
    return -bound <= float(lo) and float(hi) <= bound
