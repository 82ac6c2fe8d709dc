"""Prefix caching on the shared store: a hit gives bit-identical attention inputs and logits to recomputing
(float64 tiny model), hash-chain and radix indexes agree, a shared partial page is copied on write, the
multi-turn Session reuses every page, and every test ends with all reference counts back to zero."""

from __future__ import annotations

import pytest
import torch
from serving_checks import Engines, ids, same_attention_inputs
from tiny_models import make_tiny_model

import kvquant
from kvquant.paging import KVStore
from kvquant.serving import Session
from kvquant.serving.prefix import attach, register, unit_tokens

WINDOWED = "k=int4-channel-g8,v=int4-g16,sink=4,window=8"  # sink, FP window, channel-wise keys: the hard case
# channel-wise keys of 32 raise body pages to 32 tokens while FP pages keep 16: a window copy spans two FP
# pages of a unit, the first of which may already be released
WIDE = "k=int4-channel-g32,v=int4-g16,sink=4,window=8"
SCHEMES = ["fp16", "int4-g32", WINDOWED]


@pytest.fixture(scope="module")
def model64():
    return make_tiny_model(seed=3).double()


@pytest.fixture
def engines(model64):
    made = Engines(model64)
    yield made
    made.check_released()


@torch.no_grad()
def _reference(model, prompt: list[int], cut: int, steps: list[int], scheme: str):
    """A private cache fed prompt[:cut], prompt[cut:], then `steps` one at a time: (cache, logits list).

    Its last-position logits come from `logits_to_keep=1`, as the engine's prefill computes them: a BLAS may
    round a row differently by the matrix's row count (Intel MKL on AVX-512 does for one row against 19, so
    `logits[0, -1]` of the full (19, V) product differs in the last bits; AMD's AVX2 path does not)."""
    cache = kvquant.QuantizedCache(scheme, model.config)
    out = []
    if cut:
        model(torch.tensor([prompt[:cut]]), cache=cache)
    out.append(model(torch.tensor([prompt[cut:]]), cache=cache, logits_to_keep=1).logits[0, -1])
    for t in steps:
        out.append(model(torch.tensor([[t]]), cache=cache).logits[0, -1])
    return cache, out


@pytest.mark.parametrize("index", ["hash", "radix"])
@pytest.mark.parametrize("scheme", [*SCHEMES, WIDE])
def test_hit_is_bit_identical_to_recompute(engines, model64, scheme, index):
    system = ids(40, 1)
    a, b = system + ids(13, 2), system + ids(11, 3)
    steps = ids(6, 4)
    engine = engines(scheme, prefix_cache=index)
    ca = engine.open("a")
    engine.prefill(ca, a, boundaries=[40])  # registers at the system prompt's last unit boundary
    cb = engine.open("b")
    pre = engine.prefill(cb, b, boundaries=[40])
    r = pre.hit.reused
    assert r == engine.unit_boundary(40) == (36 if "sink=4" in scheme else 32)
    assert pre.computed == len(b) - r
    ref_cache, ref = _reference(model64, b, r, steps, scheme)
    assert torch.equal(pre.logits, ref[0])
    got = [engine.step(cb, t) for t in steps]
    for x, y in zip(got, ref[1:], strict=True):
        assert torch.equal(x, y)
    same_attention_inputs(cb, ref_cache)
    engine.close(ca, a)
    engine.close(cb, b + steps)


@pytest.mark.parametrize("scheme", ["fp16", "int4-g32"])
def test_miss_and_hit_give_the_same_logits(engines, model64, scheme):
    """Without a window a hit needs no FP copies: reuse starts at any unit boundary, even without a hint."""
    system = ids(50, 5)
    engine = engines(scheme, prefix_cache="radix")
    c1 = engine.open()
    p1 = engine.prefill(c1, system + ids(9, 6))
    assert p1.hit.reused == 0
    c2 = engine.open()
    prompt = system + ids(7, 7)
    p2 = engine.prefill(c2, prompt)
    assert p2.hit.reused == 48  # three whole pages of the 50-token system prompt
    _, ref = _reference(model64, prompt, 48, [], scheme)
    assert torch.equal(p2.logits, ref[0])
    engine.close(c1)
    engine.close(c2)


