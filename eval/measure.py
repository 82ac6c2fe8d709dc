"""Perplexity by position bucket, KL vs the reference, Δp and top-1 agreement, for the unquantized reference
and schemes run in lockstep; per-token values for the error distributions and intervals.

Three modes (every result names its mode):
  cache    decode-exact: the text is fed in chunks through a real cache; each chunk attends to what earlier
           chunks left stored (quantized K/V for kvquant's QuantizedCache), and each query sees the chunk's
           own tokens as the cache held them when that query would have been decoded (FP inside the window,
           quantized once flushed): what token-by-token decoding sees. In exact arithmetic the chunk size
           does not matter; in float32 a different chunking is a different rounding (realization noise).
  fake     one forward over the whole text; the cache's update returns K/V quantized-and-dequantized
           (`FakeQuantCache`), so every query sees every key quantized: what most papers report.
  prefill  serving-realistic: the first P tokens go through one forward with FP attention among themselves
           (their predictions equal the reference's), their K/V are then stored quantized, and the
           continuation is scored through the quantized cache in decode-exact chunks (what vLLM,
           transformers' QuantizedCache and KIVI do at prefill).

The reference and every scheme advance chunk by chunk together, so the reference distribution of a chunk is
at hand when a scheme's is computed: KL and top-1 are summed without ever holding a document's full logits
(8k positions x 49k vocabulary in fp32 is 1.6 GB per run). The reference may be passed in (`reference`, from
the reference cache): its last hidden states and the few numbers per position that KL, Δp and top-1 need of
it (`kvquant.eval.scoring`), so neither its forward nor its LM head is recomputed.

Positions: a document of L tokens gives L - 1 predictions; the prediction of token i (1 <= i < L) falls in
the bucket [start, end) that holds i.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicCache

import kvquant
from kvquant.salient import fp_prefill, needs_prompt_queries

from . import scoring
from .fakequant import FakeQuantCache
from .schemes import EvalScheme, parse_eval_scheme

__all__ = [
    "BUCKET_EDGES",
    "MODES",
    "REFERENCE",
    "Bucket",
    "BucketStats",
    "FakeQuantCache",
    "make_buckets",
    "make_cache",
    "noise_shift",
    "steps",
    "TOKEN_FIELDS",
    "evaluate_document",
    "cache_nbytes",
]

logger = logging.getLogger(__name__)

BUCKET_EDGES = (0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
MODES = ("cache", "fake", "prefill")
REFERENCE = "fp16"  # results key of the unquantized reference (a DynamicCache, at the run dtype); shown as
# "<run dtype> (reference)", e.g. "fp32 (reference)" on the CPU
TOKEN_FIELDS = ("nll_diff", "kl")  # per-token values kept for distributions and intervals
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
    """Sums over the predictions of one bucket of one document, for one scheme (kvquant.eval.metrics.ROW_SUMS
    are these), and the per-token values the distributions need."""

    nll: float = 0.0  # sum of -log p(token), natural log
    tokens: int = 0
    kl: float = 0.0  # sum of KL(p_ref || p_scheme), nats
    top1: int = 0  # predictions whose argmax equals the reference's
    ref_nll: float = 0.0  # the reference's sum of -log p(token) over the same tokens
    dp: float = 0.0  # sum of p_scheme(token) - p_ref(token)
    dp_sq: float = 0.0  # sum of its square
    token_parts: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {f: [] for f in TOKEN_FIELDS})

    def row_sums(self) -> dict[str, float]:
        """The results.jsonl fields (metrics.ROW_SUMS)."""
        return {"nll_sum": self.nll, "ref_nll_sum": self.ref_nll, "tokens": self.tokens, "kl_sum": self.kl,
                "top1": self.top1, "dp_sum": self.dp, "dp_sq_sum": self.dp_sq}

    def token_values(self) -> dict[str, torch.Tensor]:
        """Per-token nll - nll_ref (float64) and KL (float32), in position order."""
        return {f: (torch.cat(v) if v else torch.zeros(0)) for f, v in self.token_parts.items()}


# ------------------------------------------------------------------------------------------------ caches


def make_cache(scheme: EvalScheme | None, config, mode: str) -> Cache:
    """The cache one run uses: None is the reference (a DynamicCache; without the config in prefill mode, so
    sliding-window layers keep every token and can be copied into a scheme's cache after the prefill)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known modes: {', '.join(MODES)}")
    if scheme is None:
        return DynamicCache() if mode == "prefill" else DynamicCache(config=config)
    scheme = parse_eval_scheme(scheme)
    if mode not in scheme.modes:
        raise ValueError(f"{scheme.label} runs in {'/'.join(scheme.modes)} mode only, not {mode}")
    return scheme.make_cache(config, mode)


def noise_shift(chunk: int) -> int:
    """How much shorter the first chunk of the second realization (--noise-floor) is: chunk // 2 + 1, so
    its chunks start at odd offsets. Not chunk / 2: on the CPU a forward of 512 or 1,024 rows computes each
    row bit for bit alike (the GEMM tiles divide both), so a half-chunk shift reproduces the first
    realization exactly and would report no noise where other chunkings move int4-g64 by points."""
    if chunk < 2:
        raise ValueError(
            f"chunk={chunk}: token-by-token decoding has one realization; a noise floor needs >= 2"
        )
    return chunk // 2 + 1


def steps(length: int, mode: str, chunk: int, prefill: int | None = None, shift: int = 0) -> list[int]:
    """Chunk boundaries [0, b1, ..., length]: fake one forward; prefill P tokens then `chunk` at a time;
    cache `chunk` at a time, the first chunk `shift` tokens shorter (a different realization of the same
    decode-exact computation: the noise floor)."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be at least 1")
    if mode == "fake":
        return [0, length]
    first = chunk
    if mode == "prefill":
        if prefill is None or not 1 <= prefill < length:
            raise ValueError(f"prefill={prefill} must be between 1 and the length - 1 ({length - 1})")
        first = prefill
    elif shift:
        first = max(chunk - shift, 1)
    out = [0]
    pos = min(first, length)
    while True:
        out.append(pos)
        if pos >= length:
            return out
        pos = min(pos + chunk, length)


def _tensor_bytes(obj, seen: set[int]) -> int:
    """Bytes of every tensor reachable from obj's attributes, tuples, lists and dict values (quanto's packed
    tensors, HQQ's (codes, meta) pairs), each tensor object counted once."""
    if id(obj) in seen:
        return 0
    if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter):
        seen.add(id(obj))
        return obj.nbytes  # the tensor's own bytes (a view into a larger buffer counts only its part)
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, (tuple, list)):
        children = list(obj)
    elif isinstance(obj, dict):
        children = list(obj.values())
    else:
        attrs = vars(obj) if hasattr(obj, "__dict__") else {}
        children = [v for k, v in attrs.items() if not k.startswith("__")]
    total = 0
    for v in children:
        if (
            isinstance(v, (torch.Tensor, tuple, list, dict))
            or hasattr(v, "__dict__")
            and type(v).__module__.startswith(("optimum", "hqq"))
        ):
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
    cache: Cache | None
    scheme: EvalScheme | None = None
    stats: dict[Bucket, BucketStats] = field(default_factory=dict)
    error: BaseException | None = None


