"""Pack 2/4/8-bit codes into uint8 along the last dimension, and back.

Layout (little-endian within a byte), for codes c[..., n]:
    8 bits: byte j = c[j]
    4 bits: byte j = c[2j] | c[2j+1] << 4
    2 bits: byte j = c[4j] | c[4j+1] << 2 | c[4j+2] << 4 | c[4j+3] << 6
A last dimension that is not a multiple of 8 // bits is padded with zero codes; `unpack` takes the
original length back.
"""

from __future__ import annotations

import torch

__all__ = ["pack", "unpack", "packed_size"]


def _per_byte(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"cannot pack {bits}-bit codes; bits must be 2, 4 or 8")
    return 8 // bits


def packed_size(n: int, bits: int) -> int:
    """Bytes needed for n codes of `bits` bits."""
    per = _per_byte(bits)
    return (n + per - 1) // per


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) uint8 codes in [0, 2^bits) -> (..., ceil(n * bits / 8)) uint8."""
    per = _per_byte(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if per == 1:
        return codes.contiguous()
    n = codes.shape[-1]
    pad = (-n) % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    codes = codes.reshape(*codes.shape[:-1], (n + pad) // per, per)  # (..., n_bytes, per); no -1: 0-size dims
    out = codes[..., 0].clone()
    for i in range(1, per):
        out |= codes[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """(..., n_bytes) uint8 -> (..., n) uint8 codes; n defaults to n_bytes * 8 // bits."""
    per = _per_byte(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    full = packed.shape[-1] * per
    n = full if n is None else n
    if not full - per < n <= full and not (n == 0 and full == 0):
        raise ValueError(f"{packed.shape[-1]} bytes of {bits}-bit codes cannot hold {n} codes")
    if per == 1:
        return packed[..., :n]
    mask = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # (per,)
    codes = (packed.unsqueeze(-1) >> shifts) & mask  # (..., n_bytes, per)
    return codes.reshape(*packed.shape[:-1], full)[..., :n]