def test_windowed_scheme_without_window_copy_resumes_earlier(engines, model64):
    """A windowed scheme resumes only where the FP copy of its window was cached; elsewhere it falls back to
    a shorter prefix (here: the sink), never to a wrong state."""
    system = ids(40, 8)
    engine = engines(WINDOWED, prefix_cache="hash")
    c1 = engine.open()
    engine.prefill(c1, system + ids(30, 9))  # one forward: the window is cached only at its end
    c2 = engine.open()
    prompt = system + ids(10, 10)
    pre = engine.prefill(c2, prompt)
    assert pre.hit.reused == 4  # the sink unit only: units after it have no FP copy where the prompts part
    _, ref = _reference(model64, prompt, 4, [], WINDOWED)
    assert torch.equal(pre.logits, ref[0])
    engine.close(c1)
    engine.close(c2)


def test_hash_and_radix_find_the_same_prefixes(engines):
    prompts = [ids(64, 11) + ids(20, 12), ids(64, 11) + ids(20, 13), ids(32, 11) + ids(40, 14), ids(70, 15)]
    found = {}
    for kind in ("hash", "radix"):
        engine = engines("int4-g32", prefix_cache=kind)
        hits = []
        for p in prompts:
            c = engine.open()
            hits.append(engine.prefill(c, p).hit.reused)
            engine.close(c, p)
        found[kind] = hits
        assert len(engine.index) == len({u for p in prompts for u in unit_tokens(p, 0, 16)})
    assert found["hash"] == found["radix"] == [0, 64, 32, 0]


def test_copy_on_write_of_a_shared_partial_page(engines, model64):
    """The body page holding the quantized/window boundary is shared partly filled; the first write into it
    copies it, and the cached original keeps its contents."""
    system = ids(40, 16)
    engine = engines(WINDOWED, prefix_cache="radix")
    ca = engine.open()
    a = system + ids(13, 17)
    engine.prefill(ca, a, boundaries=[40])
    engine.close(ca, a)  # only the index holds A's pages now
    cb = engine.open()
    b = system + ids(11, 18)
    # adopt only, to look at the shared page before any write
    hit = attach(cb, b, engine.index)
    assert hit.reused == 36
    layer = cb.layers[0]
    assert layer.body_len == 24  # quantized_end(36) - sink: body page 1 holds 8 of its 16 tokens
    shared = layer.body_t.rows[0][1]
    pool = layer.body_pool
    assert pool.refcount(shared) == 2  # the index and this request
    before = {n: t[shared].clone() for n, t in pool.tensors.items()}
    with torch.no_grad():
        model64(torch.tensor([b[36:]]), cache=cb)  # flushes body tokens 24.. into page 1
    assert layer.body_len > 24
    copied = layer.body_t.rows[0][1]
    assert copied != shared and pool.refcount(shared) == 1 and pool.refcount(copied) == 1
    for n, t in pool.tensors.items():
        assert torch.equal(t[shared], before[n]), n
    engine.close(cb)


def test_register_and_attach_refuse_misuse(engines, model64):
    engine = engines("int4-g32", prefix_cache="hash")
    private = kvquant.QuantizedCache("int4-g32", model64.config)
    with pytest.raises(ValueError, match="shared store"):
        attach(private, ids(40, 1), engine.index)
    c = engine.open()
    engine.prefill(c, ids(40, 19))
    with pytest.raises(ValueError, match="empty cache"):
        attach(c, ids(40, 19), engine.index)
    with pytest.raises(ValueError, match="ids were given"):
        register(c, ids(10, 19), engine.index)
    engine.close(c)
    with pytest.raises(ValueError, match="unknown prefix index 'trie'.*hash, radix"):
        engines("int4-g32", prefix_cache="trie")


def test_engine_pages_of_its_block_size(engines, model64):
    """Engine(block_size=32): its caches take the store's page size (they used the default 16 and were
    refused by the store's pools), and a hit reuses whole 32-token pages."""
    engine = engines("int4-g32", prefix_cache="radix", block_size=32)
    a = ids(70, 26)
    ca = engine.open()
    engine.prefill(ca, a)
    assert ca.layers[0].block_size == 32
    engine.close(ca, a)
    cb = engine.open()
    b = a[:50] + ids(3, 27)
    pre = engine.prefill(cb, b)
    assert pre.hit.reused == 32
    _, ref = _reference(model64, b, 32, [], "int4-g32")
    assert torch.equal(pre.logits, ref[0])
    engine.close(cb)