def _hidden(model, ids: torch.Tensor, cache: Cache, position: int = 0) -> torch.Tensor:
    """Last hidden states (B, t, hidden) of the base model; the LM head is applied later in slices."""
    out = model.get_decoder()(input_ids=ids, cache=cache, use_cache=True)
    return out.last_hidden_state


def fp_prompt(model, ids: torch.Tensor) -> tuple[Cache, torch.Tensor]:
    """Prefill mode's FP forward of a prompt ids (B, t): its DynamicCache and last hidden states (B, t,
    hidden). One serves every scheme: each stores (quantizes) the same K/V from it (`store_prefill`)."""
    fp_cache = make_cache(None, model.config, "prefill")
    return fp_cache, _hidden(model, ids, fp_cache)


def store_prefill(cache: Cache, fp_cache: Cache) -> None:
    """Store what an FP prefill left in `fp_cache` (a DynamicCache) into `cache`, layer by layer: the
    scheme's cache quantizes it as it would any update (sink FP, body encoded, window FP)."""
    for i, layer in enumerate(fp_cache.layers):
        cache.update(layer.keys, layer.values, i)


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
    prefill: int | None = None,
    shift: int = 0,
    reference: dict[str, torch.Tensor] | None = None,
    on_reference: Callable[[dict[str, torch.Tensor]], None] | None = None,
    on_bucket: OnBucket | None = None,
    on_error: OnError | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict[Bucket, BucketStats]]:
    """Measure one document (ids (1, L)) for the reference and every scheme, in lockstep.

    prefill: P, the prompt length of prefill mode. shift: cache mode's first chunk is `shift` tokens shorter
    (`steps`). reference: the reference computed before with the same model, tokens, dtype and chunking, as
    the reference cache stores it: its last hidden states "hidden" (1, L, hidden) and, for a linear LM head,
    the scoring statistics of its L - 1 predictions (`scoring.STAT_FIELDS`); the reference forward is skipped,
    and with the statistics its LM head too. on_reference(reference) receives that dict on the CPU once the
    document is complete, whenever something in it was computed here.

    on_bucket(label, bucket, stats, cache_bytes, cache_tokens) is called as soon as a bucket is complete
    (the caller writes it to disk); cache_bytes is what that run's cache holds at that moment, over
    cache_tokens tokens. A scheme that raises is reported through on_error and dropped; the others go on.
    Returns {label: {bucket: stats}} for the reference (label "fp16") and every scheme that finished.
    """
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"expected ids of shape (1, L), got {tuple(ids.shape)}")
    length = ids.shape[1]
    bounds = steps(length, mode, chunk, prefill, shift)
    if reference is not None and tuple(reference["hidden"].shape[:2]) != (1, length):
        shape = tuple(reference["hidden"].shape)
        raise ValueError(f"reference hidden states {shape} do not match ids (1, {length})")
    live_ref = reference is None
    stored_stats = reference is not None and all(
        f in reference and len(reference[f]) == length - 1 for f in scoring.STAT_FIELDS
    )
    runs = _start_runs(model, schemes, mode, buckets, live_ref, on_error)
    pending = list(buckets)
    kept: list[torch.Tensor] = []  # the reference's hidden states (1, t, hidden) per chunk, computed here
    kept_stats: list[dict[str, torch.Tensor]] = []  # its scoring statistics per slice, when computed here
    for start, end in zip(bounds, bounds[1:], strict=False):
        piece = ids[:, start:end]
        if live_ref:
            ref_hidden = _hidden(model, piece, runs[0].cache)
            if on_reference is not None:
                kept.append(ref_hidden.detach().to("cpu", copy=True))
        else:
            ref_hidden = reference["hidden"][:, start:end].to(ids.device)
        prefilling = mode == "prefill" and start == 0
        hiddens = {REFERENCE: ref_hidden}
        hiddens |= _scheme_hiddens(model, piece, runs, ref_hidden if live_ref else None, prefilling, on_error)
        # predictions at positions start..end-1 target tokens start+1..end (the last one has none)
        n_pred = min(end, length - 1) - start
        kept_stats += _score_chunk(
            model, runs, hiddens, ids[0, 1:], start, n_pred, buckets, reference if stored_stats else None
        )
        _report_complete(pending, end, length, runs, on_bucket)
        if progress is not None:
            progress(end - start)
        del hiddens
    new_stats = bool(kept_stats) and all(kept_stats)  # a linear head: statistics for every slice
    if on_reference is not None and (kept or new_stats):
        out = {"hidden": torch.cat(kept, dim=1) if kept else reference["hidden"]}
        if new_stats:
            out.update({f: torch.cat([st[f] for st in kept_stats]) for f in scoring.STAT_FIELDS})
        on_reference(out)
    return {r.label: r.stats for r in runs}


