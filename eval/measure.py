"""Perplexity by position bucket, KL vs FP16 and top-1 agreement, for FP16 and schemes run in lockstep.

Two modes (every result names its mode):
  cache  the text is fed in chunks through a real cache; each chunk attends to what earlier chunks left
         stored (quantized K/V for kvquant's QuantizedCache), and each query sees the chunk's own tokens
         as the cache held them when that query would have been decoded (FP inside the window, quantized
         once flushed), so the result does not depend on the chunk size: it is what token-by-token
         decoding sees.
  fake   one forward over the whole text; the cache's update returns K/V quantized-and-dequantized
         (`FakeQuantCache`), what most papers report.

FP16 and every scheme advance chunk by chunk together, so the reference distribution of a chunk is at hand
when a scheme's is computed: KL and top-1 are summed without ever holding a document's full logits
(8k positions x 49k vocabulary in fp32 is 1.6 GB per run).

Positions: a document of L tokens gives L - 1 predictions; the prediction of token i (1 <= i < L) falls in
the bucket [start, end) that holds i.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

import kvquant
from kvquant.scheme import Scheme

from .schemes import EvalScheme, PeerScheme, scheme_label

__all__ = [
    "BUCKET_EDGES",
    "MODES",
    "REFERENCE",
    "Bucket",
    "BucketStats",
    "FakeQuantCache",
    "make_buckets",
    "make_cache",
    "evaluate_document",
    "cache_nbytes",
]

logger = logging.getLogger(__name__)

BUCKET_EDGES = (0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
MODES = ("cache", "fake")
REFERENCE = "fp16"  # label of the unquantized reference (a DynamicCache, at the run dtype)
LOGIT_SLICE = 1024  # positions turned into logits at once: 1024 x 49k x 4 B = 200 MB


@dataclass(frozen=True)
class Bucket:
    start: int
    end: int

    @property
    def label(self) -> str:
        return f"{_k(self.start)}-{_k(self.end)}"


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def make_buckets(max_length: int, edges: Sequence[int] = BUCKET_EDGES) -> list[Bucket]:
    """Buckets [0,256), [256,512), [512,1k), ... up to max_length (the last one cut at max_length)."""
    if max_length < 2:
        raise ValueError(f"max_length={max_length} must be at least 2 (one prediction)")
    out = []
    for a, b in zip(edges, edges[1:], strict=False):
        if a >= max_length:
            break
        out.append(Bucket(a, min(b, max_length)))
    if max_length > edges[-1]:
        out.append(Bucket(edges[-1], max_length))
    return out


@dataclass
class BucketStats:
    """Sums over the predictions of one bucket of one document, for one scheme."""

    nll: float = 0.0  # sum of -log p(token), natural log
    tokens: int = 0
    kl: float = 0.0  # sum of KL(p_fp16 || p_scheme), nats
    top1: int = 0  # predictions whose argmax equals the reference's


# ------------------------------------------------------------------------------------------------ caches


def _fake_quantize_stored(x: torch.Tensor, scheme: Scheme, spec) -> torch.Tensor:
    """x (B, H_kv, T, D) as a QuantizedCache fed x at once would store it: the first `sink` tokens exact,
    then whole token groups quantized-and-dequantized, then at least `window` tokens (and any incomplete
    channel group) exact."""
    t = x.shape[2]
    sink = min(scheme.sink, t)
    step = scheme.tokens_per_flush
    body = max(t - sink - scheme.window, 0) // step * step
    if body == 0 or not spec.is_quantized:
        return x
    mid = kvquant.fake_quantize(x[:, :, sink : sink + body], spec)
    return torch.cat([x[:, :, :sink], mid, x[:, :, sink + body :]], dim=2)


class FakeQuantLayer(DynamicLayer):
    """Stores K/V exactly; `update` returns everything stored, fake-quantized as a QuantizedCache holding
    those tokens would read back after one update (sink exact, body quantized from the sink on, window
    exact). Each update re-derives the body from exact values: use it for single-forward (fake) evaluation."""

    def __init__(self, scheme: Scheme):
        super().__init__()
        self.scheme = scheme

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        return (
            _fake_quantize_stored(keys, self.scheme, self.scheme.key),
            _fake_quantize_stored(values, self.scheme, self.scheme.value),
        )


class FakeQuantCache(Cache):
    """Layers return fake-quantized K/V as plain tensors (kvquant attention hands them to SDPA)."""

    def __init__(self, scheme: Scheme | str, config=None):
        self.scheme = kvquant.parse_scheme(scheme)
        if config is not None:
            self.scheme.check_head_dim(kvquant.memory.KVShape.from_config(config).head_dim)
        super().__init__(layer_class_to_replicate=lambda: FakeQuantLayer(self.scheme))


def make_cache(scheme: EvalScheme | None, config, mode: str) -> Cache:
    """The cache one run uses: None is the FP16 reference."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known modes: {', '.join(MODES)}")
    if scheme is None:
        return DynamicCache(config=config)
    if isinstance(scheme, PeerScheme):
        if mode != "cache":
            raise ValueError("peer schemes run in cache mode only (their first update is never quantized)")
        return scheme.make_cache(config)
    if mode == "fake":
        return FakeQuantCache(scheme, config)
    return kvquant.QuantizedCache(scheme, config)


