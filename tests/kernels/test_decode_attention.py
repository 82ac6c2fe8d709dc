"""decode_attention (Triton) against its twin: |out - ref32| <= 2 |ref_same_dtype - ref32| + atol."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvquant.kernels.decode_attention import decode_attention, decode_attention_ref

from kvquant.quantize import dequantize, quantize
from kvquant.scheme import parse_spec

ATOL = {torch.float16: 2e-4, torch.bfloat16: 2e-3, torch.float32: 2e-5}


def make_layer(device, dtype, *, b=2, h_kv=2, gqa=3, d=64, sink=2, body=40, recent=5, k="int4-g32",
               v="int4-g32", seed=0):
    """(query, sink_k, sink_v, key_body, value_body, recent_k, recent_v) of random data."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)
    fp = lambda n: (rand(b, h_kv, n, d), rand(b, h_kv, n, d)) if n else (None, None)
    sink_k, sink_v = fp(sink)
    recent_k, recent_v = fp(recent)
    key_body = value_body = None
    if body:
        kx, vx = rand(b, h_kv, body, d) * 1.5, rand(b, h_kv, body, d)
        key_body = kx if k == "fp16" else quantize(kx, parse_spec(k))
        value_body = vx if v == "fp16" else quantize(vx, parse_spec(v))
    return rand(b, h_kv * gqa, 1, d), sink_k, sink_v, key_body, value_body, recent_k, recent_v


def check(args, dtype, **kw):
    out = decode_attention(*args, **kw)
    kw.pop("num_splits", None)
    ref32 = decode_attention_ref(*args, upcast=True, **kw)
    ref = decode_attention_ref(*args, **kw)
    assert out.shape == ref32.shape and out.dtype == args[0].dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref32).abs().max().item()
    bound = 2 * (ref.float() - ref32).abs().max().item() + ATOL[dtype]
    assert err <= bound, f"error {err:.3g} > bound {bound:.3g}"