def _start_runs(model, schemes, mode: str, buckets, live_ref: bool, on_error: OnError | None) -> list[_Run]:
    """The reference's run first (its cache None when its hidden states are read, not computed), then one
    per scheme whose cache could be made; a scheme whose cache fails is reported and left out."""
    runs = [_Run(REFERENCE, make_cache(None, model.config, mode) if live_ref else None)]
    for s in schemes:
        s = parse_eval_scheme(s)
        try:
            runs.append(_Run(s.label, make_cache(s, model.config, mode), s))
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            _fail(_Run(s.label, None), e, on_error)
    for r in runs:
        r.stats = {b: BucketStats() for b in buckets}
    return runs


def _scheme_hiddens(
    model, piece: torch.Tensor, runs: list[_Run], live: torch.Tensor | None, prefilling: bool,
    on_error: OnError | None,
) -> dict[str, torch.Tensor]:
    """Each scheme's last hidden states (1, t, hidden) for one chunk, piece (1, t), through its cache. The
    prefill chunk has FP attention among the prompt's tokens (the reference's forward `live` when it ran
    here, else one of its own), then stores the FP K/V in the scheme's cache. A run that raises is reported
    and removed from `runs`. The FP prompt forward is one for every scheme that stores it (the same K/V and
    the same hidden tensor, which `_score_chunk` then scores once)."""
    out: dict[str, torch.Tensor] = {}
    shared: tuple | None = (runs[0].cache, live) if live is not None else None  # (fp_cache, hidden)
    for r in list(runs[1:]):
        try:
            if prefilling and needs_prompt_queries(r.cache):  # its prompt's queries choose (salient=N/G)
                with fp_prefill(r.cache):
                    out[r.label] = _hidden(model, piece, r.cache)
            elif prefilling:
                if shared is None:  # the reference was read, not run: one FP forward of the prompt here
                    shared = fp_prompt(model, piece)
                fp_cache, out[r.label] = shared
                store_prefill(r.cache, fp_cache)
            else:
                out[r.label] = _hidden(model, piece, r.cache)
        except Exception as e:  # noqa: BLE001
            _fail(r, e, on_error)
            runs.remove(r)
    return out


