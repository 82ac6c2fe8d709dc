"""The compiled quantize+pack kernels: every pack variant kind the cache appends with, compiled for sm_90 on
this CPU (`kvquant.kernels.compiled.compile_only`: the launcher runs unchanged on CPU tensors, launches
compile and run nothing).

Per variant (spec, H_kv, D, K/V dtype) and compiled kernel it prints registers, spill
bytes, shared memory, warps, programs per SM on an H200 and the SASS instruction count of the whole kernel
(per warp; the pack kernels are straight-line code: one program per token, or per token group of a head
for channel-wise statistics, and a few dozen bytes written per program). No timing: compile-only.

    python benchmarks/pack_report.py                   # the docs' table: every kind, fp16, H_kv=8, D=128
    python benchmarks/pack_report.py --subset ci       # every constexpr branch: K/V and scale dtypes, -sym,
                                                       # D 64 / 256, MQA, fills, D split (tests compile it)
    python benchmarks/pack_report.py --csv out.csv     # the CSV's path (default: results/pack_report.csv)

Writes the rows as a markdown table next to the CSV (pack_report.md). Exit code 1 when a variant fails to
compile or falls back to the reference (the launcher refused it).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compiled, never interpreted
RESULTS = Path(__file__).resolve().parent / "results"

DOCS = [  # (spec, H_kv, D, K/V dtype): affine for comparison, then the new kinds
    *[(s, 8, 128, "fp16") for s in (
        "int4-g64", "int4-channel-g32",
        "fp8-e4m3", "fp8-e5m2-head", "fp8-e4m3-channel-g32", "fp8-e4m3-tensor",
        "nuq4-g64", "nuq3-g64", "nuq2-g64", "nuq3-channel-g32",
        "int4-g64-center", "int4-g64-out1", "nuq3-g64-center-out1", "fp8-e4m3-g64-out1",
        "int2-channel-g32-center32-out1",
        "llama.cpp:q8_0-norot", "llama.cpp:q4_0-norot", "llama.cpp:q4_1-norot", "llama.cpp:q5_0-norot",
        "llama.cpp:q5_1-norot", "llama.cpp:iq4_nl-norot", "mxfp4", "nvfp4")],
]
CI = [  # each constexpr branch of the pack kernels once (the interpreter tests run them; this compiles them)
    ("fp8-e5m2-g32-sbf16", 2, 64, "bf16"), ("fp8-e4m3-channel-g16-sfp32", 1, 256, "fp32"),
    ("fp8-e5m2-tensor-out1", 2, 64, "fp32"), ("fp8-e4m3-channel-g16-center16-out2", 2, 64, "bf16"),
    ("nuq3-sym-head", 1, 256, "fp16"), ("nuq4-channel-g8-sym", 2, 128, "bf16"),
    ("nuq3-channel-g64", 1, 256, "fp16"),  # 3-bit words, two D slices
    ("nuq2-sym-head-center16", 2, 64, "fp32"), ("int8-center16-out1", 2, 64, "bf16"),
    ("int4-channel-g64-out2", 1, 256, "fp16"),  # outliers written by the first D slice
    ("llama.cpp:q4_0", 2, 256, "fp16"), ("llama.cpp:iq4_nl", 1, 64, "bf16"), ("nvfp4", 1, 256, "fp32"),
]
COLUMNS = ["variant", "kernel", "dtype", "head_dim", "heads", "regs", "spill_bytes", "smem_bytes",
           "num_warps", "programs_per_sm", "instructions", "compile_s", "error"]


def call_variant(spec: str, h: int, d: int, dtype_name: str):
    """Append one token group of `spec` through the pack launcher (CPU tensors), with a registry that
    records what it launched; returns that registry."""
    import torch
    from kvquant.kernels.quantize_pack import quantize_pack_into, random_pools
    from kvquant.kernels.testing import CountingRegistry, with_demo_levels

    from kvquant.codecs.base import codec_for

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    codec = with_demo_levels(codec_for(spec, h, d, dtype))
    g = codec.token_group
    bs = max(16, g)
    x = torch.randn(1, h, g, d).to(dtype)
    pools = random_pools(codec, 2, bs, torch.Generator().manual_seed(0))
    registry = CountingRegistry("pack_report")
    quantize_pack_into(x, codec, pools, torch.tensor([[1]]), 0, registry=registry)
    return registry


def report(variants: list[tuple], out_csv: Path) -> list[dict]:
    from kvquant.kernels.compiled import compile_only, resources

    rows = []
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    with out_csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for spec, h, d, dtype in variants:
            t0 = time.perf_counter()
            error = ""
            with compile_only() as record:
                try:
                    registry = call_variant(spec, h, d, dtype)
                    if registry.failed or not registry.launches:
                        error = "refused: " + (next(iter(registry.failed.values()), "the reference served"))
                except Exception as e:  # noqa: BLE001 - a failed compile is a row, not the end of the report
                    error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            dt = round(time.perf_counter() - t0, 1)
            kernels = [k for k in record if k is not None]
            for k in kernels or [None]:
                row = dict(variant=spec, dtype=dtype, head_dim=d, heads=h, compile_s=dt,
                           error=error.splitlines()[0][:200] if error else "")
                if k is not None:
                    r = resources(k)
                    row.update(kernel=r.name, regs=r.regs, spill_bytes=r.spill_bytes, smem_bytes=r.smem_bytes,
                               num_warps=r.num_warps, programs_per_sm=r.programs_per_sm,
                               instructions=r.instructions)
                rows.append(row)
                writer.writerow({c: row.get(c, "") for c in COLUMNS})
                print(" ".join(f"{row.get(c, '')!s:>{w}}" for c, w in zip(COLUMNS, _WIDTHS, strict=True)),
                      flush=True)
    return rows


_WIDTHS = (34, 24, 4, 3, 2, 4, 5, 6, 2, 4, 6, 5, 0)


def write_markdown(rows: list[dict], path: Path) -> None:
    lines = [
        "# Compiled quantize+pack kernels (sm_90, compiled on a CPU; `benchmarks/pack_report.py`)",
        "",
        "One append of a token group; registers, spill bytes, shared memory, warps, programs per SM on an "
        "H200, SASS instructions of the whole kernel (straight-line code). No timing.",
        "",
        "| variant | K/V | H_kv | D | kernel | regs | spill | smem | warps | prog/SM | SASS instr |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['variant']} | {r['dtype']} | {r['heads']} | {r['head_dim']} |"
        if r.get("error"):
            lines.append(f"{head} FAILED: {r['error']} | | | | | | |")
            continue
        lines.append(f"{head} {r['kernel']} | {r['regs']} | {r['spill_bytes']} | {r['smem_bytes']} "
                     f"| {r['num_warps']} | {r['programs_per_sm']} | {r['instructions']} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--subset", choices=["docs", "ci"], default="docs")
    p.add_argument("--csv", type=Path, default=RESULTS / "pack_report.csv")
    args = p.parse_args(argv)
    print(" ".join(f"{c[:w] if w else c:>{w}}" for c, w in zip(COLUMNS, _WIDTHS, strict=True)))
    rows = report(DOCS if args.subset == "docs" else CI, args.csv)
    write_markdown(rows, args.csv.with_suffix(".md"))
    failed = [r for r in rows if r.get("error")]
    print(f"{len(rows)} kernels; {len(failed)} failed; csv: {args.csv}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