SPECS = [  # (K, V): every bit width and granularity, sym/asym, scale dtypes, dense bodies
    ("int8", "int8"),
    ("int8-head-sbf16", "int8-g32"),
    ("int4-g32", "int4-g32"),
    ("int4-head-sym-sfp32", "int4"),
    ("int4-channel-g8", "int4-g16-sfp16"),
    ("int2-g16", "int2-g32-sym"),
    ("int2-channel-g8-sym", "int2-head"),
    ("int4-g32", "fp16"),
    ("fp16", "fp16"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k,v", SPECS, ids=[f"{k}+{v}" for k, v in SPECS])
def test_specs(k, v, dtype, device):
    check(make_layer(device, dtype, k=k, v=v), dtype)


@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
def test_gqa_ratios(gqa, device):
    check(make_layer(device, torch.float16, gqa=gqa, h_kv=2 if gqa < 8 else 1, body=24), torch.float16)


@pytest.mark.parametrize(
    "sink,body,recent",
    [(0, 1, 0), (0, 0, 1), (4, 0, 0), (0, 17, 0), (3, 17, 0), (0, 129, 7), (4, 129, 13), (1, 0, 16)],
)
def test_parts_present_and_absent(sink, body, recent, device):
    args = make_layer(device, torch.float16, sink=sink, body=body, recent=recent, k="int4-g64", v="int8-head")
    check(args, torch.float16)


def key_mask(kind: str, b: int, t: int, device) -> torch.Tensor:
    """(B, T) bool, or (1, T) for "broadcast"; True = attend, positions in sink | body | recent order."""
    m = torch.ones(b, t, dtype=torch.bool)
    if kind == "left_padding":  # padding cuts into the sink, the body, all but the recent; a trimmed end
        for i, (start, end) in enumerate([(0, t), (2, t), (30, t), (t - 5, t - 1)][:b]):
            m[i, :start], m[i, end:] = False, False
    elif kind == "holes":  # every third token, shifted per sequence, plus a run across the sink/body seam
        for i in range(b):
            m[i, i::3] = False
        m[-1, 1:12] = False
    elif kind == "broadcast":
        m = (torch.arange(t) % 4 != 1)[None]
    elif kind == "one_empty_row":  # sequence 1 attends to nothing: zeros, from kernel and twin alike
        m[0, :7] = False
        m[1] = False
    return m.to(device)


MASKS = ["left_padding", "holes", "broadcast", "all_true", "one_empty_row"]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("kind", MASKS)
def test_key_mask(kind, num_splits, device):
    """Any mask pattern, per sequence or broadcast, across the sink | body | recent seams and the splits."""
    args = make_layer(device, torch.float16, b=4, sink=3, body=80, recent=6, k="int4-channel-g8",
                      v="int4-g32")
    check(args, torch.float16, key_mask=key_mask(kind, 4, 89, device), num_splits=num_splits)


def test_all_false_row_gives_zeros_as_sdpa_does(device):
    """A sequence that attends to nothing: torch SDPA (math path) gives zeros; so do kernel and twin."""
    args = make_layer(device, torch.float32, b=2, sink=2, body=20, recent=3, k="int8", v="int8")
    q, sk, sv, kb, vb, rk, rv = args
    mask = torch.zeros(2, 25, dtype=torch.bool, device=device)
    mask[0, 3:] = True
    keys = torch.cat([sk, dequantize(kb, torch.float32), rk], dim=2)  # (B, H_kv, T, D)
    values = torch.cat([sv, dequantize(vb, torch.float32), rv], dim=2)
    sdpa = F.scaled_dot_product_attention(  # on the CPU: the math path
        q.cpu(), keys.cpu(), values.cpu(), attn_mask=mask.cpu()[:, None, None], enable_gqa=True
    ).transpose(1, 2)  # (B, 1, H_q, D)
    assert torch.equal(sdpa[1], torch.zeros_like(sdpa[1]))
    for out in (decode_attention(*args, key_mask=mask), decode_attention_ref(*args, key_mask=mask)):
        assert torch.equal(out[1].cpu(), sdpa[1])
        torch.testing.assert_close(out.cpu(), sdpa, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("d", [128, 256])
def test_head_dims(d, device):
    check(make_layer(device, torch.float16, b=1, h_kv=1, gqa=4, d=d, body=33, k="int4-g64", v="int2-g32"),
          torch.float16)


def test_bf16_and_scaling(device):
    args = make_layer(device, torch.bfloat16, b=1, body=20, k="int8", v="int4-g32")
    check(args, torch.bfloat16, scaling=0.3)


def test_many_splits_agree_with_one(device):
    args = make_layer(device, torch.float32, b=1, h_kv=1, gqa=2, sink=0, body=300, recent=0)
    one = decode_attention(*args, num_splits=1)
    many = decode_attention(*args, num_splits=4)
    torch.testing.assert_close(one, many, rtol=1e-5, atol=1e-6)


def test_bad_inputs(device):
    q, sk, sv, kb, vb, rk, rv = make_layer(device, torch.float16, body=8)
    with pytest.raises(ValueError, match=r"\(B, H_q, 1, D\)"):
        decode_attention(q.expand(-1, -1, 2, -1), sk, sv, kb, vb, rk, rv)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        decode_attention(q[:, :5], sk, sv, kb, vb, rk, rv)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q[..., :48], None, None, None, None, rk[..., :48], rv[..., :48])
    with pytest.raises(ValueError, match="no tokens"):
        decode_attention(q, None, None, None, None, None, None)
    t = kb.shape[2] + sk.shape[2] + rk.shape[2]
    with pytest.raises(TypeError, match="must be bool"):
        decode_attention(q, sk, sv, kb, vb, rk, rv, key_mask=torch.ones(2, t, device=device))
    too_long = torch.ones(2, t + 1, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match=r"key_mask must be \(B=2 or 1, T="):
        decode_attention(q, sk, sv, kb, vb, rk, rv, key_mask=too_long)
