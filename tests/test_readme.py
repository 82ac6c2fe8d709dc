"""Every ```python block of README.md runs as written (shell blocks are not run), each in a fresh namespace,
with the network cut. A block that loads the real model is marked slow (it still runs in `make test`).

A block that fills a QuantizedCache must teach what the cache is for: the cache holds fewer bytes than the
same tokens unquantized, and the block prints what was saved."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the opening fence, code) of each ```python block."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def _param(line: int, code: str):
    slow = "load_model(" in code
    return pytest.param(line, code, id=f"README.md:{line}", marks=[pytest.mark.slow] if slow else [])


@pytest.fixture
def no_network(monkeypatch):
    def refuse(self, address, *args, **kwargs):
        if getattr(self, "family", None) == socket.AF_UNIX:
            return real(self, address)
        raise OSError(f"README example tried to reach the network: {address!r}")

    real = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", lambda address, *a, **k: refuse(None, address))


def test_extraction_finds_python_and_skips_shell():
    text = "x\n```python\na = 1\n```\n```bash\nrm -rf /\n```\n```python\nb = 2\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n"), (8, "b = 2\n")]
    assert BLOCKS, "README.md has no ```python block: nothing would be checked"


def _fp_bytes(cache, config, dtype) -> int:
    """The bytes of the same tokens unquantized at `dtype` (K and V, every layer), from the config alone."""
    import torch

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * text.num_hidden_layers * heads * head_dim * cache.get_seq_length() * size


@pytest.mark.parametrize("line, code", [_param(line, code) for line, code in BLOCKS])
def test_readme_python_block_runs(line, code, no_network, capsys):
    namespace: dict = {"__name__": "__readme__"}
    exec(compile(code, f"{README}:{line}", "exec"), namespace)  # noqa: S102 - the README's own code
    printed = capsys.readouterr().out

    import kvquant

    caches = [v for v in namespace.values() if isinstance(v, kvquant.QuantizedCache)]
    models = [v for v in namespace.values() if hasattr(v, "config") and hasattr(v, "generate")]
    for cache in caches:
        assert cache.get_seq_length() > 0, "the example never fills its cache"
        if models:
            full = _fp_bytes(cache, models[0].config, models[0].dtype)
            assert cache.nbytes() < full, (
                f"README.md:{line}: the cache holds {cache.nbytes():,} B, as much as {full:,} B unquantized: "
                "the example quantizes nothing (make the prompt longer than sink + window)"
            )
        assert "saved" in printed, f"README.md:{line}: the example should print the bytes it saved"


_RESULT_FILE = re.compile(r"(?:benchmarks/results|calib)/[\w.-]+\.(?:md|csv|png|json|safetensors)")


def test_result_files_the_readme_cites_are_in_the_repository():
    """A measured figure cites its file; the file must ship (benchmarks/results/ is ignored by default, so a
    result added without `git add -f` would be cited and missing on a fresh checkout)."""
    root = README.parent
    cited = sorted(set(_RESULT_FILE.findall(README.read_text(encoding="utf-8"))))
    assert len(cited) >= 5, cited
    missing = [c for c in cited if not (root / c).is_file()]
    assert not missing, f"README cites files that are not in the checkout: {missing}"
