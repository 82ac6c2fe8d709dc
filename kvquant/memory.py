"""KV-cache bytes by formula, matching what `QuantizedCache.nbytes()` measures.

FP16 baseline: 2 (K and V) * L layers * H_kv heads * d head_dim * B bytes per value, per token.
Llama-3-70B (L=80, H_kv=8, d=128) at FP16: 2*80*8*128*2 = 327,680 B = 320 KiB per token.
A quantized spec stores per token and head d*bits/8 bytes of codes plus its scales (and zeros):
    token: 1 per token      head: H_kv per token      group-N: H_kv*d/N per token
    channel-N: H_kv*d per N tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scheme import Granularity, QuantSpec, Scheme, parse_scheme

__all__ = [
    "KVShape",
    "KNOWN_SHAPES",
    "spec_bytes",
    "bytes_per_token",
    "fp16_bytes_per_token",
    "cache_bytes",
    "effective_bits",
    "saving",
]


@dataclass(frozen=True)
class KVShape:
    """The part of a model's shape that sizes its KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> KVShape:
        """From a transformers config (or a KVShape, returned as is)."""
        if isinstance(config, KVShape):
            return config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(text.num_hidden_layers, heads, head_dim)


KNOWN_SHAPES: dict[str, KVShape] = {
    "llama-3-8b": KVShape(num_layers=32, num_kv_heads=8, head_dim=128),
    "llama-3-70b": KVShape(num_layers=80, num_kv_heads=8, head_dim=128),
    "smollm2-135m": KVShape(num_layers=30, num_kv_heads=3, head_dim=64),
}


def _dtype_bytes(dtype: torch.dtype | int) -> int:
    return dtype if isinstance(dtype, int) else torch.empty((), dtype=dtype).element_size()


def spec_bytes(
    spec: QuantSpec, num_tokens: int, heads: int, head_dim: int, dtype: torch.dtype | int = 2
) -> int:
    """Bytes one layer's K (or V) body holds for num_tokens tokens of one sequence under `spec`."""
    value_bytes = _dtype_bytes(dtype)
    spec.check_head_dim(head_dim)
    if not spec.is_quantized:
        return num_tokens * heads * head_dim * value_bytes
    codes = num_tokens * heads * head_dim * spec.bits // 8
    stats = {
        Granularity.TOKEN: num_tokens,
        Granularity.HEAD: num_tokens * heads,
        Granularity.GROUP: num_tokens * heads * (head_dim // (spec.group_size or 1)),
        Granularity.CHANNEL: (num_tokens // (spec.group_size or 1)) * heads * head_dim,
    }[spec.granularity]
    stat_bytes = _dtype_bytes(spec.scale_dtype) if spec.scale_dtype is not None else value_bytes
    return codes + stats * stat_bytes * (1 if spec.symmetric else 2)


def bytes_per_token(config, scheme: Scheme | str, dtype: torch.dtype | int = torch.float16) -> float:
    """Steady-state bytes per token over all layers, K and V (sink and window tokens excluded)."""
    shape, scheme = KVShape.from_config(config), parse_scheme(scheme)
    n = 1024 * scheme.tokens_per_flush  # whole channel groups, so the per-token rate is exact
    per_layer = sum(
        spec_bytes(s, n, shape.num_kv_heads, shape.head_dim, dtype) for s in (scheme.key, scheme.value)
    )
    return shape.num_layers * per_layer / n


def fp16_bytes_per_token(config, dtype: torch.dtype | int = torch.float16) -> int:
    """2 * L * H_kv * d * B."""
    shape = KVShape.from_config(config)
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * _dtype_bytes(dtype)


def cache_bytes(
    config, scheme: Scheme | str, num_tokens: int, batch: int = 1, dtype: torch.dtype | int = torch.float16
) -> int:
    """Exact bytes a QuantizedCache holds after num_tokens tokens per sequence, sink and window included."""
    shape, scheme = KVShape.from_config(config), parse_scheme(scheme)
    body = scheme.quantized_end(num_tokens) - min(scheme.sink, num_tokens)
    fp_tokens = num_tokens - body
    per_layer = 2 * fp_tokens * shape.num_kv_heads * shape.head_dim * _dtype_bytes(dtype)
    per_layer += sum(
        spec_bytes(s, body, shape.num_kv_heads, shape.head_dim, dtype) for s in (scheme.key, scheme.value)
    )
    return batch * shape.num_layers * per_layer


def effective_bits(config, scheme: Scheme | str, dtype: torch.dtype | int = torch.float16) -> float:
    """Bits per stored K/V value in steady state, scales and zeros counted."""
    shape = KVShape.from_config(config)
    values = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    return bytes_per_token(shape, scheme, dtype) * 8 / values


def saving(config, scheme: Scheme | str, dtype: torch.dtype | int = torch.float16) -> float:
    """How many times smaller than FP16 the steady-state cache is (x)."""
    return fp16_bytes_per_token(config, dtype) / bytes_per_token(config, scheme, dtype)
