"""The compiled-kernel report: every decode variant the cache can call, compiled for sm_90 on this CPU.

For each variant (K/V codec, with or without sink/window, head_dim, dtype) the launcher runs unchanged on
CPU tensors inside `kvquant.kernels.compiled.compile_only()`, so what compiles is what a GPU would compile
for the same call. Per compiled kernel it prints: registers, spill bytes, shared memory, programs per SM
on an H200, the tokens per loop iteration the launcher chose (64 or 128: it compiles both and keeps the
cheaper one that does not spill, `decode_attention._block_tokens`; the other is shown too), SASS
instructions per warp per 64 body tokens (each loop's count per iteration scaled to 64 tokens), the bytes one
program reads per 64 tokens (codes, scales, zeros of one KV head; block table and mask bytes not
counted), and the instruction-issue ceiling: bytes * 4 / (num_warps * instructions) per clock per SM
against the H200's ~18.4 B/clock/SM of HBM (4.8 TB/s), in %.

    python benchmarks/kernel_report.py                # all variants (D 64/128/256, fp16 and bf16)
    python benchmarks/kernel_report.py --quick        # D=128 fp16 only (< 3 min on 2 cores)
    python benchmarks/kernel_report.py --subset ci    # the few variants the CI test compiles
    python benchmarks/kernel_report.py --subset fp8   # FP8 next to int8 and int4-g64 (D=128, fp16 + bf16)
    python benchmarks/kernel_report.py --subset codebook   # nuq2/3/4, -center, -outP next to int8, int4-g64
    python benchmarks/kernel_report.py --subset engine     # GGUF blocks, vLLM per-token-head formats, same
    python benchmarks/kernel_report.py --measure      # + each variant run against its fp32 twin
    python benchmarks/kernel_report.py --jobs 8       # compiled in 8 child processes (a GPU host's cores)
    python benchmarks/kernel_report.py --subset ci --measure --body 128   # the same on a CPU, interpreted

--measure adds max_err (max |out - ref32| of the kernel's output against `decode_attention_ref(upcast=True)`),
err_bound (the tests' flash-attention bound, 2 |ref_same_dtype - ref32| + atol) and err_ok per variant:
on CUDA run in this process, on a CPU interpreted in a child process. It also runs the first-use
self-check (kvquant.kernels.registry) on a registry of its own: self_check is "pass" or what differed,
probe_ms the probe's cost (its launch, the twin, the comparison; on a GPU after the compile). Writes
benchmarks/results/kernel_report.csv (or --csv), row by row, and the split kernel's rows as a markdown
table next to it (kernel_report.md, or --md). Exit code 1 when a variant fails to compile
or, with --measure, exceeds its bound.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1" and "--errors-only" not in sys.argv:
    # the report compiles; the interpreter's kernels are not JITFunctions (--errors-only, the interpreted
    # error measurement of a CPU run, is the one mode that keeps the interpreter)
    os.environ["TRITON_INTERPRET"] = "0"

COLUMNS = ["variant", "kernel", "dtype", "head_dim", "regs", "spill_bytes", "smem_bytes", "programs_per_sm",
           "limit", "num_warps", "block_t", "loop_instr_per_64_tokens", "fp_loop_instr", "other_block",
           "loops", "bytes_per_64_tokens",
           "ceiling_pct", "compile_s", "error", "max_err", "err_bound", "err_ok", "err_device", "self_check",
           "probe_ms"]
ATOL = {"fp16": 2e-4, "bf16": 2e-3}  # tests/kernels/test_decode_attention.py's atol

SCHEMES = {  # report name: (K spec, V spec)
    "fp16": ("fp16", "fp16"),
    "int8": ("int8", "int8"),
    "int8-g32-sym": ("int8-g32-sym", "int8-g32-sym"),  # q8_0's information in kvquant's aligned fields
    "int4-g64": ("int4-g64", "int4-g64"),
    "int2-g32": ("int2-g32", "int2-g32"),
    "kivi-4": ("int4-channel-g32", "int4-g32"),
    "kivi-2": ("int2-channel-g32", "int2-g32"),
    "fp8-e4m3": ("fp8-e4m3", "fp8-e4m3"),  # per-token scale (shared by the heads), as int8
    "fp8-e5m2": ("fp8-e5m2", "fp8-e5m2"),
    "fp8-e4m3-tensor": ("fp8-e4m3-tensor", "fp8-e4m3-tensor"),  # vLLM's FP8 cache without k/v scales
    # codebooks (kernels.layouts.CodebookKernelLayout; stand-in levels, kernels.testing.demo_levels)
    "nuq4-g64": ("nuq4-g64", "nuq4-g64"),
    "nuq3-g64": ("nuq3-g64", "nuq3-g64"),  # 8 codes per 3 bytes
    "nuq2-g64": ("nuq2-g64", "nuq2-g64"),
    "nuq3": ("nuq3", "nuq3"),  # one scale per token: folded into scores and probabilities
    "nuq3-sym-head": ("nuq3-head-sym", "nuq3-head-sym"),  # no zero, absmax scale per (token, head)
    # the best <= 3-bit recipe's kernel part (k=nuq3-channel-g64-prerope,v=int2-g64-rot without -prerope
    # and -rot, which run outside the kernel), and with its keys' RoPE applied in the kernel
    "kvquant-3b": ("nuq3-channel-g64", "int2-g64"),
    "kvquant-3b-prerope": ("nuq3-channel-g64-prerope", "int2-g64"),
    # -center (the key offset added back, one row per 64 tokens) and -outP (exact values written in place)
    "int4-g64-kcenter": ("int4-g64-center", "int4-g64"),
    "int4-g64-out1": ("int4-g64-out1", "int4-g64-out1"),  # 2 outliers per (token, head) at D=128
    "nuq3-g64-kcenter": ("nuq3-g64-center", "nuq3-g64"),
    # GGUF blocks read in place (kernels.engine_blocks; llama.cpp's rotation and the channel order are applied
    # outside the kernel, so the rotated and -norot names compile to the same kernel)
    "q8_0": ("llama.cpp:q8_0", "llama.cpp:q8_0"),
    "q4_0": ("llama.cpp:q4_0", "llama.cpp:q4_0"),
    "q4_1": ("llama.cpp:q4_1", "llama.cpp:q4_1"),
    "q5_0": ("llama.cpp:q5_0", "llama.cpp:q5_0"),
    "q5_1": ("llama.cpp:q5_1", "llama.cpp:q5_1"),
    "iq4_nl": ("llama.cpp:iq4_nl", "llama.cpp:iq4_nl"),
    "mxfp4": ("mxfp4", "mxfp4"),
    "nvfp4": ("nvfp4", "nvfp4"),
    # vLLM's per-(token, head) formats (fp8_e4m3 at scale 1 compiles to fp8-e4m3-tensor's kernel)
    "vllm-int8-pth": ("vllm:int8_per_token_head", "vllm:int8_per_token_head"),
    "vllm-fp8-pth": ("vllm:fp8_per_token_head", "vllm:fp8_per_token_head"),
    # vLLM's TurboQuant slots (keys in the layer's rotated frame, rotated outside the kernel)
    "tq-4bit-nc": ("vllm:turboquant_4bit_nc.k", "vllm:turboquant_4bit_nc.v"),
    "tq-3bit-nc": ("vllm:turboquant_3bit_nc.k", "vllm:turboquant_3bit_nc.v"),
    "tq-k8v4": ("vllm:turboquant_k8v4.k", "vllm:turboquant_k8v4.v"),
}
# the codebook, -center and -outP variants (`--subset codebook`)
CODEBOOK = ("nuq4-g64", "nuq3-g64", "nuq2-g64", "nuq3", "nuq3-sym-head", "kvquant-3b", "kvquant-3b-prerope",
            "int4-g64-kcenter", "int4-g64-out1", "nuq3-g64-kcenter")
# the GGUF block and vLLM variants (`--subset engine`)
ENGINE = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "mxfp4", "nvfp4", "vllm-int8-pth", "vllm-fp8-pth",
          "tq-4bit-nc", "tq-3bit-nc", "tq-k8v4")
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
                Variant("kivi-2", True, 256, "fp16"), Variant("int4-g64-out1", False, 128, "fp16"),
                Variant("q8_0", False, 128, "fp16"), Variant("q4_0", False, 128, "fp16"),
                Variant("nuq4-g64", False, 128, "fp16"), Variant("nuq3-g64", False, 128, "fp16")]
    if subset == "gpu":  # gpu_check.sh's: D=128 fp16, plus bf16 for int8, int4-g64, FP8 and codebooks
        bf16 = [v for v in variants("fp8") + variants("codebook") if v.dtype == "bf16"]
        return list(dict.fromkeys(variants("quick") + bf16))
    if subset == "codebook":  # codebook, -center, -outP next to int8 and int4-g64 (D=128, fp16 + bf16)
        return [Variant(s, False, 128, dt) for dt in ("fp16", "bf16")
                for s in ("int8", "int4-g64", *CODEBOOK)]
    if subset == "engine":  # GGUF blocks and vLLM formats next to int8 and int4-g64 (D=128, fp16 + bf16)
        return [Variant(s, False, 128, dt) for dt in ("fp16", "bf16")
                for s in ("int8", "int8-g32-sym", "int4-g64", *ENGINE)]
    if subset == "fp8":
        return [Variant(s, False, 128, dt) for dt in ("fp16", "bf16")
                for s in ("int8", "int4-g64", "fp8-e4m3", "fp8-e5m2", "fp8-e4m3-tensor")]
    dims = (128,) if subset == "quick" else (64, 128, 256)
    dtypes = ("fp16",) if subset == "quick" else ("fp16", "bf16")
    # --quick (and gpu_check's subset) compiles the codebook, -center, -outP, GGUF and vLLM variants without
    # sink+window only: the FP loop is the same code for every body codec, and the GPU check has 8 minutes
    fps = lambda s: (False,) if subset == "quick" and s in CODEBOOK + ENGINE else (False, True)  # noqa: E731
    return [Variant(s, fp, d, dt) for d in dims for dt in dtypes for s in SCHEMES for fp in fps(s)]


def body_bytes_per_64(spec_text: str, h_kv: int, d: int, dtype) -> int:
    """Bytes one program reads per 64 body tokens of one KV head for one of K/V."""
    from kvquant.codecs.base import codec_for

    codec = codec_for(spec_text, h_kv, d, dtype)
    return int(sum(f.nbytes(64) / f.heads for f in codec.fields().values()))


def _codec(spec_text: str, h_kv: int, d: int, dtype):
    """The codec of a report spec: stand-in codebook levels (`kernels.testing.demo_levels`), and for a
    `-prerope` key a default RoPE (theta 10,000; the kernel does not depend on the frequencies)."""
    import torch
    from kvquant.kernels.testing import with_demo_levels

    from kvquant.codecs.base import codec_for
    from kvquant.rope import Rope

    rope = Rope(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))) if "prerope" in spec_text else None
    return with_demo_levels(codec_for(spec_text, h_kv, d, dtype, rope=rope))


def call_variant(v: Variant, device: str = "cpu", body: int = 4096, with_ref: bool = False):
    """The decode launcher's call for this variant, on a stand-in paged layer (inside compile_only
    nothing runs): B=1, `body` body tokens, and 4 sink + 130 recent tokens (offset 5) when v.fp.
    with_ref: also return its twin's calls, (kernel, ref in the query's dtype, ref in fp32)."""
    import torch
    from kvquant.kernels.decode_attention import decode_attention, decode_attention_ref
    from kvquant.kernels.testing import make_paged_layer

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[v.dtype]
    h_q, h_kv = LAYOUT
    k_spec, v_spec = SCHEMES[v.scheme]
    from kvquant.codecs.base import codec_for

    # a page holds whole token groups (channel-wise scales, -center offsets), as the cache's block size does
    bs = math.lcm(16, *(codec_for(s, h_kv, v.head_dim, dtype).token_group for s in (k_spec, v_spec)))
    k_codec, v_codec = (_codec(s, h_kv, v.head_dim, dtype) for s in (k_spec, v_spec))
    layer = make_paged_layer(b=1, h_kv=h_kv, d=v.head_dim, sink=4 if v.fp else 0, body=body,
                             recent=130 if v.fp else 0, recent_offset=5 if v.fp else 0, k=k_codec, v=v_codec,
                             dtype=dtype, block_size=bs, spare=0, device=device)
    q = torch.randn(1, h_q, 1, v.head_dim, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    mask = torch.ones(1, layer.shape[2], dtype=torch.bool, device=device)
    from kvquant.kernels.registry import KernelRegistry, SelfCheck

    if not with_ref:  # a registry of its own: a variant it refuses (cannot be built) is a failed row
        registry = KernelRegistry("kernel_report", self_check=SelfCheck(enabled=False))
        run = lambda: decode_attention(q, *layer.decode_args(), None, mask, registry=registry)  # noqa: E731
        run.registry = registry
        return run

    # a registry of its own: a variant refused here must not hide the compile-only row that follows; and a
    # self-check of its own, on whatever device (the interpreter included), so its verdict is reported
    registry = KernelRegistry("kernel_report", self_check=SelfCheck(enabled=True))
    run = lambda: decode_attention(q, *layer.decode_args(), None, mask, registry=registry)  # noqa: E731
    run.registry = registry
    ref = lambda upcast: decode_attention_ref(q, *layer.decode_args(), None, mask, upcast=upcast)  # noqa: E731
    return run, (lambda: ref(False)), (lambda: ref(True))


def measure_error(v: Variant, device: str, body: int = 4096) -> dict:
    """Run the variant (on `device`; interpreted on a CPU) and compare with its fp32 twin: max |out - ref32|
    against the tests' flash-attention bound 2 |ref_same_dtype - ref32| + atol."""
    run, ref, ref32 = call_variant(v, device, body, with_ref=True)
    out = run()
    check = run.registry.self_check
    verdict = next(iter(check.verdicts.values()), "not run")
    probe = dict(self_check="pass" if verdict is None else str(verdict)[:200],
                 probe_ms=f"{1e3 * sum(check.seconds.values()):.1f}")
    if out is None:  # the registry refused the variant (logged): no kernel output to measure
        return dict(max_err="", err_bound="", err_ok="refused", err_device=device, **probe)
    r32 = ref32()
    err = (out.float() - r32).abs().max().item()
    bound = 2 * (ref().float() - r32).abs().max().item() + ATOL[v.dtype]
    return dict(max_err=f"{err:.3g}", err_bound=f"{bound:.3g}", err_ok=str(err <= bound).lower(),
                err_device=device, **probe)


