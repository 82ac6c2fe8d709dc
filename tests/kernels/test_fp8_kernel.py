"""FP8 bodies (kvquant.codecs.fp8: E4M3 / E5M2 codes, per-token / per-head / per-group / channel-wise scale or
the `-tensor` unit scale) read in place by decode_attention, against its twin within the float bound:
|out - ref32| <= 2 |ref_same_dtype - ref32| + atol; the float8 -> fp16 conversion exact for all 256 codes;
appends through the kernel entry bit for bit the codec's; `generate` end to end equal to the torch backend."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_e2e import check_matches_torch, generate_both
from kvquant.kernels import dispatch
from kvquant.kernels.decode_attention import _fp8_w8, _interpreting, decode_attention, decode_attention_ref
from kvquant.kernels.testing import DECODE_ATOL, check_decode, make_paged_layer, random_query

from kvquant.codecs.base import codec_for

ATOL = DECODE_ATOL
query = random_query
check = check_decode


SPECS = [  # (K, V): both kinds, every scale layout, scale dtypes, FP8 next to integer and dense bodies
    ("fp8-e4m3", "fp8-e4m3"),
    ("fp8-e5m2-head", "fp8-e4m3-g32"),
    ("fp8-e4m3-g16-sbf16", "fp8-e5m2"),
    ("fp8-e4m3-tensor", "fp8-e5m2-tensor"),
    ("fp8-e4m3-channel-g16", "fp8-e4m3-head-sfp32"),
    ("fp8-e4m3", "int4-g32"),
    ("int8", "fp8-e5m2-g32"),
    ("fp8-e4m3-tensor", "fp16"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k,v", SPECS, ids=[f"{k}+{v}" for k, v in SPECS])
def test_fp8_specs(k, v, dtype, device):
    """Shuffled pages, a page shared by two sequences, sink, body and a window from mid-page."""
    layer = make_paged_layer(k=k, v=v, dtype=dtype, device=device, sink=2, body=48, recent=5,
                             recent_offset=3, share=True)
    check(layer, query(layer, 3, dtype, device), dtype)


@pytest.mark.parametrize("gqa,h_kv", [(4, 2), (8, 1), (6, 1)])
def test_fp8_gqa_and_mqa(gqa, h_kv, device):
    layer = make_paged_layer(h_kv=h_kv, body=32, k="fp8-e4m3", v="fp8-e5m2-g32", device=device)
    check(layer, query(layer, gqa, torch.float16, device), torch.float16)


def test_fp8_bf16_d128_masked_two_splits(device):
    layer = make_paged_layer(b=2, h_kv=1, d=128, sink=3, body=128, recent=6, recent_offset=9, k="fp8-e4m3",
                             v="fp8-e4m3-g64", dtype=torch.bfloat16, device=device)
    mask = torch.ones(2, layer.shape[2], dtype=torch.bool)
    mask[1, :20] = False  # left padding into the body
    check(layer, query(layer, 4, torch.bfloat16, device), torch.bfloat16, key_mask=mask.to(device),
          num_splits=2)


def test_fp8_saturated_codes(device):
    """-tensor stores values beyond the format's range as +-max (448 for E4M3): read back exactly."""
    layer = make_paged_layer(b=1, body=16, sink=0, recent=2, k="fp8-e4m3-tensor", v="fp8-e4m3-tensor",
                             dtype=torch.float32, device=device)
    layer.value_pages["codes"][layer.body.table[0, 0]] = 0x7E  # 448 everywhere in the first page
    q = query(layer, 2, torch.float32, device)
    out = decode_attention(q, *layer.decode_args())
    ref32 = decode_attention_ref(q, *layer.decode_args(), upcast=True)
    assert out.abs().max() > 100  # the saturated values dominate; fp32 rounding is relative here
    torch.testing.assert_close(out, ref32, rtol=2e-6, atol=2e-5)


@triton.jit
def _fp8_codes_kernel(w_ptr, out_ptr, BT: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr,
                      F16: tl.constexpr, ASM: tl.constexpr):
    OUT: tl.constexpr = tl.float16 if F16 else tl.float32
    t = tl.arange(0, BT)
    words = tl.load(w_ptr + t[:, None] * (D // 4) + tl.arange(0, D // 4)[None, :])
    tl.store(out_ptr + t[:, None] * D + tl.arange(0, D)[None, :], _fp8_w8(words, BT, D, FMT, OUT, ASM))


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kind,fmt", [(torch.float8_e4m3fn, 1), (torch.float8_e5m2, 2)])
def test_fp8_codes_read_as_words_decode_exactly(kind, fmt, out_dtype, device):
    """All 256 float8 codes, as int32 words (byte k of word j = code 4j + k), decode to torch's values of
    the same bits (NaN to NaN, E5M2's infinities to infinities, subnormals exactly)."""
    g = torch.Generator().manual_seed(3)
    codes = torch.arange(256, dtype=torch.uint8).repeat(4)[torch.randperm(1024, generator=g)].reshape(16, 64)
    codes = codes.to(device)
    out = torch.empty(16, 64, dtype=out_dtype, device=device)
    _fp8_codes_kernel[(1,)](codes.view(torch.int32), out, BT=16, D=64, FMT=fmt,
                            F16=out_dtype == torch.float16, ASM=not _interpreting())
    want = codes.view(kind).to(out_dtype)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(want))


def test_fp8_appends_through_the_kernel_entry_are_the_codec_bits(device):
    """The cache's body append for FP8 (dispatch.quantize_pack_into) writes codec.encode's bits."""
    from kvquant.kernels.quantize_pack import quantize_pack_into_ref

    codec = codec_for("fp8-e4m3-g32", 2, 64, torch.float16)
    x = (torch.randn(2, 2, 7, 64, generator=torch.Generator().manual_seed(1)) * 100).half()
    pools = {n: torch.zeros(4, f.heads, 16 // f.tokens, f.cols, dtype=f.dtype)
             for n, f in codec.fields().items()}
    want = {n: p.clone() for n, p in pools.items()}
    got = {n: p.to(device) for n, p in pools.items()}
    table = torch.tensor([[3, 1], [0, 2]])
    dispatch.quantize_pack_into(x.to(device), codec, got, table.to(device), 12)
    quantize_pack_into_ref(x, codec, want, table, 12)
    for n in want:
        assert torch.equal(got[n].cpu(), want[n]), n


FP8_SCHEMES = [
    "fp8-e4m3,sink=2,window=4",
    "k=fp8-e5m2-head,v=fp8-e4m3-tensor",
]


@pytest.mark.parametrize("scheme", FP8_SCHEMES)
def test_generate_fp8_with_kernels_matches_the_torch_backend(scheme, monkeypatch, caplog, device):
    if device.type != "cpu":
        pytest.skip("the cache end to end runs under the interpreter here (on a GPU: gpu_check's e2e phase)")
    ref, got, served = generate_both(scheme, monkeypatch, caplog, new_tokens=6)
    check_matches_torch(ref, got, served, 5 * 2, caplog)  # every decode step of both layers in the kernel
