"""The entry points the cache calls: decode masks, fallbacks, and a tiny Llama end to end."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from kvquant.kernels import dispatch

import kvquant
from kvquant.attention import kvquant_attention
from kvquant.cache import QuantizedLayer


def sdpa_bool_mask(valid: torch.Tensor) -> torch.Tensor:
    """(B, T) bool -> (B, 1, 1, T), the form transformers' sdpa_mask gives a decode step."""
    return valid[:, None, None, :]


def layer_with(scheme: str, n: int, device, b: int = 2, d: int = 64, seed: int = 0) -> QuantizedLayer:
    g = torch.Generator().manual_seed(seed)
    layer = QuantizedLayer(scheme, backend="triton")
    rand = lambda t: torch.randn(b, 2, t, d, generator=g).to(device)
    for chunk in (n - 3, 1, 1, 1):  # a prefill, then single tokens
        layer.update(rand(chunk), rand(chunk))
    return layer


@functools.cache
def shared_layer(scheme: str, device: torch.device) -> QuantizedLayer:
    """A 40-token layer, built once per scheme (building runs the interpreted quantize kernel); read only."""
    return layer_with(scheme, n=40, device=device)


def decode_mask(kind: str, device) -> torch.Tensor | None:
    """The 4D bool mask of a decode step over 40 tokens (B = 2), as transformers' sdpa_mask may give it."""
    if kind == "none":
        return None
    valid = torch.ones(2, 40, dtype=torch.bool)
    if kind == "left_padding":
        valid[1, :7] = False
    elif kind == "holes":
        valid[0, ::3] = False
        valid[1, 10:30] = False
    elif kind == "broadcast":  # (1, 1, 1, T): one row for the whole batch, read with stride 0
        valid = (torch.arange(40) % 5 != 2)[None]
    elif kind == "longer":  # more columns than tokens: only the first T count
        valid = torch.cat([valid, torch.zeros(2, 3, dtype=torch.bool)], dim=1)
        valid[0, :4] = False
    elif kind == "empty_row":  # zeros, as SDPA gives
        valid[1] = False
    return sdpa_bool_mask(valid.to(device))


CASES = [  # (scheme, mask kind): every mask kind on one scheme, the left-padded batch on the others
    *[("k=int4-channel-g8,v=int4-g32,sink=2,window=4", kind)
      for kind in ("none", "left_padding", "holes", "broadcast", "longer", "empty_row")],
    ("int8,window=3", "left_padding"),
    ("fp16", "holes"),
]


@pytest.mark.parametrize("scheme,kind", CASES, ids=[f"{s}:{k}" for s, k in CASES])
def test_fused_attention_matches_the_reference_path(scheme, kind, device):
    layer = shared_layer(scheme, device)
    view = layer.view()
    q = torch.randn(2, 6, 1, 64, device=device)
    mask = decode_mask(kind, device)
    got = dispatch.fused_attention(q, view, mask, None)
    assert got is not None
    module = torch.nn.Module()
    module.is_causal, module.training, module.num_key_value_groups = True, False, 3
    torch_view = QuantizedLayer(scheme, backend="torch")
    torch_view.__dict__.update({k: v for k, v in layer.__dict__.items() if k != "backend"})
    ref_view = torch_view.view()
    ref_mask = None if mask is None else mask[..., :40]  # transformers' SDPA wants exactly T columns
    want, _ = kvquant_attention(module, q, ref_view, ref_view, ref_mask, scaling=0.125)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_fused_attention_declines_what_it_does_not_serve(device):
    view = layer_with("int4-g32", n=10, device=device).view()
    q = torch.randn(2, 6, 1, 64, device=device)
    prefill = torch.randn(2, 6, 3, 64, device=device)
    assert dispatch.fused_attention(prefill, view, None, None) is None
    additive = torch.zeros(2, 1, 1, 10, device=device)
    assert dispatch.fused_attention(q, view, additive, None) is None
    short = torch.ones(2, 1, 1, 9, dtype=torch.bool, device=device)
    assert dispatch.fused_attention(q, view, short, None) is None
    rows = torch.ones(2, 1, 2, 10, dtype=torch.bool, device=device)
    assert dispatch.fused_attention(q, view, rows, None) is None
    assert dispatch.fused_attention(q[..., :48], view, None, None) is None  # head_dim not a power of two


def test_quantize_pack_entry_is_the_reference_bit_for_bit(device):
    x = torch.randn(1, 2, 8, 64, device=device)
    spec = kvquant.parse_scheme("int4-channel-g4").key
    got, want = dispatch.quantize_pack(x, spec), kvquant.quantize(x.cpu(), spec)
    assert torch.equal(got.codes.cpu(), want.codes) and torch.equal(got.scale.cpu(), want.scale)


@pytest.mark.parametrize("scheme", ["k=int4-channel-g8,v=int4-g32,sink=2,window=4", "int8"])
def test_generate_triton_equals_torch(tiny_model, scheme, monkeypatch, device):
    """generate with backend="triton" gives the torch backend's tokens and close logits; the kernels ran."""
    # tests/conftest.py: 2 layers, 6 query heads over 2 KV heads, head_dim 64 (on a GPU: a copy)
    tiny = tiny_model if device.type == "cpu" else copy.deepcopy(tiny_model).to(device)
    calls = {"attention": 0, "served": 0, "quantize": 0}
    fused, qpack = dispatch.fused_attention, dispatch.quantize_pack

    def spy_attention(*args):
        calls["attention"] += 1
        out = fused(*args)
        calls["served"] += out is not None
        return out

    def spy_quantize(*args):
        calls["quantize"] += 1
        return qpack(*args)

    monkeypatch.setattr(dispatch, "fused_attention", spy_attention)
    monkeypatch.setattr(dispatch, "quantize_pack", spy_quantize)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 1000, (2, 20), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # left padding in the second sequence
    ids, mask = ids.to(device), mask.to(device)
    outs = {}
    for backend in ("triton", "torch"):
        cache = kvquant.QuantizedCache(scheme, tiny.config, backend=backend)
        outs[backend] = tiny.generate(
            ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )
    assert torch.equal(outs["triton"].sequences, outs["torch"].sequences)
    for a, b in zip(outs["triton"].logits, outs["torch"].logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)  # fp32 model: kernels vs SDPA, same codes
    layers = tiny.config.num_hidden_layers
    assert calls["served"] == 3 * layers  # 3 decode steps (the first new token comes from the prefill)
    assert calls["quantize"] >= 2 * layers  # K and V bodies written through the kernel entry point
