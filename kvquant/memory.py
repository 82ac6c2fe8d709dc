"""KV-cache bytes by formula, matching what `QuantizedCache.nbytes()` measures.

FP16 baseline: 2 (K and V) * L layers * H_kv heads * d head_dim * B bytes per value, per token.
Llama-3-70B (L=80, H_kv=8, d=128) at FP16: 2*80*8*128*2 = 327,680 B = 320 KiB per token.
A quantized spec stores per token and head d*bits/8 bytes of codes plus its scales (and zeros), as its
codec's fields declare (`kvquant.codecs.base`):
    token: 1 per token      head: H_kv per token      group-N: H_kv*d/N per token
    channel-N: H_kv*d per N tokens
The cache stores pages (body pages of block_size tokens, raised to whole token groups; FP sink and window
pages of the requested block_size), so `cache_bytes` rounds each region (sink, body, recent window) up to
whole pages, exactly as the store holds them; `bytes_per_token` is the steady-state rate
(full pages). A sliding-window layer holds only the pages its window still reaches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import quirks
from .codecs.base import codec_for
from .plan import LayerPlan
from .scheme import QuantSpec, Scheme, parse_scheme

__all__ = [
    "KVShape",
    "KNOWN_SHAPES",
    "spec_bytes",
    "bytes_per_token",
    "fp16_bytes_per_token",
    "cache_bytes",
    "layer_plans",
    "effective_bits",
    "saving",
    "KNOWN_PARAMS",
    "Capacity",
    "capacity",
    "shared_prefix_bytes",
    "window_copy_bytes",
    "weights_bytes",
]


@dataclass(frozen=True)
class KVShape:
    """The part of a model's shape that sizes its KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None  # the window of the sliding-window layers, if any
    sliding_layers: tuple[int, ...] = ()  # which layers attend only to that window

    @classmethod
    def from_config(cls, config) -> KVShape:
        """From a transformers config (or a KVShape, returned as is); the shape and the sliding-window
        layers as `kvquant.quirks` reads them."""
        if isinstance(config, KVShape):
            return config
        a = quirks.attention_shape(config)
        if None in (a.num_layers, a.num_kv_heads, a.head_dim):
            raise ValueError(f"{type(config).__name__} does not give the KV cache's shape ({a})")
        windows = quirks.layer_windows(config) or ()
        sliding = tuple(i for i, w in enumerate(windows) if w is not None)
        window = windows[sliding[0]] if sliding else None
        return cls(a.num_layers, a.num_kv_heads, a.head_dim, window, sliding)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None for a full-attention layer."""
        return self.sliding_window if layer in self.sliding_layers else None


KNOWN_SHAPES: dict[str, KVShape] = {
    "llama-3-8b": KVShape(num_layers=32, num_kv_heads=8, head_dim=128),
    "llama-3-70b": KVShape(num_layers=80, num_kv_heads=8, head_dim=128),
    "smollm2-135m": KVShape(num_layers=30, num_kv_heads=3, head_dim=64),
}


def _dtype_bytes(dtype: torch.dtype | int) -> int:
    return dtype if isinstance(dtype, int) else torch.empty((), dtype=dtype).element_size()


def spec_bytes(
    spec: QuantSpec | str, num_tokens: int, heads: int, head_dim: int, dtype: torch.dtype | int = 2
) -> int:
    """Bytes one layer's K (or V) body holds for num_tokens tokens of one sequence under `spec` (no page
    rounding; num_tokens a multiple of the spec's token group)."""
    return codec_for(spec, heads, head_dim, _torch_dtype(dtype)).bytes(num_tokens)


def _torch_dtype(dtype: torch.dtype | int) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    sizes = {2: torch.float16, 4: torch.float32, 8: torch.float64}
    if dtype not in sizes:
        raise ValueError(f"a K/V dtype of {dtype} bytes is not supported; pass a torch dtype")
    return sizes[dtype]


