"""The first-use self-check (kvquant.kernels.registry.KernelRegistry.trusted): a variant is probed once per
device against its twin before it serves; a deliberately wrong variant (a kernel wrapper that perturbs
what the real kernel wrote) is caught, logged once, disabled, and the reference path serves its calls."""

from __future__ import annotations

import inspect
import logging
import re

import pytest
import torch
from kvquant.kernels import decode_attention as da
from kvquant.kernels import dispatch
from kvquant.kernels import pack_engine as pe
from kvquant.kernels import quantize_pack as qp
from kvquant.kernels.quantize_pack import random_pools
from kvquant.kernels.registry import KernelRegistry, SelfCheck
from kvquant.kernels.testing import make_paged_layer, with_demo_levels

from kvquant.codecs.base import codec_for


class Perturbed:
    """A wrong kernel: launches the real one, then corrupts argument `index` (a tensor) with `damage`."""

    def __init__(self, kernel, index: int, damage):
        self.kernel, self.index, self.damage = kernel, index, damage
        self.fn = kernel.fn  # the registry names a kernel by fn.__name__

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kernel[grid](*args, **kwargs)
            self.damage(args[self.index])
        return launch


def _bump_out(out: torch.Tensor) -> None:  # one output element of the reduce kernel off by 0.05
    out.view(-1)[3] += 0.05


def _layer(device, **kw):
    return make_paged_layer(k="int4-g32", v="int8", sink=2, body=64, recent=3, recent_offset=2,
                            dtype=torch.float16, device=device, **kw)


def _query(layer, device, seed=5):
    b, h_kv, _, d = layer.shape
    return torch.randn(b, 2 * h_kv, 1, d, generator=torch.Generator().manual_seed(seed)).half().to(device)


def _warnings(caplog):
    return [r for r in caplog.records if "disagrees with its reference twin" in r.getMessage()]


def test_a_correct_variant_is_probed_once_and_then_trusted(device, monkeypatch):
    check = KernelRegistry("t", self_check=SelfCheck(enabled=True))
    probes = []
    real = da._probe
    monkeypatch.setattr(da, "_probe", lambda *a: probes.append(1) or real(*a))
    layer = _layer(device)
    q = _query(layer, device)
    got = [da.decode_attention(q, *layer.decode_args(), registry=check) for _ in range(3)]
    plain = da.decode_attention(q, *layer.decode_args(), registry=KernelRegistry("u", SelfCheck(False)))
    assert len(probes) == 1  # the first call only: a benchmark that warms up never times it
    assert all(g is not None and torch.equal(g, plain) for g in got)
    (key, verdict), = check.self_check.verdicts.items()
    assert key[0] == "decode_attention" and key[2] == str(device) and verdict is None
    assert check.self_check.seconds[key] > 0


def test_a_wrong_attention_variant_is_caught_logged_once_and_served_by_the_reference(device, monkeypatch,
                                                                                   caplog):
    monkeypatch.setattr(da, "_reduce_kernel", Perturbed(da._reduce_kernel, 3, _bump_out))
    check = KernelRegistry("t", self_check=SelfCheck(enabled=True))
    layer = _layer(device)
    q = _query(layer, device)
    with caplog.at_level(logging.WARNING, logger="kvquant.kernels"):
        for _ in range(2):
            assert dispatch.fused_attention(q, layer, None, None, registry=check) is None  # -> reference
    (msg,) = [r.getMessage() for r in _warnings(caplog)]
    err = float(re.search(r"max \|out - ref32\| = ([0-9.e-]+)", msg).group(1))
    assert 0.045 < err < 0.055 and "query head" in msg and "channel" in msg  # the 0.05 the wrapper added
    assert len(check.self_check.disabled()) == 1
    # the same wrong kernel without the check serves a wrong answer: the probe is what stopped it
    unchecked = da.decode_attention(q, *layer.decode_args(), registry=KernelRegistry("u", SelfCheck(False)))
    ref32 = da.decode_attention_ref(q, *layer.decode_args(), upcast=True)
    assert (unchecked.float() - ref32).abs().max().item() > 0.04


