"""`-prerope` keys (`kvquant.codecs.base.PreRopeCodec`: stored before the rotary embedding) read by
decode_attention: the kernel decodes a body key and applies RoPE at its position (`B_START + r`) from a
table of the model's cos / sin (`kvquant.kernels.layouts.rope_table`, computed by `Rope.cos_sin` on the
device, so the values the reference multiplies by), in fp32, one rounding after it; keys are never
materialized. Attention within the float bound |out - ref32| <= 2 |ref - ref32| + atol against the twin
(which decodes at the body's start and applies `Rope.apply`), for affine, codebook, `-center` and dense inner
codecs, GQA / MQA, D 64 / 128 / 256, shuffled and shared pages, sink + body + window, a mask over two
splits, positions past the table's first size, and the RoPE types kvquant supports (default, linear,
llama3, yarn with its attention scaling); a rotated inner codec keeps the reference path; `generate` end
to end equal to the torch backend with every decode step in the kernel."""

from __future__ import annotations

import pytest
import torch
from kernel_e2e import check_matches_torch, generate_both
from kvquant.kernels.decode_attention import decode_attention, decode_attention_ref
from kvquant.kernels.layouts import decode_frame
from kvquant.kernels.testing import (
    DECODE_ATOL,
    check_decode,
    make_paged_layer,
    random_query,
    with_demo_levels,
)

from kvquant.backend import kernel_fallback
from kvquant.codecs.base import codec_for
from kvquant.rope import Rope


def _rope(d: int, scaling: float = 1.0) -> Rope:
    return Rope(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), scaling)


def _layer(k: str, v: str, dtype, device, d: int = 64, rope: Rope | None = None, **kw):
    kc = with_demo_levels(codec_for(k, kw.pop("h_kv", 2), d, dtype, rope=rope or _rope(d)))
    vc = with_demo_levels(codec_for(v, kc.heads, d, dtype))
    args = dict(sink=2, body=128, recent=5, recent_offset=3, share=True, block_size=64)
    return make_paged_layer(k=kc, v=vc, dtype=dtype, device=device, d=d, h_kv=kc.heads, **{**args, **kw})


SPECS = [  # (K, V): affine (channel-wise, per token), the 3-bit recipe's codebook keys, -center, dense
    ("int4-channel-g16-prerope", "int4-g32"),
    ("nuq3-channel-g64-prerope", "int2-g64"),
    ("int8-prerope", "fp16"),
    ("int4-g32-center-prerope", "int8"),
    ("fp16-prerope", "int4-g64"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k,v", SPECS, ids=[f"{k}+{v}" for k, v in SPECS])
def test_prerope_specs(k, v, dtype, device):
    layer = _layer(k, v, dtype, device)
    assert decode_frame(layer.key_codec, torch.device(device)).identity  # RoPE runs inside the kernel
    check_decode(layer, random_query(layer, 3, dtype, device), dtype)


def test_prerope_bf16(device):
    """bf16: the bound over six queries at once (one query's max error of the bf16 reference is a noisy
    yardstick: single queries put the kernel at 0.5-1.4x it, one seed at 2.2x, with and without -prerope)."""
    dtype = torch.bfloat16
    for k, v in SPECS[:2]:
        layer = _layer(k, v, dtype, device)
        args, err, ref_err = layer.decode_args(), 0.0, 0.0
        for seed in range(6):
            q = random_query(layer, 3, dtype, device, seed=seed)
            ref32 = decode_attention_ref(q, *args, upcast=True)
            err = max(err, (decode_attention(q, *args).float() - ref32).abs().max().item())
            ref_err = max(ref_err, (decode_attention_ref(q, *args).float() - ref32).abs().max().item())
        bound = 2 * ref_err + DECODE_ATOL[dtype]
        assert err <= bound, f"{k}: error {err:.3g} > bound {bound:.3g}"


@pytest.mark.parametrize("gqa,h_kv,d", [(4, 2, 128), (8, 1, 256)])
def test_prerope_gqa_mqa_masked_two_splits(gqa, h_kv, d, device):
    layer = _layer("int4-channel-g16-prerope", "int4-g64", torch.float16, device, d=d, h_kv=h_kv, sink=3,
                   recent=6, recent_offset=9)
    mask = torch.ones(2, layer.shape[2], dtype=torch.bool)
    mask[1, :20] = False  # left padding into the body
    check_decode(layer, random_query(layer, gqa, torch.float16, device), torch.float16,
                 key_mask=mask.to(device), num_splits=2)


def test_positions_past_the_first_table(device):
    """A body starting at position 5,000 (a sliding layer's, or a long context's): the table grows past its
    first 4,096 positions, and the kernel reads the right rows."""
    layer = _layer("int4-channel-g16-prerope", "int4-g32", torch.float32, device)
    layer.body.start = 5000
    check_decode(layer, random_query(layer, 3, torch.float32, device), torch.float32)


ROPES = {  # rope_parameters as a transformers 5 config keeps them (tests/test_prerope.py's)
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 512},
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_types(kind, device):
    """The model's own RoPE (`Rope.from_config`): its frequencies and, for yarn, its attention scaling."""
    from tiny_models import make_tiny_config

    rope = Rope.from_config(make_tiny_config(rope_parameters=ROPES[kind]))
    assert rope.rope_type == kind and (rope.attention_scaling != 1.0) == (kind == "yarn")
    layer = _layer("int4-channel-g16-prerope", "int4-g32", torch.float32, device, rope=rope)
    layer.body.start = 3000
    check_decode(layer, random_query(layer, 3, torch.float32, device), torch.float32)


def test_what_prerope_the_kernel_serves():
    dev = torch.device("cpu")
    rope = _rope(64)
    assert decode_frame(codec_for("int4-g32-rot-prerope", 2, 64, rope=rope), dev) is None  # RoPE needs the
    assert decode_frame(codec_for("llama.cpp:q8_0-prerope", 2, 64, rope=rope), dev) is None  # model's frame
    assert decode_frame(codec_for("int4-g32-prerope", 2, 64), dev) is None  # no RoPE given: nothing to apply
    line = kernel_fallback(codec_for("int4-g32-prerope", 2, 64, rope=rope), dev)  # the line the cache logs
    assert "decode attention runs in the Triton kernel" in line and "PyTorch encoder" in line


def test_the_rope_is_needed(device, monkeypatch):
    """The check can fail: the kernel without its RoPE (a layer whose body starts at 3,000) is far off."""
    from kvquant.kernels import decode_attention as da
    from kvquant.kernels.layouts import DecodeParts

    layer = _layer("int4-channel-g16-prerope", "int4-g32", torch.float32, device)
    layer.body.start = 3000
    real = da.decode_parts
    monkeypatch.setattr(da, "decode_parts", lambda c: DecodeParts(real(c).base, real(c).center,
                                                                  real(c).outliers, None))
    with pytest.raises(AssertionError):
        check_decode(layer, random_query(layer, 3, torch.float32, device), torch.float32)


E2E = ["k=int4-channel-g16-prerope,v=int4-g32,sink=2,window=4", "k=int8-prerope,v=fp16"]


@pytest.mark.parametrize("scheme", E2E)
def test_generate_prerope_with_kernels_matches_the_torch_backend(scheme, monkeypatch, caplog, device):
    if device.type != "cpu":
        pytest.skip("the cache end to end runs under the interpreter here (on a GPU: gpu_check's e2e phase)")
    ref, got, served = generate_both(scheme, monkeypatch, caplog)
    check_matches_torch(ref, got, served, 4 * 2, caplog)  # every decode step of both layers in the kernel
