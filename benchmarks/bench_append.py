"""Time of one decode-step `update` (every layer of a model shape) at a given number of stored tokens.

    python benchmarks/bench_append.py                       # SmolLM2-135M shape, int4-g64, B 1 and 8
    python benchmarks/bench_append.py --tokens 1024,32768 --scheme kivi-2 --batch 1
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_append.py   # the same figures for other code

The cache is filled to T tokens per sequence in chunks (not timed), then one token per sequence is
appended to every layer, `--steps` times; the median and the spread (min..max) of one step are printed,
with the ratio of each length to the shortest. Only the public API is used (`QuantizedCache(scheme,
shape)`, `cache.update(k, v, layer_idx)`), so the script times any checkout of kvquant, which is how a
change is compared with its parent on one machine. Torch backend, CPU, one thread by default (`--threads`).
Results are appended to `benchmarks/results/bench_append.csv`, tagged with the code's git commit.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scheme", default="int4-g64")
    p.add_argument("--tokens", default="1024,8192,32768,131072", help="stored tokens per sequence")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_append.csv"))
    a = p.parse_args(argv)
    a.tokens = [int(x) for x in a.tokens.split(",")]
    a.batch = [int(x) for x in a.batch.split(",")]
    if min(a.tokens) < 1 or min(a.batch) < 1 or a.steps < 1:
        p.error("--tokens, --batch and --steps must be positive")
    return a


def _commit(module_file: str) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(Path(module_file).parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(Path(module_file).parent), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    import torch

    import kvquant
    from kvquant.memory import KVShape

    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    shape = KVShape(a.layers, a.kv_heads, a.head_dim)
    commit = _commit(kvquant.__file__)
    print(
        f"kvquant {commit} ({Path(kvquant.__file__).parent}), scheme {a.scheme}, {a.layers} layers x "
        f"{a.kv_heads} KV heads x {a.head_dim}, {a.dtype}, {a.threads} thread(s)"
    )
    rows = []
    for batch in a.batch:
        base = None
        for tokens in a.tokens:
            g = torch.Generator().manual_seed(0)
            try:  # preallocate (a pool that doubles mid-benchmark would time one big copy)
                cache = kvquant.QuantizedCache(
                    a.scheme, shape, backend="torch", capacity=tokens + 2 * a.steps
                )
            except TypeError:  # code without page pools
                cache = kvquant.QuantizedCache(a.scheme, shape, backend="torch")
            chunk = 2048
            for start in range(0, tokens, chunk):
                n = min(chunk, tokens - start)
                for layer in range(a.layers):
                    k = torch.randn(batch, a.kv_heads, n, a.head_dim, generator=g).to(dtype)
                    cache.update(k, k.clone(), layer)
            steps = []
            for _ in range(a.steps):
                kv = [
                    torch.randn(batch, a.kv_heads, 1, a.head_dim, generator=g).to(dtype)
                    for _ in range(a.layers)
                ]
                t0 = time.perf_counter()
                for layer in range(a.layers):
                    cache.update(kv[layer], kv[layer], layer)
                steps.append(time.perf_counter() - t0)
            med = statistics.median(steps)
            base = base or med
            print(
                f"  B={batch:<3} T={tokens:>7}: one step {med * 1e3:8.3f} ms (min {min(steps) * 1e3:.3f}, "
                f"max {max(steps) * 1e3:.3f}), {med / base:5.2f}x the T={a.tokens[0]} step; "
                f"held {cache.nbytes() / 2**20:.1f} MiB"
            )
            rows.append(
                dict(
                    commit=commit,
                    scheme=a.scheme,
                    batch=batch,
                    tokens=tokens,
                    dtype=a.dtype,
                    threads=a.threads,
                    median_ms=med * 1e3,
                    min_ms=min(steps) * 1e3,
                    max_ms=max(steps) * 1e3,
                    ratio_to_first=med / base,
                )
            )
            del cache
    path = Path(a.csv)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
