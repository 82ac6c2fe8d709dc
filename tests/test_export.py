"""Calibrated FP8 k_scale / v_scale (kvquant.export, experiments/export_scales.py): computed on a tiny model,
written as vLLM / llm-compressor checkpoints carry them, read back, and bound to the vllm:fp8 codec."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvquant.codecs.base import codec_for
from kvquant.export import (
    FP8_MAX,
    KVScales,
    kv_absmax,
    kv_cache_scheme,
    load_kv_scales,
    save_kv_scales,
    scales_from_absmax,
)
from kvquant.scheme import SchemeError

ROOT = Path(__file__).resolve().parent.parent


def _ids(n: int = 2, t: int = 20) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 1000, (1, t), generator=g) for _ in range(n)]


def test_absmax_is_the_post_rope_kv_the_cache_receives(tiny_model):
    from transformers import DynamicCache

    batches = _ids()
    k, v = kv_absmax(tiny_model, batches)
    layers, heads = tiny_model.config.num_hidden_layers, tiny_model.config.num_key_value_heads
    assert k.shape == v.shape == (layers, heads) and k.dtype == torch.float32
    expect_k = torch.zeros(layers, heads)
    expect_v = torch.zeros(layers, heads)
    with torch.no_grad():
        for ids in batches:
            cache = DynamicCache(config=tiny_model.config)
            tiny_model(ids, cache=cache)
            for i, lay in enumerate(cache.layers):  # (B, H_kv, T, D), after RoPE
                expect_k[i] = torch.maximum(expect_k[i], lay.keys.abs().amax(dim=(0, 2, 3)))
                expect_v[i] = torch.maximum(expect_v[i], lay.values.abs().amax(dim=(0, 2, 3)))
    assert torch.equal(k, expect_k) and torch.equal(v, expect_v)


@pytest.mark.parametrize("strategy, shape", [("tensor", (1,)), ("attn_head", (2, 1, 1))])
def test_written_scales_read_back_with_vllms_names(tmp_path, tiny_model, strategy, shape):
    """Names model.layers.{i}.self_attn.{k,v}_scale (vLLM maybe_remap_kv_scale_name maps them onto
    self_attn.attn.k_scale), shape (1,) per tensor or (H_kv, 1, 1) per head (compressed-tensors
    initialize_qparams), the stored dtype; values max|x| / 448; the config.json fragment vLLM's
    CompressedTensorsKVCacheMethod accepts (num_bits 8, type float, symmetric, tensor | attn_head)."""
    k_amax, v_amax = kv_absmax(tiny_model, _ids())
    scales = scales_from_absmax(k_amax, v_amax, strategy)
    path = save_kv_scales(scales, tmp_path / "out", dtype=torch.bfloat16, metadata={"model": "tiny"})
    assert path.name == "kv_scales.safetensors"
    # readable by whoever may read its config fragment (an engine under another user): not save_file's 0600
    assert path.stat().st_mode & 0o777 == (path.parent / "kv_cache_scheme.json").stat().st_mode & 0o777
    with safe_open(str(path), framework="pt") as f:
        names = sorted(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
    layers = tiny_model.config.num_hidden_layers
    assert names == sorted(f"model.layers.{i}.self_attn.{r}_scale" for i in range(layers) for r in "kv")
    assert all(t.shape == shape and t.dtype == torch.bfloat16 for t in tensors.values())
    ref = (k_amax.amax(dim=1) if strategy == "tensor" else k_amax[0]) / FP8_MAX["e4m3"]
    got = tensors["model.layers.0.self_attn.k_scale"].float().flatten()
    want = (ref[0:1] if strategy == "tensor" else ref).bfloat16().float()
    assert torch.equal(got, want)
    back = load_kv_scales(path.parent)
    assert back.strategy == strategy and back.k.shape == scales.k.shape
    assert torch.equal(back.k, scales.k.bfloat16().float())
    assert torch.equal(back.v, scales.v.bfloat16().float())
    fragment = json.loads((path.parent / "kv_cache_scheme.json").read_text())
    assert fragment["quantization_config"]["kv_cache_scheme"] == kv_cache_scheme(strategy) == {
        "num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True
    }


def test_codec_takes_the_layer_scale(tmp_path):
    """VLLMCodec.bind reads `kv_scale(layer, role)`: layer 1's v_scale divides V before the E4M3 write."""
    scales = KVScales(torch.tensor([[0.5], [2.0]]), torch.tensor([[0.25], [4.0]]))
    save_kv_scales(scales, tmp_path)
    back = load_kv_scales(tmp_path)
    codec = codec_for("vllm:fp8", 1, 8, torch.float32, layer=1, role="v", calib=back)
    assert codec.scale == 4.0
    x = torch.full((1, 1, 1, 8), 1000.0)  # 1000 / 4 = 250 -> E4M3 256 -> 1024 (at scale 1.0: 448)
    assert codec.decode(codec.encode(x), torch.float32).unique().tolist() == [1024.0]
    assert codec_for("vllm:fp8", 1, 8, torch.float32).scale == 1.0  # no scales: vLLM's default


