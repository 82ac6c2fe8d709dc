"""The `fake` evaluation mode's cache: one forward over the whole text, every query seeing every key as
kvquant's cache would store it (sink exact, body quantized-and-dequantized, window exact), by the same
`LayerPlan` a `kvquant.QuantizedCache` layer has.

Below both `measure` (which runs the modes) and `schemes` (whose `KVQuantScheme.make_cache` builds this cache
for mode "fake"): neither imports the other for it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

import kvquant
from kvquant.plan import LayerPlan
from kvquant.scheme import Scheme, require_scheme

__all__ = ["FakeQuantCache", "FakeQuantLayer"]


def _fake_quantize_stored(x: torch.Tensor, plan: LayerPlan, spec) -> torch.Tensor:
    """x (B, H_kv, T, D) as a QuantizedCache fed x at once would store it, by the layer's plan: the first
    `sink` tokens exact (none on a sliding layer), then whole token groups quantized-and-dequantized, then at
    least `window` tokens (and any incomplete channel group) exact."""
    t = x.shape[2]
    sink = min(plan.sink, t)
    body = plan.quantized_end(t) - sink
    if body <= 0 or not spec.is_quantized:
        return x
    mid = kvquant.fake_quantize(x[:, :, sink : sink + body], spec)
    return torch.cat([x[:, :, :sink], mid, x[:, :, sink + body :]], dim=2)


class FakeQuantLayer(DynamicLayer):
    """Stores K/V exactly; `update` returns everything stored, fake-quantized as a QuantizedCache holding
    those tokens would read back after one update (sink exact, body quantized from the sink on, window
    exact), by the same `LayerPlan` the cache's layer has (so a sliding layer drops its sinks here too).
    Each update re-derives the body from exact values: use it for single-forward (fake) evaluation."""

    def __init__(self, scheme: Scheme, sliding_window: int | None = None):
        super().__init__()
        self.scheme, self.sliding_window = scheme, sliding_window
        self.plan: LayerPlan | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if self.plan is None:
            _, h, _, d = key_states.shape
            self.plan = LayerPlan.build(
                self.scheme, heads=h, head_dim=d, dtype=key_states.dtype, sliding_window=self.sliding_window
            )
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        return (
            _fake_quantize_stored(keys, self.plan, self.scheme.key),
            _fake_quantize_stored(values, self.plan, self.scheme.value),
        )


class FakeQuantCache(Cache):
    """Layers return fake-quantized K/V as plain tensors (kvquant attention hands them to SDPA)."""

    def __init__(self, scheme: Scheme, config=None):
        self.scheme = require_scheme(scheme, "FakeQuantCache")  # parsed once, at the entry point
        if self.scheme.salient is not None:
            raise ValueError(
                f"salient={self.scheme.salient} chooses tokens from the attention a cache sees; fake mode "
                "has no cache: run it in cache or prefill mode"
            )
        if config is None:
            if self.scheme.layers:
                raise ValueError(f"scheme {self.scheme} has per-layer specs: pass the model's config")
            super().__init__(layer_class_to_replicate=lambda: FakeQuantLayer(self.scheme))
            return
        shape = kvquant.memory.KVShape.from_config(config)
        self.scheme.check_head_dim(shape.head_dim)
        self.scheme.check_num_layers(shape.num_layers)
        n = shape.num_layers
        layers = [FakeQuantLayer(self.scheme.for_layer(i), shape.window_of(i)) for i in range(n)]
        super().__init__(layers=layers)
