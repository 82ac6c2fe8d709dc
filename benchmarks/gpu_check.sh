#!/usr/bin/env bash
# One GPU check, <= 8 minutes on an H200: the kernel tests compiled (no interpreter), then the decode
# benchmark's key points (INT4-g64 and INT8 at 16k/32k, batch 1 and 8, Llama-3-8B layout).
# Output goes to $OUT if set, else benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
# A local .venv holds a CPU build of torch: use it only where there is no GPU python (a dry run here).
if ! command -v nvidia-smi >/dev/null && [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
PY=${PYTHON:-python3}
# A bare GPU machine has torch and triton but not kvquant: install it in place, offline, without deps.
"$PY" -c "import kvquant.kernels" 2>/dev/null ||
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . ||
    { echo "gpu_check: cannot install kvquant (pip install --no-deps -e .)"; exit 1; }
OUTDIR=${OUT:-benchmarks/results}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check_$(date -u +%Y%m%dT%H%M%SZ).log"
status=0
{
    echo "== device"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
    echo "== kernel tests, compiled (TRITON_INTERPRET=0)"
    TRITON_INTERPRET=0 timeout 300 "$PY" -m pytest tests/kernels -q -x -p no:cacheprovider --durations=5 || status=1
    echo "== decode benchmark, key points"
    timeout 150 "$PY" benchmarks/bench_decode.py --key-points --csv "$OUTDIR/bench_decode.csv" || status=1
    echo "== exit status $status"
} 2>&1 | tee "$LOG"
echo "log: $LOG"
exit $status
