"""Bytes by formula: the FP16 baseline, known models, effective bits and savings.
(That the formula equals what a cache measures is in test_cache.py.)"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_config

from kvquant import memory
from kvquant.memory import KNOWN_SHAPES, KVShape


@pytest.mark.parametrize("shape", list(KNOWN_SHAPES.values()), ids=list(KNOWN_SHAPES))
@pytest.mark.parametrize("dtype, b", [(torch.float16, 2), (torch.bfloat16, 2), (torch.float32, 4), (2, 2)])
def test_fp16_formula(shape, dtype, b):
    expected = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * b
    assert memory.fp16_bytes_per_token(shape, dtype) == expected
    assert memory.bytes_per_token(shape, "fp16", dtype) == expected
    # pages of 16 tokens: 100 tokens take 7 pages (112 tokens' worth), 112 take the same, 113 one more
    assert memory.cache_bytes(shape, "fp16", 100, batch=3, dtype=dtype) == 3 * 112 * expected
    assert memory.cache_bytes(shape, "fp16", 112, batch=3, dtype=dtype) == 3 * 112 * expected
    assert memory.cache_bytes(shape, "fp16", 113, batch=3, dtype=dtype) == 3 * 128 * expected
    assert memory.cache_bytes(shape, "fp16", 100, dtype=dtype, block_size=1) == 100 * expected


def test_llama3_70b_numbers():
    shape = KNOWN_SHAPES["llama-3-70b"]
    per_token = memory.fp16_bytes_per_token(shape)
    assert per_token == 327_680 == 320 * 1024
    total = memory.cache_bytes(shape, "fp16", 4096)
    assert total == 327_680 * 4096
    assert total / 1e9 == pytest.approx(1.34, abs=0.005)  # ~1.34 GB
    assert total / 2**30 == pytest.approx(1.25)  # = 1.25 GiB


def test_from_config():
    config = make_tiny_config()
    assert KVShape.from_config(config) == KVShape(2, 2, 64)
    assert KVShape.from_config(KNOWN_SHAPES["llama-3-8b"]) is KNOWN_SHAPES["llama-3-8b"]
    # head_dim defaults to hidden // heads; kv heads default to the query heads
    config = make_tiny_config(head_dim=None, num_key_value_heads=None)
    assert KVShape.from_config(config) == KVShape(2, 6, 192 // 6)


L70 = KNOWN_SHAPES["llama-3-70b"]  # 8 KV heads x 128


@pytest.mark.parametrize(
    "scheme, bits",
    [
        ("fp16", 16.0),
        ("int8", 8 + 16 / 1024),  # one fp16 scale per token over 8 x 128 values
        ("int8-asym", 8 + 32 / 1024),  # scale and zero
        ("int8-sfp32", 8 + 32 / 1024),  # one fp32 scale
        ("int8-head", 8 + 16 / 128),
        ("int4-g64", 4 + 32 / 64),  # fp16 scale and zero per 64 channels
        ("int4-g128", 4 + 32 / 128),
        ("int4-g64-sym", 4 + 16 / 64),
        ("int2-g32", 2 + 1.0),
        ("int4-channel-g64", 4 + 32 / 64),  # per (head, channel) over 64 tokens
        ("k=int4-channel-g32,v=int2-g32", (4 + 1 + 2 + 1) / 2),
        ("kivi-2", 3.0),  # window tokens are not steady state
    ],
)
def test_effective_bits(scheme, bits):
    assert memory.effective_bits(L70, scheme) == pytest.approx(bits, rel=1e-12)
    assert memory.saving(L70, scheme) == pytest.approx(16 / bits, rel=1e-12)


def test_savings_sensible():
    order = ["fp16", "int8-head", "int8", "int4-g32", "int4-g64", "int4-g128", "int2-g32", "int2-g64"]
    savings = [memory.saving(L70, s) for s in order]
    assert savings[0] == 1.0
    assert 1.9 < savings[1] < savings[2] < 2.0
    assert 3.0 < memory.saving(L70, "int4-g64") < 4.0
    assert 4.0 < memory.saving(L70, "int2-g32") < 8.0
    assert sorted(savings) == savings  # fewer bits, larger groups: smaller cache
    # 70B at int4-g64 for 4k tokens: ~1.34 GB / 3.56
    assert memory.cache_bytes(L70, "int4-g64", 4096) == 4096 * 80 * 2 * (8 * 64 + 8 * 2 * 2 * 2)


def test_cache_bytes_sink_window_and_channel_groups():
    """Pages of 16 tokens, counted by hand: sink | body | recent, each region rounded up to whole pages."""
    s = KVShape(1, 1, 64)
    # sink=4, window=8, K channel-g16: after T tokens, sink min(T, 4), body a multiple of 16 with >= 8 left;
    # recent tokens (position p >= 4) sit in logical page (p - 4) // 16.
    scheme = "k=int4-channel-g16,v=int4-g16,sink=4,window=8"
    for t, fp_pages, body in [
        (0, 0, 0),
        (3, 1, 0),  # sink page
        (12, 2, 0),  # sink page + recent 4..11 (page 0)
        (27, 3, 0),  # sink + recent 4..26 (pages 0, 1)
        (28, 2, 16),  # sink + recent 20..27 (page 1); body page 0
        (43, 3, 16),  # sink + recent 20..42 (pages 1, 2)
        (44, 2, 32),  # sink + recent 36..43 (page 2); body pages 0, 1
    ]:
        expected = 2 * fp_pages * 16 * 64 * 2
        expected += body * 32 + (body // 16) * 64 * 2 * 2  # K: codes + per-channel scale/zero per 16 tokens
        expected += body * 32 + body * 4 * 2 * 2  # V: codes + scale/zero per 16 channels
        assert memory.cache_bytes(s, scheme, t) == expected, t


@pytest.mark.parametrize("scheme", ["int4-g64,sink=4", "k=int4-channel-g64,v=int4-g64,sink=4,window=128"])
def test_prefix_bytes_take_a_byte_count_or_a_dtype(scheme):
    """shared_prefix_bytes and window_copy_bytes accept dtype as a torch dtype or its byte count, like every
    bytes function here (shared_prefix_bytes used to fail on an int)."""
    cfg = make_tiny_config()
    for fn in (memory.shared_prefix_bytes, memory.window_copy_bytes):
        assert fn(cfg, scheme, 1000, 600, dtype=2) == fn(cfg, scheme, 1000, 600, dtype=torch.float16)
    assert memory.shared_prefix_bytes(cfg, scheme, 1000, 600, dtype=2) > 0


def test_capacity_of_a_per_layer_scheme():
    """A layers= scheme (vLLM's --kv-cache-dtype-skip-layers, TurboQuant's boundary layers) sizes each layer
    with its own plan: without a shared prefix capacity is M // request; with one, the shared pages are the
    sum of each layer's (here one FP16 layer and one int8-head layer of a 2-layer model)."""
    from kvquant.scheme import parse_scheme

    shape = KVShape(2, 2, 64)
    mixed = parse_scheme("layers=0:fp16+1:int8-head")
    budget, context, prefix = 10_000_000, 1024, 512
    plain = memory.capacity(shape, mixed, budget, context)
    assert plain.requests == budget // memory.cache_bytes(shape, mixed, context)
    one = KVShape(1, 2, 64)
    parts = [memory.capacity(one, parse_scheme(s), budget, context, shared_prefix=prefix).shared_bytes
             for s in ("fp16", "int8-head")]
    shared = memory.capacity(shape, mixed, budget, context, shared_prefix=prefix)
    assert shared.shared_bytes == sum(parts) > 0 and shared.requests > plain.requests
