"""vLLM's cache dtypes (`kvquant.codecs.engine_vllm`) read in place by decode_attention: `fp8_e4m3` /
`fp8_e5m2` at the default per-tensor scale 1.0 (FP8 codes, nothing else stored), `fp8_per_token_head`
(E4M3 codes and a float32 scale per (token, head)), `int8_per_token_head` (two's-complement int8 codes and
a float32 scale, the scale as stored) and the TurboQuant presets (keys: 3 / 4-bit Lloyd-Max centroids times
the fp16 norm, renormalized, in the layer's rotated frame, or E4M3; values: 3 / 4-bit min/max codes, fp16
scale and zero, in one `slot` row): every int8 and TurboQuant value code decoded exactly, attention within
the float bound |out - ref32| <= 2 |ref - ref32| + atol (GQA, MQA, D 64 / 128 / 256, shuffled and shared
pages, sink + body + window, a mask over two splits), and `generate` end to end equal to the torch backend."""

from __future__ import annotations

import pytest
import torch
from kernel_e2e import check_matches_torch, generate_both
from kvquant.kernels.decode_attention import decode_attention
from kvquant.kernels.layouts import (
    SignedInt8KernelLayout,
    SlotKernelLayout,
    decode_frame,
    decode_layout,
)
from kvquant.kernels.testing import check_decode, make_paged_layer, random_query

from kvquant.backend import kernel_fallback
from kvquant.codecs.base import codec_for
from kvquant.codecs.engine_vllm import tq_dequantize_value, tq_signs
from kvquant.codecs.fp8 import FP8KernelLayout
from kvquant.codecs.packing import pack


def test_which_vllm_formats_the_kernel_reads():
    names = ("vllm:fp8", "vllm:fp8_e5m2", "vllm:fp8_per_token_head", "vllm:int8_per_token_head")
    lay = {s: decode_layout(codec_for(s, 2, 64)) for s in names}
    assert isinstance(lay["vllm:fp8"], FP8KernelLayout) and lay["vllm:fp8"].unit_scale
    assert lay["vllm:fp8_e5m2"].fp8 == "e5m2"
    assert lay["vllm:fp8_per_token_head"].fp8 == "e4m3" and not lay["vllm:fp8_per_token_head"].unit_scale
    assert isinstance(lay["vllm:int8_per_token_head"], SignedInt8KernelLayout)
    scaled = codec_for("vllm:fp8", 2, 64)
    scaled.set_scale(0.5)  # a calibrated k_scale: not read by the kernel yet
    assert decode_layout(scaled) is None and decode_frame(scaled, torch.device("cpu")) is None
    assert "no Triton kernel reads" in kernel_fallback(scaled, torch.device("cpu"))



# ------------------------------------------------------------------------------- TurboQuant


def _tq(preset: str, d: int, dtype, h_kv: int = 2, layer: int = 3):
    """The K and V halves of a TurboQuant preset, bound to a layer (its rotation's signs)."""
    return (codec_for(f"vllm:{preset}.k", h_kv, d, dtype, layer=layer, role="k"),
            codec_for(f"vllm:{preset}.v", h_kv, d, dtype, layer=layer, role="v"))


