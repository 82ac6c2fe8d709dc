"""Install layout: kernels/ and eval/ live inside kvquant, `import kvquant` leaves transformers' probe of the
hub `kernels` package alone and never imports triton itself. Each check runs in a fresh interpreter whose
cwd is outside the repo (so the repo root is not on sys.path); two interpreters in all (seconds each)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvquant

REPO = Path(__file__).resolve().parents[1]

_FACTS = """
import importlib, importlib.util, json, sys
def tri(): return sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
facts = {}
from transformers.utils import import_utils
facts["kernels_probe_before"] = import_utils.is_kernels_available()
import torch, transformers
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.masking_utils import sdpa_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward
facts["triton_before"] = tri()
import kvquant
facts["triton_after"] = tri()
facts["kvquant_kernels_loaded"] = sorted(m for m in sys.modules if m.startswith("kvquant.kernels"))
import_utils.is_kernels_available.cache_clear()
facts["kernels_probe_after"] = import_utils.is_kernels_available()
for name in ("kernels", "eval", "kvquant.kernels", "kvquant.eval"):
    try:
        m = importlib.import_module(name)
        facts[name] = getattr(m, "__file__", None) or list(getattr(m, "__path__", []))
    except ImportError as e:
        facts[name] = "ImportError: " + str(e)
facts["eval_builtin"] = eval("1 + 1")
sys.path.insert(0, REPO)  # as when run from the repo root, where a kernels/ folder is importable
sys.modules.pop("kernels", None)
import_utils.is_kernels_available.cache_clear()
facts["kernels_probe_repo_root"] = import_utils.is_kernels_available()
try:  # what transformers imports by that name, with the repo root first on sys.path
    facts["kernels_repo_root"] = importlib.import_module("kernels").__file__
except ImportError as e:
    facts["kernels_repo_root"] = "ImportError: " + str(e)
print(json.dumps(facts))
"""

_TRITON_BLOCKED = """
import json, sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import torch, kvquant
cache = kvquant.QuantizedCache("int4-g32")
k = torch.randn(1, 2, 3, 64)
view, _ = cache.update(k, k, 0)
print(json.dumps([view.keys(torch.float32).shape[2], kvquant.ATTN_IMPLEMENTATION]))
"""


def _start(code: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _result(proc: subprocess.Popen) -> object:
    """The one JSON line the interpreter printed, parsed."""
    out, err = proc.communicate(timeout=1800)  # only a hang reaches this; a loaded machine takes minutes
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreters(tmp_path_factory) -> dict:
    """Both fresh interpreters, started together (each spends seconds importing transformers)."""
    cwd = tmp_path_factory.mktemp("outside")
    procs = {
        "facts": _start(f"REPO = {str(REPO)!r}\n" + _FACTS, cwd),
        "blocked": _start(_TRITON_BLOCKED, cwd),
    }
    return {name: _result(p) for name, p in procs.items()}


@pytest.fixture(scope="module")
def facts(interpreters) -> dict:
    return interpreters["facts"]


def test_kernels_and_eval_are_not_top_level(facts):
    # `kernels` is Hugging Face's hub package (a dependency of transformers >= 5.25) or absent, never ours
    kernels = facts["kernels"]
    assert kernels.startswith("ImportError") or str(REPO / "kernels") not in kernels, kernels
    assert facts["eval"].startswith("ImportError"), facts["eval"]
    assert facts["eval_builtin"] == 2
    # installed from the repo's kernels/ and eval/ folders, under kvquant
    assert str(REPO / "kernels") in json.dumps(facts["kvquant.kernels"]), facts["kvquant.kernels"]
    assert str(REPO / "eval") in json.dumps(facts["kvquant.eval"]), facts["kvquant.eval"]


def test_transformers_kernels_probe_unchanged(facts):
    """transformers asks whether the hub `kernels` package is installed; kvquant must not change its answer,
    not even with the repo root (and its kernels/ folder) on sys.path, and `import kernels` from the repo root
    gives the hub package where it is installed (transformers >= 5.25 imports it from its model modules)."""
    assert facts["kernels_probe_after"] is facts["kernels_probe_before"]
    assert facts["kernels_probe_repo_root"] is facts["kernels_probe_before"]
    if facts["kernels_probe_before"]:
        assert facts["kernels_repo_root"] == facts["kernels"], facts["kernels_repo_root"]


def test_import_kvquant_never_imports_triton(facts, interpreters):
    """Nothing of kvquant.kernels is loaded, and importing kvquant adds no triton module beyond what its
    dependencies already loaded (torch's dynamo, which transformers' modeling utilities import, imports
    triton when it is installed); with triton unimportable, kvquant imports and runs its CPU path."""
    assert facts["kvquant_kernels_loaded"] == []
    assert facts["triton_after"] == facts["triton_before"]
    assert interpreters["blocked"] == [3, "kvquant"]


def test_attention_is_registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert kvquant.ATTN_IMPLEMENTATION in AttentionInterface._global_mapping
    assert kvquant.ATTN_IMPLEMENTATION in AttentionMaskInterface._global_mapping


def test_pyproject_lists_every_package():
    """A non-editable install ships only the packages pyproject.toml names: every folder of kvquant/ (and of
    kernels/ and eval/, installed as kvquant.kernels and kvquant.eval) with an __init__.py is listed."""
    import re  # tomllib is Python 3.11+; the project supports 3.10

    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*)\]$", text, re.M).group(1)))
    found = set()
    for top, name in (("kvquant", "kvquant"), ("kernels", "kvquant.kernels"), ("eval", "kvquant.eval")):
        for init in (REPO / top).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / top).parts
            found.add(".".join([name, *rel]))
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
