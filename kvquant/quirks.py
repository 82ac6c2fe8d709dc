"""Model-family quirks in one place: where a config keeps the facts the cache, the RoPE inversion, the scorer
and the run checks need, and which families keep them where.

Every function takes a transformers config (`PreTrainedConfig`) or a config.json read as a dict (the run
checks read a model folder without torch), and looks through a wrapping multimodal config to its text config
first. Nothing here imports torch or transformers, so `kvquant.eval.config` can use it before a model is
loaded.

    text_config(config)          the decoder's config inside a multimodal or wrapped config
    attention_shape(config)      layers, query heads, KV heads and head_dim, as the cache stores them
    max_positions(config)        the positions the model was trained for
    sliding_window(config)       the window of the sliding-window layers, if the config names one
    layer_windows(config)        per layer: its sliding window, or None for full attention
    rope_config(config)          model type, RoPE type and parameters (what `kvquant.rope` inverts)
    final_logit_softcap(config)  the tanh cap on the logits (Gemma-2), or None
    adds_bos(tokenizer)          whether encoding a text puts the BOS token first

To support a new family, change the function for the quirk it has, here, and its test in
tests/test_quirks.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = [
    "AttentionShape",
    "LAYER_TYPE_ROPE_MODELS",
    "ROTATE_HALF_MODELS",
    "RopeConfig",
    "SLIDING_ATTENTION",
    "adds_bos",
    "attention_shape",
    "final_logit_softcap",
    "layer_windows",
    "max_positions",
    "rope_config",
    "sliding_window",
    "text_config",
]

SLIDING_ATTENTION = "sliding_attention"  # transformers' name in `layer_types` for a sliding-window layer

# model types whose attention applies transformers' rotate-half RoPE to all of head_dim, one RoPE for all
# layers: the ones `-prerope` can invert (kvquant.rope); models with a partial rotary factor are not.
ROTATE_HALF_MODELS = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "granite",
    "olmo2",
)
# model types with rotate-half RoPE over all of head_dim but one RoPE per layer type: `rope_parameters`
# keyed by the `layer_types` names (Gemma-3: local layers at base 10,000, global ones at 1,000,000), and
# the package of transformers that builds their rotary module
LAYER_TYPE_ROPE_MODELS = MappingProxyType({"gemma3_text": "gemma3"})


def _get(config: Any, name: str) -> Any:
    """A config field, None where absent: dict entries of a config.json, attributes of a config object."""
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def text_config(config: Any) -> Any:
    """The config of the text decoder: a multimodal or wrapped config's text config, else config itself.

    Covers Gemma-3 (`Gemma3Config` wraps a `Gemma3TextConfig`), LLaVA, Idefics, Mllama, Qwen2-VL and the
    other vision-language models, through transformers' `get_text_config()`; a config.json dict answers its
    "text_config" entry where that is a dict. Plain decoders (Llama, Mistral, Qwen, Gemma-2,
    Gemma3TextConfig) are their own text config."""
    if isinstance(config, Mapping):
        inner = config.get("text_config")
        return inner if isinstance(inner, Mapping) else config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class AttentionShape:
    """The attention shape the KV cache stores, from a config; None where the config does not say."""

    num_layers: int | None
    num_heads: int | None  # query heads
    num_kv_heads: int | None  # K/V heads: fewer than num_heads under GQA / MQA
    head_dim: int | None


def attention_shape(config: Any) -> AttentionShape:
    """Layers, query heads, KV heads and head_dim of the text decoder.

    - KV heads: `num_key_value_heads` (GQA in Llama-2-70B / Llama-3 / Mistral / Qwen2, MQA in Gemma-3-270M);
      a config without it (GPT-2 style MHA, older Llama) has as many KV heads as query heads.
    - head_dim: `head_dim` where the config sets it (Gemma: 256 with a hidden size of 640 over 4 heads, so
      not hidden_size / heads; Qwen3; Llama 5.x configs), else hidden_size // num_attention_heads.
    - layers: `num_hidden_layers`, or GPT-2's `n_layer` in a config.json."""
    text = text_config(config)
    heads = _positive_int(_get(text, "num_attention_heads"))
    kv = _positive_int(_get(text, "num_key_value_heads")) or heads
    head_dim = _positive_int(_get(text, "head_dim"))
    hidden = _positive_int(_get(text, "hidden_size"))
    if head_dim is None and hidden is not None and heads is not None:
        head_dim = hidden // heads
    layers = _get(text, "num_hidden_layers")
    if layers is None:
        layers = _get(text, "n_layer")
    return AttentionShape(_positive_int(layers), heads, kv, head_dim)


def max_positions(config: Any) -> int | None:
    """The positions the model was trained for: `max_position_embeddings` (Llama, Gemma, Qwen, Mistral and
    most decoders), or GPT-2's `n_positions` in a config.json; None where the config says neither."""
    text = text_config(config)
    positions = _get(text, "max_position_embeddings")
    if positions is None:
        positions = _get(text, "n_positions")
    return _positive_int(positions)


