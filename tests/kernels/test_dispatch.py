"""The entry points the cache calls, against stand-in layer views (kvquant.kernels.testing.PagedLayer has
exactly the attributes kvquant.cache.LayerView exposes): masks, what it refuses (the backend's to decide),
the build-failure memo."""

from __future__ import annotations

import logging

import pytest
import torch
from kvquant.kernels import dispatch
from kvquant.kernels.decode_attention import decode_attention_ref
from kvquant.kernels.registry import KernelRegistry
from kvquant.kernels.testing import make_paged_layer

from kvquant.backend import KernelHandle, call_attends, layer_paths


def decode_mask(kind: str, t: int, device) -> torch.Tensor | None:
    if kind == "none":
        return None
    valid = torch.ones(2, t, dtype=torch.bool)
    if kind == "left_padding":
        valid[1, :7] = False
    elif kind == "broadcast":
        valid = (torch.arange(t) % 5 != 2)[None]
    elif kind == "longer":  # more columns than tokens: only the first T count
        valid = torch.cat([valid, torch.zeros(2, 3, dtype=torch.bool)], dim=1)
        valid[0, :4] = False
    return valid[:, None, None, :].to(device)


@pytest.mark.parametrize("kind", ["none", "left_padding", "broadcast", "longer"])
def test_fused_attention_matches_the_reference(kind, device):
    layer = make_paged_layer(k="int4-channel-g8", v="int4-g32", sink=2, body=32, recent=4, recent_offset=6,
                             dtype=torch.float32, device=device)
    q = torch.randn(2, 6, 1, 64, device=device)
    mask = decode_mask(kind, layer.shape[2], device)
    got = dispatch.fused_attention(q, layer, mask, 0.125)
    assert got is not None
    key_mask = None if mask is None else mask[:, 0, 0, : layer.shape[2]]
    want = decode_attention_ref(q, *layer.decode_args(), 0.125, key_mask, upcast=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_what_the_kernel_does_not_serve_the_backend_sends_to_the_reference_and_dispatch_refuses(device):
    """The calls the dispatch used to decline: `kvquant.backend` answers "reference path" for each (per call:
    `call_attends`; per layer: `layer_paths`), and the dispatch, called anyway, raises naming the problem
    and the backend instead of choosing a path itself."""
    layer = make_paged_layer(body=16, dtype=torch.float32, device=device)
    t = layer.shape[2]
    q = torch.randn(2, 6, 1, 64, device=device)
    calls = {  # what: (query, mask), the problem named
        "prefill chunk": ((torch.randn(2, 6, 3, 64, device=device), None), "one token per sequence"),
        "fp64 query": ((q.double(), None), "fp16, bf16 or fp32"),
        "float mask": ((q, torch.zeros(2, 1, 1, t, device=device)), "must be bool"),
        "short mask": ((q, torch.ones(2, 1, 1, t - 1, dtype=torch.bool, device=device)), "does not cover"),
        "mask rows": ((q, torch.ones(2, 1, 2, t, dtype=torch.bool, device=device)), "for one query token"),
        "mask batch": ((q, torch.ones(3, 1, 1, t, dtype=torch.bool, device=device)), "does not cover"),
    }
    for what, ((query, mask), problem) in calls.items():
        assert not call_attends(query, mask, t), what
        with pytest.raises(ValueError, match=f"{problem}.*kvquant.backend"):
            dispatch.fused_attention(query, layer, mask, None)
    assert call_attends(q, None, t) and call_attends(q, torch.ones(1, 1, 1, t + 3, dtype=torch.bool), t)

    layer48 = make_paged_layer(body=16, d=48, k="int4-g16", v="int8", dtype=torch.float32, device=device)
    paths48 = layer_paths("triton", device, layer48.key_codec, layer48.value_codec, 48, KernelHandle())
    assert paths48.encode and not paths48.attend
    with pytest.raises(ValueError, match="head_dim 48 is not a power of two.*layer_paths"):
        dispatch.fused_attention(q[..., :48], layer48, None, None)

    class NoKernel(type(layer.key_codec)):
        def kernel_layout(self):
            return None

    unserved = make_paged_layer(body=16, dtype=torch.float32, device=device)
    unserved.key_codec.__class__ = NoKernel
    paths = layer_paths("triton", device, unserved.key_codec, unserved.value_codec, 64, KernelHandle())
    assert not paths.attend
    with pytest.raises(ValueError, match="cannot read the key codec.*layer_paths"):
        dispatch.fused_attention(q, unserved, None, None)
    assert dispatch.fused_attention(q, layer, None, None) is not None  # the same call on a served layer


def test_a_variant_that_cannot_be_built_is_refused_once_per_registry(monkeypatch, caplog):
    """OutOfResources at launch: logged once, answered False (-> reference path) without retrying."""
    from kvquant.kernels import registry as reg
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(reg, "is_build_failure", lambda exc: isinstance(exc, OutOfResources))
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(grid)
                raise OutOfResources(300000, 232448, "shared memory")
            return launch

    r, kernel = KernelRegistry("test"), Kernel()
    with caplog.at_level(logging.WARNING, logger="kvquant.kernels"):
        assert r.launch(kernel, (1,), (), {}, ("v", 1)) is False
        assert r.launch(kernel, (1,), (), {}, ("v", 1)) is False
    assert len(calls) == 1 and len(caplog.records) == 1
    assert KernelRegistry("other").launch(kernel, (1,), (), {}, ("v", 1)) is False  # its own memo
    assert len(calls) == 2
    with pytest.raises(ValueError):  # a wrong argument is not a build failure: it propagates

        class Bad:
            def __getitem__(self, grid):
                return lambda *a, **k: (_ for _ in ()).throw(ValueError("bad"))

        r.launch(Bad(), (1,), (), {}, ("w",))


def test_quantize_pack_into_entry_is_the_reference_bit_for_bit(device):
    from kvquant.kernels.quantize_pack import quantize_pack_into_ref

    from kvquant.codecs.base import codec_for

    codec = codec_for("int4-channel-g4", 2, 64, torch.float32)
    x = torch.randn(1, 2, 8, 64)
    pools = {n: torch.zeros(3, f.heads, 16 // f.tokens, f.cols, dtype=f.dtype)
             for n, f in codec.fields().items()}
    want = {n: p.clone() for n, p in pools.items()}
    got = {n: p.to(device) for n, p in pools.items()}
    table = torch.tensor([[2, 0]])
    dispatch.quantize_pack_into(x.to(device), codec, got, table.to(device), 4)
    quantize_pack_into_ref(x, codec, want, table, 4)
    for n in want:
        assert torch.equal(got[n].cpu(), want[n])
