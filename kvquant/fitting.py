"""Fit a calibration's tables on text: run the model over calibration documents, normalize each layer's K
and V as its codec does, and fit codebooks (`kvquant.calibration.fit_codebook`) and `-crot` rotations
(`kvquant.rotfit.fit_rotations`); `kvquant.calibration.save_calibration` writes what is fitted.

Collection (`collect`): one forward per calibration document through the model with an ordinary cache; each
layer's K and V (keys un-rotated for `-prerope` specs) are normalized exactly as
`kvquant.codecs.base.CodebookCodec.normalize` does at run time.

Above both the codecs and `kvquant.calibration` (the file format, which the codecs read): neither imports
this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .calibration import Entry, fit_codebook
from .scheme import QuantSpec

if TYPE_CHECKING:  # torch is imported where it is used
    import torch

__all__ = ["RotationFit", "calibrate", "collect"]


@dataclasses.dataclass(frozen=True)
class RotationFit:
    """How `calibrate` fits -crot rotations: the first `docs` documents cut to `tokens` tokens, `steps` Adam
    steps on `queries` sampled queries per document (the next document, cut alike, is held out)."""

    docs: int = 2
    tokens: int = 1024
    steps: int = 100
    queries: int = 128

    def __post_init__(self):
        for name in ("docs", "tokens", "steps", "queries"):
            if getattr(self, name) < 1:
                raise ValueError(f"rotation fit: {name} = {getattr(self, name)} must be at least 1")


def collect(
    model,
    documents: Sequence[torch.Tensor],
    entries: Iterable[Entry],
    *,
    max_samples: int = 1_000_000,
    seed: int = 0,
    progress=None,
) -> dict[str, torch.Tensor]:
    """Normalized calibration values per table: {entry name: 1-D float32 sample}. documents: token ids
    (1, T) each, run one forward each with a DynamicCache; the K/V of every layer are normalized by the
    entry's codec."""
    import torch

    with torch.inference_mode():
        return _collect(model, documents, entries, max_samples=max_samples, seed=seed, progress=progress)


def _collect(model, documents, entries, *, max_samples: int, seed: int, progress) -> dict:
    import torch
    from transformers import DynamicCache

    from .codecs.base import codec_for
    from .memory import KVShape

    entries = list(entries)
    shape = KVShape.from_config(model.config)
    ropes = None  # each layer's RoPE (Gemma-3: one per layer type)
    if any(e.spec.prerope for e in entries):
        from .rope import Rope

        ropes = Rope.for_layers(model.config)
    per_doc = max(max_samples // max(len(documents), 1), 1)
    g = torch.Generator().manual_seed(seed)

    # specs that differ only in bits normalize alike: one sample per (layer, role, spec at 4 bits)
    def norm_key(e: Entry) -> tuple[int, str, QuantSpec]:
        return e.layer, e.role, dataclasses.replace(e.spec, bits=4)

    keys = {norm_key(e) for e in entries}
    samples: dict[tuple, list[torch.Tensor]] = {k: [] for k in keys}
    for n, ids in enumerate(documents):
        cache = DynamicCache(config=model.config)
        model.get_decoder()(input_ids=ids, cache=cache, use_cache=True)  # no logits needed
        for layer_idx, role, spec in sorted(keys, key=str):
            layer = cache.layers[layer_idx]
            x = (layer.keys if role == "k" else layer.values).float()  # (1, H, T, D) at positions 0..
            rope = ropes[layer_idx] if ropes is not None else None
            codec = codec_for(spec, shape.num_kv_heads, shape.head_dim, torch.float32, rope=rope)
            t = x.shape[2] - x.shape[2] % codec.token_group
            v = codec.codebook_values(x[:, :, :t], 0).flatten()  # normalized as the codec does (RoPE undone)
            if v.numel() > per_doc:
                v = v[torch.randperm(v.numel(), generator=g)[:per_doc]]
            samples[(layer_idx, role, spec)].append(v.clone())
        del cache
        if progress is not None:
            progress(n + 1, len(documents))
    return {e.name: torch.cat(samples[norm_key(e)]) for e in entries}


def calibrate(
    model,
    documents: Sequence[torch.Tensor],
    entries: Iterable[Entry],
    *,
    seed: int = 0,
    max_samples: int = 1_000_000,
    progress=None,
    rotation: RotationFit = RotationFit(),
    report: list | None = None,
) -> dict[str, torch.Tensor]:
    """Fit every entry's table on the documents: {entry name: levels or rotation}.

    Codebooks of specs without -crot: `collect` on every document, then `fit_codebook`. -crot specs
    (`kvquant.rotfit.fit_rotations`, rotation and codebook) as `rotation` says (`RotationFit`); its held-out
    document, when there is one, is scored into `report`."""
    entries = list(entries)
    plain = [e for e in entries if not e.spec.rotate_calib]
    tables = {}
    if plain:
        values = collect(model, documents, plain, max_samples=max_samples, seed=seed, progress=progress)
        tables = {
            e.name: fit_codebook(values[e.name], e.spec.bits, seed=seed, max_samples=max_samples)
            for e in plain
        }
    crot = [e for e in entries if e.spec.rotate_calib]
    if crot:
        from .rotfit import fit_rotations

        docs = [d[:, : rotation.tokens] for d in documents]
        tables |= fit_rotations(
            model,
            docs[: rotation.docs],
            crot,
            held_out=docs[rotation.docs : rotation.docs + 1],
            steps=rotation.steps,
            queries=rotation.queries,
            seed=seed,
            max_samples=max_samples,
            report=report,
        )
    return tables
