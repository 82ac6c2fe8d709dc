"""Loading is offline: the default model, a local folder and a .gguf file load with the network cut; bad paths
fail clearly."""

from __future__ import annotations

import socket

import pytest
import torch
from tiny_models import make_tiny_model
from transformers import AutoTokenizer

import kvquant
from kvquant import models


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connection attempt fails loudly (and is recorded)."""
    attempts = []

    def refuse(self, address, *args, **kwargs):
        attempts.append(address)
        raise OSError(f"test: network access attempted to {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", lambda address, *a, **k: refuse(None, address))
    yield attempts
    assert attempts == []


@pytest.fixture(scope="module")
def default_copy(default_model):
    """The default model's fp32 safetensors copy, made (offline) by the session's first load."""
    copy = models.copy_dir(models.default_model_dir() / models.DEFAULT_GGUF, torch.float32)
    assert (copy / "config.json").is_file()
    return copy


def test_default_model_loads_offline(default_copy, no_network):
    model, tok = kvquant.load_model()
    assert model.config._attn_implementation == kvquant.ATTN_IMPLEMENTATION
    assert model.config.num_key_value_heads == 3 and model.config.num_hidden_layers == 30
    assert not model.training
    ids = tok("The cat", return_tensors="pt").input_ids
    assert ids.shape[1] >= 2


def test_gguf_path_loads_offline(default_copy, no_network):
    gguf = models.default_model_dir() / models.DEFAULT_GGUF
    model, tok = kvquant.load_model(gguf)
    assert model.config.num_hidden_layers == 30
    assert tok.decode(tok("hello world").input_ids).strip().endswith("hello world")


def test_local_folder_loads_offline(tmp_path, default_copy, no_network):
    copy = default_copy
    tiny = make_tiny_model(seed=3, num_hidden_layers=1)
    tiny.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(copy, local_files_only=True).save_pretrained(tmp_path)
    model, tok = kvquant.load_model(tmp_path)
    assert model.config.num_hidden_layers == 1
    assert model.config._attn_implementation == kvquant.ATTN_IMPLEMENTATION
    for name, p in tiny.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name
    cache = kvquant.QuantizedCache("int4-g32", model.config)
    out = model.generate(
        tok("a b c", return_tensors="pt").input_ids, cache=cache, max_new_tokens=3, do_sample=False
    )
    assert cache.get_seq_length() == out.shape[1] - 1


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model") as e:
        kvquant.load_model(missing)
    assert str(missing) in str(e.value) and "never downloads" in str(e.value)
    with pytest.raises(FileNotFoundError, match="no-such-org/no-such-model"):
        kvquant.load_model("no-such-org/no-such-model")  # a hub id is not looked up


def test_bad_local_paths(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"weights\.bin.*not a \.gguf"):
        kvquant.load_model(tmp_path / "weights.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty has no config.json"):
        kvquant.load_model(tmp_path / "empty")


def test_copy_dir_follows_content_not_path(tmp_path):
    """The dequantized copy is keyed by the GGUF's content: the same file installed elsewhere reuses it,
    a changed file of the same name gets its own."""
    a, b, c = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in (
        (a, b"GGUF" + bytes(3 << 20)),
        (b, b"GGUF" + bytes(3 << 20)),
        (c, b"GGUF" + bytes(3 << 20) + b"!"),
    ):
        path.parent.mkdir()
        path.write_bytes(data)
    assert models.copy_dir(a, torch.float32) == models.copy_dir(b, torch.float32)
    assert models.copy_dir(a, torch.float32) != models.copy_dir(c, torch.float32)
    assert models.copy_dir(a, torch.float32) != models.copy_dir(a, torch.bfloat16)
