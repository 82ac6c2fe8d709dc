"""Calibration text and the calibration command (`experiments/calibrate.py`): fit the codebooks of `nuqN`
specs.

Calibration text is never evaluation text. By default it is the Wikipedia articles that reach `length` tokens
but NOT `exclude_from` (8,192) tokens: the evaluation at the default length (8k) only reads articles of at
least 8,192 tokens, so the two sets are disjoint. (An evaluation at a shorter --max-length may read these
articles; the file's JSON lists their titles, and `kvquant.eval.allocation` refuses overlapping documents.)
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_DOCS = 8
DEFAULT_LENGTH = 2048
EXCLUDE_FROM = 8192  # articles this long are the evaluation's


@dataclass(frozen=True)
class CalibText:
    ids: list  # token ids per document, each a (1, T) LongTensor
    titles: list[str]
    corpus: str

    @property
    def tokens(self) -> int:
        return sum(int(t.shape[1]) for t in self.ids)


def calibration_documents(
    tokenizer,
    corpus: str = "wikipedia",
    docs: int = DEFAULT_DOCS,
    length: int = DEFAULT_LENGTH,
    exclude_from: int | None = EXCLUDE_FROM,
    seed: int = 0,
    exclude_titles: Sequence[str] = (),
) -> CalibText:
    """`docs` documents of the corpus with at least `length` tokens (and fewer than `exclude_from`, when
    given), in a seeded order, each cut to `length` tokens."""
    import torch

    from .data import load_corpus

    documents = load_corpus(corpus)
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    ids, titles = [], []
    for i in order:
        d = documents[i]
        if d.title in exclude_titles:
            continue
        toks = tokenizer(d.text, add_special_tokens=True)["input_ids"]
        if len(toks) < length or (exclude_from is not None and len(toks) >= exclude_from):
            continue
        ids.append(torch.tensor([toks[:length]]))
        titles.append(d.title)
        if len(ids) == docs:
            break
    if not ids:
        raise ValueError(
            f"no document of {corpus!r} has between {length} and {exclude_from} tokens; lower --length"
        )
    if len(ids) < docs:
        logger.warning("only %d calibration documents of %d requested qualify", len(ids), docs)
    return CalibText(ids, titles, corpus)


def run_calibration(
    schemes: Sequence[str],
    out: str,
    *,
    model_path: str | None = None,
    corpus: str = "wikipedia",
    docs: int = DEFAULT_DOCS,
    length: int = DEFAULT_LENGTH,
    seed: int = 0,
    max_samples: int = 1_000_000,
    extra_entries=(),
    model=None,
    tokenizer=None,
    rotation=None,
) -> tuple[str, list[str]]:
    """Fit every codebook the schemes need (plus extra_entries) and write `out` (.safetensors + .json).
    rotation: how -crot rotations are fitted (`kvquant.fitting.RotationFit`; None: its defaults), recorded
    in the JSON as `rotation_fit` when a -crot table is fitted. Returns (the safetensors path, the schemes
    with calib=out)."""
    import dataclasses

    import torch

    import kvquant
    from kvquant.calibration import entries_for, metadata, save_calibration
    from kvquant.fitting import RotationFit, calibrate
    from kvquant.memory import KVShape

    if model is None:
        model, tokenizer = kvquant.load_model(model_path)
    shape = KVShape.from_config(model.config)
    parsed = [kvquant.parse_scheme(s) for s in schemes]
    for s in parsed:
        s.check_num_layers(shape.num_layers)
        s.check_head_dim(shape.head_dim)
    entries = {e.name: e for s in parsed for e in entries_for(s, shape.num_layers)}
    entries |= {e.name: e for e in extra_entries}
    if not entries:
        raise ValueError("none of the schemes has a codebook (nuqN) spec: there is nothing to calibrate")
    text = calibration_documents(tokenizer, corpus, docs, length, seed=seed)
    logger.info("calibrating %d tables on %d documents (%d tokens)", len(entries), len(text.ids), text.tokens)
    tables = calibrate(
        model,
        [t.to(model.device) for t in text.ids],
        entries.values(),
        seed=seed,
        max_samples=max_samples,
        progress=lambda n, total: logger.info("document %d/%d", n, total),
        rotation=rotation or RotationFit(),
    )
    crot = any(e.spec.rotate_calib for e in entries.values())
    with_calib = [str(dataclasses.replace(s, calib=str(out))) for s in parsed]
    meta = metadata(
        model_path or "SmolLM2-135M-Instruct (embedded)",
        shape,
        with_calib,
        list(entries.values()),
        corpus=corpus,
        documents=text.titles,
        tokens=text.tokens,
        length=length,
        seed=seed,
        max_samples=max_samples,
        dtype=str(next(model.parameters()).dtype),
        torch=torch.__version__,
        **({"rotation_fit": dataclasses.asdict(rotation or RotationFit())} if crot else {}),
    )
    st, _ = save_calibration(out, tables, meta)
    return str(st), with_calib
