"""Perplexity drift and KL of engine KV formats on the default model: vLLM's TurboQuant presets (as served,
with their boundary layers, and on every layer), llama.cpp's q8_0 / q4_0 with and without its attention
rotation, and kvquant recipes at comparable bits for contrast.

    python benchmarks/engine_drift.py                    # 6 Wikipedia articles x 1,024 tokens
    python benchmarks/engine_drift.py --docs 12 --length 2048 --schemes 'vllm:turboquant_4bit_nc,int4-g64'

Each scheme's codecs (codecs.base.codec_for with the layer index and K/V role, as the cache builds them)
encode and decode every layer's K and V before attention reads them, one forward per document. These
formats code each (token, head) on its own, so this equals the decode-exact cache mode (every token through
the quantized cache); vLLM's and llama.cpp's own prefill would attend the prompt unquantized. Drift =
ppl / ppl_fp - 1 and KL per token, 95% bootstrap intervals over documents and tokens. Bytes per token: all
layers, K + V, as stored (kvquant.memory). Writes benchmarks/results/engine_drift.md and .csv.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT = (
    "llama.cpp:q8_0", "llama.cpp:q8_0-norot", "llama.cpp:q4_0", "llama.cpp:q4_0-norot",
    "vllm:turboquant_k8v4", "vllm:turboquant_4bit_nc", "vllm:turboquant_k3v4_nc", "vllm:turboquant_3bit_nc",
    "served:turboquant_k8v4", "served:turboquant_4bit_nc", "served:turboquant_k3v4_nc",
    "served:turboquant_3bit_nc", "vllm:fp8", "int8-head", "int4-g64", "turbo4", "turbo3.5", "turbo3",
)


def _codec_cache(config, scheme, heads: int, head_dim: int):
    from transformers import DynamicCache

    from kvquant.codecs.base import codec_for

    codecs = {}
    for i in range(config.num_hidden_layers):
        s = scheme.for_layer(i)
        codecs[i] = tuple(
            codec_for(spec, heads, head_dim, torch.float32, layer=i, role=r)
            for spec, r in ((s.key, "k"), (s.value, "v"))
        )

    class CodecCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            kc, vc = codecs[layer_idx]
            k = kc.decode(kc.encode(key_states), key_states.dtype) if kc.spec.is_quantized else key_states
            v = value_states
            if vc.spec.is_quantized:
                v = vc.decode(vc.encode(value_states), value_states.dtype)
            return super().update(k, v, layer_idx, *args, **kwargs)

    return CodecCache(config=config)


def _parse_args() -> argparse.Namespace:
    """The command line: documents, tokens per document, schemes and the output stem."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--schemes", default=",".join(DEFAULT),
                   help="comma-separated; served:NAME = vLLM's layers")
    p.add_argument("--out", default=str(RESULTS / "engine_drift"))
    return p.parse_args()


def _kv_shape(cfg) -> tuple[int, int]:
    """(KV heads, head dim) of the model config."""
    heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or head_dim
    return heads, head_dim


def _logprobs(model, ids, cache) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, cache=cache).logits[0, :-1].float().log_softmax(-1)  # (T - 1, V)


def _measure_scheme(model, docs, refs, label: str, heads: int, head_dim: int) -> dict:
    """One scheme's row: drift and KL with 95% intervals, and its bytes per token (all layers, K + V)."""
    from kvquant.eval.stats import bootstrap_intervals

    from kvquant.codecs.engine_vllm import vllm_cache_scheme
    from kvquant.memory import cache_bytes
    from kvquant.scheme import parse_scheme

    cfg = model.config
    text = label
    if label.startswith("served:"):
        text = vllm_cache_scheme(label.partition(":")[2], cfg.num_hidden_layers)
    scheme = parse_scheme(text)
    diffs, kls = [], []
    for ids, ref in zip(docs, refs, strict=True):
        lp = _logprobs(model, ids, _codec_cache(cfg, scheme, heads, head_dim))
        tgt = ids[0, 1:]
        diffs.append((ref.gather(1, tgt[:, None]) - lp.gather(1, tgt[:, None]))[:, 0].double().numpy())
        kls.append((ref.exp() * (ref - lp)).sum(-1).double().numpy())
    ci = bootstrap_intervals(diffs, kls)
    n = sum(len(d) for d in diffs)
    per_token = cache_bytes(cfg, scheme, 1024) / 1024
    return {
        "scheme": label, "as_kvquant": str(scheme),
        "drift": float(np.expm1(np.concatenate(diffs).sum() / n)), "drift_lo": ci["drift"][0],
        "drift_hi": ci["drift"][1], "kl": float(np.concatenate(kls).mean()), "kl_lo": ci["kl"][0],
        "kl_hi": ci["kl"][1], "bytes_per_token": per_token, "tokens": n,
    }


def _write_csv(out: Path, rows: list[dict]) -> None:
    """One CSV line per scheme at OUT.csv (creating the folder)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _markdown_lines(rows: list[dict], cfg, fp: int, n_docs: int, length: int, timing: str) -> list[str]:
    """The markdown report: setup paragraph, one table row per scheme, then TIMING (a sentence)."""
    lines = [
        "# Engine KV formats on the default model: drift and KL (decode-exact cache mode)",
        "",
        f"SmolLM2-135M-Instruct (fp32, CPU), {n_docs} Wikipedia articles x {length} tokens "
        f"({rows[0]['tokens']} scored tokens). Every layer's K/V through the scheme's codecs before "
        "attention (per-(token, head) codes: equal to the decode-exact cache mode). `served:` = vLLM's "
        "TurboQuant as `vllm serve --kv-cache-dtype X` runs it (layers 0-1 and 28-29 unquantized). "
        f"Bytes per token: all {cfg.num_hidden_layers} layers, K + V (FP16: {fp:,}). "
        "95% bootstrap intervals.",
        "",
        "| scheme | drift [95% CI] | KL / token [95% CI] | bytes / token |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['scheme']}` | {100 * r['drift']:+.2f}% [{100 * r['drift_lo']:+.2f}, "
            f"{100 * r['drift_hi']:+.2f}] | {r['kl']:.4f} [{r['kl_lo']:.4f}, {r['kl_hi']:.4f}] "
            f"| {r['bytes_per_token']:,.0f} |"
        )
    return lines + ["", timing, "", "Written by benchmarks/engine_drift.py."]


def main() -> None:
    args = _parse_args()

    from kvquant.eval.calibration import calibration_documents
    from transformers import DynamicCache

    from kvquant.models import load_model

    t0 = time.perf_counter()
    load0 = os.getloadavg()
    model, tok = load_model(None)
    cfg = model.config
    heads, head_dim = _kv_shape(cfg)
    docs = calibration_documents(tok, "wikipedia", args.docs, args.length, seed=1)
    refs = [_logprobs(model, ids, DynamicCache(config=cfg)) for ids in docs.ids]
    rows = []
    for label in args.schemes.split(","):
        rows.append(_measure_scheme(model, docs.ids, refs, label, heads, head_dim))
        print(rows[-1], flush=True)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    out = Path(args.out)
    _write_csv(out, rows)
    fp = 2 * cfg.num_hidden_layers * heads * head_dim * 2
    timing = (
        f"Wall time {wall:.0f} s on {platform.processor() or platform.machine()} (torch threads "
        f"{torch.get_num_threads()}, load average {load0[0]:.1f} at start, {load1[0]:.1f} at end: "
        "shared CPU)."
    )
    lines = _markdown_lines(rows, cfg, fp, len(docs.ids), args.length, timing)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