def test_turboquant_layouts_and_frames():
    dev = torch.device("cpu")
    k, v = _tq("turboquant_4bit_nc", 64, torch.float16, layer=5)
    lk, lv = decode_layout(k), decode_layout(v)
    assert isinstance(lk, SlotKernelLayout) and (lk.kind, lk.bits, lk.row_bytes) == ("mse", 4, 34)
    assert lk.norm_correction and (lv.kind, lv.bits, lv.row_bytes) == ("affine", 4, 36)
    assert torch.equal(decode_frame(k, dev).signs, tq_signs(64, 5))  # keys: the layer's rotated frame
    assert decode_frame(v, dev).identity
    k8, _ = _tq("turboquant_k8v4", 64, torch.float16)
    assert decode_layout(k8).kind == "fp8" and decode_frame(k8, dev).identity
    assert "decode attention runs in the Triton kernel" in kernel_fallback(k, dev)  # appends: the encoder


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_every_turboquant_value_code_is_read_exactly(preset, device):
    """One body token, no FP token: the output is the token's value row, code * scale + zero in fp32, equal
    to `tq_dequantize_value` bit for bit, for every code in the slot's packing (3 bits: 8 per 3 bytes)."""
    _, vc = _tq(preset, 256, torch.float32, h_kv=1)
    layer = make_paged_layer(b=1, h_kv=1, d=256, sink=0, body=1, recent=0, k="int8", v=vc,
                             dtype=torch.float32, device=device)
    page, bits = layer.body.table[0, 0], vc.preset.value_bits
    codes = torch.arange(256) % (1 << bits)
    row = torch.cat((pack(codes.to(torch.uint8), bits), torch.tensor([0.375, -1.5]).half().view(torch.uint8)))
    layer.value_pages["slot"][page, 0, 0] = row.to(device)
    out = decode_attention(random_query(layer, 1, torch.float32, device), *layer.decode_args())
    assert torch.equal(out[0, 0, 0].cpu(), tq_dequantize_value(row, preset, 256))


TQ = [("turboquant_4bit_nc", torch.float16, 64), ("turboquant_k3v4_nc", torch.float32, 64),
      ("turboquant_3bit_nc", torch.bfloat16, 128), ("turboquant_k8v4", torch.float16, 128)]


@pytest.mark.parametrize("preset,dtype,d", TQ, ids=[f"{p}-{str(t)[6:]}-{d}" for p, t, d in TQ])
def test_turboquant_presets(preset, dtype, d, device):
    """Keys in the layer's rotated frame (3 / 4-bit centroids times the norm, renormalized), FP8 keys,
    3 / 4-bit values; shuffled and shared pages, sink, body and a window from mid-page."""
    kc, vc = _tq(preset, d, dtype)
    layer = make_paged_layer(k=kc, v=vc, dtype=dtype, device=device, sink=2, body=64, recent=5,
                             recent_offset=3, share=True, d=d)
    check_decode(layer, random_query(layer, 3, dtype, device), dtype)


def test_turboquant_gqa_mqa_d256_masked_two_splits(device):
    for h_kv, gqa, d in ((2, 4, 128), (1, 8, 256)):
        kc, vc = _tq("turboquant_k3v4_nc", d, torch.float16, h_kv=h_kv)
        layer = make_paged_layer(b=2, h_kv=h_kv, d=d, sink=3, body=128, recent=6, recent_offset=9, k=kc, v=vc,
                                 device=device)
        mask = torch.ones(2, layer.shape[2], dtype=torch.bool)
        mask[1, :20] = False
        check_decode(layer, random_query(layer, gqa, torch.float16, device), torch.float16,
                     key_mask=mask.to(device), num_splits=2)


def test_the_norm_correction_is_needed(device, monkeypatch):
    """The check above can fail: a kernel that skipped the renormalization of the centroid vector (the _nc
    presets) is off the bound."""
    import dataclasses

    from kvquant.kernels import decode_attention as da

    kc, vc = _tq("turboquant_4bit_nc", 64, torch.float32)
    layer = make_paged_layer(k=kc, v=vc, dtype=torch.float32, device=device, sink=0, body=64, recent=0)
    real = da.decode_layout
    monkeypatch.setattr(da, "decode_layout", lambda c: dataclasses.replace(real(c), norm_correction=False)
                        if isinstance(real(c), SlotKernelLayout) else real(c))
    with pytest.raises(AssertionError):
        check_decode(layer, random_query(layer, 3, torch.float32, device), torch.float32)


