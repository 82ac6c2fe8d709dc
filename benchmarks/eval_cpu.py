"""Wall time of cache-mode evaluation per scheme, as a ratio to FP16 on the same chunks (one process).

    python benchmarks/eval_cpu.py                         # default model, 2,048 tokens, chunk 512
    python benchmarks/eval_cpu.py --length 8192 --chunk 1024 --schemes int8,int4-g64,kivi-2 --repeat 3

Each repeat runs FP16 (DynamicCache) and every scheme (kvquant.QuantizedCache) over the same document,
chunk by chunk, in alternation; the figure is the minimum over repeats (robust to other load on the CPU).
Target on a 2-core CPU: int8 and int4-g64 at 1.5x FP16 or less. Also prints where the quantized path spends
its extra time (dequantize vs quantize). Appends one CSV line per scheme to benchmarks/results/eval_cpu.csv.
"""

from __future__ import annotations

import argparse
import csv
import platform
import sys
import time
from pathlib import Path

import torch

import kvquant

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))


def timed_pass(model, ids: torch.Tensor, make_cache, chunk: int) -> float:
    cache = make_cache()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, ids.shape[1], chunk):
            model.get_decoder()(input_ids=ids[:, s : s + chunk], cache=cache, use_cache=True)
    return time.perf_counter() - t0


def main() -> None:
    from run import split_schemes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--schemes", default="int8,int4-g64")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--csv", default=str(Path(__file__).resolve().parent / "results" / "eval_cpu.csv"))
    args = p.parse_args()

    model, tokenizer = kvquant.load_model(args.model)
    from kvquant.eval.data import load_corpus

    text = next(d.text for d in load_corpus("shakespeare"))
    ids = torch.tensor([tokenizer(text)["input_ids"][: args.length]])
    schemes = split_schemes(args.schemes)
    from transformers.cache_utils import DynamicCache

    makers = {"fp16": lambda: DynamicCache(config=model.config)}
    for s in schemes:
        makers[s] = lambda s=s: kvquant.QuantizedCache(s, model.config)
    timed_pass(model, ids[:, : args.chunk], makers["fp16"], args.chunk)  # warm-up

    # time spent in dequantize/quantize, counted on the last repeat (the cache calls them through its
    # module globals; layers pick their quantizer when they first see K/V, so patching before a pass works)
    spent = {"dequantize": 0.0, "quantize": 0.0}

    def wrap(name, fn):
        def inner(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t

        return inner

    best = {k: float("inf") for k in makers}
    breakdown = {}
    for r in range(args.repeat):
        for name, make in makers.items():
            spent.update(dequantize=0.0, quantize=0.0)
            if r == args.repeat - 1:
                patched = [
                    (kvquant.cache, "dequantize", wrap("dequantize", kvquant.cache.dequantize)),
                    (kvquant.cache, "quantize", wrap("quantize", kvquant.cache.quantize)),
                ]
                saved = [(m, a, getattr(m, a)) for m, a, _ in patched]
                for m, a, f in patched:
                    setattr(m, a, f)
            t = timed_pass(model, ids, make, args.chunk)
            if r == args.repeat - 1:
                for m, a, f in saved:
                    setattr(m, a, f)
                breakdown[name] = dict(spent)
            best[name] = min(best[name], t)
    base = best["fp16"]
    device = f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
    print(
        f"cache-mode evaluation, {args.length} tokens, chunks of {args.chunk}, "
        f"min of {args.repeat} ({device})"
    )
    print(f"{'scheme':<50} {'seconds':>8} {'vs fp16':>8} {'dequant s':>10}")
    rows = []
    for name, t in best.items():
        print(f"{name:<50} {t:8.2f} {t / base:7.2f}x {breakdown.get(name, {}).get('dequantize', 0):10.2f}")
        rows.append(
            [
                time.strftime("%Y-%m-%d %H:%M"),
                device,
                name,
                args.length,
                args.chunk,
                f"{t:.3f}",
                f"{t / base:.3f}",
            ]
        )
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with out.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["time", "device", "scheme", "length", "chunk", "seconds", "ratio_vs_fp16"])
        w.writerows(rows)


if __name__ == "__main__":
    main()
