"""transformers' own cache tests, adapted to kvquant, and the routes transformers users expect.

Source: huggingface/transformers tests/utils/test_cache_utils.py (commit 00b1f96, the newest stored copy; the
wheel ships no tests). Each test below keeps the upstream name in its docstring. Upstream compares generated
text of SmolLM2 / Qwen3 against strings; offline, each adapted test runs a tiny random model and compares
kvquant's `fp16` scheme (unquantized pages, kvquant's attention) with transformers' DynamicCache under SDPA:
the same tokens, logits within fp32 rounding (the reference attention folds blocks by log-sum-exp, so
atol ~1e-5 rather than exact). What does not apply, and why, is listed in `NOT_APPLICABLE`.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from tiny_models import make_tiny_config, make_tiny_gemma, make_tiny_model
from transformers import DynamicCache, GenerationConfig, LlamaConfig, LlamaForCausalLM, set_seed

import kvquant
from kvquant.cache import QuantizedCache

ATOL = 1e-5

# upstream test -> why it does not apply to kvquant
NOT_APPLICABLE = {
    "test_static_cache_exportability": "torch.export: kvquant's page tables are data-dependent "
    "(is_compileable is False)",
    "test_dynamic_cache_exportability": "torch.export of a DynamicCache graph",
    "test_dynamic_cache_exportability_multiple_run": "torch.export of a DynamicCache graph",
    "test_hybrid_cache_exportability": "torch.export of a static hybrid cache",
    "test_offloaded_cache_uses_less_memory_than_dynamic_cache": "CPU offloading: kvquant's pages stay on "
    "their device (offload() is a no-op); its memory is tested in test_held_memory.py",
    "test_static_cache_no_cuda_graph_skips": "static cache + torch.compile CUDA graphs",
    "test_static_cache_multi_accelerator": "static cache across two GPUs",
    "test_static_cache_out_of_bounds": "a fixed-size static buffer (kvquant pools grow)",
    "test_static_cache": "a fixed-size static buffer with zeros at unwritten positions",
    "test_sliding_window_cache": "a static sliding buffer of exactly `window` slots (kvquant releases whole "
    "pages; its sliding layers are covered by test_hybrid_cache below)",
    "test_hybrid_cache_static_mode": "static hybrid buffer",
    "test_hybrid_cache_sliding_mode": "static hybrid buffer",
    "test_hybrid_chunked_cache": "chunked-attention static buffer",
}


def _kv_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    return make_tiny_model(seed, **overrides)


def _dynamic(model, **kwargs):
    """Generate with transformers' DynamicCache under SDPA on a copy of the model (the reference)."""
    ref = copy.deepcopy(model)
    kvquant.disable(ref)
    ref.set_attn_implementation("sdpa")
    return ref.generate(**kwargs)


def _kvq(model, scheme: str = "fp16", **kwargs):
    kvquant.enable(model, scheme, backend="torch")
    return model.generate(**kwargs)


def _padded_batch():
    ids = torch.tensor([[0, 0, 0, 11, 12, 13, 14, 15], [0, 21, 22, 23, 24, 25, 26, 27]])
    return ids, (ids != 0).long()


def _assert_same(out, ref):
    assert torch.equal(out.sequences, ref.sequences)
    if out.scores is not None:
        for a, b in zip(out.scores, ref.scores, strict=True):
            assert torch.allclose(a, b, atol=ATOL, rtol=0)


# ---- CacheTest


def test_dynamic_cache_retrocompatibility():
    """Upstream: legacy tuples <-> DynamicCache, and indexing. 5.24 dropped the legacy format and indexing;
    what remains is the per-layer K/V that iteration and `.layers[i].keys` give, equal to DynamicCache's."""
    cache, ref = QuantizedCache("fp16"), DynamicCache()
    for layer_idx in range(10):
        k, v = torch.rand((2, 4, 8, 16)), torch.rand((2, 4, 8, 16))
        cache.update(k, v, layer_idx)
        ref.update(k, v, layer_idx)
    assert len(cache) == len(ref) == 10
    assert cache.get_seq_length() == ref.get_seq_length() == 8
    for (k, v, w), (rk, rv, rw) in zip(cache, ref, strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv) and w is None and rw is None
    for i in range(10):
        assert torch.equal(cache.layers[i].keys, ref.layers[i].keys)
    rebuilt = DynamicCache(ddp_cache_data=cache)  # iteration feeds transformers' own consumer
    assert torch.equal(rebuilt.layers[3].values, ref.layers[3].values)


