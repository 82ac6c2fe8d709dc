"""Models across devices: `load_model(..., device_map=)` (accelerate's big-model loading) on the CPU.

A map of every module to `cpu` goes through the same loading code as a cuda:0 / CPU split (the GPU form
is benchmarks/gpu_device_map.py, run by benchmarks/gpu_check.sh); accelerate's hooks, which move
activations between a split model's devices, are forced on here to exercise them on one device. The pages
of each layer must be created where that layer's K/V are, and the tokens must equal the unmapped run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

import kvquant
from kvquant import models

LAYERS = 3


def save_tiny(path, layers: int = LAYERS, **overrides):
    """A tiny Llama folder with a word-level tokenizer (no default model needed)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    words = "the cache of keys and values grows with every token while four bits per value fit".split()
    vocab = {"<unk>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   pad_token="<unk>")
    model = make_tiny_model(seed=5, num_hidden_layers=layers, vocab_size=64, **overrides)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def cpu_map(layers: int = LAYERS) -> dict[str, str]:
    names = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(layers))]
    return {**dict.fromkeys(names, "cpu"), "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-map"))


def generate(model, scheme="int4-g32,window=8", n=12):
    torch.manual_seed(0)
    ids = torch.randint(2, 18, (2, 20)).to(models.input_device(model))
    cache = kvquant.QuantizedCache(scheme, model.config)
    out = model.generate(ids, cache=cache, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out, cache


@pytest.mark.parametrize("as_file", [True, False])
def test_map_over_the_cpu_places_pages_and_keeps_tokens(tmp_path, tiny_dir, as_file):
    plain, _ = kvquant.load_model(tiny_dir)
    spec = cpu_map()
    if as_file:
        (tmp_path / "map.json").write_text(json.dumps(spec))
        spec = str(tmp_path / "map.json")
    mapped, _ = kvquant.load_model(tiny_dir, device_map=spec)
    # one device: transformers places the modules without accelerate's hooks (and no hf_device_map)
    assert models.layer_devices(mapped) == (torch.device("cpu"),) * LAYERS
    assert mapped.config._attn_implementation == kvquant.ATTN_IMPLEMENTATION and not mapped.training
    want, _ = generate(plain)
    got, cache = generate(mapped)
    assert torch.equal(got, want)
    assert models.check_pages_placed(mapped, cache) == dict.fromkeys(range(LAYERS), "cpu")
    by_device = models.nbytes_by_device(cache)
    assert by_device == {"cpu": cache.nbytes()} and cache.nbytes() > 0


def test_forced_hooks_move_activations_and_keep_tokens(tiny_dir):
    """accelerate's AlignDevicesHook on every mapped module (what a split model runs through): the cache
    passes by reference (transformers' skip key), every layer writes its own pages, tokens unchanged."""
    from accelerate import dispatch_model

    plain, _ = kvquant.load_model(tiny_dir)
    want, _ = generate(plain)
    hooked, _ = kvquant.load_model(tiny_dir)
    dispatch_model(hooked, cpu_map(), force_hooks=True, skip_keys=hooked._skip_keys_device_placement)
    assert all(hasattr(hooked.get_submodule(name), "_hf_hook") for name in cpu_map())
    got, cache = generate(hooked)
    assert torch.equal(got, want)
    assert sorted(models.check_pages_placed(hooked, cache)) == list(range(LAYERS))


def test_check_pages_placed_names_a_misplaced_layer(tiny_dir):
    model, _ = kvquant.load_model(tiny_dir)
    _, cache = generate(model, n=2)
    layer = cache.layers[1]
    layer.body_pool.tensors = {k: t.to("meta") for k, t in layer.body_pool.tensors.items()}
    with pytest.raises(ValueError, match=r"layer 1: pool .* is on meta, but the layer's weights are on cpu"):
        models.check_pages_placed(model, cache)


def test_strategies_load_on_the_cpu(tiny_dir):
    plain, _ = kvquant.load_model(tiny_dir)
    want, _ = generate(plain, n=4)
    for strategy in ("auto", "balanced"):
        model, _ = kvquant.load_model(tiny_dir, device_map=strategy)
        assert {str(p.device) for p in model.parameters()} == {"cpu"}
        assert torch.equal(generate(model, n=4)[0], want)


@pytest.mark.parametrize(
    "spec, error, match",
    [
        ("everywhere", FileNotFoundError, "neither a strategy .*auto, balanced"),
        ({"model.layers.0": "disk"}, ValueError, "offloading to disk is not supported"),
        ({"model.layers.0": "meta"}, ValueError, "offloading to meta"),
        ({"model.layers.0": "gpu0"}, ValueError, "'gpu0' is not a device"),
        ({}, ValueError, "is empty"),
        (3, TypeError, "strategy name, a JSON file path or a dict"),
    ],
)
def test_bad_maps_fail_clearly(spec, error, match):
    with pytest.raises(error, match=match):
        models.parse_device_map(spec)


def test_bad_map_files_fail_clearly(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        models.parse_device_map(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        models.parse_device_map(str(tmp_path / "list.json"))
    assert models.parse_device_map({"lm_head": 0, "model": "cuda:1"}) == {"lm_head": 0, "model": "cuda:1"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_in_the_map_without_cuda_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="sees no CUDA device; map it to cpu"):
        kvquant.load_model(tiny_dir, device_map={**cpu_map(), "model.layers.1": "cuda:0"})


def test_incomplete_map_is_refused(tiny_dir):
    partial = {k: v for k, v in cpu_map().items() if k != "model.layers.1"}
    with pytest.raises(ValueError, match=r"leaves 'model.layers.1.self_attn.q_proj.weight' .* unplaced"):
        kvquant.load_model(tiny_dir, device_map=partial)
    with pytest.raises(ValueError, match=r"'model.layer.1', which is not a module .*'model.layers.1'"):
        kvquant.load_model(tiny_dir, device_map={**cpu_map(), "model.layer.1": "cpu"})


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_gpu_check_devmap_phase_dry_run(tmp_path):
    """gpu_check.sh's devmap phase on the CPU (benchmarks/gpu_device_map.py --dry-run): same tokens through
    the map, pages where each layer is, an Engine serving the mapped model on one store, int4-g64 under half
    the reference's bytes; devmap.json written."""
    out = tmp_path / "check"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_PHASES": "devmap", "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "benchmarks" / "gpu_check.sh")
    proc = subprocess.run(["bash", script, "--dry-run"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + (out / "devmap.log").read_text()[-3000:]
    result = json.loads((out / "devmap.json").read_text())
    placement, memory = result["placement"], result["memory"]
    assert placement["same_tokens"] and placement["ok"] and set(placement["bytes_by_device"]) == {"cpu"}
    engine = placement["engine"]  # an Engine on one store across the map: tokens, prefix reuse, bytes
    assert engine["same_tokens"] and engine["reused"][1] > 0 and set(engine["held_by_device"]) == {"cpu"}
    assert placement["kernel_launches_by_device"] == {}  # no CUDA layer: the reference path, no launch
    assert result["placement_2gpu"] is None  # the cuda:0 / cuda:1 split runs with 2 GPUs only
    names = [r["cache"] for r in memory["rows"]]
    assert names == ["reference", "fp16", "int4-g64"] and memory["int4_vs_reference"] < 0.5
    for r in memory["rows"]:
        assert r["counted_bytes"] == r["formula_bytes"] > 0 and r["device_peak_bytes"] is None, r
    assert "devmap: pass" in (out / "devmap.log").read_text()


def test_run_config_checks_the_device_map(tmp_path):
    from kvquant.eval.config import RunConfig, RunError

    assert RunConfig(schemes=("int8",), device_map="balanced").device_map == "balanced"
    (tmp_path / "map.json").write_text(json.dumps(cpu_map()))
    assert RunConfig(schemes=("int8",), device_map=str(tmp_path / "map.json")).device_map.endswith("map.json")
    with pytest.raises(RunError, match="--device-map: device map 'nowhere' is neither a strategy"):
        RunConfig(schemes=("int8",), device_map="nowhere")


def test_run_py_passes_the_device_map_to_the_loader(tmp_path, tiny_dir, monkeypatch):
    """`run.py --device-map FILE` reaches kvquant.load_model through the run harness (eval/harness.py)."""
    from kvquant.eval import harness
    from kvquant.eval.config import RunConfig

    (tmp_path / "map.json").write_text(json.dumps(cpu_map()))
    seen = {}
    real = kvquant.load_model

    def spy(*args, **kw):
        seen.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(kvquant, "load_model", spy)
    config = RunConfig(schemes=("int8",), model=str(tiny_dir), device_map=str(tmp_path / "map.json"))
    model, _, _ = harness.load_model(config)
    assert seen["device_map"] == str(tmp_path / "map.json")
    assert models.layer_devices(model) == (torch.device("cpu"),) * LAYERS
    script = Path(__file__).resolve().parents[1] / "experiments" / "run.py"
    spec = importlib.util.spec_from_file_location("run_py", script)
    run_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_py)
    args = run_py.build_parser().parse_args(["--scheme", "int8", "--device-map", "balanced"])
    assert run_py.config_from_args(args).device_map == "balanced"


# ---- a shared KVStore across devices (kvquant.serving.Engine over a mapped model)

SCHEME = "int4-g32,window=8"


SHARED = 40  # tokens the prompts share


def serve(engine, prompts, new: int = 5):
    """Greedy continuations of each prompt, one request after another (prefix cache: a later prompt adopts
    the shared prefix an earlier one registered); (tokens per prompt, tokens reused per prompt, bytes held
    per device while the last request was open)."""
    tokens, reused, by_device = [], [], {}
    for ids in prompts:
        cache = engine.open()
        pre = engine.prefill(cache, ids, boundaries=[SHARED])
        held, logits = list(ids), pre.logits
        for _ in range(new):
            held.append(int(logits.argmax()))
            logits = engine.step(cache, held[-1])
        by_device = engine.store.held_bytes_by_device()
        assert sum(by_device.values()) == engine.store.held_bytes() > 0
        engine.close(cache, held)
        tokens.append(held[len(ids) :])
        reused.append(pre.hit.reused)
    return tokens, reused, by_device


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(2, 18, (SHARED,), generator=g).tolist()
    return [shared + torch.randint(2, 18, (n,), generator=g).tolist() for n in (7, 12)]


@pytest.mark.parametrize("placement", ["map", "hooks"])
def test_engine_serves_a_mapped_model_with_its_pages_per_layer(tiny_dir, placement):
    """An Engine over a model placed by a device map (and over accelerate's hooks, what a split model runs
    through) keeps each layer's pool on that layer's device and serves the unmapped model's tokens, prefix
    hits included; the bytes held are reported per device."""
    from accelerate import dispatch_model

    from kvquant.serving import Engine

    plain, _ = kvquant.load_model(tiny_dir)
    want, want_reused, _ = serve(Engine(plain, SCHEME, prefix_cache="radix"), prompts())
    if placement == "map":
        model, _ = kvquant.load_model(tiny_dir, device_map=cpu_map())
    else:
        model, _ = kvquant.load_model(tiny_dir)
        dispatch_model(model, cpu_map(), force_hooks=True, skip_keys=model._skip_keys_device_placement)
    engine = Engine(model, SCHEME, prefix_cache="radix")
    assert engine.store.devices == models.layer_devices(model) == (torch.device("cpu"),) * LAYERS
    assert all(lp.fp.device == lp.body.device == torch.device("cpu") for lp in engine.store.layers)
    got, reused, by_device = serve(engine, prompts())
    assert got == want and reused == want_reused and reused[1] > 0
    assert set(by_device) == {"cpu"}


def test_store_spans_devices_layer_by_layer(tiny_dir):
    """One device per layer (a stand-in split: layer 1 on `meta`, which holds shapes and no data): each
    layer's pools are made on its device, bytes are reported per device and sum to the budget's count, and
    a cache whose layer computes elsewhere is refused naming the layer and both devices."""
    from kvquant.paging import KVStore

    model, _ = kvquant.load_model(tiny_dir)
    devices = ["cpu", "meta", "cpu"]
    store = KVStore(model.config, SCHEME, device=devices, prefix_cache="radix")
    assert store.devices == tuple(map(torch.device, devices))
    for lp, device in zip(store.layers, devices, strict=True):
        assert {t.device.type for p in (lp.fp, lp.body) for t in p.tensors.values()} == {device}
    pages = [(lp.fp.allocate(), lp.body.allocate()) for lp in store.layers]
    per_layer = [lp.fp_page_bytes + lp.body_page_bytes for lp in store.layers]
    assert store.held_bytes_by_device() == {"cpu": per_layer[0] + per_layer[2], "meta": per_layer[1]}
    assert sum(store.held_bytes_by_device().values()) == store.held_bytes()
    assert set(store.reserved_bytes_by_device()) == {"cpu", "meta"}
    for lp, (fp, body) in zip(store.layers, pages, strict=True):
        lp.fp.decref(fp)
        lp.body.decref(body)
    with pytest.raises(ValueError, match="this store's layers span cpu, meta: ask store.devices"):
        _ = store.device
    cache = kvquant.QuantizedCache(SCHEME, model.config, store=store)
    with pytest.raises(ValueError, match=r"layer 1's pages in torch.float32 on meta, but the layer got "
                                         r"torch.float32 on cpu.*layer_devices\(model\)"):
        model(torch.tensor([[2, 3, 4, 5]]), cache=cache)


def test_store_devices_must_name_every_layer(tiny_dir):
    from kvquant.paging import KVStore

    model, _ = kvquant.load_model(tiny_dir)
    with pytest.raises(ValueError, match=f"names 2 devices but the model has {LAYERS} decoder layers"):
        KVStore(model.config, SCHEME, device=["cpu", "cpu"])
    assert KVStore(model.config, SCHEME, device="cpu").device == torch.device("cpu")
    with pytest.raises(ValueError, match="a private store has no device of its own"):
        _ = KVStore.private().device


def test_a_layer_whose_attention_spans_devices_is_refused(tiny_dir):
    model, _ = kvquant.load_model(tiny_dir)
    model.model.layers[1].self_attn.v_proj.to("meta")
    with pytest.raises(ValueError, match=r"decoder layer 1's attention weights span cpu, meta; map the whole "
                                         r"layer \(model.layers.1\)"):
        models.layer_devices(model)
