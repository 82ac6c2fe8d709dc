"""A quantized KV cache for Hugging Face transformers: one `QuantizedLayer` per decoder layer.

A layer stores its tokens in three parts, in position order:

    sink    the first `scheme.sink` tokens, unquantized                  (B, H_kv, S, D)
    body    packed codes + scales (+ zeros), quantized once on arrival     QTensor fields
    recent  the last tokens, unquantized: at least `scheme.window`, plus   (B, H_kv, R, D)
            any tokens whose quantization group is not complete yet

Tokens move from `recent` to `body` in multiples of `scheme.tokens_per_flush` (the token-group size
of channel-wise specs, else 1) once more than `window` tokens wait. Nothing is ever requantized, and
nothing dequantized is written back. `update` returns a `LayerView` of what is stored; the attention
implementation registered by `kvquant.attention` reads it (Triton kernels on CUDA, else the PyTorch
reference). Unquantized tokens are kept in the dtype the model gives them (FP16 in deployment).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .memory import KVShape
from .quantize import QTensor, dequantize, quantize
from .scheme import Granularity, QuantSpec, Scheme, parse_scheme

__all__ = ["QuantizedCache", "QuantizedLayer", "LayerView", "BACKENDS"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")

TensorFn = Callable[[torch.Tensor], torch.Tensor]
Quantizer = Callable[[torch.Tensor, QuantSpec], QTensor]


def kernels_enabled(backend: str, device: torch.device) -> bool:
    """Whether Triton kernels serve this backend: forced by "triton", or "auto" on CUDA with triton."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    if backend == "triton":
        return True
    return backend == "auto" and device.type == "cuda" and importlib.util.find_spec("triton") is not None


def _quantizer_for(backend: str, device: torch.device) -> Quantizer:
    if kernels_enabled(backend, device):
        from .kernels.dispatch import quantize_pack  # lazy: `import kvquant` never imports triton

        return quantize_pack
    return quantize


def _cat(a: torch.Tensor | None, b: torch.Tensor, dim: int = 2) -> torch.Tensor:
    # clone: b is often a slice of the model's K/V (or of the old window); keeping the view would keep
    # the whole tensor alive (a 4k-token prefill behind 4 sink tokens) and nbytes() would under-count it
    return b.clone() if a is None else torch.cat([a, b], dim=dim)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.nbytes


