"""Shared helpers of the serving tests (prefix, evict, serve): engines on the tiny model whose page counts
are checked at the end of every test (import as `from serving_checks import ...`)."""

from __future__ import annotations

import torch

from kvquant.serving import Engine


class Engines:
    """Makes engines; `check_released` verifies every pool is consistent and back to zero references."""

    def __init__(self, model):
        self.model = model
        self.made: list[Engine] = []

    def __call__(self, scheme, **kwargs) -> Engine:
        engine = Engine(self.model, scheme, **kwargs)
        self.made.append(engine)
        return engine

    def check_released(self) -> None:
        for engine in self.made:
            engine.store.check()  # counts >= 0, free iff zero, no page twice on the free list
            if engine.index is not None:
                engine.index.clear()
            engine.store.check()
            assert engine.store.pages_in_use() == 0, f"{engine.store.pages_in_use()} pages still referenced"
            holders = [h for h in engine.store.holders if h != "prefix cache"]
            assert not holders, f"requests left open: {holders}"


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 5000, (n,), generator=g).tolist()


def same_attention_inputs(a, b) -> None:
    """Two caches hold, layer by layer, bit-identical decoded K/V in the same shape (float64 decode)."""
    for la, lb in zip(a.layers, b.layers, strict=True):
        va, vb = la.view(), lb.view()
        assert va.shape == vb.shape
        assert torch.equal(va.keys(torch.float64), vb.keys(torch.float64))
        assert torch.equal(va.values(torch.float64), vb.values(torch.float64))
