"""Does a row's result depend on how many rows share the operation? Measured on this CPU, for the two kinds of
op a kvquant forward batches: matrix products (torch's CPU GEMM, MKL here) and elementwise ops.

    python benchmarks/row_invariance.py            # prints a markdown report; --out FILE writes it too

GEMM: row 0 of `F.linear(x[:m], W)` for m in ROWS, on the default model's linear shapes (hidden 576,
MLP 1536, KV 192, vocabulary 49152); the row counts whose row 0 is bit-identical are grouped into classes.
A batch of B requests that puts a row in another class than batch 1 did (a 1-token scoring forward: 1 row
at batch 1, B rows at batch B) rounds it differently, whatever kvquant does.

Elementwise: ATen runs an op over a contiguous tensor in vectors and its last elements one at a time (a
scalar tail); the share of random inputs where the op on one element alone (the scalar loop) equals the
same element inside a long tensor (the vector loop). An op that disagrees gives a row other bits when the
batch moves it between body and tail (kvquant.attention merges its partial softmaxes one batch row at a
time for that reason: logaddexp disagrees).
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

ROWS = (1, 2, 3, 4, 5, 8, 12, 15, 16, 17, 32, 64, 256, 1024)
SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))  # (in, out) of SmolLM2-135M
SAMPLES = 20000


def gemm_classes(k: int, n: int, seed: int = 0) -> list[list[int]]:
    """Row counts grouped by the bits they give row 0 of x[:m] @ W.T (one class: row-invariant)."""
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(max(ROWS), k, generator=g)
    first = {m: F.linear(x[:m], w)[0] for m in ROWS}
    classes: list[list[int]] = []
    for m in ROWS:
        same = next((c for c in classes if torch.equal(first[c[0]], first[m])), None)
        if same is None:
            classes.append([m])
        else:
            same.append(m)
    return classes


def scalar_vector_agreement(name: str, seed: int = 0) -> float:
    """Share of SAMPLES inputs where the op on one element equals the op on it inside a long tensor."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(SAMPLES, generator=g) * 4, torch.randn(SAMPLES, generator=g) * 4
    ops = {
        "exp": (torch.exp, (x,)), "log": (torch.log, (x.abs() + 1e-3,)),
        "rsqrt": (torch.rsqrt, (x.abs() + 1e-3,)),
        "div": (torch.div, (x, y)), "logaddexp": (torch.logaddexp, (x, y)), "silu": (F.silu, (x,)),
        "sigmoid": (torch.sigmoid, (x,)), "sin": (torch.sin, (x,)), "cos": (torch.cos, (x,)),
    }
    f, args = ops[name]
    vector = f(*args)
    scalar = torch.stack([f(*(a[i : i + 1] for a in args))[0] for i in range(SAMPLES)])
    return float((scalar == vector).double().mean())


def report() -> str:
    torch.set_num_threads(1)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    isa = torch.backends.cpu.get_cpu_capability()
    lines = [f"# Row invariance on {cpu} ({isa}, torch {torch.__version__}, 1 thread)", "",
             "## GEMM: row counts that give row 0 the same bits", "",
             "| in x out | classes of row counts |", "|---|---|"]
    for k, n in SHAPES:
        classes = " / ".join("{" + ",".join(map(str, c)) + "}" for c in gemm_classes(k, n))
        lines.append(f"| {k} x {n} | {classes} |")
    lines += ["", "## Elementwise: one element alone (scalar loop) vs inside a long tensor (vector loop)", "",
              "| op | equal |", "|---|---|"]
    for name in ("exp", "log", "rsqrt", "div", "sin", "cos", "logaddexp", "silu", "sigmoid"):
        lines.append(f"| {name} | {scalar_vector_agreement(name):.2%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="also write the report here (markdown)")
    args = p.parse_args(argv)
    text = report()
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