def measure_errors(vs: list[Variant], body: int) -> dict[str, dict]:
    """{variant key: measure_error row} on CUDA in this process; on a CPU in a child process with the
    Triton interpreter (this process compiles, and triton.jit chooses at definition time)."""
    import torch

    if torch.cuda.is_available():
        return {_key(v): measure_error(v, "cuda", body) for v in vs}
    import json
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    names = ";".join(_key(v) for v in vs)
    proc = subprocess.run([sys.executable, __file__, "--errors-only", names, "--body", str(body)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-500:].replace("\n", " ")
        return {_key(v): dict(err_ok=f"failed: {tail}", err_device="cpu") for v in vs}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _key(v: Variant) -> str:
    return f"{v.scheme}|{int(v.fp)}|{v.head_dim}|{v.dtype}"


def _from_key(k: str) -> Variant:
    scheme, fp, d, dt = k.split("|")
    return Variant(scheme, fp == "1", int(d), dt)


def report(subset: str, out_csv: Path | None, verbose: bool = True, measure: bool = False,
           body: int = 4096, shard: tuple[int, int] | None = None) -> list[dict]:
    import torch
    from kvquant.kernels.compiled import ceiling_pct, compile_only, constexpr, resources

    rows = []
    vs = variants(subset)
    if shard is not None:  # the i-th of n contiguous chunks (concatenated in order they are the whole list)
        i, n = shard
        vs = vs[len(vs) * i // n:len(vs) * (i + 1) // n]
    on_gpu = torch.cuda.is_available()
    errors = measure_errors(vs, body) if measure and not on_gpu else {}  # a CPU: one interpreted child
    writer = None
    if out_csv is not None:  # rows are written as they come: a run cut short by a timeout keeps its rows
        out_csv.parent.mkdir(parents=True, exist_ok=True)
        f = out_csv.open("w", newline="")
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
    for v in vs:
        if measure and on_gpu:
            try:
                errors[_key(v)] = measure_error(v, "cuda", body)
            except Exception as e:  # noqa: BLE001 - a failed run is a row, not the end of the report
                errors[_key(v)] = dict(err_ok=f"failed: {type(e).__name__}", err_device="cuda")
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[v.dtype]
        k_spec, v_spec = SCHEMES[v.scheme]
        nbytes = body_bytes_per_64(k_spec, LAYOUT[1], v.head_dim, dtype) + body_bytes_per_64(
            v_spec, LAYOUT[1], v.head_dim, dtype)
        t0 = time.perf_counter()
        error = ""
        with compile_only() as record:
            try:
                run = call_variant(v)
                run()
                if run.registry.failed:  # refused by the launcher's registry (logged): a failure, not a row
                    error = f"refused: {next(iter(run.registry.failed.values()))}".splitlines()[0][:200]
            except Exception as e:  # noqa: BLE001 - a failed compile is a row, not the end of the report
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        dt = time.perf_counter() - t0
        if error and all(k is None for k in record):
            rows.append(dict(variant=v.name, kernel="", dtype=v.dtype, head_dim=v.head_dim, error=error,
                             compile_s=round(dt, 1)))
        # the launcher compiles both token blocks of a variant to choose one (decode_attention._block_tokens):
        # the record holds the candidates, then the kernels it launched (the last of each name)
        last = {}
        for k in record:
            if k is not None:
                last[k.name] = k
        candidates = [k for k in record if k is not None and "split" in k.name and k is not last[k.name]]
        for k in last.values():
            r = resources(k)
            split = "split" in r.name
            bt = constexpr(k, "BLOCK_T") if split else ""
            # address order: the body loop is compiled before the FP (sink + window) loop, as in the source
            # (by size would mislabel them where the FP loop is the longer one, as for int8 + sink + window)
            loops = r.token_loops
            body_loop = round(loops[0] * 64 / bt) if split and loops else ""
            fp_loop = round(loops[1] * 64 / bt) if split and v.fp and len(loops) > 1 else ""
            ceiling = round(min(ceiling_pct(nbytes, body_loop, r.num_warps), 100.0), 1) if body_loop else ""
            rows.append(dict(
                variant=v.name, kernel=r.name, dtype=v.dtype, head_dim=v.head_dim, regs=r.regs,
                spill_bytes=r.spill_bytes, smem_bytes=r.smem_bytes, programs_per_sm=r.programs_per_sm,
                limit=r.limit, num_warps=r.num_warps, block_t=bt, loop_instr_per_64_tokens=body_loop,
                fp_loop_instr=fp_loop, other_block=_others(candidates, bt) if split else "",
                loops="/".join(map(str, r.loops)),
                bytes_per_64_tokens=nbytes if split else "", ceiling_pct=ceiling, compile_s=round(dt, 1),
                error=error, **(errors.get(_key(v), {}) if split else {}),
            ))
        for r in rows[-len(last) or -1:]:
            if verbose:
                print_row(r)
            if writer is not None:
                writer.writerow({c: r.get(c, "") for c in COLUMNS})
        if writer is not None:
            f.flush()
    if writer is not None:
        f.close()
    return rows


def _others(candidates: list, chosen: int) -> str:
    """The token blocks the launcher compiled and did not take: "64: 605" (SASS instructions per 64 body
    tokens), with its spill bytes when it spilled."""
    from kvquant.kernels.compiled import constexpr, resources

    out = []
    for k in candidates:
        bt = constexpr(k, "BLOCK_T")
        if bt == chosen:
            continue
        r = resources(k)
        loops = r.token_loops
        text = f"{bt}: {round(loops[0] * 64 / bt) if loops else '?'}"
        out.append(text + (f" (spills {r.spill_bytes} B)" if r.spill_bytes else ""))
    return "; ".join(dict.fromkeys(out))


def write_markdown(rows: list[dict], path: Path, subset: str) -> None:
    """The split kernel's rows as a markdown table (with each row's instructions against int8's of the same
    dtype and D), for docs and notes: benchmarks/results/kernel_report.md next to the CSV."""
    base = {(r["dtype"], r["head_dim"]): r["loop_instr_per_64_tokens"] for r in rows
            if r.get("variant") == "int8" and "split" in r.get("kernel", "")}
    lines = [
        f"# Compiled decode kernels (sm_90, compiled on a CPU; `kernel_report.py --subset {subset}`)",
        "",
        "SASS instructions per warp per 64 body tokens of `_paged_split_kernel` (one program, 4 warps; the "
        "loop's count per iteration times 64 / block, the block being the tokens per iteration the launcher "
        "chose, 64 or 128, and `other block` what the one it did not choose compiled to), registers, spill "
        "bytes, shared memory, programs per SM on an H200, bytes one program reads per 64 tokens (K + V of "
        "one KV head: codes, scales, zeros), and the instruction-issue ceiling against HBM bandwidth (4 "
        "warp-instructions per clock per SM, 18.4 B/clock/SM). H_q=32, H_kv=8. No timing: compile-only "
        "(the machine's load does not change these numbers).",
        "",
        "| variant | dtype | D | block | regs | spill | smem | prog/SM | instr/64 tok | vs int8 | B/64 tok "
        "| ceil% | other block |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "split" not in r.get("kernel", ""):
            if r.get("error"):
                lines.append(f"| {r['variant']} | {r['dtype']} | {r['head_dim']} | FAILED: {r['error']} "
                             "| | | | | | | | | |")
            continue
        b = base.get((r["dtype"], r["head_dim"]))
        n = r["loop_instr_per_64_tokens"]
        ratio = f"{n / b:.2f}" if b and n else ""
        lines.append(f"| {r['variant']} | {r['dtype']} | {r['head_dim']} | {r['block_t']} | {r['regs']} | "
                     f"{r['spill_bytes']} | {r['smem_bytes']} | {r['programs_per_sm']} | {n} | {ratio} | "
                     f"{r['bytes_per_64_tokens']} | {r['ceiling_pct']} | {r['other_block']} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


_HEADER = (f"{'variant':<22} {'kernel':<24} {'dt':<4} {'D':>3} {'regs':>4} {'spill':>5} {'smem':>7} "
           f"{'p/SM':>4} {'blk':>3} {'loop':>5} {'fp':>5} {'B/64t':>6} {'ceil%':>6} {'s':>5}")


def print_row(r: dict) -> None:
    if r.get("error") and not r.get("kernel"):
        print(f"{r['variant']:<22} {'':<24} {r['dtype']:<4} {r['head_dim']:>3} FAILED: {r['error']}")
        return
    print(f"{r['variant']:<22} {r['kernel'][:24]:<24} {r['dtype']:<4} {r['head_dim']:>3} {r['regs']:>4} "
          f"{r['spill_bytes']:>5} {r['smem_bytes']:>7} {r['programs_per_sm']:>4} {r['block_t']!s:>3} "
          f"{r['loop_instr_per_64_tokens']!s:>5} {r['fp_loop_instr']!s:>5} {r['bytes_per_64_tokens']!s:>6} "
          f"{r['ceiling_pct']!s:>6} {r['compile_s']:>5}"
          + (f"  err {r['max_err']} <= {r['err_bound']}: {r['err_ok']}" if r.get("err_ok") else "")
          + (f"  self-check {r['self_check']} ({r['probe_ms']} ms)" if r.get("self_check") else ""))


_INT_COLUMNS = ("head_dim", "regs", "spill_bytes", "smem_bytes", "programs_per_sm", "num_warps", "block_t",
                "loop_instr_per_64_tokens", "fp_loop_instr", "bytes_per_64_tokens")


def _run_jobs(args, subset: str, out: Path) -> list[dict]:
    """--jobs N: N children of this script, each compiling a contiguous share of the variants into
    <out>.shardI.csv (row by row, so a run cut short keeps what each child reached); their rows, merged in
    variant order, are written to `out` and returned (numbers as numbers, as `report` gives them)."""
    import subprocess

    n = args.jobs
    shards = [out.with_suffix(f".shard{i}.csv") for i in range(n)]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--subset", subset, "--body", str(args.body)]
    procs = [subprocess.Popen(cmd + ["--shard", f"{i}/{n}", "--csv", str(shards[i])]
                              + (["--measure"] if args.measure else [])) for i in range(n)]
    codes = [p.wait() for p in procs]
    rows = []
    for i, path in enumerate(shards):
        if codes[i] != 0 or not path.exists():
            rows.append(dict(variant=f"shard {i}/{n}", kernel="", dtype="", head_dim="",
                             error=f"the child compiling this share exited with {codes[i]}"))
            continue
        for r in csv.DictReader(path.open()):
            rows.append({k: int(v) if k in _INT_COLUMNS and v not in ("", None) else v
                         for k, v in r.items()})
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({c: r.get(c, "") for c in COLUMNS})
    for path in shards:
        path.unlink(missing_ok=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="D=128 fp16 variants only")
    p.add_argument("--subset", default=None,
                   choices=["all", "quick", "ci", "fp8", "codebook", "engine", "gpu"])
    p.add_argument("--csv", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None, help="markdown table (default: the CSV's name, .md)")
    p.add_argument("--measure", action="store_true",
                   help="also run each variant and record its max error against the fp32 reference "
                        "(on CUDA; on a CPU interpreted, in a child process: use a small --body)")
    p.add_argument("--body", type=int, default=4096, help="body tokens of the measured layer")
    p.add_argument("--jobs", type=int, default=1,
                   help="compile in this many child processes, each a contiguous share of the variants "
                        "(each writes its rows to <csv>.shardI.csv as it goes; merged in order at the end)")
    p.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # a child's share, "I/N"
    p.add_argument("--errors-only", default=None, help=argparse.SUPPRESS)  # the interpreted child's mode
    args = p.parse_args(argv)
    if args.errors_only is not None:
        import json

        dev = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
        res = {k: measure_error(_from_key(k), dev, args.body) for k in args.errors_only.split(";")}
        print(json.dumps(res))
        return 0
    subset = args.subset or ("quick" if args.quick else "all")
    out = args.csv or Path(__file__).resolve().parent / "results" / "kernel_report.csv"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(_HEADER)
    if args.jobs > 1:
        rows = _run_jobs(args, subset, out)
    else:
        shard = tuple(int(x) for x in args.shard.split("/")) if args.shard else None
        rows = report(subset, out, measure=args.measure, body=args.body, shard=shard)
        if shard is not None:
            return 0  # the parent merges, checks and writes the table
    write_markdown(rows, args.md or out.with_suffix(".md"), subset)
    failed = [r for r in rows if r.get("error")]
    bad = [r for r in rows if args.measure and "split" in r.get("kernel", "") and r.get("err_ok") != "true"]
    for r in bad:
        print(f"ERROR CHECK FAILED: {r['variant']} {r['dtype']} D={r['head_dim']}: "
              f"max_err {r.get('max_err')} bound {r.get('err_bound')} ({r.get('err_ok')})")
    print(f"{len(rows)} kernels; {len(failed)} failed to compile; "
          + (f"{len(bad)} over the error bound; " if args.measure else "") + f"csv: {out}")
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
