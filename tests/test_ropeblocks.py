"""rbqB-lfPbH (kvquant.codecs.ropeblocks): RoPE frequency blocks of the head dim at different bits. The
grammar, the blocks (the P lowest-frequency pairs of the rotate-half layout), codes equal to the integer
codec applied to each block alone, bytes == the formula, and the cache decode-exact with pre-RoPE keys."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

import kvquant
from kvquant import memory
from kvquant.codecs.base import codec_for
from kvquant.scheme import SchemeError, parse_scheme, parse_spec


@pytest.mark.parametrize(
    ("text", "canonical"),
    [("rbq2-lf8b4-channel-g64-prerope", "rbq2-lf8b4-channel-g64-prerope"), ("RBQ2-LF8B4", "rbq2-lf8b4-head"),
     ("rbq4-lf16b8-g16", "rbq4-lf16b8-g16")],
)
def test_round_trip(text, canonical):
    s = parse_spec(text)
    assert str(s) == canonical and parse_spec(str(s)) == s


@pytest.mark.parametrize(
    ("text", "match"),
    [("rbq2-lf8b2", "same bits"), ("rbq3-lf8b4", "one of"), ("rbq2-lf8b4-rot", "write rbq"),
     ("rbq2-lf32b4", "1 to 31"), ("rbq2-lf12b4-g16", "inside each block")],
)
def test_refusals(text, match):
    with pytest.raises(SchemeError, match=match):
        parse_spec(text).check_head_dim(64)


def test_blocks_are_the_lowest_frequency_pairs():
    """Rotate-half: channel c and c + D/2 turn at base^(-2c/D), so the P lowest frequencies are the last P
    of each half."""
    lo, hi = parse_spec("rbq2-lf3b4").family.blocks(16)
    assert hi == [5, 6, 7, 13, 14, 15] and sorted(lo + hi) == list(range(16))


def test_codes_are_each_blocks_integer_codec():
    """Bit for bit what int2 / int4 with the same grain store for the two channel sets taken apart."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 128, 64, generator=g) * torch.linspace(0.2, 4, 64)
    c = codec_for("rbq2-lf8b4-channel-g64", 3, 64, torch.float32)
    lo, hi = parse_spec("rbq2-lf8b4").family.blocks(64)
    got = c.encode(x)
    for prefix, spec, ch in (("lo", "int2-channel-g64", lo), ("hi", "int4-channel-g64", hi)):
        want = codec_for(spec, 3, len(ch), torch.float32).encode(x[..., ch])
        for name, t in want.items():
            assert torch.equal(got[f"{prefix}.{name}"], t)
    y = c.decode(got, torch.float32)
    err = (x - y).pow(2).mean(dim=(0, 1, 2))
    assert err[hi].mean() < err[lo].mean() / 4  # the 4-bit block is the finer one (can fail)
    assert c.bytes(128) == 3 * 128 * (48 * 2 + 16 * 4) // 8 + 3 * 2 * 2 * 64 * 4  # codes + scale/zero


def test_cache_with_prerope_keys_is_decode_exact_and_counts_its_bytes():
    model = make_tiny_model(seed=5).double()
    scheme = "k=rbq2-lf8b4-channel-g16-prerope,v=int2-g16,sink=2,window=8"
    ids = torch.randint(1, 5000, (1, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole_cache = kvquant.QuantizedCache(scheme, model.config)
        whole = model(ids, cache=whole_cache).logits
        step_cache = kvquant.QuantizedCache(scheme, model.config)
        steps = torch.cat([model(ids[:, i : i + 1], cache=step_cache).logits for i in range(60)], dim=1)
    torch.testing.assert_close(whole, steps, atol=1e-9, rtol=0)
    assert whole_cache.nbytes() == memory.cache_bytes(model.config, scheme, 60, dtype=torch.float64)
    bits = memory.effective_bits(model.config, parse_scheme(scheme))
    assert bits == pytest.approx(((2 * 48 + 4 * 16) / 64 + 2 * 16 / 16 + 2 + 2 * 16 * 4 / 64) / 2)
