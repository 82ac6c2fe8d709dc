"""The reference pass, computed once: what the metrics need of the unquantized model per document, in
safetensors.

A sweep runs the same reference forward for every run that measures the same documents. Kept per document:
its last hidden states and, for a linear LM head, the scoring statistics of each prediction
(`kvquant.eval.scoring`: the mean head row under p, S, log-sum-exp, the target's nll, the argmax), so that
neither the reference's forward nor its LM head runs again. Both are small: 2 x 8k tokens x 576 x 4 B = 38 MB
for the default model, 2 x 32k x 640 x 4 B = 168 MB for Gemma-3-270M at 32k. A file from before the
statistics (hidden states only) is still read; the statistics are then computed once and the file rewritten.
They are keyed by everything that decides them: the
model (its config and a fingerprint of its weights), the document's token ids (so the length and tokenizer),
the compute dtype and the chunk boundaries (a different chunking is a different float32 rounding). Adding a
scheme to a finished run then costs the scheme's own forward and LM head per chunk.

Folder: $KVQUANT_REFERENCE_CACHE, else <kvquant cache folder>/reference ($KVQUANT_CACHE, else
~/.cache/kvquant). Files are written atomically; an unreadable file is treated as absent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

__all__ = ["ReferenceCache", "model_fingerprint", "reference_dir"]

logger = logging.getLogger(__name__)


def reference_dir() -> Path:
    if os.environ.get("KVQUANT_REFERENCE_CACHE"):
        return Path(os.environ["KVQUANT_REFERENCE_CACHE"])
    from kvquant.models import cache_root

    return cache_root() / "reference"


def model_fingerprint(model) -> str:
    """The model's config and the first 4,096 values of its first and last parameters (cheap; a different
    checkpoint of the same architecture differs there)."""
    digest = hashlib.sha1(model.config.to_json_string(use_diff=False).encode())
    params = list(model.parameters())
    for p in (params[0], params[-1]):
        digest.update(p.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class ReferenceCache:
    """Load and save the reference of one document: {"hidden": (1, L, hidden), and scoring.STAT_FIELDS}."""

    def __init__(self, root: Path | None = None, model=None):
        self.root = Path(root) if root is not None else reference_dir()
        self._model_fp = model_fingerprint(model) if model is not None else ""

    def key(self, ids: torch.Tensor, dtype: torch.dtype, bounds: list[int]) -> str:
        what = {
            "model": self._model_fp,
            "tokens": hashlib.sha1(ids.detach().cpu().numpy().astype("int64").tobytes()).hexdigest(),
            "length": int(ids.shape[-1]),
            "dtype": str(dtype),
            "bounds": bounds,
        }
        return hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]

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
