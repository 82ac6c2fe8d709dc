"""The GGUF block pack kernel (kvquant.kernels.pack_engine) writes `EngineCodec.encode`'s bytes into the
pages, byte for byte (kvquant.kernels.testing.check_pack), for every block format, on random rows and on
blocks made to hit each rule of the C reference: NaN skipped by amax / min / max (q8_0's NaN kept only as
the last element), +-Inf, all-zero and all -0 blocks, roundf and (int8_t) ties, an fp16 scale that
overflows, iq4_nl's tiny blocks, mxfp4's log2 at a power of two's edge, nvfp4's UE4M3 subnormals, saturation
and carries, E2M1 ties."""

from __future__ import annotations

import pytest
import torch
from kvquant.kernels.testing import check_pack

from kvquant.codecs.base import codec_for

FORMATS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "mxfp4", "nvfp4"]


def _name(fmt: str, rot: str = "-norot") -> str:
    return fmt if fmt in ("mxfp4", "nvfp4") else f"llama.cpp:{fmt}{rot}"


def _edge_blocks() -> torch.Tensor:
    """(N, 32) fp32 blocks, one per rule (see the module docstring)."""
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    blocks = [r(32), r(32) * 1e-3]
    for pos in (0, 13, 31):  # NaN first, in the middle, last
        b = r(32)
        b[pos] = float("nan")
        blocks.append(b)
    blocks.append(torch.full((32,), float("nan")))
    blocks += [torch.zeros(32), torch.full((32,), -0.0)]
    for pos, v in ((4, float("inf")), (9, float("-inf"))):
        b = r(32)
        b[pos] = v
        blocks.append(b)
    blocks.append(torch.full((32,), float("inf")))
    inf_mix = r(32)
    inf_mix[2], inf_mix[30] = float("inf"), float("-inf")
    blocks.append(inf_mix)
    # ties: amax 127 (q8_0 d = 1: x * id = x, roundf of k + 0.5), max -8 (q4_0 d = 1: x + 8.5), signed max
    # ties in magnitude (the first wins), q4_1's (x - min) * id + 0.5 landing on integers
    half = torch.arange(32, dtype=torch.float32) - 15.5
    half[0] = 127.0
    blocks.append(half)
    q4tie = (torch.arange(32, dtype=torch.float32) % 16) - 7.5
    q4tie[5] = -8.0
    blocks.append(q4tie)
    sym = r(32)
    sym[3], sym[20] = 5.0, -5.0
    blocks.append(sym)
    blocks.append(torch.linspace(-1.0, 1.0, 32))
    blocks += [r(32) * 1e6, r(32) * 3e38, r(32) * 1e-16, r(32) * 1e-40]  # d beyond fp16; hi - lo = Inf; tiny
    # mxfp4: amax at and just below powers of two; below 2^64, 2^-64 and 2^100 log2f rounds up to the power
    below = [torch.nextafter(torch.tensor(2.0**k), torch.tensor(0.0)).item() for k in (64, -64, 100)]
    for amax in (4.0, 3.9999998, 2.0**-120, *below):
        b = r(32).clamp(-0.9, 0.9) * amax
        b[11] = amax
        blocks.append(b)
    # E2M1 ties at d = 0.5 (amax 6: e = 127): x halfway between neighbouring levels, both signs
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4)
    blocks.append(ties * torch.tensor([1.0, -1.0]).repeat(16))
    # nvfp4 (16 per scale): amax / 6 in UE4M3's subnormals, beyond 448 (saturates), at a mantissa carry
    for amax in (0.02, 0.0001, 3000.0, 6 * 1.9375, 6 * 15.5):
        b = r(32).clamp(-0.9, 0.9) * amax
        b[1], b[17] = amax, -amax
        blocks.append(b)
    return torch.stack(blocks)


@pytest.mark.parametrize("fmt", FORMATS)
def test_edge_blocks(fmt, device):
    blocks = _edge_blocks()  # (N, 32)
    d = 64
    rows = blocks[: blocks.shape[0] // 2 * 2].reshape(1, 1, -1, d)  # two blocks per row, fp32 K/V
    x = torch.cat([rows, rows.roll(1, dims=2)])  # B = 2
    assert check_pack(codec_for(_name(fmt), 1, d, torch.float32), x, 3, 16, device) == "_engine_kernel"


CASES = [  # (format, rotation, K/V dtype, H_kv, D)
    ("q8_0", "", torch.float16, 2, 64),  # llama.cpp rotates K (64 x 64 Hadamard) before the blocks
    ("q4_0", "", torch.bfloat16, 1, 128),
    ("q4_1", "-norot", torch.float16, 8, 64),
    ("q5_0", "-norot", torch.float32, 2, 256),
    ("q5_1", "", torch.float16, 3, 64),
    ("iq4_nl", "-norot", torch.float16, 2, 64),
    ("mxfp4", "", torch.bfloat16, 2, 128),
    ("nvfp4", "", torch.float16, 1, 256),
]


@pytest.mark.parametrize("fmt,rot,dtype,h,d", CASES, ids=[c[0] + c[1] for c in CASES])
def test_formats_into_pages(fmt, rot, dtype, h, d, device):
    x = (torch.randn(2, h, 5, d, generator=torch.Generator().manual_seed(h * d)) * 3).to(dtype)
    x[0, 0, 1] = 0.0
    check_pack(codec_for(_name(fmt, rot), h, d, dtype), x, 13, 16, device)
