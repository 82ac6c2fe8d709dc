"""quantize_pack (Triton) == kvquant.codecs.quantize.quantize, bit for bit: codes, scale and zero."""

from __future__ import annotations

import itertools

import pytest
import torch
from kvquant.kernels.quantize_pack import kernel_supports, quantize_pack, quantize_pack_ref

from kvquant.codecs.quantize import dequantize, sqnr_db
from kvquant.scheme import parse_spec


def assert_bits_equal(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    """Same dtype, shape and values; NaN where the other has NaN (torch.equal calls NaN != NaN)."""
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN in different places"
    assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)), f"{what}: differs in {(a != b).sum()} places"


def check(x: torch.Tensor, spec_text: str) -> None:
    spec = parse_spec(spec_text)
    got, want = quantize_pack(x, spec), quantize_pack_ref(x.cpu(), spec)
    assert torch.equal(got.codes.cpu(), want.codes), f"{spec_text}: codes differ"
    assert_bits_equal(got.scale.cpu(), want.scale, f"{spec_text}: scale")
    assert_bits_equal(got.zero.cpu() if got.zero is not None else None, want.zero, f"{spec_text}: zero")
    assert got.shape == want.shape and got.dtype == want.dtype


GRANULARITIES = ["", "-head", "-g32", "-g16", "-channel-g4"]
BITS = [8, 4, 2]
SYMMETRY = ["-sym", "-asym"]
SCALE_DTYPES = ["", "-sfp16", "-sbf16", "-sfp32"]
X_DTYPES = [torch.float16, torch.float32, torch.bfloat16]

# every granularity x bits x symmetry; scale and input dtypes rotate over the cases so each appears often
CASES = [
    (f"int{bits}{gran}{sym}{SCALE_DTYPES[i % 4]}", X_DTYPES[i % 3])
    for i, (gran, bits, sym) in enumerate(itertools.product(GRANULARITIES, BITS, SYMMETRY))
]


@pytest.mark.parametrize("spec_text,dtype", CASES, ids=[f"{s}-{str(d)[6:]}" for s, d in CASES])
def test_bit_exact(spec_text, dtype, device):
    torch.manual_seed(hash(spec_text) % 1000)
    t = 8 if "channel" in spec_text else 5  # odd token count; channel groups need whole groups
    x = (torch.randn(2, 3, t, 64) * 2 + 0.3).to(dtype).to(device)
    x[0, 1, 1] = 0.5  # a constant token: scale 0 for head/group/channel-free granularities
    check(x, spec_text)


