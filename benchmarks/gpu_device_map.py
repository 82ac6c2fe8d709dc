"""A model split across devices, and memory measured on the device (benchmarks/gpu_check.sh's `devmap` phase).

    python benchmarks/gpu_device_map.py --out DIR            # on a CUDA machine: cuda:0 + CPU, 32k tokens
    python benchmarks/gpu_device_map.py --dry-run --out DIR  # on the CPU: the same code, a CPU-only map, 1k

1. Placement. A tiny random Llama (saved with a word-level tokenizer, loaded by `kvquant.load_model` with a
   device map: the embeddings and the first half of the layers on cuda:0, the rest and the head on the CPU)
   generates 16 greedy tokens through an int4-g64 `QuantizedCache`. They must equal the single-device run's
   (the whole model on cuda:0); every layer's pages must sit on that layer's device
   (`kvquant.models.check_pages_placed`); the cache's bytes are reported per device (`nbytes_by_device`).
   Every Triton launch is counted by the device it made current (`kvquant.kernels.registry.device_guard`):
   each CUDA device of the map must have launched kernels. A `kvquant.serving.Engine` over the split model
   (one shared `KVStore`, each layer's pools on its device) serves two prompts sharing a prefix: the same
   tokens as the engine over the single-device model, the second prompt reusing the first's pages, and the
   bytes held reported per device (`held_bytes_by_device`). With 2 or more GPUs, the same checks run again
   on a cuda:0 / cuda:1 split (a layer on cuda:1 launches with cuda:1 current).
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
import contextlib
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


@contextlib.contextmanager
def launches_by_device():
    """{device: Triton launches} of the block: every launch enters `kvquant.kernels.registry.device_guard`
    with its tensors' device (counted here, then the real guard); empty without triton."""
    counts: dict[str, int] = {}
    try:
        from kvquant.kernels import registry
    except ImportError:  # no triton: nothing can launch
        yield counts
        return
    real = registry.device_guard

    def counting(device):
        counts[str(device)] = counts.get(str(device), 0) + 1
        return real(device)

    registry.device_guard = counting
    try:
        yield counts
    finally:
        registry.device_guard = real


def serve(model, scheme: str = "int4-g64,window=16", new: int = 8) -> dict:
    """Two prompts sharing an 80-token prefix through a `kvquant.serving.Engine` (radix prefix cache), one
    after the other, greedy: their new tokens, the tokens the second reused, and the bytes the store held
    per device while the last request was open."""
    from kvquant.serving import Engine

    engine = Engine(model, scheme, prefix_cache="radix")
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(2, 255, (80,), generator=g).tolist()
    tokens, reused, by_device = [], [], {}
    for tail in (9, 14):
        ids = shared + torch.randint(2, 255, (tail,), generator=g).tolist()
        cache = engine.open()
        pre = engine.prefill(cache, ids, boundaries=[len(shared)])
        held, logits = list(ids), pre.logits
        for _ in range(new):
            held.append(int(logits.argmax()))
            logits = engine.step(cache, held[-1])
        by_device = engine.store.held_bytes_by_device()
        consistent = sum(by_device.values()) == engine.store.held_bytes()
        engine.close(cache, held)
        tokens.append(held[len(ids) :])
        reused.append(pre.hit.reused)
    return {"tokens": tokens, "reused": reused, "held_by_device": by_device, "bytes_consistent": consistent,
            "store_devices": [str(d) for d in engine.store.devices]}


def placement_check(root: Path, cuda: bool, second: str = "cpu") -> dict:
    """The map {first half: cuda:0 (cpu on a dry run), second half: `second`} against the model on cuda:0
    alone: generate() tokens, pages per layer, launches per device, and an Engine on one shared store."""
    layers = 4
    folder = save_tiny(root / f"placement-{second}", layers)
    single = "cuda:0" if cuda else "cpu"
    dmap = split_map(layers, single, second if cuda else "cpu")
    ref_model, _ = kvquant.load_model(folder, device=single)
    want, _, want_logits = generate(ref_model)
    want_served = serve(ref_model)
    del ref_model
    model, _ = kvquant.load_model(folder, device_map=dmap)
    with launches_by_device() as launches:
        got, cache, got_logits = generate(model)
    placed = models.check_pages_placed(model, cache)  # raises if a layer's pages are elsewhere
    by_device = models.nbytes_by_device(cache)
    served = serve(model)
    layer_devices = [str(d) for d in models.layer_devices(model)]
    cuda_layers = sorted({d for d in layer_devices if d.startswith("cuda")})
    row = {
        "map": dmap,
        "single_device": single,
        "layer_devices": layer_devices,
        "pages_on": placed,
        "bytes_by_device": by_device,
        "bytes_total": cache.nbytes(),
        "same_tokens": bool(torch.equal(got, want)),
        "max_logit_diff": float((got_logits - want_logits).abs().max()),
        "kernel_launches_by_device": launches,
        "engine": {**served, "same_tokens": served["tokens"] == want_served["tokens"]},
    }
    engine_ok = (row["engine"]["same_tokens"] and served["reused"][1] > 0 and served["bytes_consistent"]
                 and served["store_devices"] == layer_devices
                 and set(served["held_by_device"]) == set(placed.values()))
    row["ok"] = (row["same_tokens"] and sum(by_device.values()) == cache.nbytes() and len(placed) == layers
                 and all(launches.get(d, 0) > 0 for d in cuda_layers) and engine_ok)
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
    lines = ["# Device map and device memory (benchmarks/gpu_device_map.py)", "",
             f"device: {result['device']}; dry run: {result['dry_run']}", ""]
    for row in (p, result.get("placement_2gpu")):
        if row is None:
            continue
        e, on = row["engine"], ", ".join(row["layer_devices"])
        lines += [
            f"Placement: {row['single_device']} alone vs the map (layers on {on}): "
            f"same tokens {row['same_tokens']}, max |logit diff| {row['max_logit_diff']:.3g}; "
            f"pages per device {row['bytes_by_device']}; kernel launches per device "
            f"{row['kernel_launches_by_device'] or 'none (no CUDA layer)'}",
            f"Engine on one store across the map: same tokens {e['same_tokens']}, reused {e['reused']} "
            f"tokens, held per device {e['held_by_device']}; ok {row['ok']}",
            "",
        ]
    lines += [
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
    two_gpus = cuda and torch.cuda.device_count() >= 2
    with tempfile.TemporaryDirectory() as tmp:
        result = {
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "dry_run": not cuda,
            "placement": placement_check(Path(tmp), cuda),
            "placement_2gpu": placement_check(Path(tmp), cuda, "cuda:1") if two_gpus else None,
            "memory": memory_check(Path(tmp), cuda, length, chunk),
        }
    write_report(out, result)
    sys.stdout.write((out / "devmap.md").read_text())
    two = result["placement_2gpu"]
    ok = result["placement"]["ok"] and result["memory"]["ok"] and (two is None or two["ok"])
    sys.stdout.write(f"devmap: {'pass' if ok else 'FAIL'}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
