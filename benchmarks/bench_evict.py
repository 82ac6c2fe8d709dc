"""Time to evict N cached units under a budget: the policy's scan at every eviction (the code before the
eviction order) against the order kept beside the pool (`kvquant.paging.evict`), per index kind and policy.

The index holds N units, in prompts of 16 units (distinct first tokens), all finished (only the index holds
their pages); the budget then evicts until nothing is left. process_time, min of --repeat runs (the machine
may be shared); the order's one walk over the index when the budget first evicts is counted in its time.

    python benchmarks/bench_evict.py --units 1000 4000 16000
"""

from __future__ import annotations

import argparse
import time

from transformers import LlamaConfig

from kvquant.paging import KVStore
from kvquant.paging.evict import EvictionPolicy, make_policy
from kvquant.paging.index import PageUnit

SCHEME = "int4-g32"
RUN = 16  # units per prompt


class Scan(EvictionPolicy):
    """A policy asked for its scan (`victim_ref`) at every eviction: no order."""

    def __init__(self, inner: EvictionPolicy):
        self.inner, self.name = inner, f"{inner.name} (scan)"

    def order(self, index):
        return None

    def victim(self, index):
        return self.inner.victim_ref(index)


def _config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
    )


def filled(kind: str, policy: EvictionPolicy, n_units: int) -> KVStore:
    store = KVStore(_config(), SCHEME, prefix_cache=kind, policy=policy)
    for r in range(n_units // RUN):
        units = [(r, j) for j in range(RUN)]
        pages = [PageUnit(False, tuple(lp.body.allocate() for lp in store.layers)) for _ in units]
        store.index.insert(units, pages)
        for pu in pages:  # finished: only the index holds the pages
            for lp, page in zip(store.layers, pu.body, strict=True):
                lp.body.decref(page)
    store.budget.budget_bytes = 1  # anything held is over it
    return store


def evict_all(
    kind: str, policy: EvictionPolicy, n_units: int, limit: int | None = None
) -> tuple[float, int, bool]:
    """(process seconds to evict every unit, evictions, whether estimated); with `limit`, only the first
    `limit` evictions are timed, the total estimated for a cost per eviction linear in what is left."""
    store = filled(kind, policy, n_units)
    total = n_units // RUN * (RUN if "radix-lru" not in policy.name else 1)  # evictions to empty it
    t0, n = time.process_time(), 0
    while (limit is None or n < limit) and store.budget._evict_one():
        n += 1
    dt = time.process_time() - t0
    if limit is not None and n < total:
        return dt * (total * total / 2) / (n * (total - n / 2)), total, True
    assert len(store.index) == 0 and store.pages_in_use() == 0
    return dt, n, False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, nargs="+", default=[1000, 4000, 16000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--scan-limit",
        type=int,
        default=None,
        help="scan: time this many evictions and estimate the rest, for index sizes over it (marked ~)",
    )
    ap.add_argument("--cases", nargs="+", default=["hash:lru", "radix:lru", "radix:radix-lru"])
    args = ap.parse_args()
    print(f"{'index:policy':18} {'units':>6} {'evictions':>9} {'scan s':>10} {'order s':>9} {'speedup':>8}")
    for case in args.cases:
        kind, name = case.split(":")
        for n in args.units:
            order = min(evict_all(kind, make_policy(name), n) for _ in range(args.repeat))
            limit = args.scan_limit if args.scan_limit is not None and n > args.scan_limit else None
            scan = min(evict_all(kind, Scan(make_policy(name)), n, limit) for _ in range(args.repeat))
            assert scan[1] == order[1], (scan, order)
            mark = "~" if scan[2] else " "
            print(
                f"{case:18} {n // RUN * RUN:6d} {order[1]:9d} {mark}{scan[0]:9.3f} {order[0]:9.4f} "
                f"{scan[0] / order[0]:7.0f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
