"""A tiny random Llama with GQA for fast tests (import as `from tiny_models import make_tiny_model`;
not from conftest: each test folder has its own conftest, and the name would be ambiguous)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

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
