"""Pre-RoPE keys (`-prerope`): the rotary embedding inverted exactly, FP16 storage equal to the model,
decode-exact chunks, the RoPE types that work and those refused, and the reference-path fallback."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_config, make_tiny_model
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import kvquant
from kvquant import memory
from kvquant.codecs.base import PreRopeCodec, codec_for
from kvquant.rope import Rope, RopeError
from kvquant.scheme import SchemeError


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 5000, (batch, length), generator=torch.Generator().manual_seed(seed))


def _run(model, ids, cache, chunk):
    return torch.cat(
        [model(ids[:, i : i + chunk], cache=cache).logits for i in range(0, ids.shape[1], chunk)], 1
    )


@pytest.fixture(scope="module")
def model64():
    return make_tiny_model(seed=5).double()


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 512,
    },
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_matches_the_model_and_inverts_exactly(kind):
    config = make_tiny_config(rope_parameters=ROPES[kind])
    rope = Rope.from_config(config)
    emb = LlamaRotaryEmbedding(config)
    k = torch.randn(2, 2, 37, 64)
    pos = torch.arange(100, 137)[None].expand(2, -1)
    cos, sin = emb(k, pos)
    _, model_k = apply_rotary_pos_emb(k, k, cos, sin)
    assert torch.equal(rope.apply(k, 100), model_k)  # the same float32 ops, bit for bit
    k64 = k.double()
    assert (rope.invert(rope.apply(k64, 100), 100) - k64).abs().max() < 1e-13
    assert (rope.apply(rope.invert(k64, 7), 7) - k64).abs().max() < 1e-13


@pytest.mark.parametrize(
    "params, match",
    [
        ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, "dynamic"),
        (
            {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 32,
                "long_factor": [2.0] * 32,
                "original_max_position_embeddings": 512,
            },
            "longrope",
        ),
    ],
)
def test_rope_types_that_change_with_length_are_refused(params, match):
    config = make_tiny_config(rope_parameters=params)
    with pytest.raises(RopeError, match=match):
        Rope.from_config(config)
    with pytest.raises(ValueError, match="-prerope"):
        kvquant.QuantizedCache("k=int4-g32-prerope,v=int4-g32", config)


def test_unsupported_model_type_is_refused():
    from transformers import GPT2Config

    with pytest.raises(RopeError, match="model type 'gpt2'"):
        Rope.from_config(GPT2Config())


@pytest.mark.parametrize("scheme", ["k=fp16-prerope,v=fp16", "k=fp16-prerope,v=int4-g32,sink=3,window=7"])
@pytest.mark.parametrize("chunk", [1, 13, 50])
def test_fp16_prerope_storage_equals_the_model(model64, scheme, chunk):
    """Keys stored un-rotated in FP and re-rotated on read: exactly the model's keys (float64 rounding)."""
    ids = _ids(2, 50, seed=3)
    plain = scheme.replace("fp16-prerope", "fp16")
    got = _run(model64, ids, kvquant.QuantizedCache(scheme, model64.config), chunk)
    want = _run(model64, ids, kvquant.QuantizedCache(plain, model64.config), chunk)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    if plain == "k=fp16,v=fp16":
        fp = model64(ids, cache=DynamicCache(config=model64.config)).logits
        torch.testing.assert_close(got, fp, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "scheme", ["k=int4-channel-g8-prerope,v=int4-g16,sink=3,window=10", "k=int2-g32-prerope,v=fp16,window=4"]
)
def test_prerope_chunked_equals_token_by_token(model64, scheme):
    ids = _ids(2, 41, seed=8)
    one = kvquant.QuantizedCache(scheme, model64.config)
    decoded = _run(model64, ids, one, 1)
    chunked = _run(model64, ids, kvquant.QuantizedCache(scheme, model64.config), 16)
    torch.testing.assert_close(chunked, decoded, atol=1e-9, rtol=0)
    assert one.nbytes() == memory.cache_bytes(model64.config, scheme, 41, batch=2, dtype=torch.float64)
    post = _run(model64, ids, kvquant.QuantizedCache(scheme.replace("-prerope", ""), model64.config), 1)
    assert (decoded - post).abs().max() > 1e-6  # quantizing before RoPE is a different quantizer


