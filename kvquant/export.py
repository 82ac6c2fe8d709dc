"""Calibrated FP8 KV-cache scales, written the way vLLM loads them (`experiments/export_scales.py`).

vLLM's per-tensor FP8 cache (`--kv-cache-dtype fp8`) divides every K (V) value of layer i by that layer's
`k_scale` (`v_scale`) before the saturating E4M3 conversion and multiplies it back on read
(`kvquant.codecs.engine_vllm`). It reads the scales from the checkpoint as llm-compressor / compressed-tensors
write them: one tensor per layer and role,

    model.layers.{i}.self_attn.k_scale    strategy "tensor": shape (1,);  "attn_head": (H_kv, 1, 1)
    model.layers.{i}.self_attn.v_scale

(vLLM's `maybe_remap_kv_scale_name`, vllm/model_executor/model_loader/weight_utils.py, maps them onto its
`self_attn.attn.k_scale` parameters; compressed-tensors' `initialize_qparams` gives the shapes), declared in
config.json by `quantization_config.kv_cache_scheme = {"num_bits": 8, "type": "float", "strategy": "tensor",
"dynamic": false, "symmetric": true}` (vLLM's CompressedTensorsKVCacheMethod accepts strategies tensor and
attn_head, symmetric only). Without them vLLM uses 1.0 (docs/features/quantization/quantized_kvcache.md) and
logs a warning once.

The scales are llm-compressor's static min-max observer for a symmetric FP8 format: scale = max|x| / 448
(57344 for E5M2) over the calibration tokens, at least float32 eps (compressed-tensors' calculate_qparams),
with max|x| over every token, head and channel of a layer's post-RoPE K (V), as the cache receives them
(`attn_head`: per KV head). Here they are observed with the model's own forward on calibration text.

When 1.0 "does nothing": E4M3 has 3 mantissa bits at every exponent of its normal range, so dividing by a
scale changes no value's relative error while |x| / scale stays within [2^-6, 448]; it matters only for
values beyond 448 * scale (saturated) or below 2^-6 * scale (subnormal, coarser). A layer whose max|x| is
well under 448 therefore loses almost nothing at scale 1.0, and a calibrated checkpoint whose scales were
not loaded (names that `maybe_remap_kv_scale_name` does not map, config.json without kv_cache_scheme)
looks identical to a calibrated one until a layer's K or V exceeds 448, where 1.0 saturates
(benchmarks/results/fp8_calibrated.md measures both on the default model).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .calibfile import KV_SCALE_NAME as _NAME
from .calibfile import CalibrationError, is_kv_scale_names
from .scheme import SchemeError

__all__ = [
    "FP8_MAX",
    "KVScales",
    "SCALES_FILE",
    "SCHEME_FILE",
    "describe",
    "is_kv_scales_file",
    "kv_absmax",
    "kv_cache_scheme",
    "load_kv_scales",
    "save_kv_scales",
    "scales_from_absmax",
]

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}  # torch.finfo(float8_e4m3fn / float8_e5m2).max
STRATEGIES = ("tensor", "attn_head")
SCALES_FILE = "kv_scales.safetensors"
SCHEME_FILE = "kv_cache_scheme.json"
DEFAULT_PREFIX = "model.layers"
# the per-tensor vLLM formats that divide by k_scale / v_scale, and the FP8 kind their scales are for
SCALED_FORMATS = {"vllm:fp8_e4m3": "e4m3", "vllm:fp8_e5m2": "e5m2"}
EXPORT_COMMAND = "python experiments/export_scales.py --model MODEL --out DIR"


@dataclass(frozen=True)
class KVScales:
    """Per-layer FP8 scales: k, v (L, H_kv) fp32 for `attn_head`, (L, 1) for `tensor`; all positive. A scheme
    evaluates them with `calib=DIR/kv_scales.safetensors` (`vllm:fp8,calib=...`): the cache loads the file
    once (`kvquant.calibration.load_calibration`) and each layer's vLLM FP8 codec takes its scale in `bind`.
    source: the file they were read from (for messages)."""

    k: torch.Tensor
    v: torch.Tensor
    strategy: str = "tensor"
    fp8: str = "e4m3"
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise SchemeError(f"unknown kv_cache_scheme strategy {self.strategy!r}; vLLM takes {STRATEGIES}")
        if self.fp8 not in FP8_MAX:
            raise SchemeError(f"unknown fp8 kind {self.fp8!r}; known: {', '.join(FP8_MAX)}")
        for name in ("k", "v"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape != self.k.shape:
                raise SchemeError(f"{name} scales must be an (L, H) tensor shaped like k's, got {t!r}")
            if self.strategy == "tensor" and t.shape[1] != 1:
                raise SchemeError(
                    f"strategy 'tensor' stores one scale per layer: (L, 1), got {tuple(t.shape)}"
                )
            if not bool(torch.isfinite(t).all() and (t > 0).all()):
                raise SchemeError(f"{name} scales must be positive and finite")

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def kv_scale(self, layer: int, role: str) -> float:
        """Layer `layer`'s k_scale (role "k") or v_scale ("v"): what `VLLMCodec.bind` takes."""
        if self.strategy != "tensor":
            raise SchemeError("kvquant's vllm:fp8 codec takes one scale per layer (strategy 'tensor')")
        if not 0 <= layer < self.num_layers:
            raise SchemeError(f"no scales for layer {layer}: these cover layers 0-{self.num_layers - 1}")
        return float((self.k if role == "k" else self.v)[layer, 0])

    def check_model(self, shape, scheme=None) -> None:
        """Refuse scales written for another number of layers or per head, and a scheme that would not read
        them (no vLLM per-tensor FP8 spec, one of the other FP8 kind, or specs needing codebooks, which this
        file does not hold). shape: a `kvquant.memory.KVShape`."""
        where = f"calib={self.source or 'the k/v scales'}"
        if shape.num_layers != self.num_layers:
            raise CalibrationError(
                f"{where} holds k_scale / v_scale for {self.num_layers} layers, but the model has "
                f"{shape.num_layers}; write them for this model: `{EXPORT_COMMAND}`"
            )
        if self.strategy != "tensor":
            raise CalibrationError(
                f"{where} holds per-head (attn_head) scales; kvquant's vllm:fp8 codec takes one per layer: "
                f"write them with `{EXPORT_COMMAND} --strategy tensor`"
            )
        if scheme is None:
            return
        specs = scheme.specs()
        if any(s.needs_calibration for s in specs):
            raise CalibrationError(
                f"{where} holds vLLM FP8 k/v scales, not the codebooks or rotations this scheme's nuqN / "
                "-crot specs need (a calibration file of experiments/calibrate.py)"
            )
        kinds = {SCALED_FORMATS[s.engine] for s in specs if s.engine in SCALED_FORMATS}
        if not kinds:
            raise CalibrationError(
                f"{where} holds vLLM FP8 k/v scales, but no spec of {str(scheme)!r} reads them: only "
                f"{', '.join(SCALED_FORMATS)} (vllm:fp8) divide by k_scale / v_scale"
            )
        if kinds != {self.fp8}:
            raise CalibrationError(
                f"{where} holds scales for FP8 {self.fp8} (max|x| / {FP8_MAX[self.fp8]:g}), but the scheme "
                f"stores {', '.join(sorted(kinds))}: write them with `{EXPORT_COMMAND} --fp8 "
                f"{sorted(kinds)[0]}`"
            )

    def tensors(
        self, dtype: torch.dtype = torch.float32, prefix: str = DEFAULT_PREFIX
    ) -> dict[str, torch.Tensor]:
        """{checkpoint name: tensor} as compressed-tensors writes them (shapes in the module docstring)."""
        out = {}
        for i in range(self.num_layers):
            for role, t in (("k", self.k), ("v", self.v)):
                row = t[i].to(dtype)
                shaped = row.reshape(1) if self.strategy == "tensor" else row.reshape(-1, 1, 1)
                out[f"{prefix}.{i}.self_attn.{role}_scale"] = shaped
        return out


