"""Diagnose a model's K/V before quantizing them: per-channel offsets, outlier channels, kurtosis and the SQNR
of candidate specs, per layer; a recommended scheme; and the one-time warning a CLI gives when a scheme
quantizes offset-heavy keys per token.

Some model families add a bias in the key projection (Qwen2, for one). Their keys then carry per-channel
offsets many times the token-to-token spread, and every per-token or per-group key spec spends its range on
the offset: the signal falls below one quantization step and perplexity explodes (transformers#35185).
Channel-wise keys (`-channel-gN`, one zero point per channel) and `-center` (a stored per-channel offset,
`kvquant.codecs.transforms.CenterCodec`) survive it.

Statistics per layer and K/V, over a probe x (B, H, T, D) with per-(head, channel) mean mu_hc and std s_hc
over tokens:
    offset ratio     max_hc |mu_hc| / sqrt(mean_c s_hc^2)   how far the largest channel offset sits from zero,
                     in units of the head's typical token-to-token spread (~1 for zero-centred keys)
    outlier channels (head, channel) pairs whose RMS over tokens exceeds OUTLIER_FACTOR x the head's median
                     channel RMS
    kurtosis         E[(x - mean)^4] / var^2 over all elements (3 for a Gaussian)
    SQNR             10 log10(|x|^2 / |x - x_hat|^2) of each candidate spec (fake-quantized through its codec)

    from kvquant.diagnose import diagnose, format_report
    report = diagnose(model, input_ids)          # a forward over input_ids (1, T), keys and values captured
    print(format_report(report)); report.recommended   # e.g. "k=int4-g64-center,v=int4-g64-rot"

`offset_warning(model, scheme)` is the hook for a CLI (`experiments/run.py`): it returns (and logs, once per
model and scheme) a warning with the recommendation when the scheme quantizes offset-heavy keys per token.
"""

from __future__ import annotations

import logging
import math
import weakref
from dataclasses import dataclass, field

import torch

from . import quirks
from .scheme import QuantSpec, Scheme, SchemeError, parse_scheme, parse_spec, require_scheme
from .spec_types import FP8, Center, TokenGroups

__all__ = [
    "K_CANDIDATES",
    "V_CANDIDATES",
    "OFFSET_RATIO_WARN",
    "Diagnosis",
    "LayerStats",
    "TensorStats",
    "capture_kv",
    "diagnose",
    "format_report",
    "keys_at_risk",
    "offset_warning",
    "predicted_collapse",
    "probe_ids",
    "tensor_stats",
]

logger = logging.getLogger(__name__)

# Candidate specs near 4 bits (bits per value at FP16, head_dim 64: g64 4.5, -center +0.25, -out1 +0.375).
K_CANDIDATES = (
    "int4-g64",
    "int4-g64-center",
    "int4-g64-rot",
    "int4-g64-center-rot",
    "int4-channel-g64",
    "int4-g64-out1",
)
V_CANDIDATES = ("int4-g64", "int4-g64-center", "int4-g64-rot", "int4-g64-out1")
OUTLIER_FACTOR = 4.0
# Above this offset ratio per-token key specs collapse: a 4-bit step over a range of ~2 x ratio spreads is
# ~ratio / 7 spreads, several spreads wide. SmolLM2-135M's keys peak at 13 (measured on 512 tokens of
# Wikipedia; int4-g64 drifts +6..13% there but does not collapse, and -center / channel-wise keys gain ~7 dB
# of key SQNR): a diagnosis prints that, the run-time warning is kept for the collapsing regime.
OFFSET_RATIO_WARN = 30.0
OFFSET_RATIO_NOTE = 5.0
# A key spec is predicted to collapse when the worst layer's signal SQNR (of the token-to-token variation,
# `TensorStats.signal_sqnr`) falls below this: the noise then carries a quarter of what attention can tell
# apart. Measured on 256 probe tokens: a Qwen2 with biased keys (offset 62x) gives int4-g64 -3.7 dB, int4-g32
# 4.5, int8 17.4 (int8 loses KL there but does not collapse); SmolLM2 on Wikipedia (offset 14): int4-g64
# 11.9, int8 31.9; an unbiased tiny Llama: int4-g64 20.6.
COLLAPSE_DB = 6.0
PROBE_TOKENS = 512  # text tokens of the probe `experiments/diagnose.py` and run.py's warning both use


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one layer's K or V (see the module docstring)."""

    offset_ratio: float
    offset_where: tuple[int, int]  # (head, channel) of the largest offset
    outlier_channels: tuple[tuple[int, int], ...]  # (head, channel), largest RMS first
    kurtosis: float
    sqnr: dict[str, float] = field(default_factory=dict)  # candidate spec -> dB
    # candidate spec -> dB of the token-to-token variation: |x - mu_hc|^2 / |x - x_hat|^2, what attention
    # sees (a per-channel constant adds q . mu to every score of a query, which the softmax ignores)
    signal_sqnr: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerStats:
    layer: int
    key: TensorStats
    value: TensorStats


