"""A model split across devices, and memory measured on the device (benchmarks/gpu_check.sh's `devmap` phase).

    python benchmarks/gpu_device_map.py --out DIR            # on a CUDA machine: cuda:0 + CPU, 32k tokens
    python benchmarks/gpu_device_map.py --dry-run --out DIR  # on the CPU: the same code, a CPU-only map, 1k

1. Placement. A tiny random Llama (saved with a word-level tokenizer, loaded by `kvquant.load_model` with a
   device map: the embeddings and the first half of the layers on cuda:0, the rest and the head on the CPU)
   generates 16 greedy tokens through an int4-g64 `QuantizedCache`. They must equal the single-device run's
   (the whole model on cuda:0); every layer's pages must sit on that layer's device
   (`kvquant.models.check_pages_placed`); the cache's bytes are reported per device (`nbytes_by_device`).
2. Memory. On one device (fp16 on CUDA), `--length` tokens (32k) are fed in chunks through the reference
   cache (transformers' DynamicCache) and through QuantizedCache fp16 and int4-g64. For each:
   `torch.cuda.max_memory_allocated` above the model's own allocation (reset before each cache), what the
   cache still holds after the last chunk (`memory_allocated`), `cache.nbytes()` and the formula
   (`kvquant.memory.cache_bytes`). int4-g64 must hold under half the reference's bytes.

Writes devmap.json and devmap.md to --out; exit status 0 only if every check passed. On the CPU (--dry-run,
or no CUDA) the split is a per-module map onto the CPU and the device memory columns are empty.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvquant
from kvquant import models

logger = logging.getLogger("gpu_device_map")

WORDS = "the cache of keys and values grows with every token while four bits per value fit in memory".split()


def save_tiny(path: Path, layers: int, *, dtype=torch.float32, **config) -> Path:
    """A random Llama folder that kvquant.load_model reads offline (config, weights, word-level tokenizer)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   pad_token="<unk>")
    kw = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
              tie_word_embeddings=False, pad_token_id=0, initializer_range=0.1)
    kw.update(config)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**kw)).to(dtype).save_pretrained(path)
    fast.save_pretrained(path)
    return path


def split_map(layers: int, first: str, second: str) -> dict[str, str]:
    """Embeddings, RoPE and layers [0, layers/2) on `first`; the other layers, the norm and the head on
    `second` (accelerate's hooks move the activations across)."""
    half = layers // 2
    out = {"model.embed_tokens": first}
    out.update({f"model.layers.{i}": first if i < half else second for i in range(layers)})
    out.update({"model.rotary_emb": first, "model.norm": second, "lm_head": second})
    return out