@pytest.mark.parametrize("spec_text", ["int8", "int4-head", "int2-g32-sym", "int4-channel-g4-sbf16"])
def test_non_finite_blocks(spec_text, device):
    """NaN/Inf blocks: NaN scale, zero codes; the zero follows torch (NaN propagates through min)."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 8, 64).to(device)
    x[0, 0, 1, 3] = float("nan")
    x[0, 1, 2, 7] = float("inf")
    x[0, 1, 5, 0] = float("-inf")
    check(x, spec_text)


@pytest.mark.parametrize("spec_text", ["int8-sfp16", "int4-g32-sfp16", "int4-channel-g4-sbf16-sym"])
def test_overflowing_scale_blocks(spec_text, device):
    """fp32 values beyond the scale dtype's range (1e6 > fp16's 65504) poison their block, as in torch."""
    torch.manual_seed(1)
    x = torch.randn(1, 2, 8, 64).to(device)
    x[0, 0, 1, 3] = 1e6
    x[0, 1, 2, 7] = -3.4e38 if "bf16" in spec_text else -1e6  # bf16's largest finite value is 3.39e38
    check(x, spec_text)


@pytest.mark.parametrize("t", [1, 17])
@pytest.mark.parametrize("spec_text", ["int4-g64", "int8-head-sfp32"])
def test_odd_lengths_and_head_dims(t, spec_text, device):
    torch.manual_seed(t)
    check(torch.randn(1, 2, t, 128, dtype=torch.float16, device=device), spec_text)


def test_channel_groups_of_many_tokens(device):
    """A token group of 32 rows and D 256 (the channel kernel splits D between programs)."""
    torch.manual_seed(1)
    check(torch.randn(1, 1, 64, 256, dtype=torch.float16, device=device), "int2-channel-g32")


def test_non_contiguous_input(device):
    torch.manual_seed(2)
    x = torch.randn(2, 5, 3, 64, device=device).transpose(1, 2)  # (B, H, T, D) with strides of (B, T, H, D)
    for spec_text in ("int4-g32", "int8", "int4-channel-g5"):
        check(x, spec_text)


def test_bf16_scale_rounds_to_nearest_even(device):
    """Absmax values halfway between bf16 neighbours: a truncating cast would differ from torch."""
    x = torch.zeros(1, 1, 4, 64, device=device)
    x[0, 0, :, 0] = torch.tensor([1.00390625, 1.01171875, 1.0078125 + 2**-9, 3.0000001])
    check(x, "int8-head-sbf16")


def test_unserved_groups_fall_back_to_the_reference(device):
    """int4-g1: a group does not fill a byte, so quantize_pack uses the reference (same bits)."""
    x = torch.randn(1, 1, 2, 64, device=device)
    assert not kernel_supports(x, parse_spec("int4-g1"))
    check(x, "int4-g1")


def test_round_trip_quality(device):
    """The packed codes decode to something close (SQNR floor), whatever computed them."""
    torch.manual_seed(3)
    x = torch.randn(1, 2, 9, 64, device=device)
    assert sqnr_db(x.cpu(), dequantize(quantize_pack(x, parse_spec("int8"))).cpu()) > 35
    assert sqnr_db(x.cpu(), dequantize(quantize_pack(x, parse_spec("int4-g32"))).cpu()) > 18


def test_empty_and_bad_inputs(device):
    q = quantize_pack(torch.randn(1, 2, 0, 64, device=device), parse_spec("int4-g32"))
    assert q.codes.shape == (1, 2, 0, 32)
    with pytest.raises(ValueError, match="B, H_kv, T, D"):
        quantize_pack(torch.randn(2, 0, 64, device=device), parse_spec("int8"))
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_pack(torch.randn(1, 1, 5, 64, device=device), parse_spec("int4-channel-g4"))


# ----------------------------------------------------------------------------------------------- paged


def _pools(codec, n_pages: int, bs: int, seed: int) -> dict[str, torch.Tensor]:
    """Pools of random contents (so a stray write shows), one per codec field."""
    from kvquant.kernels.quantize_pack import random_pools

    return random_pools(codec, n_pages, bs, torch.Generator().manual_seed(seed))


INTO_CASES = ["int8", "int4-g32", "int4-head-sym-sbf16", "int2-g16", "int4-channel-g8",
              "int2-channel-g16-sfp32", "int8-channel-g16-sym"]


@pytest.mark.parametrize("spec_text", INTO_CASES)
def test_quantize_pack_into_writes_what_the_ref_writes(spec_text, device):
    """Whole pools compared after kernel and twin wrote into equal random pools, through a table that is
    not in order, at a start that is not page-aligned (but a multiple of the token group)."""
    from kvquant.kernels.quantize_pack import quantize_pack_into, quantize_pack_into_ref

    from kvquant.codecs.base import codec_for

    codec = codec_for(spec_text, 3, 64, torch.float16)
    group = codec.token_group
    bs = 16
    start, t = (8 if group <= 8 else 16), max(group, 8) * 2
    torch.manual_seed(4)
    x = (torch.randn(2, 3, t, 64) * 2).half()
    table = torch.tensor([[5, 2, 7, 0], [1, 6, 3, 4]], dtype=torch.int64)
    got = {n: p.to(device) for n, p in _pools(codec, 8, bs, 0).items()}
    want = _pools(codec, 8, bs, 0)
    quantize_pack_into(x.to(device), codec, got, table.to(device), start)
    quantize_pack_into_ref(x, codec, want, table, start)
    for name in want:
        assert_bits_equal(got[name].cpu(), want[name], f"{spec_text}: {name}")


def test_quantize_pack_into_refuses_partial_groups(device):
    from kvquant.kernels.quantize_pack import quantize_pack_into

    from kvquant.codecs.base import codec_for

    codec = codec_for("int4-channel-g8", 2, 64, torch.float16)
    pools = _pools(codec, 4, 16, 0)
    table = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="token group 8"):
        quantize_pack_into(torch.randn(1, 2, 8, 64).half().to(device), codec, pools, table.to(device), 4)
