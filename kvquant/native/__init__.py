"""Native CPU ops for the reference attention path: fused reads of affine INT8/INT4/INT2 pages, and the
Walsh-Hadamard transform of the rotations.

`affine_attn.cpp` computes attention scores and weighted sums of values straight from the packed codes in
the page pool, through the block table (no gather, no unpacked or dequantized tensor), with the scales
folded into the products: the same arithmetic as `AffineCodec.score_pages` / `value_pages`' PyTorch path,
its twin (tests/test_native.py compares them; fp32, summation order differs).
`fwht.cpp` runs `kvquant.codecs.transforms.fwht`'s butterflies a row at a time in a small buffer (the
PyTorch path makes one pass over memory per stage): the same bits as its PyTorch twin.

Built ahead, never during a run: `python -m kvquant.native build` (setup.sh runs it; about half a minute
with a C++ compiler) writes the library under `kvquant.paths.cache_root() / "native" / <key>`, the key a
hash of the sources, torch's version and the compiler flags. A run loads it if it is there; if not (no
compiler, or KVQUANT_NATIVE=0), the PyTorch path serves and one log line says how to build it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

__all__ = ["available", "build", "library_path", "ops"]

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(f) for f in ("affine_attn.cpp", "fwht.cpp"))
ENV = "KVQUANT_NATIVE"  # "0": never load the native ops


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp-simd"]
    if platform.machine() in ("x86_64", "AMD64"):
        try:
            cpu = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpu = ""
        if " avx2" in cpu and " fma" in cpu:
            flags += ["-mavx2", "-mfma"]
    return flags


def _key() -> str:
    h = hashlib.sha256()
    for source in SOURCES:
        h.update(source.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(_flags()).encode())
    return h.hexdigest()[:16]


def _name() -> str:
    return f"kvquant_native_{_key()}"


def library_path() -> Path:
    """Where the built library of this source, torch and flags lives (it may not exist)."""
    from ..paths import cache_root

    return cache_root() / "native" / _name() / f"{_name()}.so"


def build(verbose: bool = False) -> Path:
    """Compile the ops (torch.utils.cpp_extension, ninja) unless built already; the library's path."""
    path = library_path()
    if not path.exists():
        from torch.utils.cpp_extension import load

        path.parent.mkdir(parents=True, exist_ok=True)
        load(name=_name(), sources=[str(s) for s in SOURCES], extra_cflags=_flags(),
             build_directory=str(path.parent),
             is_python_module=False, verbose=verbose)
    return path


@functools.cache
def ops():
    """torch.ops.kvquant_native when the library is built and not disabled, else None (logged once)."""
    if os.environ.get(ENV, "1") == "0":
        logger.info("%s=0: the PyTorch path serves affine pages", ENV)
        return None
    path = library_path()
    if not path.exists():
        logger.info("native affine ops not built (python -m kvquant.native build): the PyTorch path serves")
        return None
    torch.ops.load_library(str(path))
    return torch.ops.kvquant_native


def available() -> bool:
    return ops() is not None