def _tensor_bytes(obj, seen: set[int]) -> int:
    """Bytes of every tensor reachable from obj's attributes (quanto's packed tensors included)."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter):
        return obj.nbytes
    total = 0
    attrs = vars(obj) if hasattr(obj, "__dict__") else {}
    for name, v in attrs.items():
        if name.startswith("__"):
            continue
        if isinstance(v, torch.Tensor) or hasattr(v, "__dict__") and type(v).__module__.startswith("optimum"):
            total += _tensor_bytes(v, seen)
    return total


def cache_nbytes(cache: Cache) -> int:
    """Bytes a cache holds: kvquant's own count, else every tensor its layers reference."""
    if isinstance(cache, kvquant.QuantizedCache):
        return cache.nbytes()
    seen: set[int] = set()
    return sum(_tensor_bytes(layer, seen) for layer in cache.layers)


# ------------------------------------------------------------------------------------------------ lockstep


@dataclass
class _Run:
    label: str
    cache: Cache
    stats: dict[Bucket, BucketStats] = field(default_factory=dict)
    error: BaseException | None = None


def _hidden(model, ids: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Last hidden states (B, t, hidden) of the base model; the LM head is applied later in slices."""
    out = model.get_decoder()(input_ids=ids, cache=cache, use_cache=True)
    return out.last_hidden_state


def _logprobs(model, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return torch.log_softmax(logits, dim=-1)


OnBucket = Callable[[str, Bucket, BucketStats, int, int], None]
OnError = Callable[[str, BaseException], None]


@torch.inference_mode()
def evaluate_document(
    model,
    ids: torch.Tensor,
    schemes: Sequence[EvalScheme],
    *,
    mode: str = "cache",
    chunk: int = 512,
    buckets: Sequence[Bucket],
    on_bucket: OnBucket | None = None,
    on_error: OnError | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict[Bucket, BucketStats]]:
    """Measure one document (ids (1, L)) for the FP16 reference and every scheme, in lockstep.

    on_bucket(label, bucket, stats, cache_bytes, cache_tokens) is called as soon as a bucket is complete
    (the caller writes it to disk); cache_bytes is what that run's cache holds at that moment, over
    cache_tokens tokens. A scheme that raises is reported through on_error and dropped; the others go on.
    Returns {label: {bucket: stats}} for the reference (label "fp16") and every scheme that finished.
    """
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"expected ids of shape (1, L), got {tuple(ids.shape)}")
    length = ids.shape[1]
    step = length if mode == "fake" else chunk
    if step < 1:
        raise ValueError(f"chunk={chunk} must be at least 1")
    runs = [_Run(REFERENCE, make_cache(None, model.config, mode))]
    for s in schemes:
        try:
            runs.append(_Run(scheme_label(s), make_cache(s, model.config, mode)))
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            _fail(_Run(scheme_label(s), None), e, on_error)
    for r in runs:
        r.stats = {b: BucketStats() for b in buckets}
    pending = list(buckets)
    targets = ids[0, 1:]
    for start in range(0, length, step):
        end = min(start + step, length)
        piece = ids[:, start:end]
        hiddens: dict[str, torch.Tensor] = {}
        for r in list(runs):
            try:
                hiddens[r.label] = _hidden(model, piece, r.cache)
            except Exception as e:  # noqa: BLE001
                if r.label == REFERENCE:
                    raise
                _fail(r, e, on_error)
                runs.remove(r)
        # predictions at positions start..end-1 target tokens start+1..end (the last one has none)
        n_pred = min(end, length - 1) - start
        for s0 in range(0, n_pred, LOGIT_SLICE):
            s1 = min(s0 + LOGIT_SLICE, n_pred)
            tgt = targets[start + s0 : start + s1]  # token positions start+s0+1 .. start+s1
            pos = torch.arange(start + s0 + 1, start + s1 + 1)
            ref_lp = _logprobs(model, hiddens[REFERENCE][0, s0:s1])
            ref_top = ref_lp.argmax(-1)
            ref_p = ref_lp.exp()
            for r in runs:
                lp = ref_lp if r.label == REFERENCE else _logprobs(model, hiddens[r.label][0, s0:s1])
                nll = -lp.gather(-1, tgt[:, None])[:, 0].double()
                if r.label == REFERENCE:
                    kl = torch.zeros_like(nll)
                    agree = torch.ones_like(tgt, dtype=torch.bool)
                else:
                    kl = (ref_p * (ref_lp - lp)).sum(-1).double().clamp_min(0)
                    agree = lp.argmax(-1) == ref_top
                for b in buckets:
                    m = (pos >= max(b.start, 1)) & (pos < b.end)
                    if m.any():
                        st = r.stats[b]
                        st.nll += float(nll[m].sum())
                        st.kl += float(kl[m].sum())
                        st.top1 += int(agree[m].sum())
                        st.tokens += int(m.sum())
        done = [b for b in pending if b.end <= end + 1 or end == length]
        for b in done:
            pending.remove(b)
            if on_bucket is not None:
                for r in runs:
                    on_bucket(r.label, b, r.stats[b], cache_nbytes(r.cache), r.cache.get_seq_length())
        if progress is not None:
            progress(end - start)
        del hiddens
    return {r.label: r.stats for r in runs}


def _fail(run: _Run, e: BaseException, on_error: OnError | None) -> None:
    logger.warning("scheme %s failed: %s: %s", run.label, type(e).__name__, e)
    if on_error is not None:
        on_error(run.label, e)


def ppl(nll: float, tokens: int) -> float:
    return math.exp(nll / tokens) if tokens else float("nan")
