"""The reference pass, computed once: what the metrics need of the unquantized model per document, in
safetensors.

A sweep runs the same reference forward for every run that measures the same documents. Kept per document:
its last hidden states and, for a linear LM head, the scoring statistics of each prediction
(`kvquant.eval.scoring`: the mean head row under p, S, log-sum-exp, the target's nll, the argmax), so that
neither the reference's forward nor its LM head runs again. Both are small: 2 x 8k tokens x 576 x 4 B = 38 MB
for the default model, 2 x 32k x 640 x 4 B = 168 MB for Gemma-3-270M at 32k. A file from before the
statistics (hidden states only) is still read; the statistics are then computed once and the file rewritten.

A file is keyed by everything that decides it, never by a sample of it (`ReferenceCache.key`):
- the model: its config, attention implementation and a content hash of its full weights (`weights_digest`:
  sha256 over every state_dict tensor's name, shape, dtype and bytes), the device type it computes on, and
  the torch / transformers versions;
- the tokenizer (`tokenizer_digest`: its full vocabulary, merges and special tokens), the document's text and
  its token ids (so the length);
- the settings of the pass: the compute dtype, the chunk boundaries (a different chunking is a different
  float32 rounding) and the reference cache's layers (prefill mode keeps sliding layers full).
A mismatch in any of them is a different key, so the pass is recomputed. Adding a scheme to a finished run
then costs the scheme's own forward and LM head per chunk.

The weights hash reads every byte once per checkpoint (SmolLM2-135M: 540 MB, about 1 s). For a model loaded
from files (`model.name_or_path` a local folder) it is remembered in <folder>/weights/ under the identity of
the checkpoint's weight files (path, size, mtime_ns, inode, ctime_ns) and the state_dict's layout, together
with a sample of every tensor (16 values each) that a later call checks first: a model whose weights were
re-initialised, quantized, pruned or fine-tuned in memory after loading no longer matches its files' sample
and is hashed again. (An in-memory edit of a single weight that misses the sample is not seen; hash such a
model afresh by giving it no `name_or_path`.) A model without files is hashed every time.

Folder: $KVQUANT_REFERENCE_CACHE, else <kvquant cache folder>/reference ($KVQUANT_CACHE, else
~/.cache/kvquant). Files are written atomically; an unreadable file is treated as absent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = [
    "ReferenceCache",
    "WeightsUnhashable",
    "checkpoint_files",
    "model_fingerprint",
    "reference_dir",
    "tokenizer_digest",
    "weights_digest",
]

logger = logging.getLogger(__name__)

REFERENCE_FORMAT = 2  # what a reference file holds and how its key is built; a change recomputes them all
WEIGHTS_FORMAT = 1  # how weights_digest hashes; a change rehashes every checkpoint
# files in a model folder that weights may be read from (any of them changing is a different checkpoint)
_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                 "*.gguf")
_SAMPLE = 16  # values per tensor in the sample that checks a remembered hash


class WeightsUnhashable(RuntimeError):
    """The model's weights cannot be read here (offloaded to the meta device): no content key."""


def reference_dir() -> Path:
    if os.environ.get("KVQUANT_REFERENCE_CACHE"):
        return Path(os.environ["KVQUANT_REFERENCE_CACHE"])
    from kvquant.models import cache_root

    return cache_root() / "reference"


# ------------------------------------------------------------------------------------------------ weights


def _unique_state(model) -> list[tuple[str, torch.Tensor, str | None]]:
    """(name, tensor, name of the tensor it aliases or None) for every state_dict entry, in order: a tied
    weight (the LM head sharing the embedding) is hashed once and recorded as an alias."""
    seen: dict[tuple, str] = {}
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        t = t.detach()
        if t.device.type == "meta":
            raise WeightsUnhashable(f"{name} is on the meta device (offloaded); its bytes cannot be hashed")
        ident = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())
        alias = seen.get(ident) if t.numel() else None
        seen.setdefault(ident, name)
        out.append((name, t, alias))
    return out


def _bytes_of(t: torch.Tensor):
    """The tensor's bytes as a buffer (contiguous, on the CPU; any dtype, bfloat16 and float8 included)."""
    t = t.contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def _tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(_bytes_of(t)).hexdigest()


def _layout(state) -> list:
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch."), alias] for name, t, alias in state]


def _sample(state) -> str:
    """A digest of _SAMPLE evenly spaced values of every tensor (cheap: it checks a remembered hash)."""
    digest = hashlib.sha256()
    for _, t, alias in state:
        if alias is not None or not t.numel():
            continue
        flat = t.reshape(-1)
        k = min(_SAMPLE, flat.numel())
        idx = torch.arange(k, dtype=torch.long) * (flat.numel() - 1) // max(k - 1, 1)  # first .. last, exact
        digest.update(_bytes_of(flat[idx.to(flat.device)]))
    return digest.hexdigest()


def _full_digest(state) -> str:
    """sha256 over every tensor's name, shape, dtype and per-tensor sha256 of its bytes (in threads: hashlib
    releases the GIL, so a many-core machine hashes a large model in parallel)."""
    todo = [t for _, t, alias in state if alias is None]
    workers = max(1, min(8, (os.cpu_count() or 1), len(todo)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = iter(list(pool.map(_tensor_digest, todo)))
    entries = [[*row, None if row[3] is not None else next(digests)] for row in _layout(state)]
    return hashlib.sha256(json.dumps([WEIGHTS_FORMAT, entries]).encode()).hexdigest()


def checkpoint_files(model) -> list[Path]:
    """The weight files `model` was loaded from, when its `name_or_path` is a local folder (or file); else
    []. Every weight-like file in the folder counts (a change to any of them is another checkpoint)."""
    config = getattr(model, "config", None)
    name = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", "")
    if not name:
        return []
    path = Path(str(name))
    if path.is_file():
        return [path.resolve()]
    if not path.is_dir():
        return []
    return sorted({f.resolve() for pattern in _WEIGHT_FILES for f in path.glob(pattern) if f.is_file()})


def _file_identity(files: list[Path]) -> list[list]:
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns])
    return out


