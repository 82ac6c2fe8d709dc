"""Serving on a shared page store: an `Engine` (model + `KVStore` + prefix index + eviction policy) that
runs requests; `kvquant.serving.session.Session` holds a multi-turn conversation on it.

    engine = Engine(model, "int4-g64", prefix_cache="radix", policy="lru", budget_bytes=256 << 20)
    chat = Session(engine)
    reply = chat.send(tokenizer(system + question)["input_ids"], max_new_tokens=32)
    reply2 = chat.send(tokenizer(follow_up)["input_ids"])      # every page of turn 1 is reused
    chat.close()                                                # its pages stay cached for other requests

A request's prefill looks its prompt up in the prefix index (`kvquant.serving.prefix.attach`), computes
the rest, and registers its complete units (after every prefill chunk, and when it ends) so later requests
reuse them.
The engine records what it ran through each cache (token ids, where each forward ended): ids given to
`close` or `register` must be the tokens the cache holds, and the forward ends tell the index which FP
window copies are whole.
The store holds the prefix index, the eviction policy and the byte budget beside its pools: an allocation
that would exceed the budget evicts cached units in the policy's order (`kvquant.paging.budget`); the engine
only asks the policy to trim running sequences after every forward (`sliding:W`). All requests run one at a
time through the model (no batching); they hold pages concurrently, which is what the budget measures.

A model split across devices by a device map (`kvquant.load_model(path, device_map=...)`) is served as it
is: the store keeps each layer's pages on that layer's device (`kvquant.models.layer_devices`), the ids go
to the input embeddings' device, the budget counts every device together and
`engine.store.held_bytes_by_device()` splits the bytes held.
"""

from __future__ import annotations

import logging
import numbers
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..cache import QuantizedCache
from ..models import input_device, layer_devices
from ..paging import EvictionPolicy, KVStore, PrefixIndex
from .prefix import Hit, attach, register

__all__ = ["Engine", "Prefill", "cache_bytes"]

logger = logging.getLogger(__name__)


def cache_bytes(store: KVStore, cache: QuantizedCache) -> int:
    """Bytes of the distinct pages one cache holds, at the store's accounting dtype (shared ones too)."""
    return store.caches_bytes([cache])


@dataclass(frozen=True)
class Prefill:
    """A prefill's outcome: the last position's logits (V,), what the index gave, and the time it took."""

    logits: torch.Tensor
    hit: Hit
    computed: int  # tokens run through the model
    seconds: float  # time to first token: lookup + adoption + forward(s)


@dataclass
class _Fed:
    """What an engine ran through one cache: the token ids it holds and where each forward ended (an adopted
    prefix counts as one forward). `covers` turns false when the cache moved outside the engine's forwards
    (a model call of its own, `kvquant.serving.prefix.attach`), which the engine then cannot vouch for."""

    ids: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    covers: bool = True

    def ran(self, ids: Sequence[int], end: int) -> None:
        """A forward ended at `end`; ids (a sequence whose first tokens are `self.ids`) hold its tokens."""
        self.ids.extend(ids[len(self.ids) : end])
        self.ends.append(end)


