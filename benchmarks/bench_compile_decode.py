"""Does torch.compile (inductor, on the CPU) decode a paged layer faster than what the reference path runs?

Issue 20 asks for the reference decode to use `torch.compile` where inductor fuses unpack + scale + dot
better than the eager path, with the eager path as its twin, and not at the cost of a short run's first call.
The reference decode of an affine codec (`AffineCodec.score_pages` / `value_pages`) runs kvquant.native's
fused C++ reads when the library is built (the default: setup.sh builds it) and its PyTorch twin otherwise.
This script times, on one layer's pages in one process, one decode query's attention through:

  eager     the PyTorch twin (`PageRead(native=False)`): unpack a block of pages into a scratch buffer,
            matmul, scales folded into the products
  compiled  the same function through `torch.compile` (inductor, default mode, dynamic=False); its first
            call includes the compile
  native    kvquant.native's fused C++ reads (`PageRead()`, the path a run takes)

    python benchmarks/bench_compile_decode.py                      # int4-g64, int8, int2-g32 at 4k, 1 thread
    python benchmarks/bench_compile_decode.py --tokens 8192 --specs int4-g64 --calls 50

Shapes are the default model's (SmolLM2-135M: 3 KV heads of D = 64, 3 query heads each, 16-token pages),
fp32. Reported per spec: first call (ms; the compile for `compiled`), steady-state median [p10-p90] over
--calls calls after 3 warm-up calls, speed against eager and native (their median over this path's: > 1 is
faster), the largest |difference| of the outputs against eager (the compiled path's twin check), and for
`compiled` the decode steps a run of 30 layers needs before the compile pays for itself against eager
(never, when it is not faster). Prints a
markdown table; --md writes it too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

H_KV, G, D, BS, LAYERS = 3, 3, 64, 16, 30


def make_layer(spec: str, tokens: int, seed: int = 0):
    """(codec, pages {name: (P, heads_f, rows, cols)}, region) of `tokens` random tokens of one layer, its
    pages in shuffled order (as a pool hands them out after evictions)."""
    import torch

    from kvquant.codecs.base import codec_for
    from kvquant.paging import Region

    g = torch.Generator().manual_seed(seed)
    codec = codec_for(spec, H_KV, D, torch.float32)
    n = tokens // BS
    x = torch.randn(1, H_KV, n * BS, D, generator=g)
    fields = codec.encode(x)  # {name: (1, heads_f, n * rows, cols)}
    order = torch.randperm(n, generator=g)
    pages = {}
    for name, f in fields.items():
        rows = BS // codec.fields()[name].tokens
        by_page = f[0].unflatten(1, (n, rows)).transpose(0, 1)  # (n, heads_f, rows, cols) in token order
        pool = torch.empty_like(by_page)
        pool[order] = by_page  # token page j lives in pool page order[j]
        pages[name] = pool.contiguous()
    region = Region(order[None].to(torch.int64), offset=0, length=tokens, start=0)
    return codec, pages, region


def attend_fn(codec, pages, region, native: bool):
    """query (1, H_kv, G, D) -> output (1, H_kv, G, D): scores, softmax, values, through the codec."""
    import torch

    from kvquant.codecs.base import PageRead

    read = PageRead(native=native)
    scale = D**-0.5

    def attend(q: torch.Tensor) -> torch.Tensor:
        s = codec.score_pages(q, pages, region, read) * scale  # (1, H_kv, G, T)
        return codec.value_pages(torch.softmax(s, dim=-1), pages, region, read)

    return attend


def _time(fn, q, calls: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    fn(q)
    first = time.perf_counter() - t0
    for _ in range(3):
        fn(q)
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(q)
        ts.append(time.perf_counter() - t0)
    return first, ts


def bench(spec: str, tokens: int, calls: int) -> list[dict]:
    import torch

    codec, pages, region = make_layer(spec, tokens)
    q = torch.randn(1, H_KV, G, D, generator=torch.Generator().manual_seed(1))
    eager = attend_fn(codec, pages, region, native=False)
    paths = {
        "eager": eager,
        "compiled": torch.compile(attend_fn(codec, pages, region, native=False), dynamic=False),
        "native": attend_fn(codec, pages, region, native=True),
    }
    with torch.inference_mode():
        ref = eager(q)
        rows = []
        for name, fn in paths.items():
            first, ts = _time(fn, q, calls)
            err = (fn(q) - ref).abs().max().item()
            ts_ms = sorted(1e3 * t for t in ts)
            rows.append(dict(spec=spec, tokens=tokens, path=name, first_ms=1e3 * first,
                             median_ms=statistics.median(ts_ms), p10=ts_ms[len(ts_ms) // 10],
                             p90=ts_ms[(9 * len(ts_ms)) // 10], max_diff=err))
    by = {r["path"]: r for r in rows}
    for r in rows:
        r["vs_eager"] = by["eager"]["median_ms"] / r["median_ms"]
        r["vs_native"] = by["native"]["median_ms"] / r["median_ms"]
    c, e = by["compiled"], by["eager"]
    saved = e["median_ms"] - c["median_ms"]  # per layer and step
    extra = max(c["first_ms"] - e["first_ms"], 0.0)  # a first call no slower than eager's costs nothing
    c["break_even_steps"] = f"{extra / (saved * LAYERS):.0f}" if saved > 0 else "never"
    return rows


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "",
             "| spec | tokens | path | first call ms | steady ms median [p10-p90] "
             "| speed vs eager (>1: faster) | speed vs native "
             "| max abs diff vs eager | compile pays off after (steps, 30 layers) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['spec']} | {r['tokens']} | {r['path']} | {r['first_ms']:.1f} "
                     f"| {r['median_ms']:.2f} [{r['p10']:.2f}-{r['p90']:.2f}] | {r['vs_eager']:.2f} "
                     f"| {r['vs_native']:.2f} | {r['max_diff']:.2g} | {r.get('break_even_steps', '')} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--specs", default="int4-g64,int8,int2-g32", help="comma-separated affine specs")
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the layer (a multiple of 16)")
    p.add_argument("--calls", type=int, default=30, help="timed calls per path after 3 warm-up calls")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--md", type=Path, default=None, help="also write the markdown table here")
    args = p.parse_args(argv)
    import os

    import torch

    from kvquant import native

    torch.set_num_threads(args.threads)
    if native.ops() is None:
        raise SystemExit("kvquant.native is not built: run `python -m kvquant.native build` (setup.sh does)")
    rows = []
    for spec in args.specs.split(","):
        rows += bench(spec, args.tokens, args.calls)
        print(f"{spec}: done", file=sys.stderr)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    header = (f"bench_compile_decode: one layer's decode attention (H_kv={H_KV}, {G} queries each, D={D}, "
              f"fp32), {args.threads} thread(s), torch {torch.__version__}, load average {load} after")
    text = markdown(rows, header)
    print(text)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(text + "\n")


if __name__ == "__main__":
    main()
