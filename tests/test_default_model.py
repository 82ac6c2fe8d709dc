"""The real default model (SmolLM2-135M, fp32 on the CPU): quantized caches generate sensibly, fp16 is
DynamicCache token for token, and bytes held == formula."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvquant
from kvquant import memory

pytestmark = pytest.mark.slow

NEW = 32
PROMPT = "The history of the Roman Empire begins with"


@pytest.fixture(scope="module")
def setup(default_model):
    """The model, the prompt ids, fp16 (DynamicCache) greedy output and its teacher-forced logits."""
    model, tok = default_model
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(
            ids,
            cache=DynamicCache(config=model.config),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
        )
        logits = model(ref, cache=DynamicCache(config=model.config)).logits
    return model, ids, ref, logits


def _generate(model, ids, scheme):
    cache = kvquant.QuantizedCache(scheme, model.config)
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out, cache


def test_fp16_identical_to_dynamic_cache(setup):
    model, ids, ref, logits = setup
    out, _ = _generate(model, ids, "fp16")
    assert torch.equal(out, ref)
    with torch.no_grad():
        ours = model(ref, cache=kvquant.QuantizedCache("fp16", model.config)).logits
    torch.testing.assert_close(ours, logits, atol=1e-4, rtol=0)


# measured: int8 97% teacher-forced agreement, KL 0.0008, first free-running difference at token 10;
# int4-g64 84%, KL 0.085, first difference at token 4
@pytest.mark.parametrize(
    "scheme, min_agree, max_kl, same_prefix", [("int8", 0.9, 0.01, 6), ("int4-g64", 0.7, 0.3, 0)]
)
def test_quantized_generation(setup, scheme, min_agree, max_kl, same_prefix):
    model, ids, ref, logits = setup
    p = ids.shape[1]
    # teacher-forced on fp16's text: next-token choices mostly as fp16's, distributions close
    with torch.no_grad():
        q = model(ref, cache=kvquant.QuantizedCache(scheme, model.config)).logits
    agree = (q[0, p - 1 : -1].argmax(-1) == logits[0, p - 1 : -1].argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(
        q.log_softmax(-1), logits.log_softmax(-1), log_target=True, reduction="none"
    )
    assert agree >= min_agree, f"{scheme}: {agree:.0%} of next tokens as fp16"
    assert 0 < kl.sum(-1).mean().item() < max_kl
    # free-running greedy generation
    out, cache = _generate(model, ids, scheme)
    assert out.shape == (1, p + NEW)
    assert torch.equal(out[0, p : p + same_prefix], ref[0, p : p + same_prefix])
    assert len(set(out[0, p:].tolist())) > 8  # not a degenerate repetition
    # the cache holds every token fed (prompt + all generated but the last), in the formula's bytes
    assert cache.get_seq_length() == p + NEW - 1
    assert cache.nbytes() == memory.cache_bytes(model.config, scheme, p + NEW - 1, dtype=torch.float32)
    assert cache.nbytes() < memory.cache_bytes(model.config, "fp16", p + NEW - 1, dtype=torch.float32) / 3.5


@pytest.mark.parametrize("scheme", ["int4-g64", "k=int4-channel-g64,v=int4-g64,sink=4,window=128", "kivi-2"])
def test_paged_body_is_the_old_layouts_arithmetic(default_model, scheme):
    """On a real-model run (300 tokens in chunks of 128), every layer's stored body decodes bit for bit to
    dequantize(quantize(.)) of the K/V the model gave that layer, quantized as one tensor: what the
    previous, unpaged layout stored (it appended quantize() of each flushed group; blocks never span a flush
    boundary, so one call over all body tokens gives the same codes). Pages change where bytes live, not
    which bytes."""
    model, tok = default_model
    ids = tok(PROMPT * 40, return_tensors="pt").input_ids[:, :300]
    cache = kvquant.QuantizedCache(scheme, model.config)
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in range(len(cache.layers))}
    for i, layer in enumerate(cache.layers):
        update = layer.update

        def spy(k, v, *args, _update=update, _i=i, **kwargs):
            seen[_i].append((k.clone(), v.clone()))
            return _update(k, v, *args, **kwargs)

        layer.update = spy
    with torch.no_grad():
        for start in range(0, 300, 128):
            model(ids[:, start : start + 128], cache=cache)
    s = cache.scheme
    for i, layer in enumerate(cache.layers):
        k = torch.cat([kv[0] for kv in seen[i]], dim=2)
        v = torch.cat([kv[1] for kv in seen[i]], dim=2)
        lo, hi = s.sink, s.quantized_end(300)
        assert layer.body_len == hi - lo > 0
        view = layer.view()
        for got, x, spec in ((view.keys(torch.float32), k, s.key), (view.values(torch.float32), v, s.value)):
            want = kvquant.dequantize(kvquant.quantize(x[:, :, lo:hi], spec))
            assert torch.equal(got[:, :, lo:hi], want), (scheme, i)
            assert torch.equal(got[:, :, :lo], x[:, :, :lo]) and torch.equal(got[:, :, hi:], x[:, :, hi:])


def test_decode_exact_chunks_equal_token_by_token_in_float64(default_model):
    """Issue 11's question (a token-by-token decode diverges from chunked runs in float32: a defect, or
    rounding?) answered on the real model: in float64, int4-g64 logits through the cache in one chunk, in
    shifted chunks and one token at a time agree to 1e-4 (measured 1.3e-5 at 512 tokens), so the decode-exact
    path computes the same thing; float32 rounding alone flips codes (measured there: logits apart by 6.9)."""
    import copy

    model, tok = default_model
    model64 = copy.deepcopy(model).to(torch.float64)  # the session's model stays float32
    ids = tok(PROMPT * 20, return_tensors="pt").input_ids[:, :96]

    def logits(bounds):
        cache = kvquant.QuantizedCache("int4-g64", model64.config)
        with torch.no_grad():
            steps = zip(bounds, bounds[1:], strict=False)
            return torch.cat([model64(ids[:, a:b], cache=cache).logits for a, b in steps], 1)

    one = logits([0, 96])
    torch.testing.assert_close(logits([0, 31, 63, 96]), one, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits(list(range(97))), one, atol=1e-4, rtol=0)
