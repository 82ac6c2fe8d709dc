"""Decode attention over a quantized KV cache: the fused Triton kernel against FP16 SDPA and dequantize+SDPA.

For each head layout, context length, batch size and scheme, times one decode step of one layer
(`triton.testing.do_bench`, median and 20/80% quantiles) and prints:
  time (us), achieved GB/s (bytes of codes, scales, zeros read; FP16 K/V for SDPA), % of this device's
  measured device-to-device copy bandwidth, speedup of the fused kernel over FP16 SDPA and over
  dequantize-then-SDPA. Rows are appended to a CSV tagged with the device name.

    python benchmarks/bench_decode.py                      # the full sweep (GPU)
    python benchmarks/bench_decode.py --key-points         # what benchmarks/gpu_check.sh runs
    python benchmarks/bench_decode.py --quick              # a few points
    python benchmarks/bench_decode.py --device cpu --interpret --quick   # dry run of the logic (tiny sizes)

Targets (Llama-3-8B layout): INT4-g64 >= 80% of copy bandwidth from 16k context and >= 3x FP16 SDPA at
32k; INT8 >= 1.8x FP16 SDPA.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

LAYOUTS = {  # name: (H_q, H_kv, D)
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
}
SCHEMES = ["int4-g64", "int8", "int2-g32", "k=int4-channel-g64,v=int4-g64"]
CONTEXTS = [1024, 4096, 16384, 32768, 65536, 131072]
BATCHES = [1, 8, 32, 64]
FIELDS = ["time_utc", "device", "layout", "scheme", "batch", "context", "method", "us_median", "us_p20",
          "us_p80", "bytes", "gb_s", "pct_copy_bw", "speedup_vs_sdpa", "speedup_vs_dequant"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--interpret", action="store_true", help="TRITON_INTERPRET=1 (CPU dry run; tiny sizes)")
    p.add_argument("--quick", action="store_true", help="a few points per layout")
    p.add_argument("--key-points", action="store_true",
                   help="INT4-g64 and INT8 at 16k/32k, batch 1 and 8, Llama-3-8B layout")
    p.add_argument("--layouts", nargs="+", default=None, choices=list(LAYOUTS))
    p.add_argument("--schemes", nargs="+", default=None)
    p.add_argument("--contexts", nargs="+", type=int, default=None)
    p.add_argument("--batches", nargs="+", type=int, default=None)
    p.add_argument("--csv", type=Path, default=None, help="append rows here (default benchmarks/results/)")
    p.add_argument("--mem-fraction", type=float, default=0.8, help="skip points needing more of free memory")
    return p.parse_args(argv)


def plan(args) -> list[tuple[str, str, int, int]]:
    """(layout, scheme, context, batch) points to run."""
    if args.key_points:
        return [("llama3-8b", s, t, b) for s in ("int4-g64", "int8") for t in (16384, 32768) for b in (1, 8)]
    if args.interpret:  # the interpreter runs every program in Python: keep it tiny
        contexts, batches = args.contexts or [128], args.batches or [1]
        schemes = args.schemes or ["int4-g64", "int8"]
    elif args.quick:
        contexts, batches = args.contexts or [4096, 32768], args.batches or [1, 8]
        schemes = args.schemes or ["int4-g64", "int8"]
    else:
        contexts, batches = args.contexts or CONTEXTS, args.batches or BATCHES
        schemes = args.schemes or SCHEMES
    layouts = args.layouts or (["smollm2-135m"] if args.interpret else list(LAYOUTS))
    return [(lay, s, t, b) for lay in layouts for s in schemes for t in contexts for b in batches]


def bench(fn, device) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds: do_bench on CUDA, a plain timer elsewhere (the dry run)."""
    import torch

    if device.type == "cuda":
        from triton.testing import do_bench

        med, p20, p80 = do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=25, rep=100)
        return med, p20, p80
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(times)
    return float(t.median()), float(t.quantile(0.2)), float(t.quantile(0.8))


def copy_bandwidth(device) -> float:
    """GB/s of a large device-to-device copy (read + write bytes), the roof the kernel is judged against."""
    import torch

    n = (1 << 30) if device.type == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms, _, _ = bench(lambda: dst.copy_(src), device)
    return 2 * n / (ms * 1e-3) / 1e9


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}{' (triton interpreter)' if os.environ.get('TRITON_INTERPRET') == '1' else ''}"


def fits(device, h_kv: int, d: int, t: int, b: int, fraction: float) -> bool:
    """FP16 K/V, their quantized copies and the dequantized copies of the baseline must fit."""
    import torch

    if device.type != "cuda":
        return True
    fp16 = 2 * b * h_kv * t * d * 2
    need = fp16 * 2 + fp16  # FP16 K/V + dequantized K/V + codes/scales (at most an FP16 copy)
    free, _ = torch.cuda.mem_get_info(device)
    return need <= fraction * free


