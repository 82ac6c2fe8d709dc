"""One backend decision per layer and per call (kvquant.backend, issue 19 item 5): `layer_paths` decides when
a layer is built which of its appends and decode steps the kernels serve, `call_attends` what only a call
knows (one query token, the mask's form); nothing else decides it (the dispatch checks and raises). Triton
runs in its interpreter here (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import make_tiny_model

import kvquant
from kvquant import backend as backend_mod
from kvquant.backend import (
    REFERENCE,
    KernelHandle,
    attend_unserved,
    call_attends,
    call_unserved,
    layer_paths,
    uses_kernels,
)
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
    pre = codec_for("int4-g32-prerope", 2, 64, torch.float32)  # pre-RoPE keys without the model's RoPE
    with caplog.at_level(logging.INFO, logger="kvquant"):
        assert layer_paths("triton", CPU, pre, v, 64, handle) is REFERENCE
        layer_paths("triton", CPU, pre, v, 64, handle)
    lines = [r.getMessage() for r in caplog.records if "prerope" in r.getMessage()]
    assert len(lines) == 1, lines  # said once per cache however many layers meet it


def test_unserved_calls_and_layers_are_named():
    """The rules `layer_paths` and `call_attends` decide by (and the dispatch checks its calls by) name what
    the kernel does not serve."""
    k, v = codec_for("int4-g32", 2, 64, torch.float32), codec_for("int8", 2, 64, torch.float32)
    assert attend_unserved(k, v, 64, CPU) is None
    assert "head_dim 80" in attend_unserved(k, v, 80, CPU)
    assert "head_dim 8 " in attend_unserved(k, v, 8, CPU)
    pre = codec_for("int4-g32-prerope", 2, 64, torch.float32)
    assert "value codec" in attend_unserved(k, pre, 64, CPU)
    assert "key codec" in attend_unserved(pre, v, 64, CPU)
    q = torch.randn(2, 4, 1, 64)
    bool_mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    assert call_unserved(q, None, 9) is None and call_unserved(q.half(), bool_mask, 9) is None
    assert call_unserved(q.bfloat16(), bool_mask[:1], 9) is None  # a broadcast row
    assert "one token" in call_unserved(torch.randn(2, 4, 5, 64), None, 9)
    assert "fp16, bf16 or fp32" in call_unserved(q.double(), None, 9)
    assert "additive" in call_unserved(q, torch.zeros(2, 1, 1, 9), 9)
    assert "does not cover" in call_unserved(q, bool_mask, 10)
    assert call_attends(q, bool_mask, 9) and not call_attends(q, bool_mask, 10)


@pytest.mark.parametrize("scheme", ["int4-g32", "k=int4-g32-center-rot,v=int8"])
def test_a_generate_decides_once_per_layer_and_once_per_call(monkeypatch, scheme):
    """Six generated tokens over two layers: `layer_paths` runs twice (once per layer), `uses_kernels` and
    its device check only inside it; `call_attends` once per forward of a layer the kernel serves (the
    prefill goes to the reference, the five decode steps to the kernel), never for a layer it does not."""
    model = make_tiny_model(seed=3, num_hidden_layers=2)
    calls = {"paths": 0, "uses": 0, "device_check": 0}
    answers = []

    def spy(name, real):
        def wrapped(*a, **kw):
            calls[name] += 1
            return real(*a, **kw)
        return wrapped

    def spy_call(*a, **kw):
        answers.append(real_call(*a, **kw))
        return answers[-1]

    import kvquant.attention as attention_mod
    import kvquant.cache as cache_mod

    real_call = attention_mod.call_attends
    monkeypatch.setattr(cache_mod, "layer_paths", spy("paths", backend_mod.layer_paths))
    monkeypatch.setattr(backend_mod, "uses_kernels", spy("uses", backend_mod.uses_kernels))
    monkeypatch.setattr(backend_mod, "triton_runs_on", spy("device_check", backend_mod.triton_runs_on))
    monkeypatch.setattr(attention_mod, "call_attends", spy_call)
    ids = torch.randint(1, 5000, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = kvquant.QuantizedCache(scheme, model.config, backend="triton")
    with torch.no_grad():
        model.generate(ids, cache=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert calls == {"paths": 2, "uses": 2, "device_check": 2}
    attend = [layer.paths.attend for layer in cache.layers]
    assert attend == ([True, True] if scheme == "int4-g32" else [False, False])
    if scheme == "int4-g32":  # 6 forwards x 2 layers: the 2 prefill calls refused, the 10 decode steps served
        assert sorted(answers) == [False] * 2 + [True] * 10
    else:
        assert answers == []