def _first_difference(held: Sequence[int], ids: Sequence[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(held, ids, strict=False)) if a != b), None)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_engine_args(budget_bytes, block_size, prefill_chunk, capacity_tokens) -> None:
    """Refuse values that would silently disable a limit (a NaN budget compares false with everything) or
    break the page arithmetic, naming the fix."""
    if budget_bytes is not None and (not _is_int(budget_bytes) or budget_bytes < 1):
        raise ValueError(
            f"budget_bytes must be a positive int (bytes at the accounting dtype) or None for no budget, "
            f"not {budget_bytes!r}"
        )
    for name, value in (("block_size", block_size), ("capacity_tokens", capacity_tokens)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int (tokens), not {value!r}")
    if prefill_chunk is not None and not _is_int(prefill_chunk):
        raise ValueError(f"prefill_chunk must be a positive int or None, not {prefill_chunk!r}")


class Engine:
    """A model with a shared page store, an optional prefix cache and an eviction policy.

    Args:
        model: a model with kvquant's attention (`kvquant.load_model`).
        scheme: the KV scheme of every request.
        prefix_cache: "hash", "radix" or None (no sharing between requests).
        policy: an eviction policy or its name ("none", "lru", "radix-lru", "sliding:W").
        budget_bytes: the store's byte budget at the accounting dtype (FP16), or None.
        prefill_chunk: tokens per prefill forward (None: the whole prompt, split only at `boundaries`).
    """

    def __init__(
        self,
        model,
        scheme,
        *,
        prefix_cache: str | None = "radix",
        policy: str | EvictionPolicy = "none",
        budget_bytes: int | None = None,
        block_size: int = 16,
        prefill_chunk: int | None = None,
        capacity_tokens: int = 256,
    ):
        _check_engine_args(budget_bytes, block_size, prefill_chunk, capacity_tokens)
        self.model = model
        self.input_device = input_device(model)  # a split model takes its ids on its first device
        self.store = KVStore(
            model.config,
            scheme,
            dtype=model.dtype,
            device=layer_devices(model),  # each layer's pages where its K/V are (a device map splits them)
            block_size=block_size,
            capacity_tokens=capacity_tokens,
            budget_bytes=budget_bytes,
            prefix_cache=prefix_cache,
            policy=policy,
        )
        self.scheme = self.store.scheme
        self.index: PrefixIndex | None = self.store.index
        self.policy: EvictionPolicy = self.store.policy
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self._open = 0
        self._fed: weakref.WeakKeyDictionary[QuantizedCache, _Fed] = weakref.WeakKeyDictionary()

    def _check_request(self, cache: QuantizedCache, ids: Sequence[int] = ()) -> None:
        """A cache opened by this engine (its pages live in this store) and token ids the model has."""
        if getattr(cache, "store", None) is not self.store:
            raise ValueError(
                "this cache was not opened by this Engine (its pages live in another store, or none); "
                "use engine.open() of the engine that runs it"
            )
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if vocab is not None:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"token id {bad[0]} is outside the model's vocabulary 0..{vocab - 1} "
                    f"({len(bad)} such ids); encode the text with the model's tokenizer"
                )

    def _record(self, cache: QuantizedCache) -> _Fed:
        """What this engine ran through `cache`; a fresh record for an empty cache, and one that no longer
        covers it when the cache holds tokens the engine did not run."""
        n = cache.get_seq_length()
        fed = self._fed.get(cache)
        if fed is None or n == 0:
            fed = self._fed[cache] = _Fed()
        if len(fed.ids) != n:
            fed.covers = False
        return fed

    def _held_ids(self, cache: QuantizedCache, ids: Sequence[int], what: str) -> _Fed:
        """The record of `cache`, once `ids` are checked to start with exactly the tokens it holds (more may
        follow: a sampled token not fed yet). Refuses ids it cannot vouch for, naming lengths and position."""
        fed = self._record(cache)
        n = cache.get_seq_length()
        if not fed.covers:
            fix = "close it without ids (nothing is registered)" if what == "close" else "open a new request"
            raise ValueError(
                f"{what}: this cache holds {n} tokens, not all run by this engine (a forward outside "
                "engine.prefill / engine.step, or kvquant.serving.prefix.attach), so its ids cannot be "
                f"checked; run every forward through the engine, or {fix}"
            )
        if len(ids) < n:
            raise ValueError(
                f"{what}: the cache holds {n} tokens but {len(ids)} ids were given; pass the ids of every "
                "token it holds (and nothing else before them)"
            )
        at = _first_difference(fed.ids, ids)
        if at is not None:
            raise ValueError(
                f"{what}: the ids differ from the {n} tokens the cache holds at position {at} (it holds "
                f"{fed.ids[at]}, {len(ids)} ids give {ids[at]}); registering them would cache its pages "
                "under the wrong tokens. Pass the tokens this request ran, in order"
            )
        return fed

    def register(self, cache: QuantizedCache, ids: Sequence[int]) -> int:
        """Index the complete units `cache` holds now (ids: the tokens it holds, checked); units added."""
        self._check_request(cache)
        if self.index is None:
            return 0
        ids = [int(t) for t in ids]
        fed = self._held_ids(cache, ids, "register")
        return register(cache, ids, self.index, forward_ends=fed.ends)

    def __repr__(self) -> str:
        index = self.index.kind if self.index is not None else "off"
        return f"Engine({self.scheme}, prefix cache {index}, policy {self.policy}, {self.store!r})"

    # ---- requests

    def open(self, name: str | None = None) -> QuantizedCache:
        """A new empty cache on the shared store, listed as a holder under `name`."""
        self._open += 1
        name = name or f"request {self._open}"
        # the store's requested page size: a cache on it with another one would not fit its pools
        block_size = self.store.requested_block_size
        cache = QuantizedCache(self.scheme, self.model.config, store=self.store, block_size=block_size)
        cache.name = name
        self.store.holders[name] = lambda: cache_bytes(self.store, cache)
        return cache

    def close(self, cache: QuantizedCache, ids: Sequence[int] | None = None) -> None:
        """End a request: register its units (ids: the tokens it holds, in order; more may follow, such as
        a sampled token not fed yet) and release its pages. Ids that do not match what the engine ran through
        the cache are refused (ValueError) before anything is registered or released."""
        self._check_request(cache)
        if ids is not None:
            ids = [int(t) for t in ids]
            fed = self._held_ids(cache, ids, "close")
            if self.index is not None:
                register(cache, ids, self.index, forward_ends=fed.ends)
        cache.reset()
        self._fed.pop(cache, None)
        self.store.holders.pop(getattr(cache, "name", None), None)

    def unit_boundary(self, tokens: int) -> int:
        """The largest position <= tokens where a cached prefix can end (sink + a whole number of pages)."""
        return self.store.unit_boundary(tokens)

    @torch.no_grad()
    def prefill(self, cache: QuantizedCache, ids: Sequence[int], boundaries: Sequence[int] = ()) -> Prefill:
        """Run the prompt `ids` (the whole sequence so far; a cache that already holds a prefix of it, as in a
        later turn, computes only the rest). An empty cache first adopts the longest cached prefix.
        `boundaries`: positions (e.g. a shared system prompt's end) where a forward ends and the cache is
        registered, so that windowed schemes can resume there (their FP window is cached at that point)."""
        ids = [int(t) for t in ids]
        self._check_request(cache, ids)
        t0 = time.perf_counter()
        hit = Hit(0, 0, 0)
        fed = self._record(cache)
        if self.index is not None and cache.get_seq_length() == 0:
            hit = attach(cache, ids, self.index)
            if hit.reused:
                fed.ran(ids, hit.reused)
        start = cache.get_seq_length()
        if start >= len(ids):
            raise ValueError(
                f"the cache already holds {start} tokens of this {len(ids)}-token prompt; "
                "a prompt must add at least one token"
            )
        if start:  # a later turn: the prompt must begin with what the cache holds
            self._held_ids(cache, ids, "prefill")
        cuts = sorted({self.unit_boundary(b) for b in boundaries if start < self.unit_boundary(b) < len(ids)})
        if self.prefill_chunk:
            cuts = sorted(set(cuts) | set(range(start + self.prefill_chunk, len(ids), self.prefill_chunk)))
        out = None
        try:
            for lo, hi in zip([start, *cuts], [*cuts, len(ids)], strict=True):
                x = torch.tensor([ids[lo:hi]], device=self.input_device)
                out = self.model(x, cache=cache, logits_to_keep=1)
                fed.ran(ids, hi)
                if self.index is not None and hi < len(ids):
                    register(cache, ids, self.index, forward_ends=fed.ends)
                self.policy.on_step(cache)
        except BaseException:
            cache.reset()  # a forward cut short leaves layers at different lengths: release everything
            self._fed.pop(cache, None)
            raise
        if self.index is not None:
            register(cache, ids, self.index, forward_ends=fed.ends)
        logits = out.logits[0, -1]
        return Prefill(logits, hit, len(ids) - start, time.perf_counter() - t0)

    @torch.no_grad()
    def step(self, cache: QuantizedCache, token: int) -> torch.Tensor:
        """One decoding step: feed `token`, return the next token's logits (V,)."""
        self._check_request(cache, [int(token)])
        fed = self._record(cache)
        try:
            out = self.model(torch.tensor([[int(token)]], device=self.input_device), cache=cache)
        except BaseException:
            cache.reset()
            self._fed.pop(cache, None)
            raise
        if fed.covers:
            fed.ids.append(int(token))
            fed.ends.append(len(fed.ids))
        self.policy.on_step(cache)
        return out.logits[0, -1]
