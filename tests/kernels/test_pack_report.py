"""The pack kernels compiled for sm_90 on this CPU (benchmarks/pack_report.py --subset ci): every constexpr
branch compiles (the interpreter accepts code the compiler refuses, such as returns of different types),
without spills."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_pack_branch_compiles_for_sm90_without_spills(tmp_path):
    out = tmp_path / "pack.csv"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pack_report.py"), "--subset", "ci",
                           "--csv", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert len(rows) >= 13
    for r in rows:
        assert r["kernel"] and not r["error"], r
        assert int(r["spill_bytes"]) == 0 and int(r["smem_bytes"]) <= 16 * 1024, r
        assert int(r["programs_per_sm"]) >= 2, r
    assert (tmp_path / "pack.md").read_text().count("| ") > len(rows)
