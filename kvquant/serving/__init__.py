"""Serving on a shared page store (`kvquant.paging.KVStore`): requests, prefixes and conversations.

    engine.py   Engine: model + store + prefix index + eviction policy; runs requests (prefill, step,
                register, close) and checks that what it registers is what it ran; Prefill, cache_bytes
    prefix.py   prefix caching: `register` a cache's complete units in the store's index, `attach` a new
                request to the longest cached prefix (decode-exact reuse, copy-on-write)
    session.py  Session: one cache across the turns of a conversation

Pages, their tables, the indexes, eviction policies and the byte budget live in `kvquant.paging`.
"""

from .engine import Engine, Prefill, cache_bytes
from .prefix import Hit, attach, register, unit_tokens
from .session import Session

__all__ = ["Engine", "Hit", "Prefill", "Session", "attach", "cache_bytes", "register", "unit_tokens"]