def test_bad_scale_files_fail_clearly(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.k_scale": torch.ones(1)}, str(tmp_path / "kv_scales.safetensors"))
    with pytest.raises(SchemeError, match="missing for layers 0.v"):
        load_kv_scales(tmp_path)
    with pytest.raises(SchemeError, match="no scales file"):
        load_kv_scales(tmp_path / "nowhere")
    with pytest.raises(SchemeError, match="positive and finite"):
        KVScales(torch.zeros(2, 1), torch.ones(2, 1))
    with pytest.raises(SchemeError, match="one scale per layer"):
        KVScales(torch.ones(2, 3), torch.ones(2, 3)).kv_scale(0, "k")


def test_export_command_refuses_bad_arguments_before_loading():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "export_scales.py"), "--out", "x", "--docs", "0"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2 and "--docs 0 must be at least 1" in proc.stderr


def test_scheme_calib_scores_exactly_the_written_scales(tmp_path, tiny_model):
    """`vllm:fp8,calib=DIR/kv_scales.safetensors` (recommend.py --export's calibrated row): the cache loads
    the file once and every layer's codec divides by that layer's k_scale / v_scale. A deliberately large
    layer-1 k_scale (64: the keys fall to E4M3's subnormals) changes layer 1's stored key codes from scale
    1.0's to exactly the E4M3 write of K / 64."""
    from transformers import DynamicCache

    from kvquant import QuantizedCache
    from kvquant.codecs.engine_vllm import vllm_quantize
    from kvquant.scheme import parse_scheme

    layers = tiny_model.config.num_hidden_layers
    k = torch.ones(layers, 1)
    k[1] = 64.0
    v = torch.full((layers, 1), 0.5)
    path = save_kv_scales(KVScales(k, v), tmp_path)
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        dyn = DynamicCache(config=tiny_model.config)
        tiny_model(ids, cache=dyn)
        cache = QuantizedCache(parse_scheme(f"layers=0:fp16+1:vllm:fp8,calib={path}"), tiny_model.config,
                               backend="torch")
        tiny_model(ids, cache=cache)
    layer = cache.layers[1]
    assert (layer.key_codec.scale, layer.value_codec.scale) == (64.0, 0.5)
    st = layer.stored()
    n = st.key_fields["codes"].shape[2]
    keys = dyn.layers[1].keys[:, :, :n]  # layer 1's input does not depend on layer 1's cache; layer 0 is FP
    assert torch.equal(st.key_fields["codes"], vllm_quantize(keys, "vllm:fp8_e4m3", 64.0)[0])
    assert not torch.equal(st.key_fields["codes"], vllm_quantize(keys, "vllm:fp8_e4m3", 1.0)[0])
    vals = dyn.layers[1].values[:, :, :n]
    assert torch.equal(st.value_fields["codes"], vllm_quantize(vals, "vllm:fp8_e4m3", 0.5)[0])


def test_scale_files_are_checked_against_model_and_scheme(tmp_path, tiny_model):
    from kvquant import QuantizedCache
    from kvquant.calibfile import CalibrationError
    from kvquant.scheme import parse_scheme

    layers = tiny_model.config.num_hidden_layers
    path = save_kv_scales(KVScales(torch.ones(layers + 1, 1), torch.ones(layers + 1, 1)), tmp_path / "a")
    with pytest.raises(CalibrationError, match=f"{layers + 1} layers, but the model has {layers}"):
        QuantizedCache(parse_scheme(f"vllm:fp8,calib={path}"), tiny_model.config)
    good = save_kv_scales(KVScales(torch.ones(layers, 1), torch.ones(layers, 1)), tmp_path / "b")
    with pytest.raises(CalibrationError, match="no spec of 'int8,calib=.*' reads them"):
        QuantizedCache(parse_scheme(f"int8,calib={good}"), tiny_model.config)
    with pytest.raises(CalibrationError, match="FP8 e4m3 .* the scheme stores e5m2"):
        QuantizedCache(parse_scheme(f"vllm:fp8_e5m2,calib={good}"), tiny_model.config)
    heads = KVScales(torch.ones(layers, 2), torch.ones(layers, 2), "attn_head")
    per_head = save_kv_scales(heads, tmp_path / "c")
    with pytest.raises(CalibrationError, match="per-head"):
        QuantizedCache(parse_scheme(f"vllm:fp8,calib={per_head}"), tiny_model.config)


def test_run_harness_accepts_a_scale_file_without_json(tmp_path):
    """eval.config.check_calib_file (torch-free, before a run loads anything): a file of k/v scale tensors
    needs no kvquant calibration JSON beside it; a file of other tensors still does."""
    from kvquant.eval.config import RunError, check_calib_file
    from safetensors.torch import save_file

    path = save_kv_scales(KVScales(torch.ones(2, 1), torch.ones(2, 1)), tmp_path)
    check_calib_file(str(path), "vllm:fp8")
    save_file({"codebook/0/k/nuq4": torch.zeros(16)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(RunError, match="other.json does not exist"):
        check_calib_file(str(tmp_path / "other.safetensors"))