def kv_cache_scheme(strategy: str = "tensor") -> dict:
    """The `quantization_config.kv_cache_scheme` entry of config.json that makes vLLM read the scales."""
    if strategy not in STRATEGIES:
        raise SchemeError(f"unknown kv_cache_scheme strategy {strategy!r}; vLLM takes {STRATEGIES}")
    return {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}


def kv_absmax(model, batches: Iterable[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """max |K| and max |V| per (layer, KV head) over every token and channel of `batches` (input ids (B, T),
    one forward each, a fresh cache per batch): the post-RoPE K/V a cache receives. -> two (L, H_kv) fp32."""
    from transformers import DynamicCache

    seen: dict[int, list[torch.Tensor]] = {}

    class _Observing(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k = key_states.detach().float().abs().amax(dim=(0, 2, 3))  # (H_kv,)
            v = value_states.detach().float().abs().amax(dim=(0, 2, 3))
            if layer_idx in seen:
                seen[layer_idx] = [torch.maximum(seen[layer_idx][0], k), torch.maximum(seen[layer_idx][1], v)]
            else:
                seen[layer_idx] = [k, v]
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    n = 0
    with torch.no_grad():
        for ids in batches:
            model(ids, cache=_Observing(config=model.config))
            n += 1
    if not n or not seen:
        raise SchemeError("no calibration text: give at least one batch of token ids")
    layers = sorted(seen)
    if layers != list(range(len(layers))):
        raise SchemeError(f"the model's attention layers reported indices {layers}, not 0..L-1")
    k = torch.stack([seen[i][0] for i in layers]).cpu()
    v = torch.stack([seen[i][1] for i in layers]).cpu()
    if not bool(torch.isfinite(k).all() and torch.isfinite(v).all()):
        raise SchemeError("the calibration forward produced non-finite K/V; check the model and its dtype")
    return k, v


def scales_from_absmax(
    k_amax: torch.Tensor, v_amax: torch.Tensor, strategy: str = "tensor", fp8: str = "e4m3"
) -> KVScales:
    """llm-compressor's symmetric min-max FP8 scales: max|x| / FP8_MAX, at least float32 eps; `tensor`
    takes the max over heads first. k_amax, v_amax (L, H_kv)."""
    if strategy not in STRATEGIES:
        raise SchemeError(f"unknown kv_cache_scheme strategy {strategy!r}; vLLM takes {STRATEGIES}")
    if fp8 not in FP8_MAX:
        raise SchemeError(f"unknown fp8 kind {fp8!r}; known: {', '.join(FP8_MAX)}")
    eps = torch.finfo(torch.float32).eps

    def one(a: torch.Tensor) -> torch.Tensor:
        a = a.float()
        if strategy == "tensor":
            a = a.amax(dim=1, keepdim=True)
        return torch.clamp(a / FP8_MAX[fp8], min=eps)

    return KVScales(one(k_amax), one(v_amax), strategy, fp8)


def save_kv_scales(
    scales: KVScales,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    prefix: str = DEFAULT_PREFIX,
    metadata: dict | None = None,
) -> Path:
    """Write DIR/kv_scales.safetensors (the checkpoint tensors) and DIR/kv_cache_scheme.json (the config.json
    fragment, with what produced the scales). Returns the safetensors path."""
    from safetensors.torch import save

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SCALES_FILE
    info = {"fp8": scales.fp8, "strategy": scales.strategy, "prefix": prefix, **(metadata or {})}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # replaced at once: a reader never sees half
    # bytes written by Python, not save_file: its files are owner-only (0600), which an engine running as
    # another user cannot read; these take the umask's mode, as every other file written here
    tmp.write_bytes(save(
        {n: t.contiguous() for n, t in scales.tensors(dtype, prefix).items()},
        metadata={k: json.dumps(v) if not isinstance(v, str) else v for k, v in info.items()},
    ))
    tmp.replace(path)
    fragment = {"quantization_config": {"quant_method": "compressed-tensors",
                                        "kv_cache_scheme": kv_cache_scheme(scales.strategy)},
                "kvquant": info}
    (out / SCHEME_FILE).write_text(json.dumps(fragment, indent=2) + "\n")
    return path


def load_kv_scales(path: str | Path) -> KVScales:
    """Read scales back from a kv_scales.safetensors (or a folder holding one, or any checkpoint shard with
    `*.self_attn.k_scale` tensors): names, layer coverage, shapes and dtypes checked."""
    from safetensors import safe_open

    p = Path(path)
    if p.is_dir():
        p = p / SCALES_FILE
    if not p.is_file():
        raise SchemeError(f"no scales file at {p}: write one with experiments/export_scales.py")
    found: dict[tuple[int, str], torch.Tensor] = {}
    with safe_open(str(p), framework="pt") as f:
        meta = f.metadata() or {}
        for name in f.keys():
            m = _NAME.match(name)
            if m:
                found[(int(m["layer"]), m["role"])] = f.get_tensor(name)
    if not found:
        raise SchemeError(f"{p} holds no '<prefix>.<i>.self_attn.k_scale' / v_scale tensors")
    layers = sorted({i for i, _ in found})
    missing = [f"{i}.{r}" for i in range(layers[-1] + 1) for r in "kv" if (i, r) not in found]
    if missing:
        raise SchemeError(f"{p}: scales missing for layers {', '.join(missing[:6])}")
    shapes = {tuple(t.shape) for t in found.values()}
    if len(shapes) != 1:
        raise SchemeError(f"{p}: the scales have different shapes {sorted(shapes)}")
    shape = shapes.pop()
    strategy = "tensor" if shape in ((1,), ()) else "attn_head"
    if strategy == "attn_head" and (len(shape) != 3 or shape[1:] != (1, 1)):
        raise SchemeError(f"{p}: a scale of shape {shape} is neither 'tensor' (1,) nor 'attn_head' (H, 1, 1)")
    if any(not t.dtype.is_floating_point for t in found.values()):
        raise SchemeError(f"{p}: scales must be floating point")
    fp8 = meta.get("fp8", "e4m3")
    k = torch.stack([found[(i, "k")].float().reshape(-1) for i in range(len(layers))])
    v = torch.stack([found[(i, "v")].float().reshape(-1) for i in range(len(layers))])
    return KVScales(k, v, meta.get("strategy", strategy), fp8 if fp8 in FP8_MAX else "e4m3", source=str(p))


def is_kv_scales_file(path: str | Path) -> bool:
    """Whether a .safetensors file holds vLLM k_scale / v_scale tensors only (`is_kv_scale_names`)."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        return False
    with safe_open(str(p), framework="pt") as f:
        return is_kv_scale_names(f.keys())


def describe(scales: KVScales) -> str:
    """One line: the range of the scales and how many layers' max|x| is beyond the format at scale 1.0."""
    top = FP8_MAX[scales.fp8]
    k_amax = scales.k.amax(dim=1) * top
    v_amax = scales.v.amax(dim=1) * top
    sat = int((k_amax > top).sum() + (v_amax > top).sum())
    return (f"k_scale {float(scales.k.min()):.3g}..{float(scales.k.max()):.3g}, v_scale "
            f"{float(scales.v.min()):.3g}..{float(scales.v.max()):.3g} over {scales.num_layers} layers; "
            f"max|K| {float(k_amax.max()):.4g}, max|V| {float(v_amax.max()):.4g}: {sat} of "
            f"{2 * scales.num_layers} tensors beyond {top:g} (saturated at scale 1.0)")
