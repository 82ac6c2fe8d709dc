"""Serving simulation on the CPU: prefix caching, eviction policies and request memory on the page store.

    python experiments/serve.py --quick          # 4 requests of 128 tokens, fp16 + int4-g64, every policy
    python experiments/serve.py --schemes fp16,int4-g64,kivi-4 --requests 8 --context 512 \\
        --shared-fraction 0.9
    python experiments/serve.py --capacity --model llama-3-70b --gpu-gb 80 --weight-bits 4 \\
        --scheme int4-g64 --context 4096 --shared-prefix 2000

Results go to a run directory (default runs/serve-...): config.json, results.jsonl, summary.csv (one row per
scheme x prefix cache on/off x eviction policy), report.md, serve.png. Rerunning the same command resumes an
interrupted run (Ctrl-C, SIGTERM, kill -9), measuring only the rows missing. See kvquant/eval/serve.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

# Light imports only until the arguments are checked (no torch): the simulation module imports torch lazily.
from kvquant.eval.config import EXIT_USAGE, MAX_SEED, script_parser
from kvquant.eval.serve import WANDB_MODES, ServeConfig, ServeError, check_config

logger = logging.getLogger("kvquant.serve")

EXIT_INTERRUPTED = 130
QUICK = dict(
    schemes=("fp16", "int4-g64"),
    requests=4,
    context=128,
    reply=6,
    policies=("lru", "radix-lru", "sliding:48"),
    fit_fp16_requests=2,
    fit_max=16,
)


def build_parser() -> argparse.ArgumentParser:
    d = ServeConfig()
    p = script_parser(__doc__)
    p.add_argument("--scheme", action="append", default=[], help="a scheme (repeatable)")
    p.add_argument("--schemes", default="", help=f"comma-separated schemes (default {','.join(d.schemes)})")
    p.add_argument("--requests", type=int, default=None, help=f"requests (default {d.requests})")
    p.add_argument(
        "--context", type=int, default=None, help=f"prompt tokens per request (default {d.context})"
    )
    p.add_argument(
        "--shared-fraction",
        type=float,
        default=None,
        help=f"system prompt / context (default {d.shared_fraction})",
    )
    p.add_argument("--reply", type=int, default=None, help=f"reply tokens per request (default {d.reply})")
    p.add_argument("--index", default=None, help=f"prefix index: radix | hash (default {d.index})")
    p.add_argument("--policies", default=None, help=f"eviction policies (default {','.join(d.policies)})")
    p.add_argument(
        "--concurrency", type=int, default=None, help=f"requests at once (default {d.concurrency})"
    )
    p.add_argument(
        "--budget-fraction",
        type=float,
        default=None,
        help="eviction rows' budget R + f * (P - R): R the most the running requests held, P the peak with "
        f"every cached unit, in the prefix-cache row without a budget (default {d.budget_fraction})",
    )
    p.add_argument(
        "--fit-fp16-requests",
        type=int,
        default=None,
        help=f"fit probe budget in FP16 requests (default {d.fit_fp16_requests}; 0 skips the probe)",
    )
    p.add_argument("--fit-max", type=int, default=None, help=f"fit probe stops here (default {d.fit_max})")
    p.add_argument("--block-size", type=int, default=None, help=f"tokens per page (default {d.block_size})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="local model (simulation) or a known shape (--capacity)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 keeps torch's choice)")
    p.add_argument(
        "--out", default=None, help="run directory; rerunning the same command resumes it (missing rows only)"
    )
    p.add_argument(
        "--force", action="store_true", help="start the run directory over (removes only files kvquant wrote)"
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 4 requests of 128 tokens, fp16 + int4-g64"
    )
    p.add_argument("--wandb", default="disabled", choices=WANDB_MODES)
    p.add_argument("--wandb-project", default=None)
    p.add_argument("--wandb-group", default=None)
    cap = p.add_argument_group("capacity calculator (--capacity; no model is loaded)")
    cap.add_argument("--capacity", action="store_true", help="print how many requests fit, then exit")
    cap.add_argument("--gpu-gb", type=float, default=80.0)
    cap.add_argument("--weight-bits", type=int, default=16)
    cap.add_argument("--weights-gb", type=float, default=None)
    cap.add_argument("--shared-prefix", type=int, default=0)
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _schemes(args) -> tuple[str, ...]:
    out = list(args.scheme)
    if args.schemes.strip():
        # split like experiments/run.py: k=/v=/sink=/window= items belong to the scheme before them
        for item in (t.strip() for t in args.schemes.split(",") if t.strip()):
            if out and "=" in item and not item.startswith(("k=", "key=")):
                out[-1] += "," + item
            else:
                out.append(item)
    return tuple(out)


def config_from_args(args) -> ServeConfig:
    base = dict(QUICK) if args.quick else {}
    given = dict(
        requests=args.requests,
        context=args.context,
        shared_fraction=args.shared_fraction,
        reply=args.reply,
        index=args.index,
        concurrency=args.concurrency,
        budget_fraction=args.budget_fraction,
        fit_fp16_requests=args.fit_fp16_requests,
        fit_max=args.fit_max,
        block_size=args.block_size,
    )
    base |= {k: v for k, v in given.items() if v is not None}
    schemes = _schemes(args)
    if schemes:
        base["schemes"] = schemes
    if args.policies is not None:
        base["policies"] = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    return ServeConfig(
        **base,
        seed=args.seed,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        out=args.out,
        force=args.force,
        wandb=args.wandb,
        extra={"wandb_project": args.wandb_project, "wandb_group": args.wandb_group},
    )


def check_args(args) -> None:
    """Flags this script reads itself (the rest: `check_config`), before torch; raises ServeError."""
    import math
    import os

    cores = os.cpu_count() or 1
    if not 0 <= args.threads <= 4 * cores:
        raise ServeError(
            f"--threads {args.threads} must lie in 0..{4 * cores} (0 keeps torch's choice; this machine has "
            f"{cores} cores)"
        )
    if not 0 <= args.seed <= MAX_SEED:
        raise ServeError(f"--seed {args.seed} must lie in 0..{MAX_SEED}")
    if not args.capacity:
        return
    if not (math.isfinite(args.gpu_gb) and args.gpu_gb > 0):
        raise ServeError(f"--gpu-gb {args.gpu_gb} must be a finite number of GB above 0, e.g. --gpu-gb 80")
    if args.weights_gb is not None and not (math.isfinite(args.weights_gb) and args.weights_gb >= 0):
        raise ServeError(f"--weights-gb {args.weights_gb} must be a finite number of GB >= 0")
    if not 1 <= args.weight_bits <= 32:
        raise ServeError(f"--weight-bits {args.weight_bits} must lie in 1..32 (16: bf16 weights, 4: int4)")
    context = args.context or 4096
    if context < 1:
        raise ServeError(f"--context {context} must be at least 1 token")
    if not 0 <= args.shared_prefix <= context:
        raise ServeError(
            f"--shared-prefix {args.shared_prefix} must lie in 0..--context {context} (the shared prefix is "
            "part of each request's context)"
        )
    if args.block_size is not None and args.block_size < 1:
        raise ServeError(f"--block-size {args.block_size} must be at least 1 token per page")


def capacity_cli(args) -> int:
    from kvquant.eval.serve import capacity_table

    schemes = _schemes(args) or ("fp16", "int4-g64")
    try:
        print(
            capacity_table(
                args.model or "llama-3-70b",
                args.gpu_gb,
                schemes,
                args.context or 4096,
                args.shared_prefix,
                args.weight_bits,
                args.weights_gb,
                args.block_size or 16,
            )
        )
    except (ServeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def main(config: ServeConfig, *, model=None, tokenizer=None) -> int:
    from kvquant.eval import serve

    try:
        run_dir, summary = serve.run(config, model=model, tokenizer=tokenizer)
    except ServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        serve.log_to_wandb(
            run_dir, config.wandb, config.extra.get("wandb_project"), config.extra.get("wandb_group")
        )
    except Exception as e:  # noqa: BLE001 - W&B never touches local results or the exit code
        logger.warning("W&B logging failed (local results are intact in %s): %s", run_dir, e)
    print(serve.markdown_table(summary, config))
    print(f"results: {run_dir}")
    return 0


def _cli(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        check_args(args)
    except ServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.capacity:
        return capacity_cli(args)
    try:
        config = config_from_args(args)
        config = check_config(config)  # the schemes parsed once, here
    except (ServeError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return main(config)


def cli(argv: Sequence[str] | None = None) -> int:
    try:
        return _cli(argv)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume (measured rows are kept)", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(cli())
