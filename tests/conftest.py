"""Shared fixtures: a tiny random Llama with GQA (fast) and the real default model (slow)."""

from __future__ import annotations

import os

# Kernel tests run in Triton's interpreter on the CPU. The switch is read when triton is first imported,
# and `import transformers` imports it (through torch._dynamo), so it is set here, before that import.
# An explicit TRITON_INTERPRET=0 (benchmarks/gpu_check.sh) compiles the kernels for CUDA instead.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvquant  # noqa: E402

# The tiny model's matmuls are far too small to gain from threads, and on a shared 2-core machine the
# threads' synchronisation makes a forward ~10x slower; one thread keeps the suite at seconds.
torch.set_num_threads(1)


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


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    return make_tiny_model()


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the embedded SmolLM2-135M, fp32 on the CPU, loaded with the network cut:
    on a fresh machine this is also the GGUF's first dequantization into the cache folder."""
    import socket

    def refuse(*args, **kwargs):
        raise OSError("test: loading the default model tried to reach the network")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket, "create_connection", refuse)
        return kvquant.load_model()


@pytest.fixture(scope="session")
def tokenizer(default_model):
    return default_model[1]
