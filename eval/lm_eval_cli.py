"""`kvquant-lm-eval` (or `python -m kvquant.eval.lm_eval_cli`): lm-eval's own command line with the
`kvquant` model registered, failing fast.

lm-eval's argument parser is light, so the command line is parsed first and the `kvquant` model's
`--model_args` (scheme, chunk, backend, dtype, pretrained path, batch size, device map) and `--device` are
checked (`kvquant.eval.lm_eval_args`) before torch, transformers or lm-eval's models are imported: a typo
is one line on stderr and exit status 2 at once, not a traceback after a minute of imports. Then the model
module is imported, which registers `kvquant` (lm-eval finds no plug-ins), and lm-eval runs. `KVQuantLM`
runs the same checks. Under torchrun or accelerate launch, every rank runs this module:

    torchrun --standalone --nproc-per-node 2 -m kvquant.eval.lm_eval_cli --model kvquant ...
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from kvquant.scheme import parse_scheme

from .lm_eval_args import (
    BACKENDS,
    DTYPE_ALIASES,
    HUB_ONLY_ARGS,
    KNOWN_MODEL_ARGS,
    batch_size_of,
    check_device,
    check_model_args,
    scheme_display,
)

__all__ = [
    "BACKENDS", "DTYPE_ALIASES", "HUB_ONLY_ARGS", "KNOWN_MODEL_ARGS", "batch_size_of", "check_model_args",
    "cli", "wandb_defaults",
]

PROG = "kvquant-lm-eval"


def wandb_defaults(argv: Sequence[str]) -> dict[str, str]:
    """W&B environment defaults for an lm-eval run with `--wandb_args`: the group `lm-eval <tasks>` (every
    scheme run on the same tasks lands in one group) and the run named by its scheme; `group=` / `name=` in
    --wandb_args, or WANDB_RUN_GROUP / WANDB_NAME already set, win. Empty without --wandb_args."""
    args = list(argv)
    if "--wandb_args" not in args and not any(a.startswith("--wandb_args=") for a in args):
        return {}

    def value(flag: str) -> str | None:
        for i, a in enumerate(args):
            if a == flag and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    out = {"WANDB_RUN_GROUP": f"lm-eval {value('--tasks') or 'tasks'}"}
    model_args = value("--model_args") or ""
    scheme = next((kv.split("=", 1)[1] for kv in model_args.split(",") if kv.startswith("scheme=")), "fp16")
    try:
        out["WANDB_NAME"] = scheme_display(parse_scheme(scheme.replace(";", ",")))
    except ValueError:
        pass  # the argument check reports a bad scheme in one line; no name here
    return out


def _default_device(args) -> None:
    """lm-eval's default device is cuda:0: without --device (or a --config that may set it) on a machine
    with no CUDA device, run on the CPU and say so, instead of failing after the model has loaded."""
    if getattr(args, "device", None) is not None or getattr(args, "config", None):
        return
    import torch

    if not torch.cuda.is_available():
        args.device = "cpu"
        print(f"{PROG}: no CUDA device; running on --device cpu (pass --device to choose)", file=sys.stderr)


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def cli(argv: Sequence[str] | None = None) -> None:
    """lm-eval's CLI: parse, check the kvquant model's arguments, then register the model and run. With
    --wandb_args, the W&B group and run name default to `wandb_defaults`."""
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.utils import setup_logging

    for var, default in wandb_defaults(sys.argv[1:] if argv is None else argv).items():
        os.environ.setdefault(var, default)  # read by the wandb.init lm-eval's WandbLogger calls
    try:
        sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
        parser = HarnessCLI()
        args = parser.parse_args()  # usage errors exit here, with status 2
        if getattr(args, "command", None) == "run" and getattr(args, "model", None) == "kvquant":
            try:
                model_args = getattr(args, "model_args", None) or {}
                check_model_args(model_args)
                batch_size_of(getattr(args, "batch_size", 1))
                _default_device(args)
                check_device(getattr(args, "device", None))
            except (ValueError, TypeError, OSError) as e:  # SchemeError, FileNotFoundError included
                _fail(str(e))
        setup_logging()
        import kvquant.eval.lm_eval_model  # noqa: F401 - registers the `kvquant` model (heavy imports)

        parser.execute(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    cli()
