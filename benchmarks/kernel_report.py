"""The compiled-kernel report: every decode variant the cache can call, compiled for sm_90 on this CPU.

For each variant (K/V codec, with or without sink/window, head_dim, dtype) the launcher runs unchanged on
CPU tensors inside `kvquant.kernels.compiled.compile_only()`, so what compiles is what a GPU would compile
for the same call. Per compiled kernel it prints: registers, spill bytes, shared memory, programs per SM
on an H200, SASS instructions per warp of each loop iteration (one iteration = 64 tokens), the bytes one
program reads per 64 tokens (codes, scales, zeros of one KV head; block table and mask bytes not
counted), and the instruction-issue ceiling: bytes * 4 / (num_warps * instructions) per clock per SM
against the H200's ~18.4 B/clock/SM of HBM (4.8 TB/s), in %.

    python benchmarks/kernel_report.py                # all variants (D 64/128/256, fp16 and bf16)
    python benchmarks/kernel_report.py --quick        # D=128 fp16 only (< 3 min on 2 cores)
    python benchmarks/kernel_report.py --subset ci    # the few variants the CI test compiles

Writes benchmarks/results/kernel_report.csv (or --csv). Exit code 1 when a variant fails to compile.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    # the report compiles; the interpreter's kernels are not JITFunctions
    os.environ["TRITON_INTERPRET"] = "0"

COLUMNS = ["variant", "kernel", "dtype", "head_dim", "regs", "spill_bytes", "smem_bytes", "programs_per_sm",
           "limit", "num_warps", "loop_instr_per_64_tokens", "fp_loop_instr", "loops", "bytes_per_64_tokens",
           "ceiling_pct", "compile_s", "error"]

SCHEMES = {  # report name: (K spec, V spec)
    "fp16": ("fp16", "fp16"),
    "int8": ("int8", "int8"),
    "int4-g64": ("int4-g64", "int4-g64"),
    "int2-g32": ("int2-g32", "int2-g32"),
    "kivi-4": ("int4-channel-g32", "int4-g32"),
    "kivi-2": ("int2-channel-g32", "int2-g32"),
}
LAYOUT = (32, 8)  # H_q, H_kv (Llama-3-8B); head_dim varies


@dataclass(frozen=True)
class Variant:
    scheme: str
    fp: bool  # sink and window tokens present
    head_dim: int
    dtype: str

    @property
    def name(self) -> str:
        return self.scheme + ("+sink+window" if self.fp else "")


def variants(subset: str) -> list[Variant]:
    if subset == "ci":
        return [Variant("int4-g64", True, 128, "fp16"), Variant("int8", False, 128, "fp16"),
                Variant("kivi-2", True, 256, "fp16")]
    dims = (128,) if subset == "quick" else (64, 128, 256)
    dtypes = ("fp16",) if subset == "quick" else ("fp16", "bf16")
    return [Variant(s, fp, d, dt) for d in dims for dt in dtypes for s in SCHEMES for fp in (False, True)]


def body_bytes_per_64(spec_text: str, h_kv: int, d: int, dtype) -> int:
    """Bytes one program reads per 64 body tokens of one KV head for one of K/V."""
    from kvquant.codec import codec_for

    codec = codec_for(spec_text, h_kv, d, dtype)
    return int(sum(f.nbytes(64) / f.heads for f in codec.fields().values()))


def call_variant(v: Variant):
    """The decode launcher's call for this variant, on a stand-in paged layer (inside compile_only
    nothing runs): B=1, 4,096 body tokens, and 4 sink + 130 recent tokens (offset 5) when v.fp."""
    import torch
    from kvquant.kernels.decode_attention import decode_attention
    from kvquant.kernels.testing import make_paged_layer

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[v.dtype]
    h_q, h_kv = LAYOUT
    k_spec, v_spec = SCHEMES[v.scheme]
    bs = 32 if "channel-g32" in k_spec else 16  # a page holds whole channel-wise groups
    layer = make_paged_layer(b=1, h_kv=h_kv, d=v.head_dim, sink=4 if v.fp else 0, body=4096,
                             recent=130 if v.fp else 0, recent_offset=5 if v.fp else 0, k=k_spec, v=v_spec,
                             dtype=dtype, block_size=bs, spare=0)
    q = torch.randn(1, h_q, 1, v.head_dim).to(dtype)
    mask = torch.ones(1, layer.shape[2], dtype=torch.bool)
    return lambda: decode_attention(q, *layer.decode_args(), None, mask)


def report(subset: str, out_csv: Path | None, verbose: bool = True) -> list[dict]:
    import torch
    from kvquant.kernels.compiled import ceiling_pct, compile_only, resources

    rows = []
    for v in variants(subset):
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[v.dtype]
        k_spec, v_spec = SCHEMES[v.scheme]
        nbytes = body_bytes_per_64(k_spec, LAYOUT[1], v.head_dim, dtype) + body_bytes_per_64(
            v_spec, LAYOUT[1], v.head_dim, dtype)
        t0 = time.perf_counter()
        error = ""
        with compile_only() as record:
            try:
                call_variant(v)()
            except Exception as e:  # noqa: BLE001 - a failed compile is a row, not the end of the report
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        dt = time.perf_counter() - t0
        if error and not record:
            rows.append(dict(variant=v.name, kernel="", dtype=v.dtype, head_dim=v.head_dim, error=error,
                             compile_s=round(dt, 1)))
        seen = set()
        for k in record:
            if k is None or id(k) in seen:
                continue
            seen.add(id(k))
            r = resources(k)
            split = "split" in r.name
            loops = sorted(r.loops, reverse=True)
            body_loop = loops[0] if split and loops else ""
            fp_loop = loops[1] if split and v.fp and len(loops) > 1 else ""
            ceiling = round(min(ceiling_pct(nbytes, body_loop, r.num_warps), 100.0), 1) if body_loop else ""
            rows.append(dict(
                variant=v.name, kernel=r.name, dtype=v.dtype, head_dim=v.head_dim, regs=r.regs,
                spill_bytes=r.spill_bytes, smem_bytes=r.smem_bytes, programs_per_sm=r.programs_per_sm,
                limit=r.limit, num_warps=r.num_warps, loop_instr_per_64_tokens=body_loop,
                fp_loop_instr=fp_loop, loops="/".join(map(str, r.loops)),
                bytes_per_64_tokens=nbytes if split else "", ceiling_pct=ceiling, compile_s=round(dt, 1),
                error=error,
            ))
        if verbose:
            for r in rows[-len(seen) or -1:]:
                print_row(r)
    if out_csv is not None:
        out_csv.parent.mkdir(parents=True, exist_ok=True)
        with out_csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            for r in rows:
                w.writerow({c: r.get(c, "") for c in COLUMNS})
    return rows


_HEADER = (f"{'variant':<22} {'kernel':<24} {'dt':<4} {'D':>3} {'regs':>4} {'spill':>5} {'smem':>7} "
           f"{'p/SM':>4} {'loop':>5} {'fp':>5} {'B/64t':>6} {'ceil%':>6} {'s':>5}")


def print_row(r: dict) -> None:
    if r.get("error") and not r.get("kernel"):
        print(f"{r['variant']:<22} {'':<24} {r['dtype']:<4} {r['head_dim']:>3} FAILED: {r['error']}")
        return
    print(f"{r['variant']:<22} {r['kernel'][:24]:<24} {r['dtype']:<4} {r['head_dim']:>3} {r['regs']:>4} "
          f"{r['spill_bytes']:>5} {r['smem_bytes']:>7} {r['programs_per_sm']:>4} "
          f"{r['loop_instr_per_64_tokens']!s:>5} {r['fp_loop_instr']!s:>5} {r['bytes_per_64_tokens']!s:>6} "
          f"{r['ceiling_pct']!s:>6} {r['compile_s']:>5}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="D=128 fp16 variants only")
    p.add_argument("--subset", choices=["all", "quick", "ci"], default=None)
    p.add_argument("--csv", type=Path, default=None)
    args = p.parse_args(argv)
    subset = args.subset or ("quick" if args.quick else "all")
    out = args.csv or Path(__file__).resolve().parent / "results" / "kernel_report.csv"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(_HEADER)
    rows = report(subset, out)
    failed = [r for r in rows if r.get("error")]
    print(f"{len(rows)} kernels; {len(failed)} failed; csv: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