def weights_digest(model, memo_dir: Path | None = None) -> str:
    """The content hash of `model`'s full weights (64 hex digits): every state_dict tensor's name, shape,
    dtype and bytes. Remembered in `memo_dir` (default <reference_dir>/weights) by the identity of the
    checkpoint files it was loaded from, when known, and checked against a sample of every tensor (see the
    module docstring). Raises WeightsUnhashable for offloaded weights."""
    state = _unique_state(model)
    files = checkpoint_files(model)
    memo = None
    if files:
        ident = {"format": WEIGHTS_FORMAT, "files": _file_identity(files), "layout": _layout(state)}
        key = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:32]
        memo = Path(memo_dir) if memo_dir is not None else reference_dir() / "weights"
        memo = memo / f"{key}.json"
        sample = _sample(state)
        try:
            held = json.loads(memo.read_text())
            if held["sample"] == sample and isinstance(held["digest"], str) and len(held["digest"]) == 64:
                return held["digest"]
            logger.info("weights differ from the sample of their files in %s; hashing them", files[0].parent)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not remembered yet, or unreadable: hashed below
    t0 = time.perf_counter()
    digest = _full_digest(state)
    seconds = time.perf_counter() - t0
    logger.info("hashed the model's weights in %.1f s", seconds)
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f".{memo.stem}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"digest": digest, "sample": sample, "files": ident["files"],
                                       "seconds": round(seconds, 3)}))
            tmp.replace(memo)
        except OSError as e:  # a read-only cache folder: hashed again next time, never wrong
            logger.warning("cannot remember the weights hash in %s: %s", memo.parent, e)
    return digest


def tokenizer_digest(tokenizer) -> str | None:
    """A hash of the tokenizer's full content: a fast tokenizer's serialized model (vocabulary, merges,
    normalizer, pre-tokenizer, post-processor, added tokens), else its vocabulary; with its class and
    special tokens. None without a tokenizer."""
    if tokenizer is None:
        return None
    digest = hashlib.sha256(type(tokenizer).__qualname__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        digest.update(backend.to_str().encode())
    elif hasattr(tokenizer, "get_vocab"):
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    else:
        digest.update(repr(tokenizer).encode())
    special = getattr(tokenizer, "special_tokens_map", None)
    digest.update(json.dumps(special, sort_keys=True, default=str).encode())
    for flag in ("add_bos_token", "add_eos_token", "padding_side", "model_max_length"):
        digest.update(f"{flag}={getattr(tokenizer, flag, None)!r}".encode())
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def model_fingerprint(model, memo_dir: Path | None = None) -> str:
    """What decides the reference of a model: its config (less the path it was loaded from), attention
    implementation, full weights (`weights_digest`), the device type it computes on and the torch /
    transformers versions."""
    config = model.config
    settings = json.loads(config.to_json_string(use_diff=False))
    settings.pop("_name_or_path", None)  # where it was loaded from is not what it computes: the weights are
    what = {
        "config": settings,
        "attention": getattr(config, "_attn_implementation", None),
        "weights": weights_digest(model, memo_dir),
        "device": next(model.parameters()).device.type,
        **_versions(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


class ReferenceCache:
    """Load and save the reference of one document: {"hidden": (1, L, hidden), and scoring.STAT_FIELDS}.

    Without a model the key holds no model (a cache for tests of the file format only)."""

    def __init__(self, root: Path | None = None, model=None, tokenizer=None):
        self.root = Path(root) if root is not None else reference_dir()
        self._model_fp = model_fingerprint(model, self.root / "weights") if model is not None else ""
        self._tokenizer_fp = tokenizer_digest(tokenizer)

    def key(
        self,
        ids: torch.Tensor,
        dtype: torch.dtype,
        bounds: list[int],
        *,
        text: str | None = None,
        layers: str = "model",
    ) -> str:
        """ids (1, L) the document's tokens; bounds the chunk boundaries; text the document's text;
        layers "model" (the reference cache as the model's config lays it out) or "full" (every layer
        keeps every token: prefill mode)."""
        text_fp = None if text is None else hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        what = {
            "format": REFERENCE_FORMAT,
            "model": self._model_fp,
            "tokenizer": self._tokenizer_fp,
            "text": text_fp,
            "tokens": hashlib.sha256(ids.detach().cpu().numpy().astype("int64").tobytes()).hexdigest(),
            "shape": list(ids.shape),
            "dtype": str(dtype),
            "bounds": [int(b) for b in bounds],
            "layers": layers,
        }
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.root / f"{key}.safetensors"

    def load(self, key: str) -> dict[str, torch.Tensor] | None:
        from safetensors.torch import load_file

        path = self.path(key)
        if not path.is_file():
            return None
        try:
            stored = load_file(str(path))
            if "hidden" not in stored:
                raise KeyError("no 'hidden' tensor")
            return stored
        except Exception as e:  # noqa: BLE001 - a damaged file is recomputed
            logger.warning("reference cache %s unreadable (%s); recomputing", path, e)
            return None

    def save(self, key: str, reference: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        self.root.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
        save_file({k: v.contiguous() for k, v in reference.items()}, str(tmp))
        tmp.replace(path)