@dataclass(frozen=True)
class Diagnosis:
    """Per-layer statistics, the recommended K and V specs and the scheme they make."""

    layers: tuple[LayerStats, ...]
    tokens: int
    head_dim: int
    recommended_key: str
    recommended_value: str

    @property
    def recommended(self) -> str:
        return str(Scheme(parse_spec(self.recommended_key), parse_spec(self.recommended_value)))

    @property
    def max_key_offset_ratio(self) -> tuple[float, int]:
        """(largest key offset ratio, its layer)."""
        best = max(self.layers, key=lambda s: s.key.offset_ratio)
        return best.key.offset_ratio, best.layer


def tensor_stats(x: torch.Tensor, candidates: tuple[str, ...] = ()) -> TensorStats:
    """Statistics of x (B, H, T, D) (T >= 2); SQNR of each candidate spec over the first T // 64 * 64 tokens
    (so channel-wise and -center groups are whole)."""
    from .codecs.quantize import fake_quantize, sqnr_db

    x = x.detach().double()
    b, h, t, d = x.shape
    per_head = x.transpose(0, 1).reshape(h, b * t, d)  # (H, N, D)
    mu = per_head.mean(dim=1)  # (H, D)
    sd = per_head.std(dim=1)
    spread = sd.pow(2).mean(dim=1, keepdim=True).sqrt().clamp_min(1e-12)  # (H, 1)
    ratio = mu.abs() / spread
    flat = int(ratio.argmax())
    rms = per_head.pow(2).mean(dim=1).sqrt()  # (H, D)
    outl = rms > OUTLIER_FACTOR * rms.median(dim=1, keepdim=True).values
    pairs = sorted(((float(rms[i, c]), i, c) for i, c in outl.nonzero().tolist()), reverse=True)
    centred = x - x.mean()
    kurt = float(centred.pow(4).mean() / centred.pow(2).mean().pow(2).clamp_min(1e-300))
    sqnr, signal = {}, {}
    n = t // 64 * 64
    if n:
        xs = x[:, :, :n].float()
        varying = (xs.double() - xs.double().mean(dim=2, keepdim=True)).pow(2).sum()  # per (B, head, channel)
        for spec in candidates:
            try:
                xq = fake_quantize(xs, spec)
            except SchemeError:  # a group size that does not divide this head_dim: not a candidate here
                continue
            sqnr[spec] = sqnr_db(xs, xq)
            noise = (xs.double() - xq.double()).pow(2).sum().clamp_min(1e-300)
            signal[spec] = float(10 * torch.log10(varying / noise))
    return TensorStats(
        offset_ratio=float(ratio.max()),
        offset_where=(flat // d, flat % d),
        outlier_channels=tuple((i, c) for _, i, c in pairs),
        kurtosis=kurt,
        sqnr=sqnr,
        signal_sqnr=signal,
    )


def probe_ids(config, tokens: int = 256, seed: int = 0) -> torch.Tensor:
    """(1, tokens) token ids drawn uniformly from the vocabulary: enough to show a key bias (it does not
    depend on the text) when no calibration text is at hand."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, quirks.text_config(config).vocab_size, (1, tokens), generator=g)


@torch.no_grad()
def capture_kv(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One forward over input_ids (B, T) with an unquantized cache: [(K, V) (B, H_kv, T, D)] per layer, the
    keys after RoPE as attention sees them."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids.to(model.device), cache=cache, use_cache=True)
    return [(layer.keys, layer.values) for layer in cache.layers]


def _best(layers: list[TensorStats], candidates: tuple[str, ...]) -> str:
    """The candidate with the highest mean SQNR over layers (dB; the worst layer breaks ties)."""

    def score(spec: str) -> tuple[float, float]:
        vals = [s.sqnr[spec] for s in layers if spec in s.sqnr]
        return (sum(vals) / len(vals), min(vals)) if len(vals) == len(layers) else (-math.inf, -math.inf)

    return max(candidates, key=score)


def diagnose(
    model,
    input_ids: torch.Tensor | None = None,
    k_candidates: tuple[str, ...] = K_CANDIDATES,
    v_candidates: tuple[str, ...] = V_CANDIDATES,
    *,
    extra_key_specs: tuple[str, ...] = (),
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Diagnosis:
    """Statistics of every layer's K and V over one forward of input_ids (default: `probe_ids`), with the
    best candidate for K and for V. extra_key_specs are scored too (SQNR, signal SQNR) without taking part in
    the recommendation (the specs a scheme uses, for `predicted_collapse`); kv: K/V already captured over
    input_ids (`capture_kv`), to score more specs without another forward."""
    if input_ids is None:
        input_ids = probe_ids(model.config)
    kv = capture_kv(model, input_ids) if kv is None else kv
    keys = tuple(dict.fromkeys((*k_candidates, *extra_key_specs)))
    layers = tuple(
        LayerStats(i, tensor_stats(k, keys), tensor_stats(v, v_candidates)) for i, (k, v) in enumerate(kv)
    )
    best_k = _best([s.key for s in layers], k_candidates)
    best_v = _best([s.value for s in layers], v_candidates)
    return Diagnosis(layers, int(input_ids.shape[-1]), int(kv[0][0].shape[-1]), best_k, best_v)


def _table(diag: Diagnosis, which: str) -> list[str]:
    stats = [getattr(s, which) for s in diag.layers]
    specs = [n for n in stats[0].sqnr if all(n in t.sqnr for t in stats)]
    head = f"{'layer':>5} {'offset':>7} {'at (h,c)':>9} {'outl.ch':>7} {'kurt':>6} " + " ".join(
        f"{s:>{max(len(s), 6)}}" for s in specs
    )
    rows = [head]
    for layer, s in zip(diag.layers, stats, strict=True):
        where = f"{s.offset_where[0]},{s.offset_where[1]}"
        sq = " ".join(f"{s.sqnr[name]:>{max(len(name), 6)}.1f}" for name in specs)
        rows.append(
            f"{layer.layer:>5} {s.offset_ratio:>7.1f} {where:>9} {len(s.outlier_channels):>7} "
            f"{s.kurtosis:>6.1f} {sq}"
        )
    means = " ".join(f"{sum(t.sqnr[n] for t in stats) / len(stats):>{max(len(n), 6)}.1f}" for n in specs)
    rows.append(f"{'mean':>5} {'':>7} {'':>9} {'':>7} {'':>6} {means}")
    return rows


def format_report(diag: Diagnosis) -> str:
    """The per-layer tables for K and V (offset ratio, its (head, channel), outlier channels, kurtosis, SQNR
    of each candidate in dB) and the recommendation."""
    ratio, layer = diag.max_key_offset_ratio
    cands = dict.fromkeys([*diag.layers[0].key.sqnr, *diag.layers[0].value.sqnr])
    bits = ", ".join(f"{c} {_spec_bits(c, diag.head_dim):.2f}" for c in cands)
    lines = [
        f"Candidates (bits per value at FP16 scales): {bits}",
        "",
        f"Keys ({diag.tokens} probe tokens; offset = max |channel mean| / RMS channel spread; SQNR in dB):",
    ]
    lines += _table(diag, "key")
    lines += ["", "Values:"]
    lines += _table(diag, "value")
    lines += [""]
    if ratio >= OFFSET_RATIO_WARN:
        scored = list(diag.layers[0].key.signal_sqnr)
        down = ", ".join(f"{s} ({db:+.1f} dB)" for s, db in predicted_collapse(diag, scored)) or "none"
        lines.append(
            f"Keys carry per-channel offsets up to {ratio:.0f}x their spread (layer {layer}): per-token and "
            "per-group key specs lose the variation attention sees; use channel-wise keys or -center. "
            f"Predicted to collapse (worst-layer signal SQNR below {COLLAPSE_DB:g} dB): {down}."
        )
    elif ratio >= OFFSET_RATIO_NOTE:
        lines.append(
            f"Keys carry moderate per-channel offsets (up to {ratio:.0f}x their spread, layer {layer}): "
            "per-token "
            "key specs lose SQNR to them; channel-wise keys or -center recover it (see the table)."
        )
    lines.append(f"Recommended (best mean SQNR of the candidates): {diag.recommended}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- the one-time warning


def keys_at_risk(scheme: Scheme) -> list[QuantSpec]:
    """Key specs of the scheme (every layer's) that quantize keys per token, head or channel group with no
    offset removed: integer or codebook specs at token / head / gN granularity without -center. Takes a
    parsed Scheme (`OffsetWarner` parses the caller's text once)."""
    keys = [k for k, _ in require_scheme(scheme, "keys_at_risk").layer_specs()]
    return [
        s
        for s in dict.fromkeys(keys)
        if s.is_quantized
        and not isinstance(s.family, FP8)
        and not isinstance(s.grain, TokenGroups)  # per channel over tokens: the offset shares its scale
        and not any(isinstance(t, Center) for t in s.transforms)
    ]


def predicted_collapse(diag: Diagnosis, specs) -> list[tuple[str, float]]:
    """(spec, worst layer's signal SQNR in dB) of the key specs the analysis predicts will collapse: keys
    with per-channel offsets of at least OFFSET_RATIO_WARN x their spread, and the spec's signal SQNR below
    COLLAPSE_DB in some layer. Specs must have been scored (`diagnose(..., extra_key_specs=...)`)."""
    ratio, _ = diag.max_key_offset_ratio
    if ratio < OFFSET_RATIO_WARN:
        return []
    out = []
    for spec in specs:
        name = str(parse_spec(spec))
        worst = min((s.key.signal_sqnr[name] for s in diag.layers if name in s.key.signal_sqnr), default=None)
        if worst is not None and worst < COLLAPSE_DB:
            out.append((name, worst))
    return out


class OffsetWarner:
    """Warns (logging.WARNING, logger "kvquant.diagnose") once per model and scheme when the scheme's key
    specs are predicted to collapse on this model's per-channel key offsets (`predicted_collapse`), with the
    scheme `experiments/diagnose.py` recommends for the same probe. The memo lives on the object: one warner
    per run, no module state.

        warner = OffsetWarner(probe=lambda: text_ids)   # the probe diagnose.py uses (PROBE_TOKENS of text)
        warner(model, "int4-g64")   # the message (logged the first time), or None

    Without a probe it falls back to `probe_ids` (random ids: enough to show a key bias, but its SQNR and its
    recommendation can differ from a text probe's).
    """

    def __init__(self, probe=None) -> None:
        self._probe = probe  # () -> (1, T) ids, called at most once, only when a scheme is at risk
        self._kv: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (ids, captured K/V)
        self._warned: set[tuple[int, str]] = set()

    def __call__(self, model, scheme: Scheme | str, input_ids: torch.Tensor | None = None) -> str | None:
        """The warning with a recommended scheme, or None when no key spec of the scheme is predicted to
        collapse. Costs nothing for a scheme whose keys cannot (channel-wise, -center, fp8); otherwise one
        forward over the probe per model, and the SQNR of the candidates and the scheme's key specs."""
        scheme = parse_scheme(scheme)  # parsed once, here at the entry point
        at_risk = [str(s) for s in keys_at_risk(scheme)]
        if not at_risk:
            return None
        if input_ids is None:
            if model not in self._kv:
                ids = self._probe() if self._probe is not None else probe_ids(model.config)
                self._kv[model] = (ids, capture_kv(model, ids))
            ids, kv = self._kv[model]
        else:
            ids, kv = input_ids, capture_kv(model, input_ids)
        diag = diagnose(model, ids, extra_key_specs=tuple(at_risk), kv=kv)
        collapsing = predicted_collapse(diag, at_risk)
        if not collapsing:
            return None
        ratio, layer = diag.max_key_offset_ratio
        name = getattr(model.config, "_name_or_path", "") or ""
        specs = ", ".join(f"{s} ({db:+.1f} dB)" for s, db in collapsing)
        msg = (
            f"this model's keys carry per-channel offsets up to {ratio:.0f}x their token-to-token spread "
            f"(layer {layer}), and scheme {scheme} quantizes keys so that the variation "
            f"attention sees drowns in noise (worst-layer signal SQNR: {specs}; below {COLLAPSE_DB:g} dB): "
            f"expect a collapse. Recommended: {diag.recommended} (or channel-wise keys, e.g. "
            f"k=int4-channel-g64); details: python experiments/diagnose.py --model {name or 'MODEL'}"
        )
        key = (id(model), str(scheme))
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg)
        return msg


def offset_warning(model, scheme: Scheme | str, input_ids: torch.Tensor | None = None) -> str | None:
    """`OffsetWarner()(model, scheme, input_ids)`: the warning for one call (logged; no memo across calls)."""
    return OffsetWarner()(model, scheme, input_ids)


def _spec_bits(spec: str, head_dim: int = 64, heads: int = 1) -> float:
    """Bits per value at FP16 of a candidate (for the report)."""
    from .codecs.base import codec_for

    c = codec_for(parse_spec(spec), heads, head_dim, torch.float16)
    n = c.token_group * 16
    return c.bytes(n) * 8 / (heads * head_dim * n)