def run_point(layout: str, scheme_text: str, t: int, b: int, device, copy_bw: float) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from kvquant.kernels.decode_attention import _gather_fields, decode_attention
    from kvquant.kernels.testing import make_paged_layer

    from kvquant.scheme import parse_scheme

    h_q, h_kv, d = LAYOUTS[layout]
    scheme = parse_scheme(scheme_text)
    dtype = torch.float16
    bs = max(16, scheme.tokens_per_flush)
    t = t // bs * bs
    layer = make_paged_layer(b=b, h_kv=h_kv, d=d, sink=0, body=t, recent=0, k=str(scheme.key),
                             v=str(scheme.value), dtype=dtype, device=device, block_size=bs, spare=0)
    q = torch.randn(b, h_q, 1, d, dtype=dtype, device=device)
    kc, vc = layer.key_codec, layer.value_codec

    def dequant(which):
        codec, pages = (kc, layer.key_pages) if which == "k" else (vc, layer.value_pages)
        return codec.decode(_gather_fields(pages, codec, layer.body), dtype)

    k, v = dequant("k"), dequant("v")  # (B, H_kv, T, D) FP16: the SDPA baseline's cache
    fused_bytes = kc.bytes(t) * b + vc.bytes(t) * b
    fp16_bytes = 2 * k.numel() * k.element_size()
    methods = {
        "fused": (lambda: decode_attention(q, *layer.decode_args()), fused_bytes),
        "sdpa_fp16": (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), fp16_bytes),
        "dequant_sdpa": (lambda: F.scaled_dot_product_attention(q, dequant("k"), dequant("v"), enable_gqa=True),
                         fused_bytes),
    }
    # the fused kernel must agree with the baseline before its time means anything
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    got = decode_attention(q, *layer.decode_args()).transpose(1, 2).float()
    err = (got - ref).abs().max().item()
    if not err < 2e-2:
        raise AssertionError(f"{layout} {scheme_text} T={t} B={b}: fused output is off by {err:.3g}")

    times = {name: bench(fn, device) for name, (fn, _) in methods.items()}
    rows = []
    for name, (_, nb) in methods.items():
        med, p20, p80 = times[name]
        gbs = nb / (med * 1e-3) / 1e9
        rows.append(dict(
            layout=layout, scheme=scheme_text, batch=b, context=t, method=name,
            us_median=round(med * 1e3, 2), us_p20=round(p20 * 1e3, 2), us_p80=round(p80 * 1e3, 2),
            bytes=nb, gb_s=round(gbs, 1), pct_copy_bw=round(100 * gbs / copy_bw, 1),
            speedup_vs_sdpa=round(times["sdpa_fp16"][0] / med, 2),
            speedup_vs_dequant=round(times["dequant_sdpa"][0] / med, 2),
        ))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; for a dry run use --device cpu --interpret", file=sys.stderr)
        return 2
    if device.type != "cuda" and not args.interpret:
        print("the kernels run on CUDA or in the interpreter: add --interpret", file=sys.stderr)
        return 2
    name = device_name(device)
    copy_bw = copy_bandwidth(device)
    print(f"device: {name}; device-to-device copy bandwidth: {copy_bw:.0f} GB/s")
    out_csv = args.csv or Path(__file__).resolve().parent / "results" / "bench_decode.csv"
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    new = not out_csv.exists()
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    header = (f"{'layout':<13} {'scheme':<30} {'B':>3} {'T':>7} {'method':<13} {'us':>9} {'GB/s':>7} "
              f"{'%copy':>6} {'x sdpa':>7} {'x deq':>6}")
    print(header)
    with out_csv.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for layout, scheme_text, t, b in plan(args):
            h_q, h_kv, d = LAYOUTS[layout]
            if not fits(device, h_kv, d, t, b, args.mem_fraction):
                print(f"{layout:<13} {scheme_text:<30} {b:>3} {t:>7} skipped: does not fit in memory")
                continue
            try:
                rows = run_point(layout, scheme_text, t, b, device, copy_bw)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"{layout:<13} {scheme_text:<30} {b:>3} {t:>7} skipped: out of memory")
                continue
            for r in rows:
                print(f"{layout:<13} {scheme_text:<30} {b:>3} {t:>7} {r['method']:<13} "
                      f"{r['us_median']:>9.1f} "
                      f"{r['gb_s']:>7.1f} {r['pct_copy_bw']:>6.1f} {r['speedup_vs_sdpa']:>7.2f} "
                      f"{r['speedup_vs_dequant']:>6.2f}")
                writer.writerow(dict(time_utc=stamp, device=name, **r))
            f.flush()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"rows appended to {out_csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
