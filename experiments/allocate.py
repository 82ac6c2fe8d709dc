"""Choose a spec per layer and K/V that minimizes predicted KL at an average-bits budget; print the scheme.

    python experiments/allocate.py --budget-bits 3.0 --calib calib/smollm2-nuq.safetensors --window 128
    python experiments/allocate.py --budget-bits 4.0 --uniform-only   # int candidates, no calibration file

Sensitivities (KL when only one layer's K or V is quantized, per candidate) are measured in cache mode on
calibration text (Wikipedia articles shorter than 8,192 tokens: never the 8k evaluation's), saved to
--out/sensitivity.json (reused on a rerun), and the choice is an exact MILP (scipy). The output is an ordinary
scheme string (`layers=...`), with its effective bits, the predicted KL (sum of sensitivities) and the KL
measured with the whole scheme on the same calibration text; --eval-docs N also measures it and the --compare
recipes on N held-out evaluation articles (>= 8,192 tokens, cut to --eval-length).
On a CPU shared with other jobs, run with OMP_NUM_THREADS=1: torch's threads then stop fighting (~8x faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import NamedTuple

from kvquant.eval.config import MAX_SEED

from kvquant.scheme import Scheme, SchemeError, parse_scheme, parse_spec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-bits", type=float, required=True, help="average effective bits per K/V value")
    p.add_argument("--model", default=None)
    p.add_argument(
        "--calib", default=None, help="calibration file for nuqN candidates (experiments/calibrate.py)"
    )
    p.add_argument(
        "--uniform-only", action="store_true", help="int candidates only (no calibration file needed)"
    )
    p.add_argument("--key-candidates", default=None, help="comma-separated K specs")
    p.add_argument("--value-candidates", default=None, help="comma-separated V specs")
    p.add_argument("--sink", type=int, default=0)
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--docs", type=int, default=1, help="calibration documents for sensitivities (default 1)")
    p.add_argument("--length", type=int, default=1024, help="tokens per calibration document (default 1024)")
    p.add_argument("--eval-docs", type=int, default=0, help="held-out articles to measure KL on (default 0)")
    p.add_argument("--eval-length", type=int, default=2048)
    p.add_argument(
        "--compare", action="append", default=[], help="uniform recipes to measure beside (repeatable)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--group", type=int, default=1, help="consecutive layers measured and chosen together (default 1)"
    )
    p.add_argument("--out", default="runs/allocation", help="folder for sensitivity.json and allocation.json")
    p.add_argument(
        "--around",
        default=None,
        help="a uniform recipe at the budget: joint sensitivities at that operating point (every other layer "
        "quantized with it while one group switches); its specs join the candidates",
    )
    p.add_argument(
        "--rounds", type=int, default=1,
        help="with --around: measure again around each round's choice and choose again (default 1); the "
        "result is the choice with the lowest measured calibration KL, the --around recipe included",
    )
    p.add_argument(
        "--write-calib",
        action="store_true",
        help="store the allocation in --calib: budget=B,calib=FILE then resolves to it in every tool",
    )
    return p


def _check_numbers(args: argparse.Namespace) -> None:
    """Raise SchemeError for a budget, size or seed out of range."""
    if not 0 < args.budget_bits <= 16:  # nan fails too
        raise SchemeError(f"--budget-bits {args.budget_bits} must be in (0, 16]")
    for flag, value, low, why in (
        ("--group", args.group, 1, "consecutive layers measured and chosen together"),
        ("--docs", args.docs, 1, "calibration documents for the sensitivities"),
        ("--length", args.length, 2, "tokens per calibration document"),
        ("--eval-docs", args.eval_docs, 0, "held-out articles; 0 skips the check"),
        ("--eval-length", args.eval_length, 2, "tokens per held-out article"),
        ("--rounds", args.rounds, 1, "rounds of joint sensitivities"),
    ):
        if value < low:
            raise SchemeError(f"{flag} {value} must be at least {low} ({why})")
    if not 0 <= args.seed <= MAX_SEED:
        raise SchemeError(f"--seed {args.seed} must lie in 0..{MAX_SEED}")


class _Parsed(NamedTuple):
    """The command line's specs and schemes, parsed before torch is imported (a NamedTuple, not a dataclass:
    it also works when the script is loaded by importlib without a sys.modules entry)."""

    key_candidates: list[str] | None  # None: the default candidates
    value_candidates: list[str] | None
    base: Scheme  # fp16 with --sink / --window (and --calib)
    compare: list[Scheme]
    around: Scheme | None  # the --around operating point, with --sink / --window


def _parse_schemes(args: argparse.Namespace) -> _Parsed:
    """Check the numbers and parse every spec and scheme on the command line (SchemeError if one is bad)."""
    _check_numbers(args)
    kc = args.key_candidates.split(",") if args.key_candidates else None
    vc = args.value_candidates.split(",") if args.value_candidates else None
    for s in (kc or []) + (vc or []):
        parse_spec(s)
    base = parse_scheme(
        f"fp16,sink={args.sink},window={args.window}" + (f",calib={args.calib}" if args.calib else "")
    )
    compare = [parse_scheme(s) for s in args.compare]
    around = None
    if args.around:
        with_calib = args.calib and "calib=" not in args.around
        text = args.around + (f",calib={args.calib}" if with_calib else "")
        around = dataclasses.replace(parse_scheme(text), sink=args.sink, window=args.window)
        if around.layers:
            raise SchemeError("--around is a uniform recipe (one k= and v=), not a per-layer scheme")
    if args.write_calib and not args.calib:
        raise SchemeError("--write-calib stores the allocation in the calibration file; give --calib")
    if args.rounds > 1 and around is None:
        raise SchemeError("--rounds measures again around each choice: it needs --around (joint)")
    return _Parsed(kc, vc, base, compare, around)


def _candidates(args: argparse.Namespace, parsed: _Parsed, A) -> tuple[list[str], list[str]]:
    """The K and V candidate specs (given or default, plus --around's); SchemeError if one is unfit."""
    kc, vc, around = parsed.key_candidates, parsed.value_candidates, parsed.around
    if kc is None:
        kc = list(A.UNIFORM_KEY_CANDIDATES if args.uniform_only else A.DEFAULT_KEY_CANDIDATES)
    if vc is None:
        vc = list(A.UNIFORM_VALUE_CANDIDATES if args.uniform_only else A.DEFAULT_VALUE_CANDIDATES)
    if around is not None:  # the operating point is always a choice
        kc += [str(around.key)] if str(around.key) not in map(str, map(parse_spec, kc)) else []
        vc += [str(around.value)] if str(around.value) not in map(str, map(parse_spec, vc)) else []
    specs = [parse_spec(s) for s in kc + vc]
    if any(s.prerope for s in map(parse_spec, vc)):
        raise SchemeError("-prerope applies to keys only; remove it from --value-candidates")
    if any(s.needs_calibration for s in specs) and not args.calib:
        raise SchemeError(
            "nuqN and -crot candidates need --calib FILE (experiments/calibrate.py), or --uniform-only"
        )
    return kc, vc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # the arguments are checked before torch is imported
        parsed = _parse_schemes(args)
    except SchemeError as e:
        print(f"allocate.py: {e}", file=sys.stderr)
        return 2
    from kvquant.eval import allocation as A

    try:
        kc, vc = _candidates(args, parsed, A)
    except SchemeError as e:
        print(f"allocate.py: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = A.run_allocation(
        args.budget_bits,
        kc,
        vc,
        parsed.base,
        model_path=args.model,
        docs=args.docs,
        length=args.length,
        eval_docs=args.eval_docs,
        eval_length=args.eval_length,
        compare=parsed.compare,
        seed=args.seed,
        group=args.group,
        out=Path(args.out),
        around=parsed.around,
        write_calib=args.write_calib,
        rounds=args.rounds,
    )
    print(json.dumps({k: v for k, v in result.items() if k != "choice"}, indent=1))
    print(result["scheme"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
