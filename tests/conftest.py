"""Shared fixtures: a tiny random Llama with GQA (fast) and the real default model (slow)."""

from __future__ import annotations

import os

# Kernel tests run in Triton's interpreter on the CPU. The switch is read when triton is first imported,
# and `import transformers` imports it (through torch._dynamo), so it is set here, before that import.
# An explicit TRITON_INTERPRET=0 (benchmarks/gpu_check.sh) compiles the kernels for CUDA instead.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import kvquant  # noqa: E402

# The tiny model's matmuls are far too small to gain from threads, and on a shared 2-core machine the
# threads' synchronisation makes a forward ~10x slower; one thread keeps the suite at seconds.
torch.set_num_threads(1)

# Hypothesis's default 200 ms deadline per example fails on a busy machine: no test here races the clock.
settings.register_profile("kvquant", deadline=None)
settings.load_profile("kvquant")


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
