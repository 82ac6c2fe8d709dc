"""`KVStore`: the page pools of every decoder layer, and what lives beside them: the prefix index, the
eviction policy and the byte budget (vLLM's `BlockPool` holds its free-block queue and cached-block map the
same way).

Every cache stores its pages in a store. A cache made with `store=` shares one with other caches (one per
request): pages of a common prefix are held once, shared by reference count, and evicted under the budget
as the pools allocate. A cache without one gets a private store with one holder (`KVStore.private`): its
layers' pools are sized when each layer first writes, and give memory back when they release pages.
Either way a layer asks `tables_for` for its `kvquant.paging.regions.LayerTables`, the one code path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..codecs.base import Codec
from ..memory import KVShape
from ..plan import LayerPlan
from ..scheme import parse_scheme
from .budget import PageBudget
from .evict import EvictionPolicy, make_policy
from .index import PrefixIndex, make_index
from .pool import PagePool, StoreError
from .regions import LayerTables

__all__ = ["KVStore", "LayerPools"]


@dataclass(frozen=True)
class LayerPools:
    """One decoder layer's pools: FP pages (sink and window, `fp_block_size` tokens) and body pages (codec
    fields of K and V under one page id, `block_size` tokens), with the codecs they were made for."""

    fp: PagePool
    body: PagePool
    key_codec: Codec
    value_codec: Codec
    block_size: int
    sliding_window: int | None
    fp_page_bytes: int  # bytes of one page at the store's accounting dtype (the budget's unit)
    body_page_bytes: int


class KVStore:
    """Page pools for every decoder layer of one model, shared by many `QuantizedCache` objects (one per
    request), with an optional prefix index and a byte budget enforced as the pools allocate.

        store = KVStore(model.config, "int4-g64", budget_bytes=64 << 20, prefix_cache="radix", policy="lru")
        cache = QuantizedCache("int4-g64", model.config, store=store)

    Bytes are counted at `accounting_dtype` (FP16 by default: what a deployment stores, whatever dtype the
    CPU computes in), so `held_bytes()` of one request equals `kvquant.memory.cache_bytes(..., dtype=fp16)`.
    With `budget_bytes`, every page allocation first checks the budget: over it, the policy's next
    unreferenced unit of the prefix index is evicted, until the page fits; when nothing can be evicted,
    `BudgetError` names the budget and each holder (`holders`: name -> bytes held).

    `device` is one device for every layer, or one per decoder layer for a model split across devices by a
    device map (`kvquant.models.layer_devices(model)`, as `kvquant.serving.Engine` passes it): each layer's
    pools live where that layer computes its K/V. The budget and `held_bytes()` count every device
    together; `held_bytes_by_device()` splits them.
    """

    def __init__(
        self,
        config,
        scheme,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | Sequence[torch.device | str] = "cpu",
        block_size: int = 16,
        capacity_tokens: int = 256,
        budget_bytes: int | None = None,
        accounting_dtype: torch.dtype | None = torch.float16,
        prefix_cache: str | None = None,
        policy: str | EvictionPolicy = "none",
    ):
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive (or None for no budget), got {budget_bytes}")
        self.shared = True
        self.scheme = parse_scheme(scheme)
        self.shape = KVShape.from_config(config)
        self.scheme.check_head_dim(self.shape.head_dim)
        self.dtype, self.devices = dtype, _per_layer_devices(device, self.shape.num_layers)
        self.holders: dict[str, Callable[[], int]] = {}
        acc = accounting_dtype or dtype
        h, d = self.shape.num_kv_heads, self.shape.head_dim
        self.layers: list[LayerPools] = []
        self.plans: list[LayerPlan] = []
        for i in range(self.shape.num_layers):
            window = self.shape.window_of(i)
            # per-layer specs as the cache's layers get them; codecs here only size the pages (a layer
            # encodes with its own, which carry calibration tables and RoPE)
            plan = LayerPlan.build(
                self.scheme.for_layer(i), heads=h, head_dim=d, dtype=dtype, block_size=block_size,
                sliding_window=window, layer=i,
            )
            bs = plan.block_size
            dev = self.devices[i]
            fp = PagePool(plan.fp_fields(), plan.fp_block_size, dev, plan.max_fp_pages, f"fp[{i}]")
            body = PagePool(plan.body_fields(), bs, dev, plan.body_pages(capacity_tokens), f"body[{i}]")
            fp_b, body_b = plan.page_bytes(acc)
            self.plans.append(plan)
            self.layers.append(
                LayerPools(fp, body, plan.key_codec, plan.value_codec, bs, window, fp_b, body_b)
            )
        self.index: PrefixIndex | None = make_index(prefix_cache, self) if prefix_cache else None
        self.policy = make_policy(policy)
        self.policy.check_index(self.index)
        self.budget = PageBudget(self, budget_bytes, self.policy, self.index)
        for lp in self.layers:
            lp.fp.budget = lp.body.budget = self.budget
        if self.index is not None:
            self.holders["prefix cache"] = self.index.held_bytes

    @classmethod
    def private(cls) -> KVStore:
        """A store with one holder, for a cache made without `store=`: each layer's pools are made when it
        first writes (sized for its batch and the cache's capacity); no budget, no prefix index."""
        store = cls.__new__(cls)
        store.shared = False
        store.scheme = store.shape = store.index = None
        store.holders, store.layers, store.plans, store.devices = {}, [], [], ()
        store._own: dict[int, LayerPools] = {}
        store.policy = make_policy("none")
        store.budget = PageBudget(store, None, store.policy, None)
        return store

    # ---- the tables of a layer

    def tables_for(
        self,
        layer: int,
        plan: LayerPlan,
        batch: int,
        *,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> LayerTables:
        """Empty tables for `batch` sequences of decoder layer `layer`, whose plan is `plan` (K/V of
        plan.heads x plan.head_dim in dtype on device): on this store's pools when shared, on new pools sized
        for the batch (FP pages for what the sink and window can hold, codec pages for `capacity` tokens)
        when private."""
        if not self.shared:
            self._own[layer] = lp = _private_pools(plan, batch, capacity, device)
        else:
            lp = _shared_pools(self, layer, plan, dtype, device)
        return LayerTables(lp.fp, lp.body, plan, batch, private=not self.shared)

    # ---- sizes

    @property
    def device(self) -> torch.device:
        """The device of every layer's pools; a store spanning devices has no one device (see `devices`)."""
        if not self.shared:
            raise ValueError("a private store has no device of its own: each layer's pools are made where "
                             "that layer first writes")
        if len(set(self.devices)) != 1:
            spread = sorted(set(map(str, self.devices)))
            raise ValueError(f"this store's layers span {', '.join(spread)}: ask store.devices[layer]")
        return self.devices[0]

    @property
    def block_size(self) -> int:
        return self.layers[0].block_size

    @property
    def requested_block_size(self) -> int:
        """The page size the store was made with (a cache on it must ask for the same)."""
        return self.plans[0].requested_block_size

    @property
    def shareable(self) -> bool:
        """Whether prefixes can be shared: not across sliding-window layers, which release their pages."""
        return not self.shape.sliding_layers

    @property
    def budget_bytes(self) -> int | None:
        return self.budget.budget_bytes

    @property
    def evicted_pages(self) -> int:
        """Pages (summed over layers) freed by eviction under the budget."""
        return self.budget.evicted_pages

    @property
    def peak_bytes(self) -> int:
        """The most bytes held at any allocation."""
        return self.budget.peak_bytes

    def unit_boundary(self, tokens: int) -> int:
        """The largest position <= tokens where a cached prefix can end (sink + a whole number of pages)."""
        plan = self.plans[0]
        sink, bs = plan.sink, plan.block_size
        return tokens if tokens <= sink else sink + (tokens - sink) // bs * bs

    def pool_bytes(self, pool: PagePool) -> int:
        """Bytes of one page of `pool` at the accounting dtype."""
        for lp in self.layers:
            if pool is lp.fp:
                return lp.fp_page_bytes
            if pool is lp.body:
                return lp.body_page_bytes
        raise StoreError(f"{pool!r} is not a pool of this store")

    def held_bytes(self) -> int:
        """Bytes of the pages in use (reference count > 0) over every layer, at the accounting dtype."""
        return sum(
            lp.fp.in_use * lp.fp_page_bytes + lp.body.in_use * lp.body_page_bytes for lp in self.layers
        )

    def held_bytes_by_device(self) -> dict[str, int]:
        """`held_bytes()` per device (`{"cuda:0": ..., "cpu": ...}`), each layer counted where its pools live;
        sums to `held_bytes()`."""
        out: dict[str, int] = {}
        for lp, device in zip(self.layers, self.devices, strict=True):
            key = str(device)
            out[key] = out.get(key, 0) + lp.fp.in_use * lp.fp_page_bytes + lp.body.in_use * lp.body_page_bytes
        return out

    def pages_in_use(self) -> int:
        return sum(lp.fp.in_use + lp.body.in_use for lp in self.layers)

    def reserved_bytes(self) -> int:
        """Bytes the pools have preallocated (at the compute dtype), used or not."""
        return sum(lp.fp.reserved_bytes + lp.body.reserved_bytes for lp in self.layers)

    def reserved_bytes_by_device(self) -> dict[str, int]:
        """`reserved_bytes()` per device, each layer's pools counted where they live."""
        out: dict[str, int] = {}
        for lp, device in zip(self.layers, self.devices, strict=True):
            out[str(device)] = out.get(str(device), 0) + lp.fp.reserved_bytes + lp.body.reserved_bytes
        return out

    def caches_bytes(self, caches) -> int:
        """Bytes of the distinct pages the `QuantizedCache`s on this store hold together (accounting dtype;
        a page several of them share counts once)."""
        total = 0
        for i, lp in enumerate(self.layers):
            fp: set[int] = set()
            body: set[int] = set()
            for cache in caches:
                layer = cache.layers[i]
                if layer.is_initialized:
                    f, b = layer.tables.page_sets()
                    fp |= f
                    body |= b
            total += len(fp) * lp.fp_page_bytes + len(body) * lp.body_page_bytes
        return total

    def tables_bytes(self, tables_per_layer) -> int:
        """Bytes of the distinct pages that per-layer (fp tables, body tables) hold (accounting dtype).
        Prefer `caches_bytes`, which does not need the layers' tables."""
        total = 0
        for lp, (fp_tables, body_tables) in zip(self.layers, tables_per_layer, strict=True):
            fp = set().union(*(t.pages() for t in fp_tables)) if fp_tables else set()
            body = set().union(*(t.pages() for t in body_tables)) if body_tables else set()
            total += len(fp) * lp.fp_page_bytes + len(body) * lp.body_page_bytes
        return total

    def check(self) -> None:
        for lp in [*self.layers, *getattr(self, "_own", {}).values()]:
            lp.fp.check()
            lp.body.check()

    def budget_message(self, need: int) -> str:
        return self.budget.message(need)

    def __repr__(self) -> str:
        if not self.shared:
            return f"KVStore(private, {len(self._own)} layers)"
        budget = "no budget" if self.budget_bytes is None else f"budget {self.budget_bytes:,} B"
        devices = sorted(set(map(str, self.devices)))
        return (
            f"KVStore({self.scheme}, {len(self.layers)} layers on {', '.join(devices)}, "
            f"block_size={self.block_size}, {self.held_bytes():,} B held, {budget})"
        )


def _one_device(device: torch.device | str) -> torch.device:
    """torch.device(device), with CUDA's current index when none is given ("cuda" -> "cuda:0"): K/V tensors
    carry their index, so the store's devices must too to compare equal."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _per_layer_devices(
    device: torch.device | str | Sequence[torch.device | str], layers: int
) -> tuple[torch.device, ...]:
    """One device per decoder layer from one device or a sequence of them (one per layer)."""
    if isinstance(device, (str, torch.device)):
        return (_one_device(device),) * layers
    devices = tuple(_one_device(d) for d in device)
    if len(devices) != layers:
        raise ValueError(
            f"device= names {len(devices)} devices but the model has {layers} decoder layers; pass one "
            "device, or one per layer (kvquant.models.layer_devices(model))"
        )
    return devices


def _private_pools(plan: LayerPlan, batch: int, capacity: int, device: torch.device) -> LayerPools:
    """A private layer's pools, sized for its batch: FP pages for what the sink and window can hold, codec
    pages for `capacity` tokens."""
    bs = plan.block_size
    why = (
        ""
        if bs == plan.requested_block_size
        else (
            f", raised from {plan.requested_block_size} to hold whole token groups of "
            f"{plan.key_codec.token_group}/{plan.value_codec.token_group} (K/V)"
        )
    )
    # grown in bounded steps beyond this (kvquant.paging.pool.PagePool.reserve)
    fp = PagePool(plan.fp_fields(), plan.fp_block_size, device, plan.max_fp_pages * batch, "fp")
    body = PagePool(plan.body_fields(), bs, device, plan.body_pages(capacity) * batch, "body" + why)
    fp_b, body_b = plan.page_bytes()
    return LayerPools(fp, body, plan.key_codec, plan.value_codec, bs, plan.sliding_window, fp_b, body_b)


def _shared_pools(
    store: KVStore, i: int, plan: LayerPlan, dtype: torch.dtype, device: torch.device
) -> LayerPools:
    """Layer i's pools of a shared store, once the layer's plan is checked to fit them."""
    lp, shape = store.layers[i], store.shape
    if (plan.heads, plan.head_dim) != (shape.num_kv_heads, shape.head_dim):
        raise ValueError(
            f"the shared store holds {shape.num_kv_heads} KV heads of head_dim {shape.head_dim}, but "
            f"layer {i} got {plan.heads} of {plan.head_dim}; one store serves one model"
        )
    if (dtype, device) != (store.dtype, store.devices[i]):
        raise ValueError(
            f"the shared store holds layer {i}'s pages in {store.dtype} on {store.devices[i]}, but the layer "
            f"got {dtype} on {device}; make the store with the model's dtype and each layer's device "
            "(KVStore(..., device=kvquant.models.layer_devices(model)), as kvquant.serving.Engine does)"
        )
    if lp.sliding_window != plan.sliding_window:
        raise ValueError(
            f"layer {i}: the store's sliding window {lp.sliding_window} is not the "
            f"layer's {plan.sliding_window}"
        )
    if plan.body_fields() != lp.body.fields or plan.block_size != lp.block_size:
        raise ValueError(
            f"layer {i}: the shared store's body pages ({lp.block_size} tokens, {list(lp.body.fields)}) "
            "do not fit this layer's codecs; make the store with the cache's scheme and block size"
        )
    return lp
