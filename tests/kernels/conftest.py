"""Kernel tests: in the Triton interpreter on the CPU by default, compiled on CUDA with TRITON_INTERPRET=0.

TRITON_INTERPRET must be set before triton is first imported (`triton.jit` decides at definition time);
the root tests/conftest.py sets it before importing transformers (which imports triton), and this file
repeats the default for a run that starts here.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the kernels need triton (pip install kvquant[kernels])")

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cpu under the interpreter; cuda when compiled (TRITON_INTERPRET=0)."""
    if INTERPRET:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 compiles the kernels, which needs a CUDA device")
    return torch.device("cuda")


@pytest.fixture(autouse=True)
def _quiet_interpreter():
    """The interpreter evaluates masked-off lanes too (0/0 in padding); numpy warns, nothing is wrong."""
    import numpy as np

    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        yield
