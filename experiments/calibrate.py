"""Fit the codebooks of non-uniform (nuqN) specs on calibration text and write them (safetensors + JSON).

    python experiments/calibrate.py --scheme 'k=nuq3-channel-g64-prerope,v=nuq3-g64' \\
        --out calib/smollm2-nuq3.safetensors
    python experiments/calibrate.py --model PATH --scheme nuq4-g64 --scheme nuq2-g32 \\
        --out calib/mine.safetensors

Then use the scheme with `,calib=calib/smollm2-nuq3.safetensors` (printed at the end). Calibration text:
Wikipedia articles of at least --length tokens and fewer than 8,192 (the 8k evaluation's articles are
excluded). On a CPU shared with other jobs, run with OMP_NUM_THREADS=1: torch's threads then stop fighting
(~8x faster).
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvquant.scheme import SchemeError, parse_scheme


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheme", action="append", required=True, help="a scheme with nuqN specs (repeatable)")
    p.add_argument(
        "--out", required=True, help="output file NAME.safetensors (NAME.json is written beside it)"
    )
    p.add_argument("--model", default=None, help="local HF folder or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument("--corpus", default="wikipedia")
    p.add_argument("--docs", type=int, default=8, help="calibration documents (default 8)")
    p.add_argument("--length", type=int, default=2048, help="tokens per document (default 2048)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-samples", type=int, default=1_000_000, help="values per codebook fit (default 1M)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.out.endswith(".safetensors"):
        print(f"calibrate.py: --out must end in .safetensors, got {args.out!r}", file=sys.stderr)
        return 2
    schemes = []
    for text in args.scheme:  # validate before heavy imports; calib= is what this command writes
        items = [i for i in text.split(",") if not i.strip().lower().startswith("calib=")]
        try:
            schemes.append(str(parse_scheme(",".join(items + [f"calib={args.out}"]))))
        except SchemeError as e:
            print(f"calibrate.py: {e}", file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from kvquant.eval.calibration import run_calibration

    path, with_calib = run_calibration(
        schemes,
        args.out,
        model_path=args.model,
        corpus=args.corpus,
        docs=args.docs,
        length=args.length,
        seed=args.seed,
        max_samples=args.max_samples,
    )
    print(f"wrote {path} and its .json; schemes:")
    for s in with_calib:
        print(f"  {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