def bytes_per_token(config, scheme: Scheme | str, dtype: torch.dtype | int = torch.float16) -> float:
    """Steady-state bytes per token over all layers, K and V (sink and window tokens excluded); a per-layer
    scheme sums its layers' specs, and salient=N/G adds its salient tokens (`LayerPlan.salient_fields`)."""
    shape, scheme = KVShape.from_config(config), parse_scheme(scheme)
    scheme.check_num_layers(shape.num_layers)
    n = 1024 * scheme.tokens_per_flush  # whole channel groups, so the per-token rate is exact
    total = 0
    for i in range(shape.num_layers):
        layer = scheme.for_layer(i)
        total += sum(
            spec_bytes(s, n, shape.num_kv_heads, shape.head_dim, dtype) for s in (layer.key, layer.value)
        )
    if scheme.salient is not None:
        plan = LayerPlan.build(
            dataclasses.replace(scheme.for_layer(0), layers=()), heads=shape.num_kv_heads,
            head_dim=shape.head_dim, dtype=_torch_dtype(dtype),
        )
        total += shape.num_layers * sum(f.nbytes(n) for f in plan.salient_fields().values())
    return total / n


def fp16_bytes_per_token(config, dtype: torch.dtype | int = torch.float16) -> int:
    """2 * L * H_kv * d * B."""
    shape = KVShape.from_config(config)
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * _dtype_bytes(dtype)


def layer_plans(
    config, scheme: Scheme | str, dtype: torch.dtype | int = torch.float16, block_size: int = 16
) -> list[LayerPlan]:
    """Every layer's `LayerPlan` (codecs at `dtype`, no calibration tables: sizes only)."""
    shape, scheme = KVShape.from_config(config), parse_scheme(scheme)
    scheme.check_num_layers(shape.num_layers)
    dtype = _torch_dtype(dtype)
    return [
        LayerPlan.build(
            scheme.for_layer(i),
            heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            dtype=dtype,
            block_size=block_size,
            sliding_window=shape.window_of(i),
        )
        for i in range(shape.num_layers)
    ]


def cache_bytes(
    config,
    scheme: Scheme | str,
    num_tokens: int,
    batch: int = 1,
    dtype: torch.dtype | int = torch.float16,
    block_size: int = 16,
) -> int:
    """Exact bytes a QuantizedCache holds after num_tokens tokens per sequence: whole pages of the sink,
    the body and the recent window, per layer (sliding-window layers at their window), as each layer's plan
    says (`kvquant.plan.LayerPlan.bytes_for`)."""
    return batch * sum(p.bytes_for(num_tokens) for p in layer_plans(config, scheme, dtype, block_size))


def effective_bits(config, scheme: Scheme | str, dtype: torch.dtype | int = torch.float16) -> float:
    """Bits per stored K/V value in steady state, scales and zeros counted."""
    shape = KVShape.from_config(config)
    values = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    return bytes_per_token(shape, scheme, dtype) * 8 / values


def saving(config, scheme: Scheme | str, dtype: torch.dtype | int = torch.float16) -> float:
    """How many times smaller than FP16 the steady-state cache is (x)."""
    return fp16_bytes_per_token(config, dtype) / bytes_per_token(config, scheme, dtype)


# ------------------------------------------------------------------------------------------- capacity

# parameters of the known shapes, for the weights' bytes in a capacity estimate
KNOWN_PARAMS: dict[str, float] = {"llama-3-8b": 8.03e9, "llama-3-70b": 70.6e9, "smollm2-135m": 134.5e6}


def weights_bytes(params: float, bits: int = 16) -> int:
    """Bytes of `params` weights at `bits` bits each (no quantization scales counted)."""
    if bits < 1:
        raise ValueError(f"weight bits must be positive, got {bits}")
    return int(params * bits / 8)


def shared_prefix_bytes(
    config,
    scheme: Scheme | str,
    context: int,
    shared_prefix: int,
    dtype: torch.dtype | int = torch.float16,
    block_size: int = 16,
) -> int:
    """Bytes of one request's pages that a common prefix of `shared_prefix` tokens lets requests share once
    they reach `context` tokens (`kvquant.serving.prefix`): a request resumes at R, the last page boundary
    in the prefix, and keeps sharing the sink pages and the body pages that were full at R (quantized pages
    are final; the page holding the quantized/window boundary is copied on its first write, the FP window is
    private). Sliding-window layers share nothing."""
    shape, scheme = KVShape.from_config(config), parse_scheme(scheme)
    return _shared_layout(shape, scheme, context, shared_prefix, dtype, block_size)[0]


