"""Rotated codecs (`-rot`) on the Triton path: decode attention in the rotated frame equals the reference
(which un-rotates on decode), the kernel append writes `RotationCodec.encode`'s bits, and generation with
the kernels matches the PyTorch path token for token. Other transforms keep the reference path."""

from __future__ import annotations

import pytest
import torch
from kvquant.kernels import dispatch, quantize_pack
from kvquant.kernels.decode_attention import decode_attention_ref
from kvquant.kernels.quantize_pack import quantize_pack_into_ref
from kvquant.kernels.testing import make_paged_layer

from kvquant.codecs.base import codec_for
from kvquant.codecs.transforms import RotationCodec, kernel_frame

# (K spec, V spec, block size): both rotated (one seed), K only (channel-wise, the scheme of the issue),
# V only with its own seed (per-token int8: scales folded), a dense inner codec with K and V seeds apart
CODECS = [
    ("int4-g64-rot", "int4-g64-rot", 16),
    ("int4-channel-g64-rot", "int4-g64", 64),
    ("int4-g32", "int8-rot3", 16),
    ("fp16-rot", "int4-g32-rot5", 16),
]


@pytest.mark.parametrize("k, v, bs", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_attention_rotated_matches_the_reference(k, v, bs, dtype, device):
    """Sink, body and window all present, the window starting mid-page, batch 2, GQA 3, a padding mask.
    fp32: within 1e-5 of the fp32 reference. fp16: within twice the fp16 reference's own error (the
    flash-attention bound) + 2e-3, both against the fp32 reference."""
    layer = make_paged_layer(k=k, v=v, sink=4, body=64, recent=16, recent_offset=5, block_size=bs,
                             dtype=dtype, device=device, share=True)
    q = torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    t = layer.shape[2]
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[1, :3] = False  # left padding: part of sequence 1's sink
    mask = valid[:, None, None, :].to(device)
    got = dispatch.fused_attention(q, layer, mask, None)
    assert got is not None  # served by the kernel, not declined
    ref32 = decode_attention_ref(q, *layer.decode_args(), None, mask[:, 0, 0], upcast=True)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref32, rtol=1e-4, atol=1e-5)
    else:
        same = decode_attention_ref(q, *layer.decode_args(), None, mask[:, 0, 0])
        err, bound = (got.float() - ref32).abs(), 2 * (same.float() - ref32).abs() + 2e-3
        assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.2e}"