def test_a_wrong_pack_variant_is_caught_and_the_pages_are_the_reference(device, monkeypatch, caplog):
    def flip(codes: torch.Tensor) -> None:
        codes.view(-1)[::7] ^= 1

    monkeypatch.setattr(qp, "_quantize_token_kernel", Perturbed(qp._quantize_token_kernel, 1, flip))
    check = KernelRegistry("t", self_check=SelfCheck(enabled=True))
    codec = codec_for("int4-g32", 2, 64, torch.float16)
    pools = {n: torch.zeros(4, f.heads, 16 // f.tokens, f.cols, dtype=f.dtype)
             for n, f in codec.fields().items()}
    want = {n: p.clone() for n, p in pools.items()}
    got = {n: p.to(device) for n, p in pools.items()}
    table = torch.tensor([[3, 1], [0, 2]])
    x = torch.randn(2, 2, 9, 64, generator=torch.Generator().manual_seed(2)).half()
    with caplog.at_level(logging.WARNING, logger="kvquant.kernels"):
        for start in (0, 9):  # two appends: one probe, one log line
            dispatch.quantize_pack_into(x[:, :, :7].to(device) if start else x.to(device), codec, got,
                                        table.to(device), start, registry=check)
    qp.quantize_pack_into_ref(x, codec, want, table, 0)
    qp.quantize_pack_into_ref(x[:, :, :7], codec, want, table, 9)
    for n in want:
        assert torch.equal(got[n].cpu(), want[n]), n
    (msg,) = [r.getMessage() for r in _warnings(caplog)]
    assert "quantize_pack" in msg and "codes:" in msg and "elements differ" in msg


def test_who_is_checked(monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv("KVQUANT_SELF_CHECK", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert SelfCheck().wanted(cuda) and not SelfCheck().wanted(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not SelfCheck().wanted(cpu)  # the interpreter: only when asked
    monkeypatch.setenv("KVQUANT_SELF_CHECK", "1")
    assert SelfCheck().wanted(cpu)
    monkeypatch.setenv("KVQUANT_SELF_CHECK", "0")
    assert not SelfCheck().wanted(cuda) and SelfCheck(enabled=True).wanted(cuda)
    # a stand-in registry without `trusted` (bench_decode's recorder) still launches: no probe, no error
    r = KernelRegistry("t", SelfCheck(enabled=True))
    r.self_check.verdicts[("k", 1, "cpu")] = "wrong"
    assert not r.trusted("k", 1, cpu, lambda: pytest.fail("a verdict is never re-probed"))


@pytest.mark.parametrize("scheme", ["int4-g32"])
def test_generate_with_a_wrong_kernel_equals_the_torch_backend(scheme, device, monkeypatch, caplog):
    """Through the cache: the process's self-check (KVQUANT_SELF_CHECK=1) catches the wrong reduce kernel
    on its first call, every decode step falls back to the reference, and generation equals the torch
    backend's."""
    if device.type != "cpu":
        pytest.skip("the cache end to end runs under the interpreter here")
    from kvquant.kernels import registry as reg
    from tiny_models import make_tiny_model

    import kvquant

    monkeypatch.setenv("KVQUANT_SELF_CHECK", "1")
    monkeypatch.setattr(reg, "_SELF_CHECK", SelfCheck())
    monkeypatch.setattr(da, "_reduce_kernel", Perturbed(da._reduce_kernel, 3, _bump_out))
    model = make_tiny_model(seed=3, num_hidden_layers=2)
    ids = torch.randint(1, 5000, (2, 21), generator=torch.Generator().manual_seed(0))

    def run(backend):
        cache = kvquant.QuantizedCache(scheme, model.config, backend=backend)
        with torch.no_grad():
            return model.generate(ids, cache=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True)

    ref = run("torch")
    with caplog.at_level(logging.WARNING, logger="kvquant.kernels"):
        got = run("triton")
    assert torch.equal(got.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), rtol=0, atol=1e-6)
    assert len(_warnings(caplog)) == 1  # two layers, three decode steps: one probe, one line
    assert [k[0] for k in reg.process_self_check().disabled()] == ["decode_attention"]


# ------------------------------------------------------------------------------- the new pack kernels


def _flip(pool: torch.Tensor) -> None:  # every 7th byte off by one bit
    pool.view(-1)[::7] ^= 1


def _bump(pool: torch.Tensor) -> None:  # every 5th scale off by a unit
    pool.view(-1)[::5] += 1


WRONG_PACKS = [  # (spec, module, kernel, the argument damaged, damage), one per new kind of variant
    ("fp8-e4m3-g32", qp, "_quantize_token_kernel", "codes_ptr", _flip),
    ("nuq3-channel-g16", qp, "_quantize_channel_kernel", "scale_ptr", _bump),
    ("int4-g32-center16-out1", qp, "_quantize_token_kernel", "oi_ptr", _flip),  # the outliers' channels
    ("llama.cpp:q4_1-norot", pe, "_engine_kernel", "blocks_ptr", _flip),  # GGUF block bytes
]


@pytest.mark.parametrize("spec,module,name,arg,damage", WRONG_PACKS, ids=[w[0] for w in WRONG_PACKS])
def test_a_wrong_new_pack_variant_is_caught(spec, module, name, arg, damage, device, monkeypatch, caplog):
    """FP8, codebook, -center / -outP and GGUF block variants: a kernel that writes wrong bytes is caught by
    its first-use probe, logged once, and every append (the probed one included) is the reference's."""
    kernel = getattr(module, name)
    index = list(inspect.signature(kernel.fn).parameters).index(arg)
    monkeypatch.setattr(module, name, Perturbed(kernel, index, damage))
    check = KernelRegistry("t", self_check=SelfCheck(enabled=True))
    codec = with_demo_levels(codec_for(spec, 2, 64, torch.float16))
    g = codec.token_group
    pools = random_pools(codec, 6, max(16, g), torch.Generator().manual_seed(0))
    want = {n: p.clone() for n, p in pools.items()}
    got = {n: p.to(device) for n, p in pools.items()}
    table = torch.tensor([[3, 1, 5], [0, 2, 4]])
    x = torch.randn(2, 2, 2 * g if g > 1 else 9, 64, generator=torch.Generator().manual_seed(2)).half()
    with caplog.at_level(logging.WARNING, logger="kvquant.kernels"):
        for start, part in ((0, x[:, :, : x.shape[2] // 2]), (x.shape[2] // 2, x[:, :, x.shape[2] // 2 :])):
            dispatch.quantize_pack_into(part.to(device), codec, got, table.to(device), start, registry=check)
            qp.quantize_pack_into_ref(part, codec, want, table, start)
    assert not qp.pool_differences({n: p.cpu() for n, p in got.items()}, want)
    (msg,) = [r.getMessage() for r in _warnings(caplog)]
    assert "quantize_pack" in msg and "elements differ" in msg
    ((_, variant, _),) = check.self_check.disabled()
    assert variant[0] == name


PACK_VARIANTS = ["fp8-e5m2-channel-g16", "nuq3-g64-center16-out1", "mxfp4"]


@pytest.mark.parametrize("spec", PACK_VARIANTS)
def test_a_correct_new_pack_variant_passes_its_probe(spec, device):
    check = KernelRegistry("t", self_check=SelfCheck(enabled=True))
    codec = with_demo_levels(codec_for(spec, 2, 64, torch.float16))
    g = codec.token_group
    pools = random_pools(codec, 4, max(16, g), torch.Generator().manual_seed(0))
    x = torch.randn(1, 2, g, 64, generator=torch.Generator().manual_seed(3)).half()
    table = torch.tensor([[2]]).to(device)
    for _ in range(2):  # probed on the first call only
        got = {n: p.to(device) for n, p in pools.items()}
        dispatch.quantize_pack_into(x.to(device), codec, got, table, 0, registry=check)
    (key, verdict), = check.self_check.verdicts.items()
    assert key[0] == "quantize_pack" and verdict is None and check.self_check.seconds[key] > 0