def window_copy_bytes(
    config,
    scheme: Scheme | str,
    context: int,
    shared_prefix: int,
    dtype: torch.dtype | int = torch.float16,
    block_size: int = 16,
) -> int:
    """Bytes of the FP copy of a windowed scheme's window at the resume point, which the prefix cache holds
    once (besides the shared pages) so that requests can resume there decode-exactly; 0 without a window."""
    shape, scheme = KVShape.from_config(config), parse_scheme(scheme)
    return _shared_layout(shape, scheme, context, shared_prefix, dtype, block_size)[1]


def _shared_layout(
    shape: KVShape,
    scheme: Scheme,
    context: int,
    shared_prefix: int,
    dtype: torch.dtype | int,
    block_size: int,
) -> tuple[int, int]:
    """(shared bytes, window-copy bytes) of a prefix over every full-attention layer (each with its own plan
    under a layers= scheme)."""
    prefix = min(shared_prefix, context - 1)  # a request computes at least its last token
    if prefix <= 0:
        return 0, 0
    dtype = _torch_dtype(dtype)  # both public callers accept a byte count too
    if scheme.salient is not None:  # no prefix is shared with salient= (kvquant.cache refuses a shared store)
        return 0, 0
    full = [i for i in range(shape.num_layers) if i not in set(shape.sliding_layers)]
    per: dict[Scheme, tuple[int, int]] = {}
    total = [0, 0]
    for i in full:
        layer = scheme.for_layer(i)
        if layer not in per:
            per[layer] = _prefix_layout(layer, shape, prefix, dtype, block_size)
        total[0] += per[layer][0]
        total[1] += per[layer][1]
    return total[0], total[1]


def _prefix_layout(scheme: Scheme, shape: KVShape, prefix: int, dtype: torch.dtype, block_size: int):
    """(shared bytes, window-copy bytes) of a `prefix`-token prefix on one layer of a uniform scheme."""
    plan = LayerPlan.build(
        scheme, heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype=dtype, block_size=block_size
    )
    bs, fbs, sink = plan.block_size, plan.fp_block_size, plan.sink
    if prefix < sink:
        return 0, 0
    fp_page, body_page = plan.page_bytes()
    resume = sink + (prefix - sink) // bs * bs
    body_len = plan.quantized_end(resume) - min(sink, resume)
    shared = -(-sink // fbs) * fp_page + body_len // bs * body_page
    window = ((resume - sink) // fbs - body_len // fbs) * fp_page
    return shared, window


@dataclass(frozen=True)
class Capacity:
    """How many requests of `context` tokens fit in `kv_bytes` (all bytes at the storage dtype)."""

    kv_bytes: int  # memory left for the KV cache
    request_bytes: int  # one request's pages (page-rounded, `cache_bytes`)
    shared_bytes: int  # of those, the shared prefix's pages (held once when sharing)
    requests: int  # with the prefix shared
    requests_unshared: int  # every request holding its own pages
    window_copy_bytes: int = 0  # a windowed scheme's FP window at the resume point, held once by the index

    @property
    def private_bytes(self) -> int:
        return self.request_bytes - self.shared_bytes


def capacity(
    config,
    scheme: Scheme | str,
    kv_bytes: int,
    context: int,
    shared_prefix: int = 0,
    dtype: torch.dtype | int = torch.float16,
    block_size: int = 16,
) -> Capacity:
    """Concurrent requests of `context` tokens that fit in kv_bytes: without sharing floor(M / request), with
    a shared prefix floor((M - shared - window copy) / (request - shared)) (the prefix's pages held once, and
    for a windowed scheme the FP copy of its window at the resume point, which the prefix cache keeps).

    Llama-3-70B at FP16: 4,096 tokens x 320 KiB = 1.34 GB per request, so 100 requests take 134 GB."""
    if context < 1:
        raise ValueError(f"context must be at least 1 token, got {context}")
    if shared_prefix < 0:
        raise ValueError(f"shared_prefix must be >= 0 tokens, got {shared_prefix}")
    request = cache_bytes(config, scheme, context, dtype=dtype, block_size=block_size)
    shape = KVShape.from_config(config)
    shared, window = _shared_layout(shape, parse_scheme(scheme), context, shared_prefix, _torch_dtype(dtype),
                                    block_size)
    kv_bytes = max(int(kv_bytes), 0)
    unshared = kv_bytes // request
    if shared and kv_bytes >= shared + window and request > shared:
        n = (kv_bytes - shared - window) // (request - shared)
    else:
        n = unshared
    return Capacity(kv_bytes, request, shared, int(n), int(unshared), window)