def test_reorder_cache_retrocompatibility():
    """Upstream: Cache.reorder_cache against a legacy reorder function; here against DynamicCache's."""
    cache, ref = QuantizedCache("fp16"), DynamicCache()
    for layer_idx in range(10):
        k, v = torch.rand((4, 4, 8, 16)), torch.rand((4, 4, 8, 16))
        cache.update(k, v, layer_idx)
        ref.update(k, v, layer_idx)
    beam_idx = torch.tensor([3, 0, 0, 2])
    cache.reorder_cache(beam_idx)
    ref.reorder_cache(beam_idx)
    for layer, rlayer in zip(cache.layers, ref.layers, strict=True):
        assert torch.equal(layer.keys, rlayer.keys) and torch.equal(layer.values, rlayer.values)


@pytest.mark.parametrize("kv_heads", [6, 2, 1], ids=["mha", "gqa", "mqa"])
def test_static_cache_mha_mqa_gqa(kv_heads):
    """Upstream: StaticCache shapes for MHA, GQA and MQA; here the shapes kvquant's layers hold."""
    config = make_tiny_config(num_key_value_heads=kv_heads)
    cache = QuantizedCache("int8", config)
    k, v = torch.rand((1, kv_heads, 1, 64)), torch.rand((1, kv_heads, 1, 64))
    cache.update(k, v, 0)
    assert cache.layers[0].keys.shape == cache.layers[0].values.shape == (1, kv_heads, 1, 64)


# ---- CacheIntegrationTest (tiny model; each upstream parameterization over cache names is one kvquant case)


def test_cache_batched():
    """Upstream: batched, left-padded greedy generation through cache_implementation=..."""
    model = _kv_model()
    ids, mask = _padded_batch()
    kw = dict(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=10,
        return_dict_in_generate=True,
        output_scores=True,
    )
    ref = _dynamic(model, **kw)
    out = _kvq(model, **kw)
    assert isinstance(out.cache, QuantizedCache)
    _assert_same(out, ref)


def test_cache_beam_search():
    """Upstream: beam search exercises reorder_cache (a sequence needs several beam indices)."""
    model = _kv_model(seed=1)
    ids = torch.tensor([[5, 17, 99, 3]])
    kw = dict(
        input_ids=ids,
        do_sample=False,
        max_new_tokens=10,
        num_beams=3,
        num_return_sequences=2,
        return_dict_in_generate=True,
        output_scores=True,
    )
    ref = _dynamic(model, **kw)
    out = _kvq(model, **kw)
    assert isinstance(out.cache, QuantizedCache)
    assert torch.equal(out.sequences, ref.sequences)
    assert any(len(set(beams.tolist())) > 1 for beams in out.beam_indices)
    assert torch.allclose(out.sequences_scores, ref.sequences_scores, atol=ATOL, rtol=0)


def test_quantized_cache_generation():
    """Upstream: cache_implementation="quantized" with cache_config (quanto / HQQ); here with a kvquant
    scheme in cache_config, and something is really quantized."""
    model = _kv_model()
    kvquant.enable(model)  # no default scheme: the call's cache_config names it
    out = model.generate(
        torch.tensor([[4, 8, 15, 16, 23, 42]]),
        do_sample=False,
        max_new_tokens=10,
        return_dict_in_generate=True,
        cache_implementation="quantized",
        cache_config={"scheme": "int4-g16,window=4", "backend": "torch"},
    )
    cache = out.cache
    assert isinstance(cache, QuantizedCache) and str(cache.scheme) == "int4-g16,window=4"
    assert all(layer.body_len > 0 for layer in cache.layers)  # tokens left the FP window: encoded


def test_cache_extra_left_padding():
    """Upstream: extra left padding does not change greedy generation."""
    model = _kv_model(seed=2)
    ids = torch.tensor([[31, 32, 33, 34]])
    kvquant.enable(model, "fp16", backend="torch")
    out = model.generate(input_ids=ids, do_sample=False, max_new_tokens=10)
    padded = torch.cat([torch.zeros((1, 5), dtype=torch.long), ids], dim=1)
    out_padded = model.generate(
        input_ids=padded, attention_mask=(padded != 0).long(), do_sample=False, max_new_tokens=10
    )
    assert torch.equal(out[0, -10:], out_padded[0, -10:])
    assert torch.equal(
        out_padded,
        _dynamic(
            model, input_ids=padded, attention_mask=(padded != 0).long(), do_sample=False, max_new_tokens=10
        ),
    )


