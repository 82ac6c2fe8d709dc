"""95% bootstrap intervals of drift and KL over documents, then tokens (numpy; seeded, so reproducible).

Two-stage (hierarchical) bootstrap: a replicate draws D documents with replacement out of the D measured,
then, inside each drawn document, its n tokens with replacement; the statistic is recomputed over the drawn
tokens (drift = exp(mean(nll - nll_ref)) - 1 over them, KL = their mean). Documents differ more among
themselves than tokens within one, so resampling tokens alone would give intervals far too narrow.

To keep it cheap at 8 documents x 8k tokens, each document gets a pool of `n_boot` token resamples (their
sums), and each drawn document of a replicate takes one of its pool at random; the same (document, resample)
pair appearing twice in a replicate has probability about 1 / n_boot.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import numpy as np

__all__ = ["N_BOOT", "LEVEL", "bootstrap_intervals", "seed_for"]

N_BOOT = 1000
LEVEL = 0.95
_CHUNK = 200  # resamples drawn at once: 200 x 8k indices x 8 B = 13 MB


def seed_for(seed: int, *key: object) -> int:
    """A stable seed per (run seed, scheme, mode, bucket): the same run gives the same intervals."""
    return zlib.crc32(repr((seed, *key)).encode())


def _pool(values: Sequence[np.ndarray], n_boot: int, rng: np.random.Generator) -> list[np.ndarray]:
    """For one document: n_boot token resamples, each summed, for every array (paired: same indices)."""
    n = len(values[0])
    out = [np.empty(n_boot) for _ in values]
    for lo in range(0, n_boot, _CHUNK):
        hi = min(lo + _CHUNK, n_boot)
        idx = rng.integers(0, n, size=(hi - lo, n))
        for o, v in zip(out, values, strict=True):
            o[lo:hi] = v[idx].sum(axis=1)
    return out


def bootstrap_intervals(
    diffs: Sequence[np.ndarray],
    kls: Sequence[np.ndarray],
    *,
    n_boot: int = N_BOOT,
    seed: int = 0,
    level: float = LEVEL,
) -> dict[str, tuple[float, float]]:
    """{"drift": (lo, hi), "kl": (lo, hi)} from per-document arrays of per-token nll - nll_ref and KL.

    Documents with no tokens are left out; with none at all the intervals are nan."""
    docs = [
        (np.asarray(d, dtype=np.float64), np.asarray(k, dtype=np.float64))
        for d, k in zip(diffs, kls, strict=True)
        if len(d)
    ]
    if not docs:
        return {"drift": (math.nan, math.nan), "kl": (math.nan, math.nan)}
    rng = np.random.default_rng(seed)
    pools = [_pool(doc, n_boot, rng) for doc in docs]
    diff_pool = np.stack([p[0] for p in pools])  # (D, n_boot)
    kl_pool = np.stack([p[1] for p in pools])
    n = np.array([len(d) for d, _ in docs], dtype=np.float64)
    n_docs = len(docs)
    pick = rng.integers(0, n_docs, size=(n_boot, n_docs))  # documents drawn, per replicate
    which = rng.integers(0, n_boot, size=(n_boot, n_docs))  # which token resample of each
    tokens = n[pick].sum(axis=1)
    drift = np.expm1(diff_pool[pick, which].sum(axis=1) / tokens)
    kl = kl_pool[pick, which].sum(axis=1) / tokens
    a = (1 - level) / 2
    return {
        "drift": (float(np.quantile(drift, a)), float(np.quantile(drift, 1 - a))),
        "kl": (float(np.quantile(kl, a)), float(np.quantile(kl, 1 - a))),
    }