@pytest.mark.parametrize("spec", ["int4-g64-rot", "int4-channel-g16-rot7", "int8-rot", "fp16-rot3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernel_append_writes_rotation_encode_bits(spec, dtype, device, monkeypatch):
    """dispatch.quantize_pack_into rotates and packs with the inner codec's kernel: the pages equal
    `RotationCodec.encode` written by index, bit for bit."""
    codec = codec_for(spec, 2, 64, dtype)
    assert isinstance(codec, RotationCodec)
    served = []
    launch = quantize_pack._launch_into

    def spy(x, codec_, *args):
        ok = launch(x, codec_, *args)
        served.append((codec_, ok))
        return ok

    monkeypatch.setattr(quantize_pack, "_launch_into", spy)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 2, 16, 64, generator=g) * 3).to(dtype)
    x[..., 5] += 20  # an outlier channel, as rotation is for
    pools = {n: torch.rand(4, f.heads, 16 // f.tokens, f.cols, generator=g).to(f.dtype)
             for n, f in codec.fields().items()}
    want = {n: p.clone() for n, p in pools.items()}
    got = {n: p.to(device) for n, p in pools.items()}
    table = torch.tensor([[3, 1], [0, 2]])
    dispatch.quantize_pack_into(x.to(device), codec, got, table.to(device), 16)
    quantize_pack_into_ref(x, codec, want, table, 16)  # codec.encode(x) + index writes
    for n in want:
        assert torch.equal(got[n].cpu(), want[n]), n
    inner_is_dense = codec.inner.kernel_layout().bits == 16
    assert served == [(codec.inner, not inner_is_dense)]  # the inner codec's kernel (a dense body: a copy)


def test_only_rotation_around_a_kernel_codec_is_served():
    dev = torch.device("cpu")
    for spec in ("int4-g64-rot", "fp16-rot", "int4-channel-g64-rot"):
        frame = kernel_frame(codec_for(spec, 2, 64), dev)
        assert frame is not None and frame.signs is not None and frame.codec.kernel_layout() is not None
    plain = codec_for("int4-g64", 2, 64)
    assert kernel_frame(plain, dev).codec is plain and kernel_frame(plain, dev).signs is None
    for spec in ("int4-g64-center", "int4-g64-out1", "int4-g64-rot-out1", "int4-g64-center-rot"):
        assert kernel_frame(codec_for(spec, 2, 64), dev) is None  # the reference path, as before


# `generate` end to end with rotated schemes: tests/kernels/test_cache_end_to_end.py (SCHEMES)


# ------------------------------------------------------------------------------- -crot (a dense rotation)


def _orthogonal(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return q.float()


def _crot(spec: str, d: int, dtype, seed: int):
    from kvquant.kernels.testing import with_demo_levels

    codec = with_demo_levels(codec_for(spec, 2, d, dtype))
    codec.set_matrix(_orthogonal(d, seed))
    return codec


CROT = [("int4-g32-crot", "int8-crot", torch.float32), ("nuq3-g64-crot", "int4-g64", torch.float16),
        ("fp8-e4m3-crot", "nuq4-g32-crot", torch.bfloat16)]


@pytest.mark.parametrize("k,v,dtype", CROT, ids=[f"{k}+{v}-{str(t)[6:]}" for k, v, t in CROT])
def test_calibrated_rotation_is_served_in_its_frame(k, v, dtype, device):
    """-crot around a kernel codec: the query times M once, the sink and window copies times M, the output
    times M^T (`KernelFrame.matrix`); sink, body and a window from mid-page, a padding mask, two splits."""
    from kvquant.kernels.layouts import decode_frame
    from kvquant.kernels.testing import check_decode, random_query

    kc = _crot(k, 64, dtype, 1) if "crot" in k else codec_for(k, 2, 64, dtype)
    vc = _crot(v, 64, dtype, 2) if "crot" in v else codec_for(v, 2, 64, dtype)
    frame = decode_frame(kc, torch.device(device))
    assert frame.matrix is not None and frame.codec is kc.inner
    from kvquant.backend import kernel_fallback

    line = kernel_fallback(kc, torch.device(device))  # the line the cache logs: appends by the codec's encode
    assert "decode attention runs in the Triton kernel" in line and "PyTorch encoder" in line
    layer = make_paged_layer(k=kc, v=vc, sink=3, body=128, recent=6, recent_offset=9, dtype=dtype,
                             device=device, share=True)
    mask = torch.ones(2, layer.shape[2], dtype=torch.bool)
    mask[1, :20] = False
    check_decode(layer, random_query(layer, 3, dtype, device), dtype, key_mask=mask.to(device), num_splits=2)


def test_crot_without_its_matrix_is_not_served():
    from kvquant.kernels.layouts import decode_frame

    assert decode_frame(codec_for("int4-g32-crot", 2, 64), torch.device("cpu")) is None


def test_generate_crot_with_kernels_matches_the_torch_backend(tmp_path, monkeypatch, caplog, device):
    if device.type != "cpu":
        pytest.skip("the cache end to end runs under the interpreter here (on a GPU: gpu_check's e2e phase)")
    from kernel_e2e import check_matches_torch, generate_both
    from tiny_models import make_tiny_config

    from kvquant.calibration import entries_for, metadata, save_calibration
    from kvquant.memory import KVShape
    from kvquant.scheme import parse_scheme

    scheme = "k=int4-g32-crot,v=int8-crot,sink=2,window=4"
    shape = KVShape.from_config(make_tiny_config(num_hidden_layers=2))
    path = tmp_path / "rot.safetensors"
    entries = entries_for(parse_scheme(f"{scheme},calib={path}"), shape.num_layers)
    tables = {e.name: _orthogonal(shape.head_dim, i) for i, e in enumerate(entries)}
    save_calibration(path, tables, metadata("tiny", shape, [scheme], entries))
    ref, got, served = generate_both(f"{scheme},calib={path}", monkeypatch, caplog)
    check_matches_torch(ref, got, served, 4 * 2, caplog)  # every decode step of both layers in the kernel
