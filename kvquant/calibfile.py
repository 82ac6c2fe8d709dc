"""Where a calibration file's two halves live, its error type, and the `budget=B` allocations its JSON
side holds. Torch-free and below `kvquant.scheme` (which resolves `budget=B,calib=FILE` through
`stored_allocation`) and `kvquant.calibration` (the tables); it imports neither of them."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .spec_types import SchemeError

__all__ = ["KV_SCALE_NAME", "CalibrationError", "calib_paths", "is_kv_scale_names", "stored_allocation"]

# a checkpoint's FP8 KV-cache scale, as llm-compressor writes and vLLM loads it (`kvquant.export`)
KV_SCALE_NAME = re.compile(r"^(?P<prefix>.+)\.(?P<layer>\d+)\.self_attn\.(?P<role>[kv])_scale$")


class CalibrationError(SchemeError):
    """A calibration file that is missing, unreadable, or lacks what a scheme needs; says how to make it."""


def calib_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """(FILE.safetensors, FILE.json) for a calibration path given with either suffix or none."""
    p = Path(path)
    if p.suffix == ".json":
        p = p.with_suffix(".safetensors")
    elif p.suffix != ".safetensors":
        p = p.with_name(p.name + ".safetensors")
    return p, p.with_suffix(".json")


def is_kv_scale_names(names) -> bool:
    """Tensor names of a vLLM k_scale / v_scale file (`experiments/export_scales.py`, or a checkpoint shard
    holding only those), which a scheme's calib= may name instead of a kvquant calibration: at least one, and
    every name `<prefix>.<i>.self_attn.k_scale` / `v_scale` (safetensors' `__metadata__` aside)."""
    names = [n for n in names if n != "__metadata__"]
    return bool(names) and all(KV_SCALE_NAME.match(n) for n in names)


def stored_allocation(budget: float, calib: str) -> tuple[str, Path]:
    """(the scheme text stored for `budget` average bits, the JSON file): what `experiments/allocate.py
    --write-calib` wrote; CalibrationError naming the command that writes it when there is none."""
    _, js = calib_paths(calib)
    if not js.is_file():
        raise CalibrationError(
            f"budget={budget:g}: calibration file {js} does not exist; write it with "
            "experiments/calibrate.py, then `python experiments/allocate.py "
            f"--budget-bits {budget:g} --calib {calib} --write-calib`"
        )
    allocations = json.loads(js.read_text()).get("allocations", [])
    for a in allocations:
        if abs(float(a["budget_bits"]) - budget) <= 1e-9:
            return a["scheme"], js
    have = ", ".join(f"budget={float(a['budget_bits']):g}" for a in allocations) or "none"
    raise CalibrationError(
        f"calibration file {js} holds no allocation for budget={budget:g} (it holds {have}); run `python "
        f"experiments/allocate.py --budget-bits {budget:g} --calib {calib} --write-calib`"
    )
