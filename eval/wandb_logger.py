"""Log a finished run directory to Weights & Biases, named as its report names things.

Reads what the evaluation wrote (`config.json`, `summary.csv`, `*.png`), never the model, so it can run after
the fact on any run directory (`python -m kvquant.eval.wandb_logger runs/<name> --mode offline`). Three kinds
of run directory, told apart by their config.json: perplexity (experiments/run.py), retrieval
(`--task passkey|needle`) and serving (experiments/serve.py).

Names and groups, the same for every kind:
    run name     the scheme as the report shows it (`scheme_names` in config.json): a preset by its name
                 (`kivi-2`, not its expansion), the reference as what it computes in (`fp32 (reference)`);
                 `<name> (<mode>)` when a run compares modes
    group        the run directory's name (or --group / $WANDB_RUN_GROUP): one group per run
    config       top-level `scheme` (the shown name), `scheme_label` (the results key), `scheme_spec` (the
                 canonical spec), `is_reference`, `eval_mode`, `task`, `run`: group or filter by scheme in the
                 W&B table; job_type is the eval mode (`compare` for the comparison run)

Perplexity
    per (scheme, mode) run   each bucket metric (kvquant.eval.metrics) with its 95% interval (`drift_lo`,
                             `drift_hi`, `kl_lo`, `kl_hi`) against `seq_len` (the bucket's end), the rows as a
                             table, the `all` row and bytes per token in run.summary
    one `compare` run        drift and KL vs length per scheme, each with its interval as `<name> lo/hi`
                             lines (wandb.plot.line_series); a `comparison` table (scheme, bucket, drift and
                             KL with intervals, top-1, bytes, saving) for custom panels; bytes per token per
                             scheme (bar); summary.csv as a table; the report's PNG plots (drift and KL with
                             shaded intervals)
Retrieval: per (scheme, mode) run with exact match, first-token match, log p(answer) and its delta against
    `length` (depths pooled), the cells as a table; a `compare` run with exact match and Δ log p vs length per
    scheme, overall exact match per scheme (bar), the table and the heatmaps.
Serving: per scheme run with its rows (prefix cache, policy) as a table and the first row's figures in its
    summary; a `compare` run with requests that fit and peak bytes per scheme (bars), the table and the plot.

mode: "disabled" logs and writes nothing (wandb is not even imported); "offline" needs no account or network
and writes under `<run_dir>/wandb/` (upload later with `wandb sync <run_dir>/wandb/offline-run-*`);
"online" needs `wandb login` (or WANDB_API_KEY). experiments/run.py and experiments/serve.py call `log_run`
after their results are on disk and turn any exception into a warning.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .metrics import (
    BUCKET_METRICS,
    RETRIEVAL_COLUMNS,
    RETRIEVAL_METRICS,
    RUN_METRICS,
    SUMMARY_COLUMNS,
    TEXT_COLUMNS,
)

__all__ = [
    "MODES",
    "DEFAULT_PROJECT",
    "SUMMARY_COLUMNS",
    "METRICS",
    "read_summary",
    "log_run",
    "display_name",
]

MODES = ("online", "offline", "disabled")
DEFAULT_PROJECT = "kvquant"
# per bucket, against seq_len, and their intervals: read from the one metric schema (kvquant.eval.metrics)
METRICS = tuple(
    name
    for m in BUCKET_METRICS
    if m.wandb
    for name in (m.name, *((f"{m.name}_lo", f"{m.name}_hi") if m.interval else ()))
)
PER_SCHEME = tuple(m.name for m in RUN_METRICS)
ALL = "all"  # the bucket label of the whole-document row
RETRIEVAL_TASKS = ("passkey", "needle")
RETRIEVAL_PER_LENGTH = tuple(m.name for m in RETRIEVAL_METRICS if m.name != "trials")
RETRIEVAL_TEXT = ("task", "scheme", "mode", "status")  # length and depth: numbers, or "all"
COMPARE_COLUMNS = (
    "scheme",
    "mode",
    "bucket",
    "seq_len",
    "drift",
    "drift_lo",
    "drift_hi",
    "kl",
    "kl_lo",
    "kl_hi",
    "top1_agree",
    "bytes_per_token",
    "saving",
)


def _number(text: str) -> float | int | None:
    """A CSV cell as a number; empty and nan cells are None (W&B charts skip them)."""
    if text is None or text.strip() == "":
        return None
    value = float(text)
    if math.isnan(value):
        return None
    return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def _read_csv(path: Path, columns: Sequence[str], text: Sequence[str]) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != list(columns):
            raise ValueError(f"{path}: columns {reader.fieldnames} are not the expected {','.join(columns)}")
        return [{k: (v if k in text or v == ALL else _cell(v)) for k, v in row.items()} for row in reader]


def _cell(text: str):
    """A number where the cell holds one, else the text (a serving row's `prefix_cache`, say)."""
    try:
        return _number(text)
    except ValueError:
        return text


def read_summary(path: Path) -> list[dict]:
    """summary.csv rows with numbers parsed; refuses a file whose columns are not the schema's."""
    return _read_csv(path, SUMMARY_COLUMNS, TEXT_COLUMNS)


def display_name(label: str, config: Mapping) -> str:
    """The name the report shows for a results label: config.json's `scheme_names` (a preset's name, the
    reference's dtype), else the label; an old run directory's reference as `fp16 (reference)`."""
    names = config.get("scheme_names") or {}
    if label in names:
        return names[label]
    return f"{label} (reference)" if label == config.get("reference") else label


def _spec(label: str) -> str:
    """The canonical scheme spec of a label (`kvquant:fp16` -> fp16); the label when it is not a scheme."""
    try:
        from kvquant.scheme import parse_scheme

        return str(parse_scheme(label.removeprefix("kvquant:")))
    except Exception:  # noqa: BLE001 - a peer's label (`kivi`, `hqq`) names no kvquant scheme
        return label


def _wandb_config(config: dict, label: str, mode: str, run_dir: Path, task: str) -> dict:
    drop = ("documents", "scheme_names", "identity")  # the per-document list and the identity stay on disk
    out = {k: v for k, v in config.items() if k not in drop}
    if isinstance(config.get("documents"), list):
        out["num_documents"] = len(config["documents"])
    reference = config.get("reference")
    if label in ("all", "compare"):
        scheme = {"scheme": "all", "scheme_label": "all", "scheme_spec": "all", "is_reference": False}
    else:
        scheme = {
            "scheme": display_name(label, config),
            "scheme_label": label,
            "scheme_spec": _spec(label),
            "is_reference": label == reference,
        }
    ref = {"reference": display_name(reference, config)} if reference else {}
    return (
        out | scheme | ref | {"eval_mode": mode, "task": task, "run": run_dir.name, "run_dir": str(run_dir)}
    )


def _settings(wandb):
    # no system-metrics sampler, no git probing, no console capture: a quick, quiet upload of finished
    # results; 5 minutes (not 30 s / 90 s) for the wandb-core service to start and a run to open on a
    # busy machine
    return wandb.Settings(
        silent=True, console="off", x_disable_stats=True, disable_git=True, disable_code=True,
        init_timeout=300.0, x_service_wait=300.0,
    )


def _task(config: Mapping, run_dir: Path) -> str:
    if config.get("kind") == "serve":
        return "serve"
    with open(run_dir / "summary.csv", encoding="utf-8") as f:
        header = f.readline().strip().split(",")
    if header and header[:2] == ["scheme", "prefix_cache"]:  # a serving summary (kvquant.eval.serve)
        return "serve"
    return config.get("task") if config.get("task") in RETRIEVAL_TASKS else "perplexity"


def log_run(run_dir: Path, mode: str, project: str | None = None, group: str | None = None) -> None:
    """Log the run directory `run_dir` to W&B (see the module docstring): perplexity, retrieval or serving.

    project defaults to $WANDB_PROJECT, else "kvquant"; group to $WANDB_RUN_GROUP, else the run directory's
    name, so reruns of one configuration land in one group.

    Under `wandb agent` (WANDB_SWEEP_ID set) a process owns exactly one run (wandb reuses the agent's run id
    for every init), so that run gets the swept scheme's metrics and the comparison charts together."""
    if mode not in MODES:
        raise ValueError(f"unknown W&B mode {mode!r}; known modes: {', '.join(MODES)}")
    if mode == "disabled":
        return
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    task = _task(config, run_dir)
    rows, writer = _summary_and_writer(run_dir, task)
    pngs = sorted(run_dir.glob("*.png"))

    import wandb  # only when logging: importing wandb costs about a second

    project = project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
    group = group or os.environ.get("WANDB_RUN_GROUP") or run_dir.name
    common = dict(
        project=project,
        group=group,
        dir=str(run_dir),
        mode=mode,
        reinit="create_new",
        settings=_settings(wandb),
    )
    log_one, compare = writer(wandb, config, rows, pngs)
    pairs = list(dict.fromkeys((r["scheme"], r.get("mode") or "serve") for r in rows))
    multi_mode = len({m for _, m in pairs}) > 1

    def label(pair: tuple[str, str]) -> str:
        name = display_name(pair[0], config)
        return f"{name} ({pair[1]})" if multi_mode else name

    def init(pair: tuple[str, str] | None):
        if pair is None:
            return wandb.init(
                name="compare",
                job_type="compare",
                tags=[task, "compare"],
                config=_wandb_config(config, "compare", "all", run_dir, task),
                **common,
            )
        return wandb.init(
            name=label(pair),
            job_type=pair[1],
            tags=[task, pair[1]],
            config=_wandb_config(config, pair[0], pair[1], run_dir, task),
            **common,
        )

    if os.environ.get("WANDB_SWEEP_ID"):
        reference = config.get("reference")
        swept = next((p for p in pairs if p[0] != reference), pairs[0])
        with init(swept) as run:
            log_one(run, swept)
            run.log(compare(label))
        return
    for pair in pairs:
        with init(pair) as run:
            log_one(run, pair)
    with init(None) as run:
        run.log(compare(label))


def _summary_and_writer(run_dir: Path, task: str) -> tuple[list[dict], Callable]:
    """The run's summary.csv rows, read with the columns of its task (serving, retrieval or perplexity), and
    the writer that logs that task's rows (`_serve_writer`, `_retrieval_writer`, `_perplexity_writer`)."""
    if task == "serve":
        from .results import SERVE_SUMMARY_COLUMNS

        rows = _read_csv(run_dir / "summary.csv", SERVE_SUMMARY_COLUMNS, ("scheme", "prefix_cache", "policy"))
        return rows, _serve_writer
    if task in RETRIEVAL_TASKS:
        return _read_csv(run_dir / "summary.csv", RETRIEVAL_COLUMNS, RETRIEVAL_TEXT), _retrieval_writer
    return read_summary(run_dir / "summary.csv"), _perplexity_writer


Writer = tuple[Callable, Callable]


def _images(wandb, pngs: list[Path]) -> dict:
    return {f"plots/{p.stem}": wandb.Image(str(p), caption=p.name) for p in pngs}


def _lines(wandb, series: list[tuple[str, list[tuple[float, float]]]], title: str, xname: str):
    series = [(key, pts) for key, pts in series if pts]
    if not series:
        return None
    return wandb.plot.line_series(
        xs=[[x for x, _ in pts] for _, pts in series],
        ys=[[y for _, y in pts] for _, pts in series],
        keys=[key for key, _ in series],
        title=title,
        xname=xname,
    )


def _bars(wandb, values: dict[str, float], column: str, title: str):
    if not values:
        return None
    table = wandb.Table(columns=["scheme", column], data=[[k, v] for k, v in values.items()])
    return wandb.plot.bar(table, "scheme", column, title=title)


def _shown_table(wandb, config: Mapping, rows: list[dict], columns: Sequence[str]):
    """A summary as on disk, with `scheme` the shown name and `scheme_label` the results key appended."""

    def cell(r: dict, c: str):
        if c == "scheme":
            return display_name(r[c], config)
        return str(r[c]) if c in ("length", "depth") else r[c]  # numbers and "all": one type per W&B column

    data = [[cell(r, c) for c in columns] + [r["scheme"]] for r in rows]
    return wandb.Table(columns=[*columns, "scheme_label"], data=data)


def _perplexity_writer(wandb, config: dict, rows: list[dict], pngs: list[Path]) -> Writer:
    reference = config.get("reference", "fp16")
    ref_name = display_name(reference, config)
    by_pair: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by_pair.setdefault((r["scheme"], r["mode"]), []).append(r)

    def buckets(pair: tuple[str, str]) -> list[dict]:
        ok = (r for r in by_pair[pair] if r["bucket"] != ALL and r["status"] == "ok")
        return sorted(ok, key=lambda r: r["bucket_end"])

    def whole(pair: tuple[str, str]) -> dict:
        return next((r for r in by_pair[pair] if r["bucket"] == ALL), by_pair[pair][-1])

    def log_one(run, pair: tuple[str, str]) -> None:
        run.define_metric("seq_len")
        for m in METRICS:
            run.define_metric(m, step_metric="seq_len")
        for r in buckets(pair):
            run.log(
                {
                    "seq_len": r["bucket_end"],
                    "tokens": r["tokens"],
                    **{m: r[m] for m in METRICS if r[m] is not None},
                }
            )
        run.log({"buckets": _shown_table(wandb, config, by_pair[pair], SUMMARY_COLUMNS)})
        w = whole(pair)
        run.summary.update({f"all/{m}": w[m] for m in (*METRICS, *PER_SCHEME) if w[m] is not None})
        run.summary["status"] = w["status"]

    def with_interval(name: str, metric: str, r_rows: list[dict]) -> list[tuple[str, list]]:
        out = []
        for suffix, col in (("", metric), (" lo", f"{metric}_lo"), (" hi", f"{metric}_hi")):
            out.append((name + suffix, [(r["bucket_end"], r[col]) for r in r_rows if r[col] is not None]))
        return out

    def compare(label: Callable[[tuple[str, str]], str]) -> dict:
        charts = {}
        quantized = [p for p in by_pair if p[0] != reference]  # the reference is the zero line: left out
        for metric, title in (
            ("drift", f"PPL drift vs {ref_name} by sequence length [95% interval]"),
            ("kl", f"KL vs {ref_name} (nats/token) by sequence length [95% interval]"),
        ):
            series = [s for p in quantized for s in with_interval(label(p), metric, buckets(p))]
            chart = _lines(wandb, series, title, "tokens")
            if chart is not None:
                charts[f"{metric}_vs_length"] = chart
        data = []
        for p in by_pair:
            for r in [*buckets(p), whole(p)]:
                data.append(
                    [label(p), p[1], r["bucket"], r["bucket_end"], *(r[c] for c in COMPARE_COLUMNS[4:])]
                )
        charts["comparison"] = wandb.Table(columns=list(COMPARE_COLUMNS), data=data)
        bars: dict[str, float] = {}
        for p in by_pair:  # bytes held at the full length at the storage dtype, else the steady-state formula
            w = whole(p)
            value = w["bytes_per_token"] or w["bytes_per_token_formula"]
            if value is not None:
                bars.setdefault(display_name(p[0], config), value)
        bar = _bars(wandb, bars, "bytes_per_token", "KV-cache bytes per token")
        if bar is not None:
            charts["bytes_per_token"] = bar
        charts["summary"] = _shown_table(wandb, config, rows, SUMMARY_COLUMNS)
        return charts | _images(wandb, pngs)

    return log_one, compare


def _retrieval_writer(wandb, config: dict, rows: list[dict], pngs: list[Path]) -> Writer:
    by_pair: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by_pair.setdefault((r["scheme"], r["mode"]), []).append(r)

    def per_length(pair: tuple[str, str]) -> list[dict]:
        rs = (r for r in by_pair[pair] if r["length"] != ALL and r["depth"] == ALL and r["status"] == "ok")
        return sorted(rs, key=lambda r: r["length"])

    def overall(pair: tuple[str, str]) -> dict:
        return next((r for r in by_pair[pair] if r["length"] == ALL), by_pair[pair][-1])

    def log_one(run, pair: tuple[str, str]) -> None:
        run.define_metric("length")
        for m in RETRIEVAL_PER_LENGTH:
            run.define_metric(m, step_metric="length")
        for r in per_length(pair):
            run.log({"length": r["length"], **{m: r[m] for m in RETRIEVAL_PER_LENGTH if r[m] is not None}})
        run.log({"cells": _shown_table(wandb, config, by_pair[pair], RETRIEVAL_COLUMNS)})
        w = overall(pair)
        keys = (*RETRIEVAL_PER_LENGTH, "trials", "bytes_per_token", "saving")
        run.summary.update({f"all/{m}": w[m] for m in keys if w[m] is not None})
        run.summary["status"] = w["status"]

    def compare(label: Callable[[tuple[str, str]], str]) -> dict:
        charts = {}
        for metric, title in (
            ("exact_match", "exact match vs context length"),
            ("answer_logprob_delta", "Δ log p(answer) vs the reference by context length"),
        ):
            series = [
                (label(p), [(r["length"], r[metric]) for r in per_length(p) if r[metric] is not None])
                for p in by_pair
            ]
            chart = _lines(wandb, series, f"{config.get('task', 'retrieval')}: {title}", "tokens")
            if chart is not None:
                charts[f"{metric}_vs_length"] = chart
        exact = {
            label(p): overall(p)["exact_match"] for p in by_pair if overall(p)["exact_match"] is not None
        }
        bar = _bars(wandb, exact, "exact_match", "exact match over every cell")
        if bar is not None:
            charts["exact_match"] = bar
        charts["summary"] = _shown_table(wandb, config, rows, RETRIEVAL_COLUMNS)
        return charts | _images(wandb, pngs)

    return log_one, compare


def _serve_writer(wandb, config: dict, rows: list[dict], pngs: list[Path]) -> Writer:
    from .results import SERVE_SUMMARY_COLUMNS as SERVE_COLUMNS

    by_scheme: dict[str, list[dict]] = {}
    for r in rows:
        by_scheme.setdefault(r["scheme"], []).append(r)

    def log_one(run, pair: tuple[str, str]) -> None:
        rs = by_scheme[pair[0]]
        run.log({"rows": _shown_table(wandb, config, rs, SERVE_COLUMNS)})
        first = rs[0]
        run.summary.update({c: first[c] for c in SERVE_COLUMNS if c != "scheme" and first[c] is not None})

    def compare(label: Callable[[tuple[str, str]], str]) -> dict:
        charts = {}
        for column, title in (
            ("fit_requests", "requests that fit the GPU budget"),
            ("peak_bytes", "peak KV bytes held"),
        ):
            values = {
                label((s, "serve")): rs[0][column] for s, rs in by_scheme.items() if rs[0][column] is not None
            }
            bar = _bars(wandb, values, column, title)
            if bar is not None:
                charts[column] = bar
        charts["summary"] = _shown_table(wandb, config, rows, SERVE_COLUMNS)
        return charts | _images(wandb, pngs)

    return log_one, compare


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Log a kvquant run directory to Weights & Biases.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--mode", default="offline", choices=MODES)
    p.add_argument("--project", default=None)
    p.add_argument("--group", default=None)
    args = p.parse_args(argv)
    log_run(args.run_dir, args.mode, args.project, args.group)


if __name__ == "__main__":
    main()
