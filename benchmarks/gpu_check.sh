#!/usr/bin/env bash
# One GPU check (<= 8 minutes on an H200, torch + triton preinstalled): phases, each under its own
# timeout, each with its status recorded; a failing phase never hides the others; the exit code is true
# (0 only if every phase passed).
#
#   benchmarks/gpu_check.sh             # on a GPU machine; output to $OUT (or benchmarks/results/gpu_check_<time>)
#   benchmarks/gpu_check.sh --dry-run   # on a CPU: the same phases on tiny sizes, kernels interpreted
#
# Phases: env (GPU, SMs, L2, shared memory, clocks, versions, SDPA backend), report (the compiled-kernel
# table on the device, each variant's max error against its fp32 reference: benchmarks/kernel_report.py
# --measure), tests (tests/kernels in parallel processes, no -x), bench (copy bandwidth and decode
# benchmark: benchmarks/bench_decode.py), e2e (16 decode steps, Triton vs torch tokens, and the
# recompile count: distinct Triton variants the generation compiled, in e2e.json), devmap (a model split
# between cuda:0 and the CPU by a device map: tokens equal to the cuda:0 run, each layer's pages on its
# device, kernel launches on each CUDA device of the map, an Engine serving the split model on one store;
# the same on a cuda:0/cuda:1 split when 2 GPUs are present; torch.cuda.max_memory_allocated of int4-g64
# vs the reference cache at 32k tokens: benchmarks/gpu_device_map.py, devmap.json / devmap.md).
# Per-phase logs, status.csv and status.json land in the output folder. GPU_CHECK_PHASES="env bench" runs
# only those; GPU_CHECK_FAIL_PHASE=<name> makes that phase fail (both to test this script).
set -u -o pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PYTHON:-python3}
if [ "$DRY" = 1 ] || ! command -v nvidia-smi >/dev/null 2>&1; then
    [ -f .venv/bin/activate ] && . .venv/bin/activate
    # this checkout's interpreter by path: a venv copied from another checkout activates that one's python
    [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY="$PWD/.venv/bin/python"
fi
OUTDIR=${OUT:-benchmarks/results/gpu_check_$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUTDIR"
STATUS="$OUTDIR/status.csv"
echo "phase,status,seconds" > "$STATUS"
if [ "$DRY" = 1 ]; then export TRITON_INTERPRET=1; SCALE=dry; else export TRITON_INTERPRET=0; SCALE=gpu; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# a bare GPU machine has torch and triton but not kvquant: install it in place, offline, without deps
"$PY" -c "import kvquant.kernels" 2>/dev/null || "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
    >"$OUTDIR/install.log" 2>&1 || echo "gpu_check: pip install -e . failed (see install.log)"

failed=0
phase() {  # phase NAME TIMEOUT_S COMMAND...: run, log, record; never exits the script
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS rc
    if [ -n "${GPU_CHECK_PHASES:-}" ] && [[ " $GPU_CHECK_PHASES " != *" $name "* ]]; then
        echo "$name,skipped,0" >> "$STATUS"; return 0
    fi
    echo "== $name (timeout ${limit}s)"
    if [ "${GPU_CHECK_FAIL_PHASE:-}" = "$name" ]; then
        echo "forced failure (GPU_CHECK_FAIL_PHASE)" > "$OUTDIR/$name.log"; rc=99
    else
        # a phase is a shell function: run it in its own bash so that timeout can kill it
        timeout --kill-after=10 "$limit" bash -c "$*" > "$OUTDIR/$name.log" 2>&1; rc=$?
    fi
    tail -n 25 "$OUTDIR/$name.log"
    local st=pass
    [ "$rc" -ne 0 ] && { st="fail($rc)"; failed=$((failed + 1)); }
    [ "$rc" -eq 124 ] && st="timeout"
    echo "$name,$st,$((SECONDS - t0))" >> "$STATUS"
    echo "== $name: $st in $((SECONDS - t0)) s"
}

env_phase() {
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv
    "$PY" - <<'PY'
import os, torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())
try:
    import transformers; print("transformers", transformers.__version__)
except ImportError:
    print("transformers: not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"{p.name}: {p.multi_processor_count} SMs, L2 {p.L2_cache_size >> 20} MiB, "
          f"smem/block optin {getattr(p, 'shared_memory_per_block_optin', '?')}, mem {p.total_memory >> 30} GiB")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.float16)
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([b]):
                torch.nn.functional.scaled_dot_product_attention(q, k, k)
            print("SDPA backend usable for decode:", b.name)
        except RuntimeError as e:
            print("SDPA backend refused:", b.name, str(e).splitlines()[0])
else:
    print("no CUDA device (dry run)")
PY
}

report_phase() {
    # --measure: each variant also run against its fp32 twin (max_err, err_bound, err_ok columns)
    if [ "$DRY" = 1 ]; then
        "$PY" benchmarks/kernel_report.py --subset ci --measure --body 128 --csv "$OUTDIR/kernel_report.csv"
    else
        # the D=128 fp16 variants (the full table is compiled on the CPU: kernel_report_after.csv), so that the
        # whole check stays within 8 minutes
        # --subset gpu: those plus int8 / int4-g64 / FP8 in bf16; each row also carries the first-use
        # self-check's verdict on this GPU and the probe's cost (self_check, probe_ms)
        # --jobs 8: the launcher compiles 64 and 128 tokens per iteration of each variant to choose one, so the
        # compiles run in 8 child processes (the H200 host has 16 cores)
        "$PY" benchmarks/kernel_report.py --subset gpu --measure --jobs 8 --csv "$OUTDIR/kernel_report.csv"
    fi
}