# ---- CacheHardIntegrationTest


def test_dynamic_cache_hard():
    """Upstream: sampled generation with a seed; the sequence and the sum of scores match."""
    model = _kv_model(seed=3)
    kw = dict(
        input_ids=torch.tensor([[7, 70, 700, 7000]]),
        do_sample=True,
        max_new_tokens=24,
        return_dict_in_generate=True,
        output_scores=True,
    )
    set_seed(0)
    ref = _dynamic(model, **kw)
    set_seed(0)
    out = _kvq(model, **kw)
    _assert_same(out, ref)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_static_cache_greedy_decoding_pad_left(attn_implementation):
    """Upstream: pad-left greedy decoding alike across attention implementations; here kvquant's attention
    over its cache against transformers' eager / SDPA attention over a DynamicCache (the static and
    compiled variants do not apply: kvquant's cache is not compileable)."""
    model = _kv_model(seed=4)
    ids, mask = _padded_batch()
    kw = dict(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=10,
        return_dict_in_generate=True,
        output_scores=True,
    )
    ref_model = copy.deepcopy(model)
    ref_model.set_attn_implementation(attn_implementation)
    ref = ref_model.generate(**kw)
    assert isinstance(ref.cache, DynamicCache)
    _assert_same(_kvq(model, **kw), ref)


def test_cache_copy():
    """Upstream: prefill a prompt cache, deepcopy it, reuse each copy for a generation."""
    model = _kv_model(seed=5)
    kvquant.enable(model, "fp16", backend="torch")
    prompt = torch.tensor([[9, 8, 7, 6, 5]])
    prompt_cache = QuantizedCache("fp16", model.config, backend="torch")
    with torch.no_grad():
        prompt_cache = model(prompt, cache=prompt_cache).cache
    for tail in ([[1, 2, 3]], [[40, 41]]):
        full = torch.cat([prompt, torch.tensor(tail)], dim=1)
        reused = model.generate(full, cache=copy.deepcopy(prompt_cache), do_sample=False, max_new_tokens=8)
        fresh = model.generate(full, do_sample=False, max_new_tokens=8)
        assert torch.equal(reused, fresh)
    assert prompt_cache.get_seq_length() == 5  # the copies, not the original, grew


