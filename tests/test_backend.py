"""One backend decision per layer (kvquant.backend, issue 19 item 5): `layer_paths` decides when a layer is
built which of its appends and decode steps the kernels serve; nothing decides it again per call. Triton
runs in its interpreter here (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import make_tiny_model

import kvquant
from kvquant import backend as backend_mod
from kvquant.backend import REFERENCE, KernelHandle, layer_paths, uses_kernels
from kvquant.codecs.base import codec_for

CPU = torch.device("cpu")


def test_triton_on_a_cpu_without_the_interpreter_is_refused_with_both_fixes(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1.*backend='torch'"):
        uses_kernels("triton", CPU)
    assert uses_kernels("auto", CPU) is False  # auto on the CPU is the reference, never an error
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert uses_kernels("triton", CPU) is True
    with pytest.raises(ValueError, match="known backends: auto, triton, torch"):
        uses_kernels("cuda", CPU)


def test_layer_paths_follow_backend_codecs_and_head_dim(caplog):
    k, v = codec_for("int4-g32", 2, 64, torch.float32), codec_for("int8", 2, 64, torch.float32)
    served = layer_paths("triton", CPU, k, v, 64, KernelHandle())
    assert served.encode and served.attend and served.registry is not None
    assert layer_paths("torch", CPU, k, v, 64, KernelHandle()) is REFERENCE
    assert layer_paths("auto", CPU, k, v, 64, KernelHandle()) is REFERENCE  # no CUDA here
    k48, v48 = codec_for("int4-g16", 2, 48), codec_for("int8", 2, 48)
    odd = layer_paths("triton", CPU, k48, v48, 48, KernelHandle())
    assert odd.encode and not odd.attend  # head_dim 48: appends by the kernel, decode by the reference
    handle = KernelHandle()
    pre = codec_for("int4-g32-prerope", 2, 64, torch.float32)  # no kernel reads pre-RoPE keys
    with caplog.at_level(logging.INFO, logger="kvquant"):
        assert layer_paths("triton", CPU, pre, v, 64, handle) is REFERENCE
        layer_paths("triton", CPU, pre, v, 64, handle)
    lines = [r.getMessage() for r in caplog.records if "prerope" in r.getMessage()]
    assert len(lines) == 1, lines  # said once per cache however many layers meet it


@pytest.mark.parametrize("scheme", ["int4-g32", "k=int4-g32-prerope,v=int8"])
def test_a_generate_decides_once_per_layer(monkeypatch, scheme):
    """Six generated tokens over two layers: `layer_paths` runs twice (once per layer) and `uses_kernels`
    only inside it; the dispatch's own device check is never consulted on the cache's path."""
    model = make_tiny_model(seed=3, num_hidden_layers=2)
    calls = {"paths": 0, "uses": 0, "device_check": 0}
    real_paths, real_uses = backend_mod.layer_paths, backend_mod.uses_kernels

    def spy_paths(*a, **kw):
        calls["paths"] += 1
        return real_paths(*a, **kw)

    def spy_uses(*a, **kw):
        calls["uses"] += 1
        return real_uses(*a, **kw)

    from kvquant.kernels import dispatch

    real_check = dispatch._triton_runs_on

    def spy_check(device):
        calls["device_check"] += 1
        return real_check(device)

    import kvquant.cache as cache_mod

    monkeypatch.setattr(cache_mod, "layer_paths", spy_paths)
    monkeypatch.setattr(backend_mod, "uses_kernels", spy_uses)
    monkeypatch.setattr(dispatch, "_triton_runs_on", spy_check)
    ids = torch.randint(1, 5000, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = kvquant.QuantizedCache(scheme, model.config, backend="triton")
    with torch.no_grad():
        model.generate(ids, cache=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert calls == {"paths": 2, "uses": 2, "device_check": 0}
    attend = [layer.paths.attend for layer in cache.layers]
    assert attend == ([True, True] if scheme == "int4-g32" else [False, False])
