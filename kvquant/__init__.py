"""kvquant: quantize the KV cache of transformer language models and measure what it costs and saves.

`import kvquant` is instant: it imports neither torch nor transformers. Each public name below is imported
from its module the first time it is used (PEP 562), so a CLI can parse a scheme string and check its
arguments before paying seconds for the heavy imports.

The "kvquant" attention implementation is registered with transformers the first time a name that leads to a
model is used (`kvquant.ATTN_IMPLEMENTATION`, `kvquant.QuantizedCache`, `kvquant.load_model`, ...), so
`model.set_attn_implementation(kvquant.ATTN_IMPLEMENTATION)` always finds it; `kvquant.register_attention()`
registers it explicitly (for code that writes the literal "kvquant").

`kvquant.enable(model, "int4-g64")` makes `model.generate()` and pipelines build a `QuantizedCache` without a
`cache=` argument (`kvquant.hf`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the submodule that defines it
_LAZY: dict[str, str] = {
    "ATTN_IMPLEMENTATION": "attention",
    "register_attention": "attention",
    "QuantizedCache": "cache",
    "QuantizedLayer": "cache",
    "disable": "hf",
    "enable": "hf",
    "load_model": "models",
    "QTensor": "codecs.quantize",
    "dequantize": "codecs.quantize",
    "fake_quantize": "codecs.quantize",
    "quantize": "codecs.quantize",
    "Granularity": "scheme",
    "QuantSpec": "scheme",
    "Scheme": "scheme",
    "SchemeError": "scheme",
    "list_schemes": "scheme",
    "parse_scheme": "scheme",
    "scheme_help": "scheme",
}
_SUBMODULES = ("memory",)
# names whose use means a model with kvquant's attention is near: register it with transformers first
_NEEDS_ATTENTION = frozenset({"ATTN_IMPLEMENTATION", "QuantizedCache", "QuantizedLayer", "load_model"})

__all__ = [  # _LAZY's names and the submodules (a test keeps them equal)
    "ATTN_IMPLEMENTATION",
    "Granularity",
    "QTensor",
    "QuantSpec",
    "QuantizedCache",
    "QuantizedLayer",
    "Scheme",
    "SchemeError",
    "dequantize",
    "disable",
    "enable",
    "fake_quantize",
    "list_schemes",
    "load_model",
    "memory",
    "parse_scheme",
    "quantize",
    "register_attention",
    "scheme_help",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    if name not in _LAZY:
        raise AttributeError(f"module 'kvquant' has no attribute {name!r}")
    if name in _NEEDS_ATTENTION:
        _register_attention_once()
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # later lookups find it without coming back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_registered = False


def _register_attention_once() -> None:
    """Register "kvquant" with transformers' AttentionInterface and mask interface (imports transformers)."""
    global _registered
    if not _registered:
        importlib.import_module(".attention", __name__).register_attention()
        _registered = True


if TYPE_CHECKING:  # for type checkers and IDEs; at run time these come from __getattr__
    from . import memory
    from .attention import ATTN_IMPLEMENTATION, register_attention
    from .cache import QuantizedCache, QuantizedLayer
    from .codecs.quantize import QTensor, dequantize, fake_quantize, quantize
    from .hf import disable, enable
    from .models import load_model
    from .scheme import (
        Granularity,
        QuantSpec,
        Scheme,
        SchemeError,
        list_schemes,
        parse_scheme,
        scheme_help,
    )
