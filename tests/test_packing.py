"""Packing 2/4/8-bit codes into bytes: bit-exact round trips and the documented layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvquant.codecs.packing import pack, packed_size, unpack

BITS = [2, 4, 8]
SHAPES = [(1,), (3,), (7,), (65,), (2, 1), (3, 5, 7), (2, 3, 65), (1, 1, 1, 129), (4, 0), (0, 3), (2, 2, 130)]


def _codes(shape, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, shape, generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_odd_shapes(shape, bits):
    codes = _codes(shape, bits)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*shape[:-1], packed_size(shape[-1], bits))
    assert torch.equal(unpack(packed, bits, shape[-1]), codes)


@pytest.mark.parametrize("bits", BITS)
def test_round_trip_extreme_codes(bits):
    for value in (0, (1 << bits) - 1):
        codes = torch.full((3, 17), value, dtype=torch.uint8)
        assert torch.equal(unpack(pack(codes, bits), bits, 17), codes)


@pytest.mark.parametrize("bits", BITS)
def test_non_contiguous_input(bits):
    codes = _codes((8, 6), bits).t()  # (6, 8), non-contiguous
    assert not codes.is_contiguous()
    assert torch.equal(unpack(pack(codes, bits), bits, 8), codes)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from(BITS),
    lead=st.lists(st.integers(0, 4), max_size=3),
    n=st.integers(0, 70),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_property(bits, lead, n, seed):
    codes = _codes((*lead, n), bits, seed)
    packed = pack(codes, bits)
    assert packed.shape[-1] == (n * bits + 7) // 8
    assert torch.equal(unpack(packed, bits, n), codes)


def test_layout_hand_computed_bytes():
    # 4 bits: byte j = c[2j] | c[2j+1] << 4
    c4 = torch.tensor([0x1, 0xA, 0xF, 0x0, 0x7], dtype=torch.uint8)
    assert pack(c4, 4).tolist() == [0xA1, 0x0F, 0x07]
    # 2 bits: byte j = c[4j] | c[4j+1] << 2 | c[4j+2] << 4 | c[4j+3] << 6
    c2 = torch.tensor([1, 2, 3, 0, 3, 3], dtype=torch.uint8)
    assert pack(c2, 2).tolist() == [1 | 2 << 2 | 3 << 4 | 0 << 6, 3 | 3 << 2]  # [0x39, 0x0F]
    assert pack(c2, 2).tolist() == [0x39, 0x0F]
    # 8 bits: identity
    c8 = torch.tensor([0, 255, 17], dtype=torch.uint8)
    assert pack(c8, 8).tolist() == [0, 255, 17]
    # and back from hand-written bytes
    assert unpack(torch.tensor([0xA1, 0x0F], dtype=torch.uint8), 4).tolist() == [0x1, 0xA, 0xF, 0x0]
    assert unpack(torch.tensor([0x39], dtype=torch.uint8), 2, 3).tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "n, bits, size", [(0, 4, 0), (1, 4, 1), (2, 4, 1), (3, 4, 2), (5, 2, 2), (8, 2, 2), (9, 8, 9)]
)
def test_packed_size(n, bits, size):
    assert packed_size(n, bits) == size


def test_errors():
    with pytest.raises(ValueError, match="bits must be 2, 3, 4 or 8"):
        pack(torch.zeros(4, dtype=torch.uint8), 5)  # 3 bits pack 8 codes per 3 bytes (tests/test_nuq.py)
    with pytest.raises(TypeError, match="uint8"):
        pack(torch.zeros(4, dtype=torch.int32), 4)
    with pytest.raises(TypeError, match="uint8"):
        unpack(torch.zeros(4, dtype=torch.int8), 4)
    with pytest.raises(ValueError, match="cannot hold 9 codes"):
        unpack(torch.zeros(4, dtype=torch.uint8), 4, 9)
    with pytest.raises(ValueError, match="cannot hold 6 codes"):
        unpack(torch.zeros(4, dtype=torch.uint8), 4, 6)  # 6 codes need 3 bytes, not 4
