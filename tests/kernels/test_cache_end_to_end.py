"""The cache with the kernels forced on (Triton's interpreter on the CPU): every decode step goes through
the paged fused attention, every body append through quantize_pack_into, and generation matches the
PyTorch reference token for token (logits to 1e-4); the pages the kernels wrote are the reference's bit
for bit. Rotated schemes included."""

from __future__ import annotations

import logging

import pytest
import torch
from kvquant.kernels import dispatch
from tiny_models import make_tiny_model

import kvquant

SCHEMES = [
    "int4-g32",
    "k=int4-channel-g16,v=int8,sink=2,window=4",
    "fp16,sink=2,window=4",
    "int4-g64-rot",  # rotated: the kernels work in the rotated frame (kvquant.codecs.transforms.kernel_frame)
    "k=int4-channel-g16-rot,v=int4-g32-rot5,sink=2,window=4",
]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3, num_hidden_layers=2)


def _generate(model, ids, scheme, backend):
    cache = kvquant.QuantizedCache(scheme, model.config, backend=backend)
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out, cache


@pytest.mark.parametrize("scheme", SCHEMES)
def test_generate_with_kernels_matches_the_reference(model, scheme, monkeypatch, caplog):
    ids = torch.randint(1, 5000, (2, 21), generator=torch.Generator().manual_seed(0))
    ref, ref_cache = _generate(model, ids, scheme, "torch")
    calls = {"attention": 0, "served": 0, "append": 0}
    attend, append = dispatch.fused_attention, dispatch.quantize_pack_into

    def spy_attention(*args, **kwargs):
        calls["attention"] += 1
        out = attend(*args, **kwargs)
        calls["served"] += out is not None
        return out

    def spy_append(*args, **kwargs):
        calls["append"] += 1
        return append(*args, **kwargs)

    monkeypatch.setattr(dispatch, "fused_attention", spy_attention)
    monkeypatch.setattr(dispatch, "quantize_pack_into", spy_append)
    with caplog.at_level(logging.INFO, logger="kvquant"):
        got, cache = _generate(model, ids, scheme, "triton")
    assert torch.equal(got.sequences, ref.sequences)
    # a tiny random model's greedy tokens barely depend on attention; its logits do (fp32 throughout; an
    # unrotated query in the rotated frame moves them by ~5e-2, the kernel path agrees to ~1e-6)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), rtol=0, atol=1e-4)
    assert calls["served"] == 5 * 2  # every decode step (6 new tokens: 5 after the prefill) of both layers
    assert calls["attention"] == calls["served"]  # the prefill never reaches the dispatch (backend: no)
    if kvquant.parse_scheme(scheme).key.is_quantized:
        assert calls["append"] > 0
    assert not [r for r in caplog.records if "no Triton kernel reads" in r.getMessage()]  # no fallback
    # layer 0's K/V depend only on the tokens (equal), so the pages the kernel wrote equal the reference's;
    # deeper layers see attention outputs that agree only to rounding, so their scales may differ in ulps
    a, b = cache.layers[0].stored(), ref_cache.layers[0].stored()
    for name in a.key_fields:
        assert torch.equal(a.key_fields[name], b.key_fields[name]), name
    for name in a.value_fields:
        assert torch.equal(a.value_fields[name], b.value_fields[name]), name
    for layer in cache.layers:
        layer.check()


# ------------------------------------------------------------------------------- the new pack kernels

PACK_SCHEMES = [  # (scheme, whether the decode kernel reads it too)
    ("k=fp8-e4m3-channel-g16,v=fp8-e5m2-tensor-out1,sink=2,window=4", True),
    ("k=nuq3-channel-g16-center16,v=nuq4-g32-out2,window=4", True),  # stand-in calibration levels
    ("k=int4-g32-center16-out1,v=fp8-e4m3-g32,sink=2", True),
    ("k=llama.cpp:q4_0,v=nvfp4,window=4", True),  # GGUF blocks: appends packed, read in place too
]


@pytest.mark.parametrize("scheme,attends", PACK_SCHEMES, ids=[s for s, _ in PACK_SCHEMES])
def test_pack_kernels_fill_the_cache_with_the_torch_backends_bytes(model, scheme, attends, tmp_path,
                                                                   monkeypatch, device):
    """Every body append of both layers goes through a pack kernel (counted at the registry's launch), and
    the pages hold exactly what the torch backend's encoder wrote: layer 0 always (its K/V depend on the
    tokens only), every layer when attention is the reference's on both backends."""
    if device.type != "cpu":
        pytest.skip("the cache end to end runs under the interpreter here (on a GPU: gpu_check's e2e phase)")
    from kvquant.kernels.registry import KernelRegistry
    from kvquant.kernels.testing import demo_calibration

    if "nuq" in scheme:
        scheme = f"{scheme},calib={demo_calibration(tmp_path / 'levels.safetensors', scheme, model.config)}"
    ids = torch.randint(1, 5000, (2, 21), generator=torch.Generator().manual_seed(1))
    ref, ref_cache = _generate(model, ids, scheme, "torch")
    appends, launches = [], {}
    append, launch = dispatch.quantize_pack_into, KernelRegistry.launch

    def spy_append(*args, **kwargs):
        appends.append(args[1].spec)
        return append(*args, **kwargs)

    def spy_launch(self, kernel, *args, **kwargs):
        ok = launch(self, kernel, *args, **kwargs)
        name = kernel.fn.__name__
        launches[name] = launches.get(name, 0) + ok
        return ok

    monkeypatch.setattr(dispatch, "quantize_pack_into", spy_append)
    monkeypatch.setattr(KernelRegistry, "launch", spy_launch)
    got, cache = _generate(model, ids, scheme, "triton")
    assert torch.equal(got.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), rtol=0, atol=1e-4)
    pack_kernels = ("_quantize_token_kernel", "_quantize_channel_kernel", "_engine_kernel")
    packed = sum(launches.get(k, 0) for k in pack_kernels)
    assert appends and packed == len(appends), (launches, len(appends))  # the kernel served every append
    assert ("_paged_split_kernel" in launches) == attends
    for i in range(len(cache.layers) if not attends else 1):
        a, b = cache.layers[i].stored(), ref_cache.layers[i].stored()
        for name in a.key_fields:
            assert torch.equal(a.key_fields[name], b.key_fields[name]), (i, name)
        for name in a.value_fields:
            assert torch.equal(a.value_fields[name], b.value_fields[name]), (i, name)
