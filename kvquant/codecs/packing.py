"""Pack 2/3/4/8-bit codes into uint8 along the last dimension, and back.

Layout (little-endian within a byte), for codes c[..., n]:
    8 bits: byte j = c[j]
    4 bits: byte j = c[2j] | c[2j+1] << 4
    2 bits: byte j = c[4j] | c[4j+1] << 2 | c[4j+2] << 4 | c[4j+3] << 6
    3 bits: 8 codes per 3 bytes: the 24-bit word w = c[8i] | c[8i+1] << 3 | ... | c[8i+7] << 21 is stored
            little-endian as bytes 3i, 3i+1, 3i+2 (w & 255, w >> 8 & 255, w >> 16)
A last dimension that is not a whole number of packing units (8 // bits codes, or 8 codes for 3 bits) is
padded with zero codes; `unpack` takes the original length back. So n codes take exactly n * bits / 8 bytes
when n is a multiple of the unit.
"""

from __future__ import annotations

import torch

__all__ = ["pack", "unpack", "unpack_into", "packed_size"]


def _per_byte(bits: int) -> int:
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"cannot pack {bits}-bit codes; bits must be 2, 3, 4 or 8")
    return 8 // bits


def _unit(bits: int) -> tuple[int, int]:
    """(codes, bytes) of one packing unit: (8 // bits, 1), or (8, 3) for 3 bits."""
    return (8, 3) if bits == 3 else (_per_byte(bits), 1)


def packed_size(n: int, bits: int) -> int:
    """Bytes needed for n codes of `bits` bits."""
    codes, nbytes = _unit(bits)
    return (n + codes - 1) // codes * nbytes


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) uint8 codes in [0, 2^bits) -> (..., ceil(n * bits / 8)) uint8."""
    per = _per_byte(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if bits == 3:
        return _pack3(codes)
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
    if bits == 3:
        return _unpack3(packed, n)
    full = packed.shape[-1] * per
    n = full if n is None else n
    if not full - per < n <= full and not (n == 0 and full == 0):
        raise ValueError(f"{packed.shape[-1]} bytes of {bits}-bit codes cannot hold {n} codes")
    if per == 1:
        return packed[..., :n]
    mask = (1 << bits) - 1
    # one scalar shift per position (a broadcast shift against a tensor of shifts is ~3.5x slower on the CPU)
    middle = [(packed >> (bits * i)) & mask for i in range(1, per - 1)]
    parts = [packed & mask, *middle, packed >> (8 - bits)]
    codes = torch.stack(parts, dim=-1)  # (..., n_bytes, per)
    return codes.reshape(*packed.shape[:-1], full)[..., :n]


def unpack_into(packed: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """`unpack` written straight into `out` (..., n_bytes * 8 // bits), any dtype and strides (a view into a
    page-major or transposed buffer): the codes converted to out's dtype, with no uint8 temporary for the
    first and last code of each byte. 2, 4 and 8 bits (3-bit words go through `unpack`)."""
    per = _per_byte(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    if bits == 3 or out.shape[-1] != packed.shape[-1] * per:
        out.copy_(unpack(packed, bits, out.shape[-1]))
        return out
    if per == 1:
        return out.copy_(packed)
    dst = out.unflatten(-1, (packed.shape[-1], per))  # (..., n_bytes, per): a view, no copy
    mask = (1 << bits) - 1
    torch.bitwise_and(packed, mask, out=dst[..., 0])
    for i in range(1, per - 1):
        dst[..., i].copy_((packed >> (bits * i)) & mask)
    torch.bitwise_right_shift(packed, 8 - bits, out=dst[..., per - 1])
    return out


def _pack3(codes: torch.Tensor) -> torch.Tensor:
    """(..., n) codes in [0, 8) -> (..., ceil(n / 8) * 3) bytes: 8 codes in one 24-bit word, little-endian."""
    n = codes.shape[-1]
    pad = (-n) % 8
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    c = codes.reshape(*codes.shape[:-1], (n + pad) // 8, 8).to(torch.int32)  # (..., units, 8)
    shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=codes.device)
    word = (c << shifts).sum(dim=-1, dtype=torch.int32)  # (..., units); disjoint bits: sum == or
    out = torch.stack([word & 255, (word >> 8) & 255, word >> 16], dim=-1).to(torch.uint8)
    return out.reshape(*codes.shape[:-1], (n + pad) // 8 * 3)


def _unpack3(packed: torch.Tensor, n: int | None) -> torch.Tensor:
    nbytes = packed.shape[-1]
    if nbytes % 3:
        raise ValueError(f"3-bit codes are packed in units of 3 bytes; got a last dimension of {nbytes}")
    full = nbytes // 3 * 8
    n = full if n is None else n
    if not full - 8 < n <= full and not (n == 0 and full == 0):
        raise ValueError(f"{nbytes} bytes of 3-bit codes cannot hold {n} codes")
    b = packed.reshape(*packed.shape[:-1], nbytes // 3, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)  # (..., units)
    shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device)
    codes = ((word.unsqueeze(-1) >> shifts) & 7).to(torch.uint8)  # (..., units, 8)
    return codes.reshape(*packed.shape[:-1], full)[..., :n]
