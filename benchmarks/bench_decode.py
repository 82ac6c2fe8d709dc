"""Decode attention over a quantized KV cache: the fused Triton kernel against FP16 SDPA and dequantize+SDPA.

For each head layout, context length, batch size and scheme, times one decode step of one layer
(`triton.testing.do_bench`, median and 20/80% quantiles) and prints:
  time (us), achieved GB/s (bytes of codes, scales, zeros read; FP16 K/V for SDPA), % of this device's
  measured device-to-device copy bandwidth, speedup of the fused kernel over FP16 SDPA and over
  dequantize-then-SDPA. Rows are appended to a CSV tagged with the device name. Where the launcher took
  128 tokens per loop iteration (it compiles 64 and 128 and keeps the one with fewer instructions that
  does not spill), a `fused_block64` row times the 64-token variant beside it: the compiled count is the
  reason for the choice, this row is the measured check of it.

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
          "us_p80", "bytes", "gb_s", "pct_copy_bw", "pct_peak", "speedup_vs_sdpa", "speedup_vs_dequant",
          "host_us_per_call", "note"]
PEAK_GBS = 4800.0  # H200 HBM3e
# KIVI-4 is the third; the fifth is the kernel part of the best <= 3-bit recipe (k=nuq3-channel-g64-prerope,
# v=int2-g64-rot): a codebook's speed does not depend on its levels, so stand-in ones serve (no file is read)
KEY_SCHEMES = ["int4-g64", "int8", "k=int4-channel-g32,v=int4-g32", "fp16",
               "k=nuq3-channel-g64,v=int2-g64,calib=stand-in-levels"]
KEY_POINTS = [(t, b) for t in (4096, 32768) for b in (1, 8, 32)] + [(131072, 1)]


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
    if args.key_points and not args.interpret:
        # bare and with sink+window (the normal cache case), B 1/8/32 x T 4k/32k, and 128k at B=1
        schemes = [s + fp for s in KEY_SCHEMES for fp in ("", ",sink=4,window=128")]
        return [("llama3-8b", s, t, b) for s in schemes for t, b in KEY_POINTS]
    if args.interpret:  # the interpreter runs every program in Python: keep it tiny
        contexts, batches = args.contexts or [128], args.batches or [1]
        schemes = args.schemes or (["int4-g64,sink=4,window=128", "k=int4-channel-g32,v=int4-g32", "fp16"]
                                   if args.key_points else ["int4-g64", "int8"])
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

    if device.type == "cuda":
        from triton.testing import do_bench

        med, p20, p80 = do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=25, rep=100)
        return med, p20, p80
    # the dry run checks the logic, not the speed: one call (the interpreter runs each program in Python)
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    return ms, ms, ms


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


class _Recorder:
    """A KernelRegistry stand-in that launches and remembers each launch, so the split and the reduce
    kernels can be timed alone (replayed with the same arguments)."""

    def __init__(self):
        self.launches = []
        self.constants = {}  # a codebook's device table, made once (kvquant.kernels.layouts.device_levels)
        self.blocks = {}  # each variant's compiled tokens per iteration, chosen once (decode_attention)

    def launch(self, kernel, grid, args, kwargs, variant) -> bool:
        from kvquant.kernels.registry import device_guard, launch_device

        with device_guard(launch_device(args)):  # as KernelRegistry.launch: the arguments' device current
            kernel[grid](*args, **kwargs)
        self.launches.append((kernel, grid, args, kwargs))
        return True


def sdpa_flash(q, k, v):
    """SDPA pinned to the flash backend (the fair FP16 baseline); (fn, backend name) where flash refuses
    this call (GQA, dtype, CPU), the backend torch picks, named."""
    import torch.nn.functional as F

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # pragma: no cover - old torch
        return (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)), "default"
    g = q.shape[1] // k.shape[1]
    if q.device.type == "cuda":
        # flash with GQA read in place first; else flash on K/V expanded to H_q (reads g times the bytes:
        # named in the note, since it flatters the fused kernel)
        for kk, vv, kw, name in (
            (k, v, {"enable_gqa": True}, "flash"),
            (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), {}, "flash (K/V expanded)"),
        ):
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    F.scaled_dot_product_attention(q, kk, vv, **kw)
            except RuntimeError:
                continue

            def fn(kk=kk, vv=vv, kw=kw):
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return F.scaled_dot_product_attention(q, kk, vv, **kw)
            return fn, name
    return (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)), "default"


def host_us(fn, device, n: int = 50) -> float:
    """Host time per call: n calls launched back to back, timed before the device is waited for."""
    import torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    return dt / n * 1e6


def graph_time(make_call, bytes_one: int, device, l2_bytes: int = 50 << 20):
    """Median ms per call of a CUDA graph that calls the kernel over R rotating layer copies, R chosen so
    the copies together exceed twice the L2 (so INT4's working set cannot stay cached while FP16's
    cannot); (ms, R), or (None, 0) off CUDA. make_call() builds one fresh copy and returns its call."""
    import torch

    if device.type != "cuda":
        return None, 0
    r = max(2, min(16, -(-2 * l2_bytes // max(bytes_one, 1))))
    calls = [make_call() for _ in range(r)]
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for c in calls:
            c()
    med, _, _ = bench(g.replay, device)
    return med / r, r


def run_point(layout: str, scheme_text: str, t: int, b: int, device, copy_bw: float) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from kvquant.kernels.decode_attention import decode_attention, decode_attention_ref
    from kvquant.kernels.testing import make_paged_layer

    from kvquant.scheme import parse_scheme

    h_q, h_kv, d = LAYOUTS[layout]
    scheme = parse_scheme(scheme_text)
    dtype = torch.float16
    bs = max(16, scheme.tokens_per_flush)
    sink, recent = scheme.sink, scheme.window
    t = t // bs * bs
    body = max(bs, (t - sink - recent) // bs * bs)

    def make_layer(seed=0):
        return make_paged_layer(b=b, h_kv=h_kv, d=d, sink=sink, body=body, recent=recent,
                                recent_offset=3 if recent else 0, k=str(scheme.key), v=str(scheme.value),
                                dtype=dtype, device=device, block_size=bs, spare=0, seed=seed)

    layer = make_layer()
    q = torch.randn(b, h_q, 1, d, dtype=dtype, device=device)
    kc, vc = layer.key_codec, layer.value_codec
    total = sink + body + recent
    mask = torch.ones(1, total, dtype=torch.bool, device=device)

    k, v = _dequant_all(layer, kc, vc, dtype)  # the SDPA baseline's FP16 cache
    fp_tokens = sink + recent
    fused_bytes = (kc.bytes(body) + vc.bytes(body)) * b + 2 * b * h_kv * fp_tokens * d * 2
    fp16_bytes = 2 * k.numel() * k.element_size()
    rec = _Recorder()
    fused = lambda: decode_attention(q, *layer.decode_args(), None, mask, registry=rec)  # noqa: E731
    flash, backend = sdpa_flash(q, k, v)

    def dequant_sdpa():  # dequantize every part on each call, then SDPA over FP16
        return F.scaled_dot_product_attention(q, *_dequant_all(layer, kc, vc, dtype), enable_gqa=True)

    methods = {
        "fused": (fused, fused_bytes, ""),
        "sdpa_fp16": (flash, fp16_bytes, f"sdpa backend: {backend}"),
        "dequant_sdpa": (dequant_sdpa, fused_bytes, ""),
    }
    # the fused kernel must agree with the fp32 reference before its time means anything
    _check_fused(fused, decode_attention_ref(q, *layer.decode_args(), None, mask, upcast=True),
                 f"{layout} {scheme_text} T={t} B={b}")
    split_launch, reduce_launch = rec.launches[-2], rec.launches[-1]
    replay = lambda launch: (lambda: launch[0][launch[1]](*launch[2], **launch[3]))  # noqa: E731
    methods["fused_split_only"] = (replay(split_launch), fused_bytes, "the split kernel alone")
    methods["fused_reduce_only"] = (replay(reduce_launch), 0, "the reduce kernel alone")
    chosen = split_launch[3]["BLOCK_T"]
    if chosen != 64:  # the launcher compiled 64 and 128 tokens per iteration and took 128: time 64 beside it
        narrow = lambda: decode_attention(q, *layer.decode_args(), None, mask, registry=rec,  # noqa: E731
                                          block_t=64)
        methods["fused_block64"] = (narrow, fused_bytes,
                                    f"64 tokens per iteration (the launcher chose {chosen})")

    times = {name: bench(fn, device) for name, (fn, _, _) in methods.items()}
    hosts = {name: host_us(fn, device) for name, (fn, _, _) in methods.items()}

    def graph_call():
        lay = make_layer(seed=1) if device.type == "cuda" else layer
        return lambda: decode_attention(q, *lay.decode_args(), None, mask)

    g_ms, g_r = graph_time(graph_call, fused_bytes, device)
    if g_ms is not None:
        times["fused_graph_rotating"] = (g_ms, g_ms, g_ms)
        hosts["fused_graph_rotating"] = float("nan")
        methods["fused_graph_rotating"] = (None, fused_bytes, f"CUDA graph over {g_r} rotating layer copies")
    point = dict(layout=layout, scheme=scheme_text, batch=b, context=total)
    return _point_rows(point, methods, times, hosts, copy_bw)


def _dequant_all(lay, kc, vc, dtype):
    """(B, H_kv, T, D) FP16 K and V of every part (sink | body | recent) of the paged layer `lay`, as a
    dequantizing cache would (kc, vc: its K and V codecs)."""
    import torch
    from kvquant.kernels.decode_attention import _gather_fields

    parts_k, parts_v = [], []
    for region, pool_k, pool_v in ((lay.sink, lay.fp_k, lay.fp_v), (lay.body, None, None),
                                   (lay.recent, lay.fp_k, lay.fp_v)):
        if not region.length:
            continue
        if pool_k is None:
            parts_k.append(kc.decode(_gather_fields(lay.key_pages, kc, region), dtype))
            parts_v.append(vc.decode(_gather_fields(lay.value_pages, vc, region), dtype))
        else:
            from kvquant.kernels.decode_attention import gather_region
            parts_k.append(gather_region(pool_k, region))
            parts_v.append(gather_region(pool_v, region))
    return torch.cat(parts_k, 2), torch.cat(parts_v, 2)


def _check_fused(fused, ref, what: str) -> None:
    """Refuse to time a fused kernel whose output (`fused()`) is off the fp32 reference by 2e-2 or more."""
    got = fused()
    err = (got.float() - ref).abs().max().item()
    if not err < 2e-2:
        raise AssertionError(f"{what}: fused output is off by {err:.3g}")


def _point_rows(point: dict, methods: dict, times: dict, hosts: dict, copy_bw: float) -> list[dict]:
    """One result row per method at this point (layout, scheme, batch, context): its median and p20/p80
    time, bandwidth against the copy bandwidth and the peak, speedups over SDPA and dequantize-then-SDPA,
    host time per call."""
    rows = []
    for name, (_, nb, note) in methods.items():
        med, p20, p80 = times[name]
        gbs = nb / (med * 1e-3) / 1e9
        rows.append(dict(
            **point, method=name,
            us_median=round(med * 1e3, 2), us_p20=round(p20 * 1e3, 2), us_p80=round(p80 * 1e3, 2),
            bytes=nb, gb_s=round(gbs, 1), pct_copy_bw=round(100 * gbs / copy_bw, 1),
            pct_peak=round(100 * gbs / PEAK_GBS, 1),
            speedup_vs_sdpa=round(times["sdpa_fp16"][0] / med, 2),
            speedup_vs_dequant=round(times["dequant_sdpa"][0] / med, 2),
            host_us_per_call=round(hosts[name], 1), note=note,
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
