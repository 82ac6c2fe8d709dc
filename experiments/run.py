"""Evaluate KV-cache quantization schemes: perplexity drift by position, KL and top-1 vs FP16, bytes/token.

    python experiments/run.py --scheme int4-g64   # FP16 + int4-g64, default model + Wikipedia
    python experiments/run.py --schemes int8,int4-g64,kivi-2,hf-quanto-int4 --mode both --docs 4
    python experiments/run.py --list-schemes
    python experiments/run.py --task passkey --schemes int8,int4-g64 --lengths 512,1k,2k --depths 0,0.5,1
    torchrun --nproc-per-node 4 experiments/run.py --schemes int8,int4-g64 --device cuda --out runs/x
    python experiments/run.py --schemes int8,int4-g64 --out runs/x --shard 0/4   # ... 3/4, then --merge

Results go to a run directory (default runs/<name from the config>): config.json, results.jsonl, summary.csv,
report.md, drift_vs_length.png, bytes_per_token.png. Rerunning the same command resumes. Running at scale
(torchrun ranks, job arrays): docs/scale.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

# Light imports only until the arguments are checked: kvquant.eval.config and kvquant.scheme need no torch,
# so a usage error or an unknown scheme is reported at once; the runner (torch, transformers) comes after.
from kvquant.eval.config import (
    DEFAULT_CHUNK,
    DEFAULT_DOCS,
    DEFAULT_MAX_LENGTH,
    EXIT_USAGE,
    MODE_CHOICES,
    TASKS,
    WANDB_MODES,
    RunConfig,
    RunError,
    RunIncomplete,
    RunInterrupted,
    parse_depths,
    parse_lengths,
    parse_shard,
    script_parser,
    validate,
)

logger = logging.getLogger("kvquant.run")

QUICK = {"max_length": 1024, "chunk": 256, "docs": 1}
QUICK_RETRIEVAL = {"lengths": "256,512", "depths": "0,0.5,1", "trials": 2}
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
EXIT_FAILED = 1  # the run finished, but a scheme failed (its rows in results.jsonl say why)


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument(
        "--scheme", action="append", default=[], help="a scheme string (repeatable); see --list-schemes"
    )
    p.add_argument(
        "--schemes",
        default="",
        help="several schemes, comma-separated where unambiguous; use "
        "--scheme for schemes holding commas (k=...,v=...)",
    )
    p.add_argument("--list-schemes", action="store_true", help="print the scheme grammar, presets and peers")
    p.add_argument(
        "--model", default=None, help="local HF model folder or .gguf file (default: embedded SmolLM2)"
    )
    p.add_argument(
        "--corpus", default="wikipedia", help="wikipedia | shakespeare | a .txt/.jsonl file or folder"
    )
    p.add_argument(
        "--task",
        default="ppl",
        choices=TASKS,
        help="ppl: perplexity drift by position (default); passkey / needle: retrieval of a key hidden in "
        "filler text, over --lengths x --depths",
    )
    p.add_argument("--mode", default="cache", choices=MODE_CHOICES)
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help=f"tokens per document, >= 2 (default {DEFAULT_MAX_LENGTH})",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=None,
        help=f"tokens per forward in cache mode (default {DEFAULT_CHUNK}; peers hf-*: 128, their residual)",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--docs", type=int, default=None, help=f"documents to evaluate (default {DEFAULT_DOCS})"
    )
    budget.add_argument(
        "--tokens", type=int, default=None, help="token budget (documents = ceil(tokens/max-length))"
    )
    p.add_argument("--lengths", default=None, help="retrieval: prompt lengths: 512,1k (default 1k,2k,4k)")
    p.add_argument("--depths", default=None, help="retrieval: key depths in [0, 1] (default 0,.25,.5,.75,1)")
    p.add_argument("--trials", type=int, default=None, help="retrieval: keys per cell (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seeds the document order (retrieval: keys, filler)")
    p.add_argument("--out", default=None, help="run directory (default runs/<derived from the config>)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps (must be available)")
    p.add_argument("--device-map", default=None, metavar="auto|balanced|FILE",
                   help="split the model across devices (accelerate; FILE: JSON module -> device); "
                   "--device is then ignored")
    p.add_argument(
        "--dtype", default="float32", help="float32 | float16 | bfloat16 (model and unquantized K/V)"
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 1 document of 1,024 tokens, chunk 256 (flags win)"
    )
    p.add_argument(
        "--kv-dtype", default="fp16", help="storage dtype of the reported bytes and savings: fp16|bf16|fp32"
    )
    p.add_argument(
        "--prefill", type=int, default=None, help="prefill mode: prompt tokens in one FP forward (L/2)"
    )
    p.add_argument(
        "--no-reference-cache", action="store_true", help="recompute the reference pass (default: reuse it)"
    )
    p.add_argument(
        "--noise-floor",
        action="store_true",
        help="measure cache mode a second time with chunk boundaries shifted by chunk/2 + 1; report "
        "|drift difference| (the realization noise of float rounding)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing run directory")
    sharding = p.add_mutually_exclusive_group()
    sharding.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="a job-array task: measure shard I (0-based) of N of the run's points into the shared --out "
        "(no report); under torchrun the ranks shard themselves (docs/scale.md)",
    )
    sharding.add_argument(
        "--merge",
        action="store_true",
        help="measure nothing: write summary, report and plots from every shard's results in --out",
    )
    p.add_argument("--wandb", default="disabled", choices=WANDB_MODES)
    p.add_argument("--wandb-project", default=None)
    p.add_argument("--wandb-group", default=None)
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def split_schemes(text: str) -> list[str]:
    """`a,b,c` -> [a, b, c], keeping k=/v=/sink=/window= items with the scheme they belong to."""
    out: list[str] = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        starts_new = "=" not in item or item.startswith(("k=", "key="))
        if out and not starts_new:
            out[-1] += "," + item  # v=, sink=, window= belong to the scheme before them
        else:
            out.append(item)
    return out


def _given(value, quick_key: str, quick: dict, default):
    """An explicit flag wins (0 too: refused later, never replaced), then --quick, then the default."""
    if value is not None:
        return value
    return quick.get(quick_key, default)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """RunConfig from parsed flags; raises RunError for values that make no sense."""
    quick = QUICK if args.quick else {}
    grid: dict = {}
    if args.task != "ppl":
        given = [f for f, v in (("--max-length", args.max_length), ("--docs", args.docs),
                                ("--tokens", args.tokens), ("--prefill", args.prefill)) if v is not None]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise RunError(f"{', '.join(given)} {verb} to --task ppl; retrieval: --lengths/--depths/--trials")
        q = QUICK_RETRIEVAL if args.quick else {}
        lengths, depths = _given(args.lengths, "lengths", q, None), _given(args.depths, "depths", q, None)
        grid = {
            "lengths": parse_lengths(lengths) if lengths is not None else None,
            "depths": parse_depths(depths) if depths is not None else None,
            "trials": _given(args.trials, "trials", q, None),
        }
        quick = {}
    elif args.lengths is not None or args.depths is not None or args.trials is not None:
        raise RunError("--lengths, --depths and --trials apply to --task passkey|needle")
    docs = args.docs
    if docs is None and args.tokens is None:
        docs = quick.get("docs")
    return RunConfig(
        schemes=tuple(args.scheme) + tuple(split_schemes(args.schemes)),
        model=args.model,
        corpus=args.corpus,
        mode=args.mode,
        max_length=_given(args.max_length, "max_length", quick, DEFAULT_MAX_LENGTH),
        chunk=_given(args.chunk, "chunk", quick, None),  # None: DEFAULT_CHUNK, peers their own (128)
        docs=docs,
        tokens=args.tokens,
        seed=args.seed,
        device=args.device,
        device_map=args.device_map,
        dtype=args.dtype,
        out=args.out,
        force=args.force,
        wandb=args.wandb,
        kv_dtype=args.kv_dtype,
        prefill=args.prefill,
        reference_cache=not args.no_reference_cache,
        noise_floor=args.noise_floor,
        task=args.task,
        shard=parse_shard(args.shard) if args.shard is not None else None,
        merge=args.merge,
        **grid,
        extra={"wandb_project": args.wandb_project, "wandb_group": args.wandb_group},
    )


def log_to_wandb(run_dir, config) -> None:
    """After the results are on disk, every task alike (`harness.log_wandb`): a W&B failure is a warning."""
    from kvquant.eval.harness import log_wandb

    log_wandb(run_dir, config.wandb, config.extra.get("wandb_project"), config.extra.get("wandb_group"))


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


def failed_schemes(run_dir) -> list[str]:
    """`scheme (mode): error` of every failure recorded in the run directory's results.jsonl."""
    from pathlib import Path

    from kvquant.eval import results as res

    out: dict[str, None] = {}
    paths = [p for p in res.results_files(Path(run_dir)) if p.is_file()]  # results.jsonl and the shards'
    if not paths:
        return []
    try:
        rows = res.RunResults(run_dir).rows  # every results file as one: torn and foreign lines skipped
    except Exception:  # noqa: BLE001 - a retrieval run's rows, or a reader that refuses: read the lines
        rows = []
        for path in paths:
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    for row in rows:
        if isinstance(row, dict) and row.get("status") == "failed":
            out[f"{row.get('scheme')} ({row.get('mode')}): {row.get('error')}"] = None
    return list(out)


