"""kvquant.quirks on real transformers configs built here (no hub): Llama, Mistral with and without its global
window, Gemma-2, Gemma-3 text and its multimodal wrapper, Qwen2 / Qwen3 with `layer_types`, GPT-2; the
config.json (dict) form the run checks read; and that no other module looks a quirk up on its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    PhiConfig,
    Qwen2Config,
    Qwen3Config,
)

import kvquant
from kvquant import quirks
from kvquant.memory import KVShape

REPO = Path(__file__).resolve().parents[1]
S, F = "sliding_attention", "full_attention"


def llama(**kw) -> LlamaConfig:
    kw = dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=3) | kw
    return LlamaConfig(**kw)


def gemma3_text(**kw) -> Gemma3TextConfig:
    """Gemma-3-270M's attention shape: 640 wide over 4 heads, yet head_dim 256; 1 KV head; window 512."""
    kw = dict(hidden_size=640, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
              num_hidden_layers=7, sliding_window=512, max_position_embeddings=32768) | kw
    return Gemma3TextConfig(**kw)


# ---- text config


def test_text_config_unwraps_gemma3_and_keeps_plain_decoders():
    text = gemma3_text()
    wrapped = Gemma3Config(text_config=text.to_dict())
    assert type(quirks.text_config(wrapped)) is Gemma3TextConfig
    assert quirks.text_config(wrapped).sliding_window == 512
    for cfg in (text, llama(), MistralConfig(), Qwen3Config()):
        assert quirks.text_config(cfg) is cfg
    raw = {"model_type": "gemma3", "text_config": {"num_hidden_layers": 5}}
    assert quirks.text_config(raw) == {"num_hidden_layers": 5}
    assert quirks.text_config({"num_hidden_layers": 5, "text_config": None}) == {
        "num_hidden_layers": 5, "text_config": None
    }


# ---- attention shape and positions


@pytest.mark.parametrize(
    "cfg, want",
    [
        (llama(head_dim=64), quirks.AttentionShape(3, 6, 2, 64)),  # GQA 3, head_dim given
        (llama(), quirks.AttentionShape(3, 6, 2, 32)),  # head_dim from hidden_size / heads
        (gemma3_text(), quirks.AttentionShape(7, 4, 1, 256)),  # not 640 / 4
        (Gemma3Config(text_config=gemma3_text().to_dict()), quirks.AttentionShape(7, 4, 1, 256)),
        (GPT2Config(n_layer=2, n_head=4, n_embd=128), quirks.AttentionShape(2, 4, 4, 32)),  # MHA
        ({"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512},
         quirks.AttentionShape(4, 8, 8, 64)),
        ({"n_layer": 12}, quirks.AttentionShape(12, None, None, None)),
        ({"text_config": {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                          "head_dim": 128}}, quirks.AttentionShape(2, 2, 1, 128)),
    ],
)
def test_attention_shape(cfg, want):
    assert quirks.attention_shape(cfg) == want


def test_max_positions():
    assert quirks.max_positions(gemma3_text()) == 32768
    assert quirks.max_positions(Gemma3Config(text_config=gemma3_text().to_dict())) == 32768
    assert quirks.max_positions(GPT2Config(n_positions=1024)) == 1024
    assert quirks.max_positions({"n_positions": 2048}) == 2048
    assert quirks.max_positions({"max_position_embeddings": 0}) is None
    assert quirks.max_positions({}) is None


def test_kv_shape_without_heads_is_refused():
    with pytest.raises(ValueError, match="shape"):
        KVShape.from_config({"num_hidden_layers": 2})


# ---- layer kinds


def test_full_attention_families():
    assert quirks.layer_windows(llama()) == (None, None, None)
    assert quirks.layer_windows(GPT2Config(n_layer=2)) == (None, None)
    assert quirks.layer_windows(Qwen2Config(num_hidden_layers=3)) == (None, None, None)  # window off
    assert quirks.layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == (None, None)


def test_mistral_global_window_makes_every_layer_sliding():
    cfg = MistralConfig(num_hidden_layers=3, sliding_window=64)
    assert getattr(cfg, "layer_types", None) is None  # the case this rule is for
    assert quirks.layer_windows(cfg) == (64, 64, 64)
    assert KVShape.from_config(cfg).sliding_layers == (0, 1, 2)


def test_gemma_layer_types():
    g2 = Gemma2Config(num_hidden_layers=4, sliding_window=128)
    assert quirks.layer_windows(g2) == (128, None, 128, None)  # alternating, as its config class lists them
    g3 = gemma3_text()
    want = tuple(512 if t == S else None for t in g3.layer_types)
    assert quirks.layer_windows(g3) == want
    assert want.count(None) == 1 and want[5] is None  # 5 sliding : 1 full
    assert quirks.layer_windows(Gemma3Config(text_config=g3.to_dict())) == want
    shape = KVShape.from_config(Gemma3Config(text_config=g3.to_dict()))
    assert shape == KVShape(7, 1, 256, 512, (0, 1, 2, 3, 4, 6))
    assert quirks.layer_windows(gemma3_text(layer_types=[S, F] * 3 + [S], sliding_window=None)) == (None,) * 7


@pytest.mark.parametrize("cls", [Qwen2Config, Qwen3Config])
def test_qwen_window_layers(cls):
    cfg = cls(num_hidden_layers=4, use_sliding_window=True, sliding_window=32, max_window_layers=2)
    assert list(cfg.layer_types) == [F, F, S, S]
    assert quirks.layer_windows(cfg) == (None, None, 32, 32)
    assert KVShape.from_config(cfg).window_of(3) == 32 and KVShape.from_config(cfg).window_of(1) is None


def test_config_json_says_only_what_it_lists():
    assert quirks.layer_windows({"sliding_window": 4096, "num_hidden_layers": 2}) is None  # unknown
    assert quirks.sliding_window({"sliding_window": 4096}) == 4096
    listed = {"sliding_window": 16, "layer_types": [S, S, F]}
    assert quirks.layer_windows(listed) == (16, 16, None)
    assert quirks.layer_windows({"text_config": listed}) == (16, 16, None)
    assert quirks.layer_windows({"layer_types": [S, F]}) == (None, None)


def test_mistral_cache_slides_like_transformers():
    """The cache follows the Mistral rule: sliding layers, logits as transformers' own cache gives them."""
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
                        max_position_embeddings=128)
    model = MistralForCausalLM(cfg).eval()
    model.set_attn_implementation(kvquant.ATTN_IMPLEMENTATION)
    ids = torch.randint(0, 128, (1, 24))
    cache = kvquant.QuantizedCache("fp16", cfg)
    with torch.no_grad():
        ref = model(ids, cache=DynamicCache(config=cfg)).logits
        out = torch.cat([model(ids[:, i : i + 6], cache=cache).logits for i in range(0, 24, 6)], dim=1)
    assert [type(layer).__name__ for layer in cache.layers] == ["SlidingLayer", "SlidingLayer"]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


