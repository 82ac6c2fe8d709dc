"""A tiny random Llama with GQA for fast tests (import as `from tiny_models import make_tiny_model`;
not from conftest: each test folder has its own conftest, and the name would be ambiguous)."""

from __future__ import annotations

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

import kvquant


def make_tiny_config(**overrides) -> LlamaConfig:
    """2 layers, 6 query heads over 2 KV heads (GQA 3), head_dim 64, the default model's vocabulary size."""
    kw = dict(
        vocab_size=49152,
        hidden_size=192,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def make_tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(make_tiny_config(**overrides)).eval()
    model.set_attn_implementation(kvquant.ATTN_IMPLEMENTATION)
    return model


def make_tiny_gemma(
    head_dim: int = 64, sliding_window: int = 16, dtype: torch.dtype = torch.float32, **overrides
) -> Gemma3ForCausalLM:
    """A tiny random Gemma-3: 3 layers (sliding, sliding, full), MQA (2 query heads over 1 KV head), as
    Gemma-3-270M's shape in miniature."""
    torch.manual_seed(0)
    kw = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=512,
        pad_token_id=0,
    )
    kw.update(overrides)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**kw)).to(dtype).eval()
    model.set_attn_implementation(kvquant.ATTN_IMPLEMENTATION)
    return model
