"""kvquant: quantize the KV cache of transformer language models and measure what it costs and saves."""

from . import memory
from .attention import ATTN_IMPLEMENTATION, register_attention
from .cache import QuantizedCache, QuantizedLayer
from .models import load_model
from .quantize import QTensor, dequantize, fake_quantize, quantize
from .scheme import Granularity, QuantSpec, Scheme, SchemeError, list_schemes, parse_scheme, scheme_help

__all__ = [
    "ATTN_IMPLEMENTATION",
    "Granularity",
    "QTensor",
    "QuantSpec",
    "QuantizedCache",
    "QuantizedLayer",
    "Scheme",
    "SchemeError",
    "dequantize",
    "fake_quantize",
    "list_schemes",
    "load_model",
    "memory",
    "parse_scheme",
    "quantize",
    "register_attention",
    "scheme_help",
]

register_attention()
__version__ = "0.1.0"
