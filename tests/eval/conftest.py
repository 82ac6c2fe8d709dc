"""Fixtures for eval tests: a saved tiny model folder (with the real tokenizer) and a tiny local corpus."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

WORDS = (
    "the cache of keys and values grows with every token while quantization keeps four bits per "
    "value and a scale per group so long documents fit in memory"
).split()


def make_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_model, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """Three text files of ~400+ tokens and one short one."""
    path = tmp_path_factory.mktemp("corpus")
    for i in range(3):
        (path / f"doc{i}.txt").write_text(make_text(500, i))
    (path / "short.txt").write_text("too short")
    return path


@pytest.fixture(autouse=True)
def _reference_cache(tmp_path_factory, monkeypatch):
    """Reference passes cached by eval tests go to a temporary folder, never the user's cache."""
    monkeypatch.setenv("KVQUANT_REFERENCE_CACHE", str(tmp_path_factory.getbasetemp() / "reference-cache"))