# ---- RoPE


def test_rope_config():
    rc = quirks.rope_config(llama(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192}))
    assert (rc.model_type, rc.rope_type, rc.partial_rotary_factor) == ("llama", "llama3", 1.0)
    assert rc.parameters["factor"] == 8.0
    wrapped = Gemma3Config(text_config=gemma3_text().to_dict())
    g = quirks.rope_config(wrapped)
    assert g.model_type == "gemma3_text" and type(g.text) is Gemma3TextConfig
    assert set(g.parameters) == {S, F} and g.rope_type == "default"  # per layer type: read as one "default"
    assert quirks.rope_config(PhiConfig(partial_rotary_factor=0.5)).partial_rotary_factor == 0.5
    legacy = quirks.rope_config({"model_type": "llama", "rope_parameters": {"type": "linear", "factor": 2.0}})
    assert legacy.rope_type == "linear"
    assert quirks.rope_config({"rope_parameters": [1, 2]}).rope_type is None


# ---- final logit softcap


def test_final_logit_softcap():
    assert quirks.final_logit_softcap(Gemma2Config()) == 30.0
    assert quirks.final_logit_softcap(gemma3_text()) is None
    capped = Gemma3Config(text_config=gemma3_text(final_logit_softcapping=20.0).to_dict())
    assert quirks.final_logit_softcap(capped) == 20.0
    assert quirks.final_logit_softcap(llama()) is None
    assert quirks.final_logit_softcap(Gemma2Config(final_logit_softcapping=0.0)) is None
    assert quirks.final_logit_softcap({"text_config": {"final_logit_softcapping": 15.0}}) == 15.0


# ---- BOS


def _tokenizer(bos_first: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "a": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos_first:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")


def test_adds_bos():
    assert quirks.adds_bos(_tokenizer(True))
    assert not quirks.adds_bos(_tokenizer(False))
    no_bos = _tokenizer(True)
    no_bos.bos_token = None
    assert not quirks.adds_bos(no_bos)


# ---- one home


LIBRARY = ("kvquant", "eval", "experiments", "benchmarks", "kernels")
QUIRK_FIELDS = {"final_logit_softcapping", "layer_types", "rope_parameters"}


def _lookups(path: Path, names: set[str]) -> list[str]:
    """Where one file reads `names`: as an attribute (`x.get_text_config`) or a getattr-style string
    ("layer_types"); keyword arguments that build a config are not lookups."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    return found


def test_no_module_outside_quirks_looks_up_a_quirk():
    """get_text_config nowhere but kvquant/quirks.py (tests included); the quirk fields nowhere else in the
    library (tests may read the configs they built)."""
    home, here = REPO / "kvquant" / "quirks.py", Path(__file__).resolve()
    library = [p for d in LIBRARY for p in sorted((REPO / d).rglob("*.py"))]
    tests = sorted((REPO / "tests").rglob("*.py"))
    assert len(library) > 50 and home in library
    assert _lookups(home, {"get_text_config"} | QUIRK_FIELDS), "the scan finds nothing even at home"
    stray = [h for p in library + tests if p not in (home, here) for h in _lookups(p, {"get_text_config"})]
    stray += [hit for p in library if p != home for hit in _lookups(p, QUIRK_FIELDS)]
    assert stray == [], "quirk lookups outside kvquant/quirks.py:\n" + "\n".join(stray)
