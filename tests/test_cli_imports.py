"""What a command line may touch before it has checked its arguments: `import kvquant`, scheme parsing, model
and corpus paths and run configs, none of which may import torch or transformers. The public names of
kvquant still resolve (lazily), and the "kvquant" attention is registered before a model can need it.

Each import check runs in a fresh interpreter (this one has torch loaded already)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvquant
from kvquant import models

HANG_LIMIT_S = 20 * 60  # only a hang reaches it
HEAVY = ("torch", "transformers", "lm_eval", "datasets", "wandb", "matplotlib")


def fresh(code: str, cwd: Path) -> dict:
    """Run code in a new interpreter; it prints one JSON line as its last."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_LIMIT_S, cwd=cwd
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_validation_imports_nothing_heavy(tmp_path):
    (tmp_path / "corpus.txt").write_text("some text")
    code = f"""
import json, sys
import kvquant
from kvquant.eval.config import RunConfig, check_inputs
s = kvquant.parse_scheme("kivi-2")
schemes = check_inputs(RunConfig(schemes=("int8", "kivi-2", "k=int4-channel-g64,v=int4-g64"),
                                 corpus={str(tmp_path / "corpus.txt")!r}))
help_text = __import__("kvquant.eval.schemes", fromlist=["x"]).schemes_help()
print(json.dumps({{"heavy": [m for m in {HEAVY!r} if m in sys.modules], "name": s.name,
                   "n": len(schemes), "help": "kivi-2" in help_text}}))
"""
    facts = fresh(code, tmp_path)
    assert facts == {"heavy": [], "name": "kivi-2", "n": 3, "help": True}


def test_lazy_names_and_attention_registration(tmp_path):
    code = """
import json
import kvquant
from transformers import AttentionInterface
before = "kvquant" in AttentionInterface._global_mapping
impl = kvquant.ATTN_IMPLEMENTATION
after = "kvquant" in AttentionInterface._global_mapping
import kvquant.codecs.quantize, kvquant.cache  # submodules named like public functions must not hide them
q = kvquant.quantize
print(json.dumps({"before": before, "after": after, "impl": impl,
                  "quantize_is_function": callable(q) and q.__name__ == "quantize"}))
"""
    facts = fresh(code, tmp_path)
    assert facts == {"before": False, "after": True, "impl": "kvquant", "quantize_is_function": True}


def test_every_public_name_resolves():
    assert sorted(kvquant.__all__) == sorted([*kvquant._LAZY, *kvquant._SUBMODULES])
    for name in kvquant.__all__:
        assert getattr(kvquant, name) is not None, name
    assert kvquant.memory.KVShape is not None and callable(kvquant.quantize)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvquant.nope  # noqa: B018


@pytest.fixture
def folders(tmp_path) -> Path:
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text("{}")
    (tmp_path / "no-tok").mkdir()
    (tmp_path / "no-tok" / "config.json").write_text("{}")
    (tmp_path / "no-tok" / "model.safetensors").write_bytes(b"\0")
    (tmp_path / "ok").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / "ok" / name).write_text("{}")
    (tmp_path / "fake.gguf").write_bytes(b"ggml")
    (tmp_path / "real.gguf").write_bytes(b"GGUF\x03\x00")
    return tmp_path


def test_model_path_checks(folders):
    with pytest.raises(FileNotFoundError, match=r"config-only has config.json but no weights"):
        models.check_model_path(folders / "config-only")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer files .*tokenizer.save_pretrained"):
        models.check_model_path(folders / "no-tok")
    with pytest.raises(ValueError, match=r"fake.gguf is not a GGUF file"):
        models.check_model_path(folders / "fake.gguf")
    assert models.check_model_path(folders / "ok") == models.ModelSource(folders / "ok")
    assert models.check_model_path(folders / "real.gguf") == models.ModelSource(folders, "real.gguf")
    assert models.check_model_path(None).gguf == models.DEFAULT_GGUF


def test_config_only_folder_fails_before_transformers(folders):
    """The folder that used to end in transformers' "need sentencepiece or tiktoken" error."""
    with pytest.raises(FileNotFoundError, match="no weights"):
        kvquant.load_model(folders / "config-only")


def test_modes_are_declared_once():
    from kvquant.eval import config, measure

    assert config.MODES == measure.MODES
