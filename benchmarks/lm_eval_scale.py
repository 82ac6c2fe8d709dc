"""lm-eval at scale on this machine: batch size N vs 1 (one process), and 2 data-parallel ranks vs 1.

    python benchmarks/lm_eval_scale.py                       # the embedded default model, kvquant_mmlu
    python benchmarks/lm_eval_scale.py --model DIR --limit 8 --skip-ranks

Batch: one KVQuantLM scores the task's requests with batch size 1, then with each --batch-sizes value (the
same model object, lm-eval's simple_evaluate); the time of each pass, the speed-up over batch 1 and the
largest log-likelihood difference from batch 1 are reported. Ranks: the `kvquant-lm-eval` command (python -m
kvquant.eval.lm_eval_cli) run once as one process and once under `torchrun --standalone --nproc-per-node 2`,
wall time from start to end (imports and model loading included), and whether the two give the same samples.
The machine's load average is recorded with every timing. Writes benchmarks/results/lm_eval_scale.{md,csv}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "eval" / "tasks"


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def batch_rows(model: str | None, scheme: str, chunk: int, limit: int, sizes: list[int]) -> list[dict]:
    import lm_eval
    import torch
    from kvquant.eval.lm_eval_model import KVQuantLM
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(1)
    lm = KVQuantLM(pretrained=model, scheme=scheme, chunk=chunk, device="cpu")
    tm = TaskManager(include_path=[str(TASKS)], include_defaults=False)
    rows, base = [], None
    for size in [1, *sizes]:
        lm.batch_size_per_gpu = size
        lm._prefix = None
        before = load()
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=["kvquant_mmlu"], limit=limit, task_manager=tm,
                                      log_samples=True, bootstrap_iters=0)
        seconds = time.perf_counter() - t0
        ll = {(s["doc_id"], i): float(r[0][0]) for s in out["samples"]["kvquant_mmlu"]
              for i, r in enumerate(s["resps"])}
        base = base or (seconds, ll)
        rows.append({"what": f"batch {size}", "model": model or "default", "scheme": scheme, "chunk": chunk,
                     "docs": limit, "seconds": round(seconds, 2), "speedup": round(base[0] / seconds, 2),
                     "max_ll_diff_vs_batch1": max(abs(v - base[1][k]) for k, v in ll.items()),
                     "acc": out["results"]["kvquant_mmlu"]["acc,none"], "load": f"{before} -> {load()}"})
    return rows


def rank_rows(model: str | None, scheme: str, chunk: int, limit: int) -> list[dict]:
    args = f"scheme={scheme},chunk={chunk}" + (f",pretrained={model}" if model else "")
    entry = ["-m", "kvquant.eval.lm_eval_cli", "--model", "kvquant", "--model_args", args, "--include_path",
             str(TASKS), "--tasks", "kvquant_mmlu", "--limit", str(limit), "--device", "cpu", "--log_samples"]
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    runner = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    launch = {1: [sys.executable], 2: [*runner, "--standalone", "--nproc-per-node", "2"]}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    rows, samples = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for n, cmd in launch.items():
            out = Path(tmp) / f"w{n}"
            before = load()
            t0 = time.perf_counter()
            proc = subprocess.run([*cmd, *entry, "--output_path", str(out)], capture_output=True, text=True,
                                  env=env, cwd=tmp)
            seconds = time.perf_counter() - t0
            if proc.returncode != 0:
                raise SystemExit(f"{n} process(es) failed:\n{proc.stderr[-3000:]}")
            lines = next(out.rglob("samples_kvquant_mmlu_*.jsonl")).read_text().splitlines()
            samples[n] = {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in map(json.loads, lines)}
            metrics = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["kvquant_mmlu"]
            rows.append({"what": f"{n} process(es)", "model": model or "default", "scheme": scheme,
                         "chunk": chunk, "docs": limit, "seconds": round(seconds, 2),
                         "acc": metrics["acc,none"], "load": f"{before} -> {load()}"})
    same_docs = samples[1].keys() == samples[2].keys()
    diffs = [abs(a - b) for d in samples[1] for a, b in zip(samples[1][d], samples[2].get(d, []),
                                                            strict=False)]
    for r in rows:
        r["speedup"] = round(rows[0]["seconds"] / r["seconds"], 2)
        r["same_samples_as_1"] = samples[1] == samples[2]
        r["max_ll_diff_vs_1_process"] = max(diffs) if same_docs and diffs else None
    return rows


def write(out: Path, rows: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = ["what", "model", "scheme", "chunk", "docs", "seconds", "speedup", "max_ll_diff_vs_batch1",
              "acc", "same_samples_as_1", "max_ll_diff_vs_1_process", "load"]
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)
    md = [f"# lm-eval at scale ({os.cpu_count()} CPUs, OMP_NUM_THREADS=1 per process)", "",
          "| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    md += ["| " + " | ".join(str(r.get(k, "")) for k in fields) + " |" for r in rows]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    sys.stdout.write("\n".join(md) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a local model folder or .gguf (default: the embedded one)")
    p.add_argument("--scheme", default="int4-g64")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--limit", type=int, default=16, help="MMLU questions (4 requests each)")
    p.add_argument("--batch-sizes", default="4,8")
    p.add_argument("--skip-ranks", action="store_true")
    p.add_argument("--skip-batch", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lm_eval_scale"))
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",") if s]
    rows = [] if args.skip_batch else batch_rows(args.model, args.scheme, args.chunk, args.limit, sizes)
    write(Path(args.out), rows)  # the batch rows stay on disk if a rank run fails
    if not args.skip_ranks:
        rows += rank_rows(args.model, args.scheme, args.chunk, args.limit)
        write(Path(args.out), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
