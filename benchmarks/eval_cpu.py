"""Wall time of cache-mode evaluation per scheme, as a ratio to FP16 on the same chunks (one process).

    python benchmarks/eval_cpu.py                         # default model, 2,048 tokens, chunk 512
    python benchmarks/eval_cpu.py --length 8192 --chunk 1024 --schemes int8,int4-g64,kivi-2 --repeat 3

Each repeat runs FP16 (DynamicCache) and every scheme (kvquant.QuantizedCache) over the same document,
chunk by chunk, in alternation; the figure is the minimum over repeats (robust to other load on the CPU).
Target on a 2-core CPU: int8 and int4-g64 at 1.5x FP16 or less. Also prints where the quantized path spends
its extra time (attention over the stored pages vs encoding what the window lets go). Appends one CSV line
per scheme to benchmarks/results/eval_cpu.csv.
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


def _parse_args() -> argparse.Namespace:
    """The command line: model, document length, chunk, schemes, repeats and the CSV to append to."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--schemes", default="int8,int4-g64")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--csv", default=str(Path(__file__).resolve().parent / "results" / "eval_cpu.csv"))
    return p.parse_args()


def _timing(spent: dict[str, float], name: str, fn):
    """FN, adding the seconds each call takes to spent[NAME]."""

    def inner(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.perf_counter() - t

    return inner


def _pass_with_breakdown(model, ids, make, chunk: int, spent: dict[str, float]) -> float:
    """timed_pass with the two calls a quantized cache adds wrapped to add their time to SPENT: attention
    over the stored pages (`kvquant.attention.reference_attention`, which decodes them block by block) and
    the encoding of tokens into body pages (`kvquant.cache._encode_pair`, both codecs of a layer).

    Both are called through their modules' globals, so patching before a pass works; the originals are put
    back afterwards.
    """
    import kvquant.attention
    import kvquant.cache

    patched = [
        (kvquant.attention, "reference_attention",
         _timing(spent, "attention", kvquant.attention.reference_attention)),
        (kvquant.cache, "_encode_pair", _timing(spent, "encode", kvquant.cache._encode_pair)),
    ]
    saved = [(m, a, getattr(m, a)) for m, a, _ in patched]
    for m, a, f in patched:
        setattr(m, a, f)
    t = timed_pass(model, ids, make, chunk)
    for m, a, f in saved:
        setattr(m, a, f)
    return t


def _time_all(model, ids, makers: dict, chunk: int, repeat: int) -> tuple[dict, dict]:
    """Minimum seconds per cache over REPEAT alternating passes, and (last repeat) the attention / encode
    split."""
    spent = {"attention": 0.0, "encode": 0.0}
    best = {k: float("inf") for k in makers}
    breakdown = {}
    for r in range(repeat):
        for name, make in makers.items():
            spent.update(attention=0.0, encode=0.0)
            if r == repeat - 1:
                t = _pass_with_breakdown(model, ids, make, chunk, spent)
                breakdown[name] = dict(spent)
            else:
                t = timed_pass(model, ids, make, chunk)
            best[name] = min(best[name], t)
    return best, breakdown


def _report(best: dict, breakdown: dict, args: argparse.Namespace) -> list[list]:
    """Print the table (seconds, ratio to fp16, attention and encode seconds) and return the CSV rows."""
    base = best["fp16"]
    device = f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
    print(
        f"cache-mode evaluation, {args.length} tokens, chunks of {args.chunk}, "
        f"min of {args.repeat} ({device})"
    )
    print(f"{'scheme':<50} {'seconds':>8} {'vs fp16':>8} {'attention s':>12} {'encode s':>9}")
    rows = []
    for name, t in best.items():
        spent = breakdown.get(name, {})
        parts = f"{spent.get('attention', 0):12.2f} {spent.get('encode', 0):9.2f}"
        print(f"{name:<50} {t:8.2f} {t / base:7.2f}x {parts}")
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
    return rows


def _append_csv(path: str, rows: list[list]) -> None:
    """Append ROWS to the CSV at PATH, writing the header first when the file is new."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with out.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["time", "device", "scheme", "length", "chunk", "seconds", "ratio_vs_fp16"])
        w.writerows(rows)


def main() -> None:
    from run import split_schemes

    args = _parse_args()

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
    best, breakdown = _time_all(model, ids, makers, args.chunk, args.repeat)
    _append_csv(args.csv, _report(best, breakdown, args))


if __name__ == "__main__":
    main()