def sliding_window(config: Any) -> int | None:
    """The window, in tokens, that the config gives its sliding-window layers (`sliding_window`), or None.
    Whether any layer uses it is `layer_windows`' answer: Qwen2 / Qwen3 configs carry a window also when
    `use_sliding_window` is off."""
    return _positive_int(_get(text_config(config), "sliding_window"))


def layer_windows(config: Any) -> tuple[int | None, ...] | None:
    """Per decoder layer, its sliding window (tokens), or None for a full-attention layer; None when the
    config (a config.json dict) does not say which layers slide.

    - `layer_types` (transformers 5.x): "sliding_attention" layers slide over `sliding_window`, every other
      type attends fully. Gemma-2 (alternating), Gemma-3 (5 sliding : 1 full), Cohere2, and Qwen2 / Qwen3
      (whose config classes fill `layer_types` from `use_sliding_window` and `max_window_layers`). A config
      whose `layer_types` names sliding layers but no window has none. Llama-4's "chunked_attention" layers
      count as full: the cache keeps their keys and the model's mask hides the other chunks.
    - no `layer_types`, a `sliding_window` on a config object: every layer slides (Mistral-7B-v0.1, whose
      config has one global window), as transformers' own cache and the model's mask have it
      (transformers.cache_utils.get_layer_types_and_kwargs). A config.json dict without `layer_types` is
      not completed by its config class (Qwen2's lists a window it may not use): None, unknown.
    - neither: every layer attends fully (Llama, SmolLM2, GPT-2)."""
    text = text_config(config)
    window = sliding_window(text)
    types = _get(text, "layer_types")
    if isinstance(types, (list, tuple)):
        return tuple(window if t == SLIDING_ATTENTION else None for t in types)
    if isinstance(text, Mapping):
        return None
    layers = attention_shape(text).num_layers or 0
    return (window,) * layers


@dataclass(frozen=True)
class RopeConfig:
    """What `kvquant.rope.Rope.from_config` needs to rebuild a model's rotary embedding."""

    text: Any  # the text config the model's rotary module is built from
    model_type: str | None
    rope_type: str | None  # None when the parameters are not one dict
    parameters: Any  # `rope_parameters` as the config has it ({} when absent)
    partial_rotary_factor: float | None  # of head_dim that rotates; None when the parameters are not a dict
    layer_kinds: tuple[str, ...] = ()  # each layer's `layer_types` entry: what its RoPE is keyed by (Gemma-3)


def rope_config(config: Any) -> RopeConfig:
    """The RoPE of the text decoder, as transformers 5.x configs keep it: `rope_parameters` (the 4.x
    `rope_scaling` with the theta folded in) with its "rope_type" (or the legacy "type"; "default" when it
    names neither); a partial rotary factor from the parameters or the config (Phi, StableLM, GPT-NeoX).

    Gemma-3 keeps one parameter dict per layer type ({"sliding_attention": ..., "full_attention": ...}):
    it reads here as a "default" type; `kvquant.rope` reads each layer type's dict itself
    (`LAYER_TYPE_ROPE_MODELS`)."""
    text = text_config(config)
    params = _get(text, "rope_parameters") or {}
    types = tuple(_get(text, "layer_types") or ())
    if not isinstance(params, dict):
        return RopeConfig(text, _get(text, "model_type"), None, params, None, types)
    rope_type = params.get("rope_type", params.get("type", "default"))
    factor = float(params.get("partial_rotary_factor", _get(text, "partial_rotary_factor")) or 1.0)
    return RopeConfig(text, _get(text, "model_type"), rope_type, params, factor, types)


def final_logit_softcap(config: Any) -> float | None:
    """The cap c of `logits = c * tanh(logits / c)`, or None where the model does not cap its logits.

    Gemma-2 caps at 30.0 (`final_logit_softcapping`); Gemma-3 keeps the field but sets it to None; a 0 reads
    as none. Looked up on the config, then on its text config (a wrapping Gemma-3 multimodal config)."""
    cap = _get(config, "final_logit_softcapping")
    if cap is None:
        cap = _get(text_config(config), "final_logit_softcapping")
    return cap or None


def adds_bos(tokenizer: Any) -> bool:
    """Whether `tokenizer(text)` (special tokens on) puts the BOS token first.

    Llama-2/3, Mistral and Gemma tokenizers add one (Gemma needs it: without BOS its first positions are
    garbage, so measure with special tokens on); SmolLM2, Qwen2 and GPT-2 tokenizers add none (SmolLM2's
    BOS is a chat marker). Asked of the tokenizer itself, not its `add_bos_token` flag: a fast tokenizer's
    post-processor decides, and some set the flag without one."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return len(ids) > 0 and ids[0] == bos