def test_prerope_generate_and_left_padding(model64):
    """Padded rows see their keys re-rotated by the same angles they were un-rotated with: the pre-RoPE
    FP cache still equals the model."""
    ids = _ids(2, 12, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    fp = model64.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    got = model64.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        cache=kvquant.QuantizedCache("k=fp16-prerope,v=fp16", model64.config),
    )
    assert torch.equal(got, fp)


def test_prerope_codec_takes_the_reference_path_and_needs_positions():
    c = codec_for("int4-g32-prerope", 2, 64, torch.float32)
    assert isinstance(c, PreRopeCodec) and c.kernel_layout() is None
    assert c.fields() == codec_for("int4-g32", 2, 64, torch.float32).fields()
    with pytest.raises(SchemeError, match="positions"):
        c.encode(torch.randn(1, 2, 3, 64))
    with pytest.raises(SchemeError, match="model's config"):
        c.encode_at(torch.randn(1, 2, 3, 64), 0)
    with pytest.raises(ValueError, match="model's config"):
        kvquant.QuantizedCache("k=int4-g32-prerope,v=int4-g32")


def test_gemma3_keeps_one_rope_per_layer_type():
    """Gemma-3's local layers rotate at base 10,000, its global ones at 1,000,000: each layer's Rope is the
    model's own for its layer type, bit for bit, and a layer must be named."""
    from tiny_models import make_tiny_gemma
    from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb as gemma_rotary

    model = make_tiny_gemma()
    config = model.config
    ropes = Rope.for_layers(config)
    assert len(ropes) == 3 and ropes[0] is ropes[1] and ropes[2] is not ropes[0]
    assert not torch.equal(ropes[0].inv_freq, ropes[2].inv_freq)
    emb = model.model.rotary_emb
    k = torch.randn(1, 1, 9, 64)
    pos = torch.arange(40, 49)[None]
    for layer, kind in enumerate(config.layer_types):
        cos, sin = emb(k, pos, kind)
        _, want = gemma_rotary(k, k, cos, sin)
        assert torch.equal(ropes[layer].apply(k, 40), want)
        assert Rope.from_config(config, layer).inv_freq.equal(ropes[layer].inv_freq)
    with pytest.raises(RopeError, match="one RoPE per layer type"):
        Rope.from_config(config)
    with pytest.raises(RopeError, match="layer 3"):
        Rope.from_config(config, 3)


@pytest.mark.parametrize(
    "scheme", ["k=fp16-prerope,v=fp16", "k=int4-channel-g8-prerope,v=int4-g16,sink=2,window=6"]
)
def test_gemma3_prerope_cache(scheme):
    """On Gemma-3 (sliding and global layers, two RoPE bases), pre-RoPE FP16 keys give the model's own
    logits, and quantized pre-RoPE keys are decode-exact: chunked prefill equals token by token."""
    from tiny_models import make_tiny_gemma

    model = make_tiny_gemma().double()
    ids = torch.randint(1, 500, (1, 40), generator=torch.Generator().manual_seed(4))
    got = _run(model, ids, kvquant.QuantizedCache(scheme, model.config), 1)
    chunked = _run(model, ids, kvquant.QuantizedCache(scheme, model.config), 16)
    torch.testing.assert_close(chunked, got, atol=1e-9, rtol=0)
    if scheme == "k=fp16-prerope,v=fp16":
        fp = model(ids, cache=DynamicCache(config=model.config)).logits
        torch.testing.assert_close(got, fp, atol=1e-10, rtol=0)
    else:
        post = _run(model, ids, kvquant.QuantizedCache(scheme.replace("-prerope", ""), model.config), 1)
        assert (got - post).abs().max() > 1e-6  # quantized before RoPE: another quantizer
