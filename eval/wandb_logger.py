"""Log a finished run directory to Weights & Biases: one W&B run per (scheme, mode), in one group.

Reads what the evaluation wrote (`config.json`, `summary.csv`, `*.png`), never the model, so it can run after
the fact on any run directory (`python -m kvquant.eval.wandb_logger runs/<name> --mode offline`).

    per (scheme, mode) run   config.json + the scheme; each bucket metric (kvquant.eval.metrics) per bucket
                             (x axis `seq_len`, the bucket's end), the same rows as a wandb.Table, and the
                             `all` row and bytes per token in run.summary
    one `compare` run        drift vs sequence length across schemes (wandb.plot.line_series), bytes per token
                             per scheme (wandb.plot.bar), the whole summary.csv as a table, the PNG plots

mode: "disabled" logs and writes nothing (wandb is not even imported); "offline" needs no account or network
and writes under `<run_dir>/wandb/` (upload later with `wandb sync <run_dir>/wandb/offline-run-*`);
"online" needs `wandb login` (or WANDB_API_KEY). experiments/run.py calls `log_run` after its results are on
disk and turns any exception into a warning.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from .metrics import BUCKET_METRICS, RUN_METRICS, SUMMARY_COLUMNS, TEXT_COLUMNS

__all__ = ["MODES", "DEFAULT_PROJECT", "SUMMARY_COLUMNS", "METRICS", "read_summary", "log_run"]

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


def _number(text: str) -> float | int | None:
    """A CSV cell as a number; empty and nan cells are None (W&B charts skip them)."""
    if text is None or text.strip() == "":
        return None
    value = float(text)
    if math.isnan(value):
        return None
    return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def read_summary(path: Path) -> list[dict]:
    """summary.csv rows with numbers parsed; refuses a file whose columns are not the schema's."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames != SUMMARY_COLUMNS:
            raise ValueError(
                f"{path}: columns {reader.fieldnames} are not the expected {','.join(SUMMARY_COLUMNS)}"
            )
        return [{k: (v if k in TEXT_COLUMNS else _number(v)) for k, v in row.items()} for row in reader]


def _wandb_config(config: dict, scheme: str, mode: str, run_dir: Path) -> dict:
    out = {k: v for k, v in config.items() if k != "documents"}  # the per-document list stays on disk
    if isinstance(config.get("documents"), list):
        out["num_documents"] = len(config["documents"])
    return out | {"scheme": scheme, "eval_mode": mode, "run_dir": str(run_dir)}


def _settings(wandb):
    # no system-metrics sampler, no git probing, no console capture: a quick, quiet upload of finished results
    return wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                          disable_code=True)


def log_run(run_dir: Path, mode: str, project: str | None = None, group: str | None = None) -> None:
    """Log the run directory `run_dir` to W&B (see the module docstring).

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
    rows = read_summary(run_dir / "summary.csv")
    pngs = sorted(run_dir.glob("*.png"))

    import wandb  # only when logging: importing wandb costs about a second

    project = project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
    group = group or os.environ.get("WANDB_RUN_GROUP") or run_dir.name
    common = dict(project=project, group=group, dir=str(run_dir), mode=mode, reinit="create_new",
                  settings=_settings(wandb))
    by_pair: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by_pair.setdefault((r["scheme"], r["mode"]), []).append(r)
    pairs = list(by_pair)
    reference = config.get("reference", "fp16")
    ref_name = config.get("scheme_names", {}).get(reference, reference)  # e.g. "fp32 (reference)" on the CPU
    multi_mode = len({m for _, m in pairs}) > 1

    def label(pair: tuple[str, str]) -> str:
        return f"{pair[0]} ({pair[1]})" if multi_mode else pair[0]

    def buckets(pair: tuple[str, str]) -> list[dict]:
        ok = (r for r in by_pair[pair] if r["bucket"] != ALL and r["status"] == "ok")
        return sorted(ok, key=lambda r: r["bucket_end"])

    def whole(pair: tuple[str, str]) -> dict:
        return next((r for r in by_pair[pair] if r["bucket"] == ALL), by_pair[pair][-1])

    def table(rs: list[dict]):
        return wandb.Table(columns=SUMMARY_COLUMNS, data=[[r[c] for c in SUMMARY_COLUMNS] for r in rs])

    def log_scheme(run, pair: tuple[str, str]) -> None:
        run.define_metric("seq_len")
        for m in METRICS:
            run.define_metric(m, step_metric="seq_len")
        for r in buckets(pair):
            run.log({"seq_len": r["bucket_end"], "tokens": r["tokens"],
                     **{m: r[m] for m in METRICS if r[m] is not None}})
        run.log({"buckets": table(by_pair[pair])})
        w = whole(pair)
        run.summary.update({f"all/{m}": w[m] for m in (*METRICS, *PER_SCHEME) if w[m] is not None})
        run.summary["status"] = w["status"]

    def compare_charts() -> dict:
        charts = {}
        lines = [(label(p), [(r["bucket_end"], r["drift"]) for r in buckets(p) if r["drift"] is not None])
                 for p in pairs]
        lines = [(key, pts) for key, pts in lines if pts]
        if lines:
            charts["drift_vs_length"] = wandb.plot.line_series(
                xs=[[x for x, _ in pts] for _, pts in lines], ys=[[y for _, y in pts] for _, pts in lines],
                keys=[key for key, _ in lines], title=f"PPL drift vs {ref_name} by sequence length",
                xname="tokens")
        bars: dict[str, float] = {}
        for p in pairs:  # bytes held at the full length at the storage dtype, else the steady-state formula
            w = whole(p)
            value = w["bytes_per_token"] or w["bytes_per_token_formula"]
            if value is not None:
                bars.setdefault(p[0], value)
        if bars:
            data = [[scheme, value] for scheme, value in bars.items()]
            bar_table = wandb.Table(columns=["scheme", "bytes_per_token"], data=data)
            charts["bytes_per_token"] = wandb.plot.bar(bar_table, "scheme", "bytes_per_token",
                                                       title="KV-cache bytes per token")
        charts["summary"] = table(rows)
        charts.update({f"plots/{p.stem}": wandb.Image(str(p), caption=p.name) for p in pngs})
        return charts

    if os.environ.get("WANDB_SWEEP_ID"):
        swept = next((p for p in pairs if p[0] != reference), pairs[0])
        with wandb.init(name=label(swept), job_type=swept[1],
                        config=_wandb_config(config, swept[0], swept[1], run_dir), **common) as run:
            log_scheme(run, swept)
            run.log(compare_charts())
        return

    for scheme, eval_mode in pairs:
        with wandb.init(name=label((scheme, eval_mode)), job_type=eval_mode,
                        config=_wandb_config(config, scheme, eval_mode, run_dir), **common) as run:
            log_scheme(run, (scheme, eval_mode))
    with wandb.init(name="compare", job_type="compare", config=_wandb_config(config, "all", "all", run_dir),
                    **common) as run:
        run.log(compare_charts())


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