tests_phase() {  # the kernel test files in parallel processes, no -x; fails if any process fails
    local pids=() rc=0 f
    for f in tests/kernels/test_*.py; do
        "$PY" -m pytest "$f" -q -p no:cacheprovider > "$OUTDIR/tests_$(basename "$f" .py).log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    tail -n 3 "$OUTDIR"/tests_*.log
    return $rc
}

bench_phase() {
    if [ "$DRY" = 1 ]; then
        "$PY" benchmarks/bench_decode.py --device cpu --interpret --csv "$OUTDIR/bench_decode.csv"
    else
        "$PY" benchmarks/bench_decode.py --key-points --csv "$OUTDIR/bench_decode.csv"
    fi
}

e2e_phase() {  # 16 decode steps (6 dry), Triton vs torch tokens, and the variants the Triton run compiled
    "$PY" - "$SCALE" <<'PY'
import json, os, sys, torch
sys.path.insert(0, "tests")
from kvquant.kernels.compiled import SpecializationCounter
import kvquant
device = "cuda" if torch.cuda.is_available() else "cpu"
steps = 16 if sys.argv[1] == "gpu" else 6  # the dry run interprets every kernel: fewer steps, same checks
from tiny_models import make_tiny_model
model = make_tiny_model().to(device)
ids = torch.randint(1, 1000, (2, 24), device=device)
toks, counts, calls = {}, {}, {}
# FP8 read in place (its appends take the codec's encoder): the same tokens as the torch backend
fp8 = {}
for backend in ("triton", "torch"):
    cache = kvquant.QuantizedCache("fp8-e4m3,sink=4,window=16", model.config, backend=backend)
    fp8[backend] = model.generate(ids, past_key_values=cache, max_new_tokens=steps, do_sample=False)
fp8_same = torch.equal(fp8["triton"], fp8["torch"])
print("fp8-e4m3: triton == torch tokens:", fp8_same)
from kvquant.kernels.registry import process_self_check
for backend in ("triton", "torch"):
    cache = kvquant.QuantizedCache("int4-g64,sink=4,window=16", model.config, backend=backend)
    # passthrough: every kernel launch runs as usual and its JIT cache key is recorded, so the distinct
    # keys are the variants this generation compiled (prefill and every decode step, all layers)
    counter = SpecializationCounter(passthrough=True)
    with counter:
        toks[backend] = model.generate(ids, past_key_values=cache, max_new_tokens=steps, do_sample=False)
    counts[backend], calls[backend] = counter.counts(), dict(counter.calls)
same = torch.equal(toks["triton"], toks["torch"])
launched = sum(calls["triton"].values())
print("triton == torch tokens:", same)
print("recompiles: variants compiled by the triton run, per kernel:", counts["triton"],
      "over", calls["triton"], "launches")
print("torch run launched Triton kernels:", calls["torch"] or "none")
checked = process_self_check()
print("first-use self-check:", len(checked.verdicts), "variants probed,", len(checked.disabled()), "disabled",
      checked.disabled() or "", f"probe time {sum(checked.seconds.values()) * 1e3:.1f} ms in all")
out = {"same_tokens": same, "fp8_same_tokens": fp8_same, "self_check_disabled": len(checked.disabled()),
       "probe_ms": sum(checked.seconds.values()) * 1e3, "variants": counts["triton"], "launches": calls["triton"],
       "torch_backend_launches": calls["torch"], "device": device}
json.dump(out, open(os.path.join(os.environ["OUTDIR"], "e2e.json"), "w"), indent=1)
# one variant per (parts present) of the decode kernels: a cache whose body appears mid-generation needs
# at most 2 split variants (sink+window only, then with a body) and 1 reduce; more means recompiles
split = counts["triton"].get("_paged_split_kernel", 0)
ok = same and fp8_same and not checked.disabled() and launched > 0 and split <= 2 and counts["triton"].get("_reduce_kernel", 0) <= 1
sys.exit(0 if ok else 1)
PY
}

devmap_phase() {  # a device map split between cuda:0 and the CPU; device memory of int4-g64 vs the reference
    if [ "$DRY" = 1 ]; then
        "$PY" benchmarks/gpu_device_map.py --dry-run --length 512 --chunk 128 --out "$OUTDIR"
    else
        "$PY" benchmarks/gpu_device_map.py --length 32768 --chunk 2048 --out "$OUTDIR"
    fi
}

export PY OUTDIR DRY SCALE
export -f env_phase report_phase tests_phase bench_phase e2e_phase devmap_phase
if [ "$DRY" = 1 ]; then L_ENV=60; L_REP=240; L_TEST=400; L_BENCH=300; L_E2E=300; L_MAP=300
else L_ENV=30; L_REP=120; L_TEST=120; L_BENCH=150; L_E2E=60; L_MAP=90; fi  # 570 s at most: one 10-minute call
phase env "$L_ENV" env_phase
phase report "$L_REP" report_phase
phase tests "$L_TEST" tests_phase
phase bench "$L_BENCH" bench_phase
phase e2e "$L_E2E" e2e_phase
phase devmap "$L_MAP" devmap_phase

"$PY" - "$STATUS" "$OUTDIR/status.json" <<'PY'
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1])))
json.dump(rows, open(sys.argv[2], "w"), indent=1)
PY
echo "== status"; cat "$STATUS"
echo "output: $OUTDIR"
[ "$failed" -eq 0 ]