def generate(model, n: int = 16, scheme: str = "int4-g64,window=16"):
    torch.manual_seed(1)
    ids = torch.randint(2, 255, (2, 48)).to(models.input_device(model))
    cache = kvquant.QuantizedCache(scheme, model.config)
    with torch.no_grad():
        first = model(ids, cache=kvquant.QuantizedCache(scheme, model.config)).logits[:, -1].float().cpu()
        out = model.generate(ids, cache=cache, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out.cpu(), cache, first


def placement_check(root: Path, cuda: bool) -> dict:
    layers = 4
    folder = save_tiny(root / "placement", layers)
    single = "cuda:0" if cuda else "cpu"
    dmap = split_map(layers, "cuda:0", "cpu") if cuda else split_map(layers, "cpu", "cpu")
    ref_model, _ = kvquant.load_model(folder, device=single)
    want, _, want_logits = generate(ref_model)
    del ref_model
    model, _ = kvquant.load_model(folder, device_map=dmap)
    got, cache, got_logits = generate(model)
    placed = models.check_pages_placed(model, cache)  # raises if a layer's pages are elsewhere
    by_device = models.nbytes_by_device(cache)
    row = {
        "map": dmap,
        "single_device": single,
        "layer_devices": [str(d) for d in models.layer_devices(model)],
        "pages_on": placed,
        "bytes_by_device": by_device,
        "bytes_total": cache.nbytes(),
        "same_tokens": bool(torch.equal(got, want)),
        "max_logit_diff": float((got_logits - want_logits).abs().max()),
    }
    row["ok"] = row["same_tokens"] and sum(by_device.values()) == cache.nbytes() and len(placed) == layers
    return row


def _cuda_mem() -> tuple[int, int]:
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()


def memory_check(root: Path, cuda: bool, length: int, chunk: int) -> dict:
    from transformers import DynamicCache

    device = "cuda:0" if cuda else "cpu"
    dtype = torch.float16 if cuda else torch.float32
    # 8 KV heads of 128: 4 KiB per token per layer at fp16, so the cache dominates the activations
    folder = save_tiny(root / "memory", 4, dtype=dtype, hidden_size=512, intermediate_size=1024,
                       num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=max(length, 4096) + 16)
    model, _ = kvquant.load_model(folder, dtype=dtype, device=device)
    torch.manual_seed(2)
    ids = torch.randint(2, 255, (1, length), device=device)
    rows = []
    for name in ("reference", "fp16", "int4-g64"):
        cache = DynamicCache(config=model.config) if name == "reference" else kvquant.QuantizedCache(
            name, model.config, capacity=length
        )
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(0, length, chunk):
                model(ids[:, i : i + chunk], cache=cache, use_cache=True, logits_to_keep=1)
        if cuda:
            torch.cuda.synchronize()
            held, peak = (x - base for x in _cuda_mem())
        else:
            held = peak = None
        seconds = time.perf_counter() - t0
        if name == "reference":  # DynamicCache: K and V of every token, every layer, at the model's dtype
            counted = sum(t.numel() * t.element_size() for k, v, *_ in cache for t in (k, v))
            shape = kvquant.memory.KVShape.from_config(model.config)
            elem = torch.empty((), dtype=dtype).element_size()
            formula = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * length * elem
        else:
            counted = cache.nbytes()
            formula = kvquant.memory.cache_bytes(model.config, name, length, dtype=dtype)
        rows.append({"cache": name, "tokens": length, "chunk": chunk, "device": device,
                     "device_peak_bytes": peak, "device_held_bytes": held, "counted_bytes": counted,
                     "formula_bytes": formula, "seconds": round(seconds, 2)})
        del cache
    ref, int4 = rows[0], rows[2]
    key = "device_held_bytes" if cuda else "counted_bytes"
    ratio = int4[key] / ref[key]
    return {"rows": rows, "int4_vs_reference": ratio, "measured_on": key, "ok": ratio < 0.5}


def write_report(out: Path, result: dict) -> None:
    (out / "devmap.json").write_text(json.dumps(result, indent=1))
    p, m = result["placement"], result["memory"]
    lines = [
        "# Device map and device memory (benchmarks/gpu_device_map.py)",
        "",
        f"device: {result['device']}; dry run: {result['dry_run']}",
        "",
        f"Placement: {p['single_device']} alone vs the map (layers on {', '.join(p['layer_devices'])}): "
        f"same tokens {p['same_tokens']}, max |logit diff| {p['max_logit_diff']:.3g}; "
        f"pages per device {p['bytes_by_device']}",
        "",
        "| cache | tokens | device peak (MiB) | device held (MiB) | counted (MiB) | formula (MiB) | s |",
        "|---|---|---|---|---|---|---|",
    ]

    def mib(x):
        return "-" if x is None else f"{x / 2**20:.1f}"

    for r in m["rows"]:
        sizes = ("device_peak_bytes", "device_held_bytes", "counted_bytes", "formula_bytes")
        cells = [r["cache"], r["tokens"], *(mib(r[k]) for k in sizes), r["seconds"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", f"int4-g64 / reference ({m['measured_on']}): {m['int4_vs_reference']:.3f}", ""]
    (out / "devmap.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="on the CPU: a per-module CPU map, short lengths")
    p.add_argument("--length", type=int, default=None, help="memory check tokens (32768; dry: 1024)")
    p.add_argument("--chunk", type=int, default=None, help="tokens per forward (2048; dry run 256)")
    p.add_argument("--out", default=".", help="folder for devmap.json and devmap.md")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = torch.cuda.is_available() and not args.dry_run
    length = args.length or (32768 if cuda else 1024)
    chunk = args.chunk or (2048 if cuda else 256)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = {
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "dry_run": not cuda,
            "placement": placement_check(Path(tmp), cuda),
            "memory": memory_check(Path(tmp), cuda, length, chunk),
        }
    write_report(out, result)
    sys.stdout.write((out / "devmap.md").read_text())
    ok = result["placement"]["ok"] and result["memory"]["ok"]
    sys.stdout.write(f"devmap: {'pass' if ok else 'FAIL'}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