@dataclass
class Body:
    """The quantized middle of one of K or V: codes, scale and zero grow along dim 2 (tokens, or token
    groups for channel-wise scales). For an fp16 spec, `dense` holds the tokens as they are."""

    spec: QuantSpec
    quantizer: Quantizer = quantize  # kvquant.quantize.quantize, or the Triton quantize_pack twin
    codes: torch.Tensor | None = None  # uint8 (B, H, T, D * bits // 8)
    scale: torch.Tensor | None = None  # see kvquant.quantize.scale_shape
    zero: torch.Tensor | None = None
    dense: torch.Tensor | None = None  # (B, H, T, D), fp16 specs only
    num_tokens: int = 0
    head_dim: int = 0
    dtype: torch.dtype = torch.float16

    def append(self, x: torch.Tensor) -> None:
        """Quantize x (B, H, t, D) once and append it; t is a multiple of the spec's token group."""
        self.head_dim, self.dtype = x.shape[-1], x.dtype
        if not self.spec.is_quantized:
            self.dense = _cat(self.dense, x)
        else:
            q = self.quantizer(x, self.spec)
            self.codes = _cat(self.codes, q.codes)
            self.scale = _cat(self.scale, q.scale)
            if q.zero is not None:
                self.zero = _cat(self.zero, q.zero)
        self.num_tokens += x.shape[2]

    def qtensor(self) -> QTensor | None:
        """The stored body as one QTensor (no copy), or None when empty or unquantized."""
        if self.codes is None:
            return None
        b, h = self.codes.shape[:2]
        shape = torch.Size((b, h, self.num_tokens, self.head_dim))
        return QTensor(self.codes, self.scale, self.zero, self.spec, shape, self.dtype)

    def materialize(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Dequantized (B, H, T, D) in `dtype`, for the reference attention path; never stored."""
        if self.dense is not None:
            return self.dense.to(dtype)
        q = self.qtensor()
        return None if q is None else dequantize(q, dtype)

    def truncate(self, num_tokens: int) -> None:
        """Keep the first num_tokens tokens."""
        rows = num_tokens
        if self.spec.granularity is Granularity.CHANNEL:
            if num_tokens % self.spec.group_size:
                raise ValueError(
                    f"cannot crop to {num_tokens} quantized tokens: that splits a channel-wise group of "
                    f"{self.spec.group_size} tokens; crop fewer tokens or use a larger window"
                )
            rows = num_tokens // self.spec.group_size
        self.map(lambda t: t[:, :, :num_tokens].clone(), lambda t: t[:, :, :rows].clone())  # clone: see _cat
        self.num_tokens = num_tokens

    def map(self, on_tokens: TensorFn, on_rows: TensorFn | None = None) -> None:
        """Apply a function to every stored tensor (for batch selection, reordering, truncation)."""
        on_rows = on_rows or on_tokens
        self.dense = None if self.dense is None else on_tokens(self.dense)
        self.codes = None if self.codes is None else on_tokens(self.codes)
        self.scale = None if self.scale is None else on_rows(self.scale)
        self.zero = None if self.zero is None else on_rows(self.zero)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes) + _nbytes(self.scale) + _nbytes(self.zero) + _nbytes(self.dense)


_NOT_KVQUANT_ATTENTION = (
    "a QuantizedCache layer reached an attention implementation that is not kvquant's; load the model "
    "with kvquant.load_model(), or call model.set_attn_implementation('kvquant') (after `import kvquant`)"
)


@dataclass(frozen=True)
class LayerView:
    """What one layer stores, as attention reads it: sink | body | recent along the token axis.

    sink_k/v, recent_k/v: (B, H_kv, S or R, D) or None. key_body/value_body: QTensor for quantized
    specs, a dense (B, H_kv, T_body, D) tensor for fp16 specs, or None.

    fresh_k/v (B, H_kv, n, D): the unquantized K/V of the n body tokens quantized by the update that made
    this view (positions fresh_start ..), or None. They are not stored: the view lives for one forward,
    so that queries of a multi-token chunk can see those tokens as the cache held them when each query
    would have been decoded (`kvquant.attention`), whatever the chunk size.
    """

    sink_k: torch.Tensor | None
    sink_v: torch.Tensor | None
    key_body: QTensor | torch.Tensor | None
    value_body: QTensor | torch.Tensor | None
    recent_k: torch.Tensor | None
    recent_v: torch.Tensor | None
    scheme: Scheme
    backend: str
    shape: torch.Size  # (B, H_kv, T, D) of everything stored
    fresh_k: torch.Tensor | None = None
    fresh_v: torch.Tensor | None = None
    fresh_start: int = 0

    # An attention implementation other than kvquant's gets a LayerView where it expects a tensor; when
    # the cache had no config to check up front, fail with what to do rather than a bare TypeError.
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(_NOT_KVQUANT_ATTENTION)

    def __getitem__(self, index):
        raise TypeError(_NOT_KVQUANT_ATTENTION)

    def _materialize(self, sink, body, recent, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(body, QTensor):
            body = dequantize(body, dtype)
        parts = [p.to(dtype) for p in (sink, body, recent) if p is not None and p.shape[2]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def keys(self, dtype: torch.dtype) -> torch.Tensor:
        """All keys dequantized, (B, H_kv, T, D): the reference path."""
        return self._materialize(self.sink_k, self.key_body, self.recent_k, dtype)

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """All values dequantized, (B, H_kv, T, D): the reference path."""
        return self._materialize(self.sink_v, self.value_body, self.recent_v, dtype)


class QuantizedLayer(CacheLayerMixin):
    """One decoder layer's K/V, stored as sink (FP) | quantized body | recent window (FP)."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, scheme: Scheme | str, backend: str = "auto"):
        super().__init__()
        self.scheme = parse_scheme(scheme)
        kernels_enabled(backend, torch.device("cpu"))  # validates the name
        self.backend = backend
        self._clear()

    def _clear(self) -> None:
        self.sink_k: torch.Tensor | None = None
        self.sink_v: torch.Tensor | None = None
        self.key_body = Body(self.scheme.key)
        self.value_body = Body(self.scheme.value)
        self.recent_k: torch.Tensor | None = None
        self.recent_v: torch.Tensor | None = None
        self.is_initialized = False

    # ---- transformers' CacheLayerMixin interface

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.scheme.check_head_dim(key_states.shape[-1])
        self.device, self.dtype = key_states.device, key_states.dtype
        self.head_dim = key_states.shape[-1]
        quantizer = _quantizer_for(self.backend, key_states.device)
        self.key_body.quantizer = self.value_body.quantizer = quantizer
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[LayerView, LayerView]:
        """Append new K/V (B, H_kv, t, D); return a view of everything stored (for K and for V)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k, v = key_states, value_states
        room = self.scheme.sink - self.sink_len
        if room > 0:
            self.sink_k = _cat(self.sink_k, k[:, :, :room])
            self.sink_v = _cat(self.sink_v, v[:, :, :room])
            k, v = k[:, :, room:], v[:, :, room:]
        fresh = None
        if k.shape[2]:
            self.recent_k, self.recent_v = _cat(self.recent_k, k), _cat(self.recent_v, v)
            fresh = self._flush()
        view = self.view(fresh)
        return view, view

    def _flush(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Quantize whole token groups that have left the window; they are never touched again.
        Returns the unquantized K/V of the tokens just quantized and their first position, or None."""
        start = self.sink_len + self.key_body.num_tokens
        n = self.scheme.quantized_end(self.get_seq_length()) - start
        if n <= 0:
            return None
        fresh_k, fresh_v = self.recent_k[:, :, :n], self.recent_v[:, :, :n]
        self.key_body.append(fresh_k)
        self.value_body.append(fresh_v)
        # clone: a slice would keep the whole old buffer alive and nbytes() would under-count it
        self.recent_k = self.recent_k[:, :, n:].clone()
        self.recent_v = self.recent_v[:, :, n:].clone()
        return fresh_k, fresh_v, start

    def view(self, fresh: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> LayerView:
        def body(b: Body):
            return b.dense if b.dense is not None else b.qtensor()

        any_k = next(
            t for t in (self.sink_k, self.recent_k, self.key_body.dense, self.key_body.codes) if t is not None
        )
        shape = torch.Size((*any_k.shape[:2], self.get_seq_length(), self.head_dim))
        return LayerView(
            self.sink_k,
            self.sink_v,
            body(self.key_body),
            body(self.value_body),
            self.recent_k,
            self.recent_v,
            self.scheme,
            self.backend,
            shape,
            *(fresh or ()),
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.sink_len + self.key_body.num_tokens + self.recent_len

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last |tokens_to_remove| tokens (a negative number, as transformers' DynamicLayer)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as transformers does"
            )
        keep = max(self.get_seq_length() + tokens_to_remove, 0)
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep_recent = keep - self.sink_len - self.key_body.num_tokens
        # clones: a slice would keep the cropped tokens' memory alive (see _cat)
        if keep_recent >= 0:
            self.recent_k = self.recent_k[:, :, :keep_recent].clone()
            self.recent_v = self.recent_v[:, :, :keep_recent].clone()
            return
        self.recent_k = self.recent_k[:, :, :0].clone() if self.recent_k is not None else None
        self.recent_v = self.recent_v[:, :, :0].clone() if self.recent_v is not None else None
        keep_body = keep - self.sink_len
        if keep_body >= 0:
            self.key_body.truncate(keep_body)
            self.value_body.truncate(keep_body)
            return
        self.key_body = Body(self.scheme.key, self.key_body.quantizer)
        self.value_body = Body(self.scheme.value, self.value_body.quantizer)
        self.sink_k, self.sink_v = self.sink_k[:, :, :keep].clone(), self.sink_v[:, :, :keep].clone()

    def _map_batch(self, fn: TensorFn) -> None:
        """Apply fn along the batch dimension of every stored tensor."""
        if not self.is_initialized:
            return
        for name in ("sink_k", "sink_v", "recent_k", "recent_v"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))
        self.key_body.map(fn)
        self.value_body.map(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def offload(self):  # the parts are not `keys`/`values` tensors; keep them where they are
        return None

    def prefetch(self):
        return None

    # ---- kvquant's own

    @property
    def sink_len(self) -> int:
        return 0 if self.sink_k is None else self.sink_k.shape[2]

    @property
    def recent_len(self) -> int:
        return 0 if self.recent_k is None else self.recent_k.shape[2]

    def nbytes(self) -> int:
        """Bytes this layer really holds: FP sink and recent tokens, codes, scales and zeros."""
        fp = sum(_nbytes(t) for t in (self.sink_k, self.sink_v, self.recent_k, self.recent_v))
        return fp + self.key_body.nbytes + self.value_body.nbytes


@dataclass
class _Expect:
    """What the cache learned of the model from its config, checked when the model first writes."""

    attn_implementation: str | None = None
    checked: bool = field(default=False)


class QuantizedCache(Cache):
    """A transformers `Cache` whose layers store K/V quantized with `scheme`.

    Args:
        scheme: a `Scheme` or a scheme string (`"int4-g64"`, `"kivi-2"`, ...).
        config: the model's config; gives the number of layers and checks head_dim and the attention
            implementation up front. Without it, layers are created as the model writes them.
        backend: "auto" (Triton kernels on CUDA when available, else PyTorch), "triton" or "torch".

    Use it as `model(ids, cache=cache)` or `model.generate(ids, cache=cache)`, on a model whose
    attention implementation is `kvquant.ATTN_IMPLEMENTATION` (`kvquant.load_model` sets it).
    """

    def __init__(self, scheme: Scheme | str, config=None, *, backend: str = "auto"):
        self.scheme = parse_scheme(scheme)
        kernels_enabled(backend, torch.device("cpu"))  # validates the name
        self.backend = backend
        self._expect = _Expect()
        if config is not None:
            shape = KVShape.from_config(config)
            self.scheme.check_head_dim(shape.head_dim)
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            self._expect = _Expect(getattr(text, "_attn_implementation", None))
            layers = [QuantizedLayer(self.scheme, backend) for _ in range(shape.num_layers)]
            super().__init__(layers=layers)
        else:
            super().__init__(layer_class_to_replicate=lambda: QuantizedLayer(self.scheme, backend))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not self._expect.checked:
            self._check_model(key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_model(self, key_states: torch.Tensor) -> None:
        from .attention import ATTN_IMPLEMENTATION

        impl = self._expect.attn_implementation
        if impl is not None and impl != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"the model's attention implementation is {impl!r}, which cannot read a quantized cache; "
                f"load it with kvquant.load_model(), or call model.set_attn_implementation("
                f"{ATTN_IMPLEMENTATION!r}) (after `import kvquant`)"
            )
        self.scheme.check_head_dim(key_states.shape[-1])
        self._expect.checked = True

    def nbytes(self) -> int:
        """Bytes held by every layer: codes, scales, zeros and unquantized tokens."""
        return sum(layer.nbytes() for layer in self.layers)

    def __repr__(self) -> str:
        scheme, n, tokens = str(self.scheme), len(self.layers), self.get_seq_length()
        return f"QuantizedCache(scheme={scheme!r}, layers={n}, tokens={tokens})"
