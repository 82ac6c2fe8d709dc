"""Diagnose a model's K/V for quantization: per layer, for K and V, the offset-to-spread ratio, outlier
channels, kurtosis and the SQNR of candidate specs; then a recommended scheme.

    python experiments/diagnose.py                       # the default model, 512 tokens of calibration text
    python experiments/diagnose.py --model path/to/qwen2 --tokens 1024 --json diag.json
    python experiments/diagnose.py --k-candidates int4-g64,int4-g64-center,int2-channel-g32-rot

Calibration text: a Wikipedia article taken from the end of the evaluation's seeded document order
(`experiments/run.py` takes documents from its front), so the diagnosis does not look at evaluation text;
`--random` probes with uniformly drawn token ids instead (enough to show a key bias, which does not depend on
the text). See `kvquant.diagnose` for the definitions.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

# Light imports only until the arguments are checked (as experiments/run.py): a bad spec, model path or corpus
# is reported at once; torch and transformers come after.
from kvquant.eval.config import EXIT_USAGE, RunError, check_model_path, model_facts, script_parser

from kvquant.scheme import SchemeError, parse_spec

K_CANDIDATES = "int4-g64,int4-g64-center,int4-g64-rot,int4-g64-center-rot,int4-channel-g64,int4-g64-out1"
V_CANDIDATES = "int4-g64,int4-g64-center,int4-g64-rot,int4-g64-out1"
PROBE_TOKENS = 512  # kvquant.diagnose.PROBE_TOKENS (run.py's warning probes the same text; tested equal)


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument(
        "--model", default=None, help="local HF model folder or .gguf file (default: embedded SmolLM2)"
    )
    p.add_argument(
        "--corpus", default="wikipedia", help="wikipedia | shakespeare | a .txt/.jsonl file or folder"
    )
    p.add_argument(
        "--tokens", type=int, default=PROBE_TOKENS, help=f"probe tokens (>= 64; default {PROBE_TOKENS})"
    )
    p.add_argument("--random", action="store_true", help="probe with random token ids instead of text")
    p.add_argument("--k-candidates", default=K_CANDIDATES, help="comma-separated key specs to score")
    p.add_argument("--v-candidates", default=V_CANDIDATES, help="comma-separated value specs to score")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--json", default=None, help="also write the statistics to this JSON file")
    return p


def check_args(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Validate everything that needs no torch; returns the candidate specs (canonical). Raises RunError."""
    if args.tokens < 64:
        raise RunError(
            f"--tokens {args.tokens} must be at least 64 (SQNR is taken over whole 64-token groups)"
        )
    cands = []
    for flag, text in (("--k-candidates", args.k_candidates), ("--v-candidates", args.v_candidates)):
        specs = [t.strip() for t in text.split(",") if t.strip()]
        if not specs:
            raise RunError(f"{flag} names no spec")
        try:
            cands.append(tuple(dict.fromkeys(str(parse_spec(s)) for s in specs)))
        except SchemeError as e:
            raise RunError(f"{flag}: {e}") from None
        if any(parse_spec(s).codebook or parse_spec(s).prerope for s in cands[-1]):
            raise RunError(
                f"{flag}: nuqN and -prerope specs need a calibration file / the cache; score them with run.py"
            )
    check_model_path(args.model)
    facts = model_facts(args.model)
    if facts.positions is not None and args.tokens > facts.positions:
        raise RunError(
            f"--tokens {args.tokens} is beyond the model's {facts.positions} positions ({facts.source}); "
            f"use at most --tokens {facts.positions}"
        )
    if not args.random:
        from kvquant.eval.data import check_corpus  # no torch

        try:
            check_corpus(args.corpus)
        except ValueError as e:
            raise RunError(str(e)) from None
    return cands[0], cands[1]


def main(args: argparse.Namespace, k_cands, v_cands, *, model=None, tokenizer=None) -> int:
    import torch

    import kvquant
    from kvquant.diagnose import diagnose, format_report, probe_ids

    if model is None:
        model, tokenizer = kvquant.load_model(
            args.model, dtype=getattr(torch, args.dtype), device=args.device
        )
    if args.random or tokenizer is None:
        ids, source = probe_ids(model.config, args.tokens), "random token ids"
    else:
        from kvquant.eval.data import probe_text_ids

        try:
            ids, title = probe_text_ids(tokenizer, args.corpus, args.tokens)
        except ValueError as e:
            raise RunError(f"{e} (lower --tokens)") from None
        source = f"{args.corpus}: {title!r}"
    diag = diagnose(model, ids, k_cands, v_cands)
    print(f"model: {args.model or 'default (SmolLM2-135M)'}; probe: {args.tokens} tokens of {source}\n")
    print(format_report(diag))
    if args.json:
        from dataclasses import asdict

        with open(args.json, "w") as f:
            json.dump(
                {"model": args.model, "probe": source, **asdict(diag), "recommended": diag.recommended},
                f,
                indent=1,
            )
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        k_cands, v_cands = check_args(args)
        return main(args, k_cands, v_cands)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(cli())