def test_data_parallel_dynamic_cache():
    """Upstream (2 GPUs): nn.DataParallel rebuilds a DynamicCache from per-replica caches by iterating them
    (`DynamicCache(ddp_cache_data=...)`); the gather format is what QuantizedCache's iteration yields."""
    model = _kv_model(seed=6)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        ref = model(ids, cache=DynamicCache(config=model.config)).cache
        kvq = model(ids, cache=QuantizedCache("fp16", model.config, backend="torch")).cache
    gathered = DynamicCache(ddp_cache_data=kvq)
    for layer, rlayer in zip(gathered.layers, ref.layers, strict=True):
        torch.testing.assert_close(layer.keys, rlayer.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(layer.values, rlayer.values, atol=ATOL, rtol=0)


def test_cache_gptj_model():
    """Upstream: a text-generation pipeline (GPT-J) through cache_implementation=...; here a pipeline over an
    enabled model, no cache argument anywhere, the same token ids as DynamicCache's."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast, pipeline

    vocab = {"[PAD]": 0, "[UNK]": 1, "hello": 2, "world": 3, **{f"w{i}": 4 + i for i in range(200)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    model = _kv_model(seed=7, vocab_size=len(vocab))
    ref = _dynamic(model, input_ids=torch.tensor([[2, 3]]), do_sample=False, max_new_tokens=10)
    kvquant.enable(model, "fp16", backend="torch")
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = pipe("hello world", max_new_tokens=10, do_sample=False, return_tensors=True)[0][
        "generated_token_ids"
    ]
    assert out[-10:] == ref[0, -10:].tolist()


# ---- SyntheticCacheTest


def test_dynamic_cache():
    """Upstream, as it is: prefill and update one layer, then two layers independently."""
    prefill = torch.tensor([1.0, 2.0])[None, None, :, None]
    update3, update4 = torch.tensor(3.0)[None, None, None, None], torch.tensor(4.0)[None, None, None, None]
    cache = QuantizedCache("fp16")
    cache.update(prefill, prefill, 0)
    cache.update(update3, update3, 0)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0]
    cache.update(update4, update4, 0)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]

    prefill1 = torch.tensor([10.0, 20.0])[None, None, :, None]
    cache = QuantizedCache("fp16")
    cache.update(prefill, prefill, 0)
    cache.update(prefill1, prefill1, 1)
    for x in (3.0, 4.0):
        t = torch.tensor(x)[None, None, None, None]
        cache.update(t, t, 0)
        cache.update(t * 10, t * 10, 1)
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert cache.layers[1].values[0, 0, :, 0].tolist() == [10.0, 20.0, 30.0, 40.0]


def test_hybrid_cache():
    """Upstream: a full and a sliding layer, prefill longer than the window; the sliding layer returns the
    whole prefill and keeps what the window needs. kvquant releases whole pages (16 tokens), so it keeps at
    least the window's tokens, in order, ending with the newest (upstream: exactly window - 1)."""
    model = make_tiny_gemma(sliding_window=16)
    cache = QuantizedCache("fp16", model.config)
    full = torch.arange(40.0)[None, None, :, None].expand(1, 1, 40, 64).contiguous()
    view, _ = cache.update(full, full, 0)  # layer 0 slides
    assert torch.equal(view.keys(torch.float32), full)  # what this forward attends to: all of it
    held = cache.layers[0].keys[0, 0, :, 0].tolist()
    assert held == list(range(40 - len(held), 40)) and 15 <= len(held) < 40
    cache.update(full, full, 2)  # layer 2 is full attention: keeps everything
    assert cache.layers[2].keys[0, 0, :, 0].tolist() == list(range(40))
    windows = [w for _, _, w in cache]
    assert windows[0].item() == 16 and windows[2] is None  # as DynamicCache yields its sliding tensor


def test_sliding_model_matches_dynamic_cache():
    """Upstream's sliding tests, end to end: generation on a Gemma-3 with sliding layers matches."""
    model = make_tiny_gemma(sliding_window=16)
    kw = dict(
        input_ids=torch.randint(1, 500, (1, 30), generator=torch.Generator().manual_seed(0)),
        do_sample=False,
        max_new_tokens=12,
        return_dict_in_generate=True,
        output_scores=True,
    )
    ref = _dynamic(model, **kw)
    _assert_same(_kvq(model, **kw), ref)


# ---- the routes: enable, GenerationConfig, cache_config


def test_enable_needs_no_cache_argument_and_fp16_equals_dynamic_cache():
    model = _kv_model()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    kw = dict(
        input_ids=ids, do_sample=False, max_new_tokens=6, return_dict_in_generate=True, output_scores=True
    )
    ref = _dynamic(model, **kw)
    settings = kvquant.enable(model, "fp16", backend="torch")
    assert model.config._attn_implementation == kvquant.ATTN_IMPLEMENTATION and kvquant.hf.enabled(model)
    assert model.generation_config.cache_config == {"scheme": "fp16", "backend": "torch"}
    out = model.generate(**kw)
    assert isinstance(out.cache, QuantizedCache) and out.cache.scheme == settings.scheme
    _assert_same(out, ref)
    assert "_prepare_cache_for_generation" not in vars(LlamaForCausalLM)  # the class is untouched
    assert isinstance(_dynamic(_kv_model(), **kw).cache, DynamicCache)


def test_generation_config_selects_the_scheme_per_call():
    model = _kv_model()
    kvquant.enable(model, "int8", backend="torch")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    out = model.generate(
        ids, max_new_tokens=3, return_dict_in_generate=True, cache_config={"scheme": "int4-g16"}
    )
    assert str(out.cache.scheme) == "int4-g16" and out.cache.backend == "torch"  # the enabled backend stays
    gc = GenerationConfig(cache_config={"scheme": "kivi-2"}, max_new_tokens=3, return_dict_in_generate=True)
    assert out.cache is not model.generate(ids, generation_config=gc).cache
    assert model.generate(ids, generation_config=gc).cache.scheme.name == "kivi-2"
    assert isinstance(
        model.generate(
            ids, max_new_tokens=3, return_dict_in_generate=True, cache_implementation="dynamic"
        ).cache,
        DynamicCache,
    )  # opt out


def test_cache_config_without_a_scheme_fails_loudly():
    model = _kv_model()
    kvquant.enable(model, "int8")
    with pytest.raises(ValueError, match="names no kvquant 'scheme'"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, cache_config={"nbits": 4})
    with pytest.raises(ValueError, match="kvquant does not know: \\['shceme'\\]"):
        model.generate(
            torch.tensor([[1, 2, 3]]), max_new_tokens=2, cache_config={"scheme": "int8", "shceme": 1}
        )
    with pytest.raises(ValueError, match="asks transformers for another cache"):
        model.generate(
            torch.tensor([[1, 2, 3]]),
            max_new_tokens=2,
            cache_implementation="static",
            cache_config={"scheme": "int4-g16"},
        )
    with pytest.raises(ValueError, match="Invalid `cache_implementation` \\(kvquant\\)"):
        GenerationConfig(cache_implementation="kvquant")  # transformers has no registry: refused, loudly


def test_enable_checks_the_scheme_against_the_model_now():
    model = _kv_model()
    with pytest.raises(ValueError, match="48"):
        kvquant.enable(model, "int4-g48")  # a group that does not divide head_dim 64
    with pytest.raises(kvquant.SchemeError):
        kvquant.enable(model, "int5-g64")
    with pytest.raises(ValueError, match="positive integer"):
        kvquant.enable(model, "int8", block_size=0)
    with pytest.raises(ValueError, match="without a scheme"):
        kvquant.enable(model, backend="torch")
    with pytest.raises(TypeError, match="generative model"):
        kvquant.enable(torch.nn.Linear(2, 2), "int8")
    assert not kvquant.hf.enabled(model)


def test_saved_generation_config_reenables_the_scheme(tmp_path):
    model = _kv_model()
    kvquant.enable(model, "kivi-2")
    model.generation_config.save_pretrained(tmp_path)
    fresh = _kv_model()
    fresh.generation_config = GenerationConfig.from_pretrained(tmp_path)
    settings = kvquant.enable(fresh)  # no scheme: generation_config.json names it
    assert settings.scheme == kvquant.parse_scheme("kivi-2")
    kvquant.disable(fresh)
    assert not kvquant.hf.enabled(fresh) and fresh.generation_config.cache_config is None
    out = fresh.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, return_dict_in_generate=True)
    assert isinstance(out.cache, DynamicCache)


