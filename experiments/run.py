"""Evaluate KV-cache quantization schemes: perplexity drift by position, KL and top-1 vs FP16, bytes/token.

    python experiments/run.py --scheme int4-g64   # FP16 + int4-g64, default model + Wikipedia
    python experiments/run.py --schemes int8,int4-g64,kivi-2,hf-quanto-int4 --mode both --docs 4
    python experiments/run.py --list-schemes

Results go to a run directory (default runs/<name from the config>): config.json, results.jsonl, summary.csv,
report.md, drift_vs_length.png, bytes_per_token.png. Rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

logger = logging.getLogger("kvquant.run")

QUICK = {"max_length": 1024, "chunk": 256, "docs": 1}


def build_parser() -> argparse.ArgumentParser:
    from kvquant.eval.runner import DEFAULT_CHUNK, DEFAULT_DOCS, DEFAULT_MAX_LENGTH

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--mode", default="cache", choices=["cache", "fake", "both"])
    p.add_argument(
        "--max-length", type=int, default=None, help=f"tokens per document (default {DEFAULT_MAX_LENGTH})"
    )
    p.add_argument(
        "--chunk", type=int, default=None, help=f"tokens per forward in cache mode (default {DEFAULT_CHUNK})"
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--docs", type=int, default=None, help=f"documents to evaluate (default {DEFAULT_DOCS})"
    )
    budget.add_argument(
        "--tokens", type=int, default=None, help="token budget (documents = ceil(tokens/max-length))"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the document order")
    p.add_argument("--out", default=None, help="run directory (default runs/<derived from the config>)")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype", default="float32", help="float32 | float16 | bfloat16 (model and unquantized K/V)"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 1 document of 1,024 tokens, chunk 256")
    p.add_argument("--force", action="store_true", help="replace an existing run directory")
    p.add_argument("--wandb", default="disabled", choices=["online", "offline", "disabled"])
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


def config_from_args(args: argparse.Namespace):
    from kvquant.eval.runner import DEFAULT_CHUNK, DEFAULT_MAX_LENGTH, RunConfig

    schemes = list(args.scheme) + split_schemes(args.schemes)
    quick = QUICK if args.quick else {}
    return RunConfig(
        schemes=tuple(schemes),
        model=args.model,
        corpus=args.corpus,
        mode=args.mode,
        max_length=args.max_length or quick.get("max_length", DEFAULT_MAX_LENGTH),
        chunk=args.chunk or quick.get("chunk", DEFAULT_CHUNK),
        docs=args.docs if args.docs is not None else (quick.get("docs") if args.tokens is None else None),
        tokens=args.tokens,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        out=args.out,
        force=args.force,
        wandb=args.wandb,
        extra={"wandb_project": args.wandb_project, "wandb_group": args.wandb_group},
    )


def log_to_wandb(run_dir, config) -> None:
    """After the results are on disk: any W&B failure is a warning, never an error."""
    if config.wandb == "disabled":
        return
    try:
        from kvquant.eval.wandb_logger import log_run

        log_run(
            run_dir,
            config.wandb,
            project=config.extra.get("wandb_project"),
            group=config.extra.get("wandb_group"),
        )
    except Exception as e:  # noqa: BLE001 - W&B never touches local results or the exit code
        logger.warning(
            "W&B logging failed (local results are intact in %s): %s: %s", run_dir, type(e).__name__, e
        )


def main(config, *, model=None, tokenizer=None) -> int:
    """Run one configuration; print the markdown table. Returns the exit code."""
    import time

    from kvquant.eval import results as res
    from kvquant.eval.runner import RunError, run

    t0 = time.perf_counter()
    try:
        run_dir, summary = run(config, model=model, tokenizer=tokenizer)
    except RunError as e:
        logger.error("%s", e)
        return 2
    log_to_wandb(run_dir, config)
    print(res.markdown_table(summary))
    print(f"results: {run_dir}  ({time.perf_counter() - t0:.0f} s)")
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.list_schemes:
        from kvquant.eval.schemes import schemes_help

        print(schemes_help())
        return 0
    config = config_from_args(args)
    if not config.schemes:
        build_parser().error("name at least one scheme: --scheme int4-g64 (see --list-schemes)")
    return main(config)


if __name__ == "__main__":
    sys.exit(cli())
