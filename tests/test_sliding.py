"""Sliding-window layers (Gemma-3 style `layer_types`): the cache keeps only the pages a layer's window can
still reach, attention equals transformers' own sliding cache, and bytes stay flat past the window."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_gemma
from transformers import DynamicCache

import kvquant
from kvquant import memory

WINDOW = 16


def _tiny_gemma(dtype=torch.float32):
    return make_tiny_gemma(head_dim=64, sliding_window=WINDOW, dtype=dtype)


@pytest.fixture(scope="module")
def gemma():
    return _tiny_gemma()


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 512, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _run(model, ids, cache, chunks):
    out, start = [], 0
    for n in chunks:
        out.append(model(ids[:, start : start + n], cache=cache).logits)
        start += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("chunks", [[70], [1] * 70, [20, 1, 1, 30, 18], [5] * 14], ids=str)
def test_fp16_equals_transformers_sliding_cache(gemma, chunks):
    ids = _ids(70)
    ref = _run(gemma, ids, DynamicCache(config=gemma.config), chunks)
    cache = kvquant.QuantizedCache("fp16", gemma.config)
    got = _run(gemma, ids, cache, chunks)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert [layer.is_sliding for layer in cache.layers] == [True, True, False]
    for layer in cache.layers:
        layer.check()


@pytest.mark.parametrize(
    "scheme", ["fp16", "int8", "int4-g32,window=8", "k=int4-channel-g16,v=int4-g16,sink=2"]
)
def test_bytes_flat_past_the_window_and_equal_the_formula(gemma, scheme):
    cache = kvquant.QuantizedCache(scheme, gemma.config)
    ids = _ids(120, seed=1)
    sliding_bytes, full_bytes = [], []
    for t in range(120):
        _run(gemma, ids[:, t : t + 1], cache, [1])
        assert cache.nbytes() == memory.cache_bytes(gemma.config, scheme, t + 1, dtype=torch.float32), t
        sliding_bytes.append(cache.layers[0].nbytes())
        full_bytes.append(cache.layers[2].nbytes())
    # a sliding layer holds at most window - 1 + one page of tokens (plus an FP page of the scheme's window)
    assert max(sliding_bytes[60:]) == max(sliding_bytes[40:60])
    assert full_bytes[-1] > full_bytes[59] and full_bytes[-1] > max(
        sliding_bytes[60:]
    )  # the full layer grows
    assert cache.layers[0].get_mask_sizes(1)[1] > 0  # its view starts past position 0


def test_quantized_sliding_layers_match_an_unbounded_cache(gemma):
    """Releasing pages behind the window changes nothing the model can see: a quantized cache whose sliding
    layers keep every token (the config without layer types) gives the same logits when the mask hides
    the same keys. Here: compare chunked vs token-by-token decoding, both bounded (decode-exact)."""
    gemma64 = _tiny_gemma(torch.float64)
    ids = _ids(60, seed=2)
    scheme = "int4-g32,window=8"
    one = _run(gemma64, ids, kvquant.QuantizedCache(scheme, gemma64.config), [1] * 60)
    chunked = _run(gemma64, ids, kvquant.QuantizedCache(scheme, gemma64.config), [25, 1, 34])
    torch.testing.assert_close(chunked, one, atol=1e-9, rtol=0)


def test_layer_classes_match_what_they_store(gemma):
    """Each decoder layer gets the class of its kind: SlidingLayer (no sink, releases what falls behind the
    window) on sliding layers, FullLayer elsewhere; `QuantizedLayer(...)` picks the same way."""
    from kvquant.cache import FullLayer, QuantizedLayer, SlidingLayer

    cache = kvquant.QuantizedCache("int4-g32,sink=4", gemma.config)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [SlidingLayer, SlidingLayer, FullLayer]
    assert [layer.scheme.sink for layer in cache.layers] == [0, 0, 4]
    with torch.no_grad():
        gemma(_ids(3 * WINDOW), cache=cache)
    assert cache.layers[0].dropped > 0 and cache.layers[2].dropped == 0  # the sliding layer released pages
    assert type(QuantizedLayer("int8")) is FullLayer
    sliding = QuantizedLayer("int8,sink=4", sliding_window=8)
    assert type(sliding) is SlidingLayer and sliding.scheme.sink == 0 and isinstance(sliding, QuantizedLayer)
    with pytest.raises(ValueError, match="a SlidingLayer"):
        FullLayer("int8", sliding_window=8)
    with pytest.raises(ValueError, match="positive number of tokens"):
        SlidingLayer("int8", sliding_window=0)
    with pytest.raises(ValueError, match="not shared across sliding-window layers"):
        sliding.adopt_prefix(0, [], [], 0, [])
