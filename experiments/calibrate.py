"""Fit the codebooks of non-uniform (nuqN) specs and the rotations of -crot specs (`kvquant.codecs.calibrot`:
learned to preserve the attention output) on calibration text and write them (safetensors + JSON).

    python experiments/calibrate.py --scheme 'k=nuq3-channel-g64-prerope,v=nuq3-g64' \\
        --out calib/smollm2-nuq3.safetensors
    python experiments/calibrate.py --model PATH --scheme nuq4-g64 --scheme nuq2-g32 \\
        --out calib/mine.safetensors
    python experiments/calibrate.py --scheme int2-g64-crot --docs 3 --length 1024 \\
        --out calib/smollm2-crot.safetensors     # 2 documents fit the rotations, the 3rd is held out
    python experiments/calibrate.py --merge calib/smollm2-nuq.safetensors \\
        --merge calib/smollm2-crot.safetensors --out calib/smollm2-mixed.safetensors  # one calib= for both

Then use the scheme with `,calib=calib/smollm2-nuq3.safetensors` (printed at the end). Calibration text:
Wikipedia articles of at least --length tokens and fewer than 8,192 (the 8k evaluation's articles are
excluded). On a CPU shared with other jobs, run with OMP_NUM_THREADS=1: torch's threads then stop fighting
(~8x faster).
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvquant.eval.config import RunError, check_model_path, check_seed, model_facts, script_parser

from kvquant.scheme import SchemeError, parse_scheme


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--scheme", action="append", help="a scheme with nuqN or -crot specs (repeatable)")
    p.add_argument(
        "--merge", action="append", default=[],
        help="instead of fitting, merge these calibration files (repeatable, >= 2) into --out",
    )
    p.add_argument(
        "--out", required=True, help="output file NAME.safetensors (NAME.json is written beside it)"
    )
    p.add_argument("--model", default=None, help="local HF folder or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument("--corpus", default="wikipedia")
    p.add_argument("--docs", type=int, default=8, help="calibration documents (default 8)")
    p.add_argument("--length", type=int, default=2048, help="tokens per document (default 2048)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-samples", type=int, default=1_000_000, help="values per codebook fit (default 1M)")
    fit = p.add_argument_group("-crot rotation fit (kvquant.fitting.RotationFit)")
    fit.add_argument("--rotation-docs", type=int, default=2, help="documents the rotations fit on (2)")
    fit.add_argument("--rotation-tokens", type=int, default=1024, help="tokens of each (default 1,024)")
    fit.add_argument("--rotation-steps", type=int, default=100, help="Adam steps (default 100)")
    fit.add_argument("--rotation-queries", type=int, default=128,
                     help="sampled queries per document (default 128)")
    return p


def check_args(args: argparse.Namespace) -> list[str]:
    """Everything that needs no torch, before the model loads; returns the schemes with calib=--out.
    Raises RunError (or SchemeError) naming the fix."""
    if not args.out.endswith(".safetensors"):
        raise RunError(f"--out must end in .safetensors, got {args.out!r}")
    for flag, value, low, why in (
        ("--docs", args.docs, 1, "calibration documents; 0 would not mean all of them"),
        ("--length", args.length, 2, "tokens per calibration document"),
        ("--max-samples", args.max_samples, 1, "values per codebook fit"),
        ("--rotation-docs", args.rotation_docs, 1, "documents the -crot rotations fit on"),
        ("--rotation-tokens", args.rotation_tokens, 2, "tokens per rotation-fit document"),
        ("--rotation-steps", args.rotation_steps, 1, "Adam steps of the rotation fit"),
        ("--rotation-queries", args.rotation_queries, 1, "sampled queries per rotation-fit document"),
    ):
        if value < low:
            raise RunError(f"{flag} {value} must be at least {low} ({why})")
    check_seed(args.seed)
    schemes = []
    for text in args.scheme:  # calib= is what this command writes
        if any(not i.strip() for i in text.split(",")):
            parse_scheme(text)  # refuses the empty item (a trailing comma) as the user wrote it
        items = [i for i in text.split(",") if not i.strip().lower().startswith("calib=")]
        scheme = parse_scheme(",".join(items + [f"calib={args.out}"]))
        if not scheme.needs_calibration:
            raise RunError(
                f"scheme {text!r} has no codebook (nuqN) spec and no calibrated rotation (-crot), so there "
                "is nothing to calibrate; use nuq4/nuq3/nuq2 or -crot specs, e.g. --scheme nuq4-g64, "
                "--scheme 'k=nuq3-channel-g64-prerope,v=nuq3-g64' or --scheme int2-g64-crot"
            )
        schemes.append(str(scheme))
    try:
        check_model_path(args.model)
    except RunError as e:
        raise RunError(f"--model: {e}") from None
    facts = model_facts(args.model)
    if facts.positions is not None and args.length > facts.positions:
        raise RunError(f"--length {args.length} is beyond the model's {facts.positions} positions "
                       f"({facts.source})")
    if facts.layers is not None:
        for s in schemes:
            parse_scheme(s).check_num_layers(facts.layers)
    return schemes


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.merge:
        return _merge(args)
    if not args.scheme:
        print("calibrate.py: error: give --scheme (to fit) or --merge FILE --merge FILE", file=sys.stderr)
        return 2
    try:  # validate before heavy imports
        schemes = check_args(args)
    except (RunError, SchemeError) as e:
        print(f"calibrate.py: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from kvquant.eval.calibration import run_calibration

    from kvquant.fitting import RotationFit

    path, with_calib = run_calibration(
        schemes,
        args.out,
        model_path=args.model,
        corpus=args.corpus,
        docs=args.docs,
        length=args.length,
        seed=args.seed,
        max_samples=args.max_samples,
        rotation=RotationFit(
            args.rotation_docs, args.rotation_tokens, args.rotation_steps, args.rotation_queries
        ),
    )
    print(f"wrote {path} and its .json; schemes:")
    for s in with_calib:
        print(f"  {s}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    """--merge A --merge B --out C: every table of A and B in C (`kvquant.calibration.merge_calibrations`)."""
    from kvquant.calibration import CalibrationError, merge_calibrations

    if args.scheme:
        print("calibrate.py: error: --merge takes no --scheme (it fits nothing)", file=sys.stderr)
        return 2
    try:
        st, _ = merge_calibrations(args.merge, args.out)
    except CalibrationError as e:
        print(f"calibrate.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {st} and its .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
