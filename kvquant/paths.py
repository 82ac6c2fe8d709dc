"""Where kvquant keeps what it builds and caches on this machine: `$KVQUANT_CACHE`, else ~/.cache/kvquant.

The dequantized model copies (`kvquant.models`), the native library (`kvquant.native`) and the reference
cache (`kvquant.eval.refcache`) live under it. Imports nothing of ours, so the lowest module may ask.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """kvquant's cache folder: `$KVQUANT_CACHE`, else ~/.cache/kvquant (it may not exist yet)."""
    return Path(os.environ.get("KVQUANT_CACHE", Path.home() / ".cache" / "kvquant"))
