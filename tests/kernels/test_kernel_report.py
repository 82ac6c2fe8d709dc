"""The compiled-kernel report (sm_90, compiled on this CPU) and the GPU check script's own logic."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KB = 1024


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra)
    return env


def test_ci_subset_compiles_without_spills_within_shared_memory(tmp_path):
    """int4-g64 with sink+window and int8 at D=128, KIVI-2 at D=256: no spills, <= 110 KB shared memory,
    two programs per SM at D=128 (one of 8 warps at D=256, register-bound), and D=256 compiles."""
    out = tmp_path / "report.csv"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_report.py"), "--subset", "ci",
                           "--csv", str(out)], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    split = [r for r in rows if "split" in r["kernel"]]
    assert {r["variant"] for r in split} == {"int4-g64+sink+window", "int8", "kivi-2+sink+window"}
    assert any(r["head_dim"] == "256" for r in split)
    for r in rows:
        assert not r["error"], r
        assert int(r["spill_bytes"]) == 0, r
        assert int(r["smem_bytes"]) <= 110 * KB, r
        assert int(r["programs_per_sm"]) >= (2 if r["head_dim"] != "256" else 1), r  # D=256: 8 warps
    for r in split:
        assert int(r["loop_instr_per_64_tokens"]) > 0 and float(r["ceiling_pct"]) > 0, r


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_gpu_check_reports_a_failed_phase_and_runs_the_others(tmp_path):
    """A failing phase gives a non-zero exit, and the phases after it still run and are recorded."""
    out = tmp_path / "check"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=300,
                          env=_env(OUT=str(out), GPU_CHECK_PHASES="env bench", GPU_CHECK_FAIL_PHASE="env"))
    assert proc.returncode != 0, proc.stdout[-3000:]
    status = {r["phase"]: r["status"] for r in csv.DictReader((out / "status.csv").open())}
    assert status["env"].startswith("fail"), status
    assert status["bench"] == "pass", (status, (out / "bench.log").read_text()[-2000:])
    assert status["tests"] == "skipped"
    assert (out / "bench_decode.csv").exists() and (out / "status.json").exists()
    ok = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                        text=True, timeout=300, env=_env(OUT=str(tmp_path / "ok"), GPU_CHECK_PHASES="env"))
    assert ok.returncode == 0, ok.stdout[-3000:]