def test_store_refuses_another_scheme_or_model(model64):
    store = KVStore(model64.config, "int4-g32", dtype=torch.float64)
    with pytest.raises(ValueError, match="one store serves one scheme"):
        kvquant.QuantizedCache("int8", model64.config, store=store)
    with pytest.raises(ValueError, match="needs the model's config"):
        kvquant.QuantizedCache("int4-g32", store=store)
    other = make_tiny_model(num_hidden_layers=1).double()
    with pytest.raises(ValueError, match="was made for"):
        kvquant.QuantizedCache("int4-g32", other.config, store=store)


def test_one_request_holds_what_the_formula_says(engines, model64):
    """Bytes one request holds in the store (at FP16) == memory.cache_bytes at FP16, for each scheme."""
    from kvquant import memory
    from kvquant.serving import cache_bytes

    for scheme in SCHEMES:
        engine = engines(scheme, prefix_cache=None)
        c = engine.open()
        engine.prefill(c, ids(45, 20))
        expected = memory.cache_bytes(model64.config, scheme, 45, dtype=torch.float16)
        assert cache_bytes(engine.store, c) == engine.store.held_bytes() == expected
        engine.close(c)


# ------------------------------------------------------------------------------------------- sessions


@pytest.mark.parametrize("scheme", ["int4-g32", WINDOWED])
def test_session_reuses_every_page_of_earlier_turns(engines, model64, scheme):
    engine = engines(scheme, prefix_cache="radix")
    chat = Session(engine, "chat")
    m1, m2 = ids(30, 21), ids(9, 22)
    r1 = chat.send(m1, max_new_tokens=5)
    layer = chat.cache.layers[0]
    body_before = list(layer.body_t.rows[0])
    r2 = chat.send(m2, max_new_tokens=4)
    assert chat.turns[1].computed == len(m2) + 1  # the new message and turn 1's last reply token
    assert layer.body_t.rows[0][: len(body_before) - 1] == body_before[:-1]  # full pages kept, not copied
    # the same tokens through a private cache, chunk for chunk: bit-identical replies
    cache = kvquant.QuantizedCache(scheme, model64.config)
    seq, out = m1, []
    with torch.no_grad():
        logits = model64(torch.tensor([seq]), cache=cache).logits[0, -1]
        for t in r1[:-1]:
            out.append(int(logits.argmax()))
            logits = model64(torch.tensor([[t]]), cache=cache).logits[0, -1]
        out.append(int(logits.argmax()))
        logits = model64(torch.tensor([[r1[-1]] + m2]), cache=cache).logits[0, -1]
        for t in r2[:-1]:
            out.append(int(logits.argmax()))
            logits = model64(torch.tensor([[t]]), cache=cache).logits[0, -1]
        out.append(int(logits.argmax()))
    assert out == r1 + r2
    chat.close()
    # a new conversation with the same first message reuses its cached pages
    again = Session(engine, "again")
    again.send(m1 + ids(5, 23), max_new_tokens=2)
    # a windowed scheme resumes only where its window's FP copy was cached (the turns' ends): the sink here
    assert again.turns[0].hit.reused == (4 if scheme == WINDOWED else 16)
    again.close()


def test_generate_continues_a_conversation_with_the_same_cache(model64):
    """The transformers way: the same QuantizedCache passed to generate again computes only the new turn."""
    cache = kvquant.QuantizedCache("int4-g32", model64.config)
    turn1 = torch.tensor([ids(20, 24)])
    out1 = model64.generate(turn1, cache=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    held = cache.get_seq_length()
    turn2 = torch.cat([out1, torch.tensor([ids(6, 25)])], dim=1)
    out2 = model64.generate(turn2, cache=cache, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert held == out1.shape[1] - 1 and cache.get_seq_length() == out2.shape[1] - 1
    fresh = model64.generate(
        turn2,
        cache=kvquant.QuantizedCache("int4-g32", model64.config),
        max_new_tokens=3,
        min_new_tokens=3,
        do_sample=False,
    )
    assert torch.equal(out2, fresh)