def test_every_int8_code_is_read_exactly(device):
    """One body token, no FP token: the output is the token's decoded value row itself (p = 1), so every
    two's-complement code -128..127 times its scale comes back exactly in fp32."""
    codec = codec_for("vllm:int8_per_token_head", 1, 256, torch.float32)
    layer = make_paged_layer(b=1, h_kv=1, d=256, sink=0, body=1, recent=0, k="int8", v=codec,
                             dtype=torch.float32, device=device)
    page = layer.body.table[0, 0]
    layer.value_pages["codes"][page, 0, 0] = torch.arange(-128, 128, dtype=torch.int8).to(device)
    layer.value_pages["scale"][page, 0, 0] = 0.375
    q = random_query(layer, 1, torch.float32, device)
    out = decode_attention(q, *layer.decode_args())
    want = torch.arange(-128, 128, dtype=torch.float32) * 0.375
    assert torch.equal(out[0, 0, 0].cpu(), want)


SPECS = [  # (K, V, dtype)
    ("vllm:int8_per_token_head", "vllm:int8_per_token_head", torch.float16),
    ("vllm:fp8_per_token_head", "vllm:int8_per_token_head", torch.float32),
    ("vllm:fp8", "vllm:fp8_e5m2", torch.bfloat16),
    ("vllm:int8_per_token_head", "int4-g32", torch.float16),
]


@pytest.mark.parametrize("k,v,dtype", SPECS, ids=[f"{k}+{v}-{str(t)[6:]}" for k, v, t in SPECS])
def test_vllm_specs(k, v, dtype, device):
    """Shuffled pages, a page shared by two sequences, sink, body and a window from mid-page; codes stored
    as vLLM writes them (scales of 1e-6 and up)."""
    layer = make_paged_layer(k=k, v=v, dtype=dtype, device=device, sink=2, body=48, recent=5, recent_offset=3,
                             share=True)
    check_decode(layer, random_query(layer, 3, dtype, device), dtype)


@pytest.mark.parametrize("gqa,h_kv,d", [(4, 2, 128), (8, 1, 64)])
def test_vllm_gqa_and_mqa(gqa, h_kv, d, device):
    layer = make_paged_layer(h_kv=h_kv, d=d, body=32, k="vllm:int8_per_token_head",
                             v="vllm:fp8_per_token_head", device=device)
    check_decode(layer, random_query(layer, gqa, torch.float16, device), torch.float16)


def test_vllm_d256_mqa_bf16_masked_two_splits(device):
    layer = make_paged_layer(b=2, h_kv=1, d=256, sink=3, body=128, recent=6, recent_offset=9,
                             k="vllm:int8_per_token_head", v="vllm:fp8", dtype=torch.bfloat16, device=device)
    mask = torch.ones(2, layer.shape[2], dtype=torch.bool)
    mask[1, :20] = False  # left padding into the body
    check_decode(layer, random_query(layer, 4, torch.bfloat16, device), torch.bfloat16,
                 key_mask=mask.to(device), num_splits=2)


# (scheme, layers). int8_per_token_head truncates x * (1 / scale) (vLLM's Triton store), and the absmax
# element of every (token, head) lands on 127 up to an ulp: a deeper layer's K/V, which differ between the
# backends by the previous layer's attention rounding (~1e-7), flip such codes (126 / 127), and the logits
# move by ~1e-4 at the third step for that reason alone (measured: 1.6e-4; kvquant's rounding int8: 1e-6).
# One layer sees the same K/V on both paths, so its logits show the kernel's own difference.
E2E = [("vllm:int8_per_token_head", 1), ("k=vllm:fp8_per_token_head,v=vllm:fp8_e5m2,sink=2,window=4", 2),
       ("vllm:turboquant_4bit_nc", 2), ("vllm:turboquant_k8v4,sink=2,window=4", 2)]


@pytest.mark.parametrize("scheme,layers", E2E)
def test_generate_vllm_formats_with_kernels_matches_the_torch_backend(scheme, layers, monkeypatch, caplog,
                                                                      device):
    if device.type != "cpu":
        pytest.skip("the cache end to end runs under the interpreter here (on a GPU: gpu_check's e2e phase)")
    ref, got, served = generate_both(scheme, monkeypatch, caplog, layers=layers)
    check_matches_torch(ref, got, served, 4 * layers, caplog)  # every decode step of every layer
