"""Compute per-layer FP8 k_scale / v_scale on calibration text and write them as vLLM loads them.

    python experiments/export_scales.py --out calib/smollm2-kv-scales
    python experiments/export_scales.py --model PATH --strategy attn_head --dtype bf16 --out DIR

Writes DIR/kv_scales.safetensors (`model.layers.{i}.self_attn.k_scale` / `v_scale`, shape (1,) for the
`tensor` strategy, (H_kv, 1, 1) for `attn_head`: llm-compressor's / compressed-tensors' layout) and
DIR/kv_cache_scheme.json (the `quantization_config.kv_cache_scheme` that config.json needs). The scales are
max|K| / 448 (E4M3; 57344 for --fp8 e5m2) over the calibration tokens, per layer (and head), as
llm-compressor's static min-max observer computes them (`kvquant.export`).

To serve them: copy kv_scales.safetensors into the checkpoint folder (if it has a
model.safetensors.index.json, add the tensor names to its weight_map with this file's name), merge
kv_cache_scheme.json's
quantization_config into config.json, then `vllm serve FOLDER --kv-cache-dtype fp8`. vLLM logs "Using KV
cache scaling factor 1.0" when it did not find them. kvquant evaluates the same scales with
`KVScales.kv_scale` bound to the `vllm:fp8` codec (benchmarks/fp8_calibrated.py).

Calibration text: Wikipedia articles of at least --length tokens and fewer than 8,192 (the 8k evaluation's
articles are excluded), in a seeded order, as experiments/calibrate.py.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvquant.eval.config import RunError, check_model_path, check_seed, script_parser

from kvquant.scheme import SchemeError

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def build_parser() -> argparse.ArgumentParser:
    p = script_parser(__doc__)
    p.add_argument("--out", required=True, help="output folder (kv_scales.safetensors, kv_cache_scheme.json)")
    p.add_argument("--model", default=None, help="local HF folder or .gguf (default: embedded SmolLM2-135M)")
    p.add_argument("--corpus", default="wikipedia")
    p.add_argument("--docs", type=int, default=8, help="calibration documents (default 8)")
    p.add_argument("--length", type=int, default=2048, help="tokens per document (default 2048)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", choices=("tensor", "attn_head"), default="tensor")
    p.add_argument("--fp8", choices=("e4m3", "e5m2"), default="e4m3")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="fp32", help="dtype the scales are stored in")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Everything that needs no torch, before the model loads. Raises RunError naming the fix."""
    for flag, value, low in (("--docs", args.docs, 1), ("--length", args.length, 2)):
        if value < low:
            raise RunError(f"{flag} {value} must be at least {low}")
    check_seed(args.seed)
    try:
        check_model_path(args.model)
    except RunError as e:
        raise RunError(f"--model: {e}") from None


def export(args: argparse.Namespace):
    """Load the model, observe max|K| / max|V| per layer on the calibration text, write the scales.
    Returns (path, KVScales)."""
    import torch
    from kvquant.eval.calibration import calibration_documents

    from kvquant.export import describe, kv_absmax, save_kv_scales, scales_from_absmax
    from kvquant.models import load_model

    model, tok = load_model(args.model)
    text = calibration_documents(tok, args.corpus, args.docs, args.length, seed=args.seed)
    k_amax, v_amax = kv_absmax(model, text.ids)
    scales = scales_from_absmax(k_amax, v_amax, args.strategy, args.fp8)
    meta = {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "corpus": args.corpus,
            "documents": text.titles, "tokens": text.tokens, "observer": "minmax (max|x| / fp8 max)"}
    path = save_kv_scales(scales, args.out, dtype=getattr(torch, _DTYPES[args.dtype]), metadata=meta)
    logging.getLogger(__name__).info("%s", describe(scales))
    return path, scales


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except (RunError, SchemeError) as e:
        print(f"export_scales.py: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path, scales = export(args)
    print(f"wrote {path} ({2 * scales.num_layers} tensors, strategy {scales.strategy}) and "
          f"{path.parent / 'kv_cache_scheme.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