def _report_failures(run_dir) -> int:
    failed = failed_schemes(run_dir)
    for f in failed:
        print(f"error: scheme {f}", file=sys.stderr)
    if failed:
        print(f"error: {len(failed)} scheme run(s) failed; their rows in {run_dir}/results.jsonl say why",
              file=sys.stderr)
        return EXIT_FAILED
    return 0


def main(config: RunConfig, *, model=None, tokenizer=None) -> int:
    """Run one configuration; print the markdown table. Returns the exit code (0; 1 a scheme failed during
    the run; 2 bad input; 130 Ctrl-C or SIGTERM)."""
    import time

    from kvquant.eval import results as res
    from kvquant.eval.runner import run

    t0 = time.perf_counter()
    try:
        run_dir, summary = run(config, model=model, tokenizer=tokenizer)
    except RunError as e:
        return _error(str(e))
    except RunInterrupted as e:
        print(e, file=sys.stderr)
        return EXIT_INTERRUPTED
    except RunIncomplete as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    saved = json.loads((run_dir / "config.json").read_text())
    import os

    sharded = config.shard is not None or int(os.environ.get("WORLD_SIZE", "").strip() or 1) > 1
    if not summary and (sharded or not config.is_retrieval):  # a shard, or a torchrun rank but 0: no report
        print(f"results: {run_dir}  ({time.perf_counter() - t0:.0f} s; this process's part of the run)")
        return _report_failures(run_dir)
    log_to_wandb(run_dir, config)  # perplexity and retrieval runs alike (kvquant.eval.wandb_logger)
    if config.is_retrieval:
        from kvquant.eval.retrieval import summary_table

        print(summary_table(summary, saved.get("scheme_names", {})))
        print(f"results: {run_dir}  ({time.perf_counter() - t0:.0f} s)")
        return _report_failures(run_dir)
    print(res.markdown_table(summary, saved.get("scheme_names", {}), saved.get("kv_dtype", "float16")))
    print(f"results: {run_dir}  ({time.perf_counter() - t0:.0f} s)")
    return _report_failures(run_dir)


def _cli(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.list_schemes:
        from kvquant.eval.schemes import schemes_help

        print(schemes_help())
        return 0
    if not args.scheme and not args.schemes.strip():
        parser.error("name at least one scheme, e.g. --scheme int4-g64 (--list-schemes lists them)")
    try:
        config = config_from_args(args)
        config = validate(config)  # schemes (parsed once), model path, corpus, --out: before torch
        from kvquant.eval.harness import check_wandb

        check_wandb(config.wandb)  # a W&B mode that cannot log: refused before any work, every task alike
    except RunError as e:
        return _error(str(e))
    return main(config)


def _sigterm(signum, frame) -> None:
    raise KeyboardInterrupt  # as Ctrl-C: what was measured is written (report and plots marked partial)


def cli(argv: Sequence[str] | None = None) -> int:
    """The command line; Ctrl-C (or SIGTERM, e.g. from `timeout`) anywhere ends with one line and exit status
    130, never a traceback, after writing what was measured."""
    import signal
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm) if main_thread else None
    try:
        return _cli(argv)
    except RunInterrupted as e:
        print(e, file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume (measured points are kept)", file=sys.stderr)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(cli())