def _score_chunk(
    model, runs: list[_Run], hiddens: dict[str, torch.Tensor], targets: torch.Tensor, start: int, n_pred: int,
    buckets: Sequence[Bucket], stored: dict[str, torch.Tensor] | None,
) -> list[dict[str, torch.Tensor]]:
    """Score one chunk's n_pred predictions (positions start.., targets (L - 1,) the document's tokens 1..)
    for every run, LOGIT_SLICE positions at a time, into the runs' bucket sums. The reference's statistics
    are read from `stored` when given, else computed; the computed ones are returned, one dict per slice."""
    computed = []
    for s0 in range(0, n_pred, LOGIT_SLICE):
        s1 = min(s0 + LOGIT_SLICE, n_pred)
        tgt = targets[start + s0 : start + s1]  # token positions start+s0+1 .. start+s1
        pos = torch.arange(start + s0 + 1, start + s1 + 1, device=tgt.device)
        if stored is not None:
            ref = scoring.stored_slice(stored, start + s0, start + s1, tgt.device)
        else:
            ref = scoring.reference_slice(model, hiddens[REFERENCE][0, s0:s1], tgt)
            computed.append(ref.stats())
        ref_nll = ref.nll
        scored: dict[int, tuple] = {}  # runs handed one hidden tensor (prefill's FP prompt) are scored once
        for r in runs:
            if r.label == REFERENCE:
                nll, kl = ref_nll, torch.zeros_like(ref_nll)
                agree = torch.ones_like(tgt, dtype=torch.bool)
            else:
                h = hiddens[r.label]
                if id(h) not in scored:
                    scored[id(h)] = scoring.score(model, ref, h[0, s0:s1], tgt)
                nll, kl, agree = scored[id(h)]
            _add_to_buckets(r.stats, buckets, pos, nll, ref_nll, kl, agree)
    return computed


def _add_to_buckets(
    stats: dict[Bucket, BucketStats], buckets: Sequence[Bucket], pos: torch.Tensor, nll: torch.Tensor,
    ref_nll: torch.Tensor, kl: torch.Tensor, agree: torch.Tensor,
) -> None:
    """Add one slice's values per prediction (pos (n,): the predicted tokens' positions) to its buckets."""
    dp = torch.exp(-nll) - torch.exp(-ref_nll)
    for b in buckets:
        m = (pos >= max(b.start, 1)) & (pos < b.end)
        if m.any():
            st = stats[b]
            st.nll += float(nll[m].sum())
            st.ref_nll += float(ref_nll[m].sum())
            st.kl += float(kl[m].sum())
            st.top1 += int(agree[m].sum())
            st.dp += float(dp[m].sum())
            st.dp_sq += float((dp[m] ** 2).sum())
            st.tokens += int(m.sum())
            st.token_parts["nll_diff"].append((nll[m] - ref_nll[m]).cpu())
            st.token_parts["kl"].append(kl[m].float().cpu())


def _report_complete(pending: list[Bucket], end: int, length: int, runs: list[_Run], on_bucket) -> None:
    """Hand every bucket the chunk ending at `end` completed to on_bucket, for each run, and drop it from
    `pending`; cache bytes and tokens are None for the reference read from the reference cache."""
    done = [b for b in pending if b.end <= end + 1 or end == length]
    for b in done:
        pending.remove(b)
        if on_bucket is not None:
            for r in runs:
                if r.cache is None:  # the reference read from the reference cache holds nothing
                    on_bucket(r.label, b, r.stats[b], None, None)
                else:
                    on_bucket(r.label, b, r.stats[b], cache_nbytes(r.cache), r.cache.get_seq_length())


def _fail(run: _Run, e: BaseException, on_error: OnError | None) -> None:
    logger.warning("scheme %s failed: %s: %s", run.label, type(e).__name__, e)
    if on_error is not None:
        on_error(run.label, e)


def ppl(nll: float, tokens: int) -> float:
    return math.exp(nll / tokens) if tokens else float("nan")
