"""The evaluation on tiny random models of each KV shape a user meets: GQA, MQA, head_dim 64/128/256, and
Gemma-3-style sliding-window layers (tests/test_sliding.py checks the cache itself on such a model; here the
three modes run through it), and left-padded batches. An unquantized scheme through the kvquant cache must
equal the reference; a quantized one must differ, with finite values."""

from __future__ import annotations

import math

import pytest
import torch
from kvquant.eval.measure import REFERENCE, evaluate_document, make_buckets
from kvquant.eval.runner import memory_of
from kvquant.eval.schemes import parse_eval_scheme
from tiny_models import make_tiny_gemma, make_tiny_model

import kvquant

LENGTH = 96


def _gemma(head_dim: int = 256):
    return make_tiny_gemma(head_dim=head_dim, final_logit_softcapping=30.0)


SHAPES = {
    "gqa-d64": lambda: make_tiny_model(num_hidden_layers=1, vocab_size=512),
    "mqa-d128": lambda: make_tiny_model(
        num_hidden_layers=1,
        vocab_size=512,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        hidden_size=128,
    ),
    "gemma-sliding-mqa-d256": _gemma,
}


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request):
    return SHAPES[request.param]()


@pytest.mark.parametrize("mode", ["cache", "fake", "prefill"])
def test_modes_on_each_shape(model, mode):
    torch.manual_seed(1)
    ids = torch.randint(1, 512, (1, LENGTH))
    buckets = make_buckets(LENGTH, edges=(0, 48, 256))
    schemes = [parse_eval_scheme(s) for s in ("fp16", "int2-g32")]
    out = evaluate_document(
        model, ids, schemes, mode=mode, chunk=20, buckets=buckets, prefill=40 if mode == "prefill" else None
    )
    for b in buckets:
        ref, fp, q = out[REFERENCE][b], out["kvquant:fp16"][b], out["int2-g32"][b]
        # float32 rounding only (the sums run over up to 48 tokens)
        assert fp.nll == pytest.approx(ref.nll, rel=1e-5) and fp.kl == pytest.approx(0, abs=1e-4)
        assert math.isfinite(q.nll) and q.tokens == ref.tokens
    last = buckets[-1]
    assert out["int2-g32"][last].kl > 1e-6  # the quantized cache is read


def test_sliding_layers_count_at_their_window():
    model = _gemma()
    mem = memory_of([parse_eval_scheme("int8")], model.config, "float16")
    per_token_layer = 2 * 1 * 256 * 2  # K and V, 1 head, D 256, FP16
    # 2 sliding layers hold at most their window (16 tokens), the full layer every token
    assert mem[REFERENCE].held(1000) == per_token_layer * (1000 + 2 * 16)
    assert mem["int8"].held(1000) == kvquant.memory.cache_bytes(model.config, "int8", 1000)
    # past the window only the full layer grows: 512 more tokens cost one layer's int8 K and V (256 codes +
    # one FP16 scale per token each), not three layers'
    assert mem["int8"].held(1024) - mem["int8"].held(512) == 512 * 2 * (256 + 2)


def _chunked_logits(model, ids, mask, scheme, chunk: int) -> torch.Tensor:
    """Logits of a (left-padded) batch fed `chunk` tokens at a time through the scheme's cache, positions
    counted from each row's first real token (as `generate` does)."""
    cache = parse_eval_scheme(scheme).make_cache(model.config, "cache")
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    out = []
    for a in range(0, ids.shape[1], chunk):
        b = min(a + chunk, ids.shape[1])
        step = model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=pos[:, a:b], cache=cache,
                     use_cache=True)
        out.append(step.logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("scheme", ["fp16", "int8", "int4-g32"])
def test_left_padded_batch_equals_each_sequence_alone(model, scheme):
    """A batch of two sequences, the shorter left-padded, through the cache in chunks: each row's logits equal
    that sequence's run alone (other chunk boundaries; float64, so rounding cannot hide a mask or position
    error). Per-token schemes only: a scheme grouping keys over tokens (KIVI's per-channel keys) would put the
    pad tokens into the first group's scale."""
    import copy

    model = copy.deepcopy(model).double()
    torch.manual_seed(2)
    long, short, pad = torch.randint(1, 512, (1, 40)), torch.randint(1, 512, (1, 28)), 12
    ids = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    with torch.inference_mode():
        both = _chunked_logits(model, ids, mask, scheme, 16)
        alone = [_chunked_logits(model, x, torch.ones_like(x), scheme, 16) for x in (long, short)]
        unmasked = _chunked_logits(model, ids, torch.ones_like(ids), scheme, 16)
    torch.testing.assert_close(both[0], alone[0][0], rtol=0, atol=1e-9)
    torch.testing.assert_close(both[1, pad:], alone[1][0], rtol=0, atol=1e-9)
    assert (unmasked[1, pad:] - alone[1][0]).abs().max() > 1e-3  # the mask is what keeps the pads out