def test_layer_keys_values_are_materialised_with_one_warning(caplog):
    cache = QuantizedCache("int4-g16")
    assert len(cache) == 0 and list(cache) == []
    k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    cache.update(k, v, 0)
    cache.update(k, v, 1)
    with caplog.at_level(logging.WARNING, logger="kvquant.cache"):
        keys = cache.layers[0].keys
        _ = [kv for kv in cache]
    assert sum("decode a whole layer" in r.getMessage() for r in caplog.records) == 1  # once per cache
    assert keys.shape == (1, 2, 40, 16) and keys.dtype == torch.float32
    err = (keys - k).abs().max().item()
    assert 0 < err < 0.5  # decoded int4: close to, not equal to, what went in
    with pytest.raises(AttributeError, match="cannot be assigned"):
        cache.layers[0].keys = k
    assert kvquant.QuantizedLayer("int8").keys is None  # before the first update, as DynamicLayer


def test_window_with_a_channel_group_quantizes_nothing_in_a_short_generation():
    """docs/python-api.md: kvquant keeps `window` tokens FP and encodes whole channel-wise groups once, so
    kivi-2 (channel-wise groups of 32 keys, window 128) quantizes nothing in a 13-token generation; a
    per-token group with a small window does (transformers' residual_length=4 quantizes after 4 tokens)."""
    model = _kv_model()
    kvquant.enable(model, "kivi-2", backend="torch")
    ids = torch.tensor([[1, 2, 3]])
    out = model.generate(ids, max_new_tokens=10, return_dict_in_generate=True, do_sample=False)
    assert out.cache.get_seq_length() == 12 and all(layer.body_len == 0 for layer in out.cache.layers)
    out = model.generate(
        ids,
        max_new_tokens=10,
        return_dict_in_generate=True,
        do_sample=False,
        cache_config={"scheme": "int4-g16,window=4"},
    )
    assert all(layer.body_len == 8 for layer in out.cache.layers)  # 12 held, the newest 4 unquantized


def test_not_applicable_names_are_upstream_tests():
    here = {name for name in globals() if name.startswith("test_")}
    assert not here & set(NOT_APPLICABLE)
    assert len(NOT_APPLICABLE) == 13
    assert LlamaConfig  # the upstream fixtures' config class, used through make_tiny_config
