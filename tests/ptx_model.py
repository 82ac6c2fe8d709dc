"""A small model of the inline PTX the compiled kernels run (b32 and/or/shl/shr/prmt/lop3/mov, u32 add and
mad.lo), on numpy uint32 arrays: the first GPU run must not meet an untested selector
(tests/kernels/test_codebook_kernel.py, test_engine_kernel.py). Imported as `from ptx_model import run_ptx`
(tests/ is on sys.path)."""

from __future__ import annotations

import numpy as np

__all__ = ["run_ptx"]


def _operand(tok: str, regs: dict, args: dict) -> np.ndarray:
    tok = tok.strip()
    if tok.startswith("$"):
        return args[int(tok[1:])]
    if tok in regs:
        return regs[tok]
    return np.uint32(int(tok, 0))


def run_ptx(asm: str, inputs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Evaluate an inline-PTX block of b32 and/or/shl/shr/prmt/lop3/mov and u32 add/mad.lo (as
    `kernels.codebook` writes them) on uint32 arrays: operand $i (inputs by index) -> the 16-bit outputs ($i
    of `mov.b32 {$a, $b}, x`)."""
    regs: dict[str, np.ndarray] = {}
    args = {k: np.asarray(v, dtype=np.uint32) for k, v in inputs.items()}
    outs: dict[int, np.ndarray] = {}
    for ins in asm.strip().strip("{}").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):
            lo_hi, src = rest[1:].split("}")
            lo, hi = (t.strip() for t in lo_hi.split(","))
            x = _operand(src.strip(" ,"), regs, args)
            outs[int(lo[1:])], outs[int(hi[1:])] = x & 0xFFFF, x >> 16
            continue
        dst, *srcs = [t.strip() for t in rest.split(",")]
        v = [_operand(s, regs, args) for s in srcs]
        with np.errstate(over="ignore"):
            if op == "and.b32":
                r = v[0] & v[1]
            elif op == "or.b32":
                r = v[0] | v[1]
            elif op == "shl.b32":
                r = (v[0].astype(np.uint64) << np.uint64(int(v[1]))).astype(np.uint32)
            elif op == "shr.b32":
                r = v[0] >> np.uint32(int(v[1]))
            elif op == "mov.b32":
                r = v[0]
            elif op == "add.u32":  # modulo 2^32
                r = ((v[0].astype(np.uint64) + v[1]) & 0xFFFFFFFF).astype(np.uint32)
            elif op == "mad.lo.u32":  # the low 32 bits of a * b + c
                r = ((v[0].astype(np.uint64) * np.uint64(v[1]) + v[2]) & 0xFFFFFFFF).astype(np.uint32)
            elif op == "lop3.b32":
                a, b, c, lut = v[0], v[1], v[2], int(v[3])
                r = np.zeros_like(np.broadcast_to(a, np.broadcast(a, b, c).shape))
                for i in range(8):  # minterm i: a = bit 2, b = bit 1, c = bit 0
                    if lut >> i & 1:
                        r = r | ((a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c))
            elif op == "prmt.b32":
                a, b, sel = np.broadcast_arrays(*[np.asarray(x, dtype=np.uint32) for x in v])
                src = [(a >> np.uint32(8 * i)) & 255 for i in range(4)] + [(b >> np.uint32(8 * i)) & 255
                                                                           for i in range(4)]
                r = np.zeros_like(a)
                for i in range(4):
                    s = (sel >> np.uint32(4 * i)) & 15
                    byte = np.choose(s & 7, src)
                    byte = np.where(s & 8, np.where(byte & 0x80, 255, 0), byte).astype(np.uint32)
                    r = r | (byte << np.uint32(8 * i))
            else:
                raise AssertionError(f"the PTX model has no {op}")
        regs[dst] = np.asarray(r, dtype=np.uint32)
    return outs
