"""Fitting `-crot`'s rotations (`kvquant.codecs.calibrot` is the codec; its docstring gives the method):
queries, keys and values captured from the model (`capture`), the straight-through surrogate of a codec's
round trip (`surrogate_roundtrip`), the attention-output loss (`attention_error`), one rotation
(`fit_rotation`) and a calibration's worth (`fit_rotations`, called by `kvquant.fitting.calibrate`).

Above the codecs, the attention function and `kvquant.calibration`: none of them imports this module.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .codecs.base import CodebookCodec, Codec, block_extent, codec_for
from .codecs.calibrot import CalibRotationCodec, hadamard_matrix, inner_spec
from .codecs.quantize import AffineCodec
from .scheme import QuantSpec
from .spec_types import CalibRotate, Codebook

__all__ = [
    "Captured",
    "RotationFit",
    "attention_error",
    "capture",
    "fit_rotation",
    "fit_rotations",
    "surrogate_roundtrip",
]

logger = logging.getLogger(__name__)

CAPTURE_ATTENTION = "kvquant_capture"


# ------------------------------------------------------------------------------------------------ surrogate


def _ste(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """target in the forward pass, the gradient of x in the backward pass."""
    return x + (target - x).detach()


def surrogate_roundtrip(codec: Codec, y: torch.Tensor) -> torch.Tensor:
    """codec.decode(codec.encode(y)) in the forward pass (float32, exact), with a differentiable surrogate's
    gradient: block statistics differentiable, rounding / nearest level straight through. y (B, H, T, D)."""
    exact = codec.decode(codec.encode(y.detach().to(codec.dtype)), torch.float32)
    spec = codec.spec
    if isinstance(codec, (AffineCodec, CodebookCodec)):
        e = block_extent(spec, codec.heads, codec.head_dim)
        b = e.blocks(y.float())  # (*stat, G)
        if isinstance(codec, AffineCodec):
            if spec.symmetric:
                qmax = (1 << (spec.bits - 1)) - 1
                s = b.abs().amax(-1, keepdim=True).clamp_min(1e-12)
                u = b / s * qmax
                sur = _ste(u, u.round()) / qmax * s
            else:
                qmax = (1 << spec.bits) - 1
                lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
                s = ((hi - lo) / qmax).clamp_min(1e-12)
                u = (b - lo) / s
                sur = _ste(u, u.round()) * s + lo
        else:
            levels = codec._levels(y.device)
            if spec.symmetric:
                z = torch.zeros((), device=y.device)
                s = b.abs().amax(-1, keepdim=True).clamp_min(1e-12)
            else:
                lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
                z, s = (hi + lo) / 2, ((hi - lo) / 2).clamp_min(1e-12)
            xn = (b - z) / s
            idx = torch.bucketize(xn.detach().contiguous(), (levels[1:] + levels[:-1]) / 2)
            sur = _ste(xn, levels[idx]) * s + z
        sur = e.unblocks(sur, y.shape)
    else:
        sur = y.float()
    return _ste(sur, exact)


# ------------------------------------------------------------------------------------------------ capture


@dataclass(frozen=True)
class Captured:
    """One document's attention inputs at one layer: queries at `positions` (post-RoPE), all keys (post-RoPE)
    and values, and the layer's softmax scaling."""

    query: torch.Tensor  # (1, H_q, S, D) float32: the queries at positions
    key: torch.Tensor  # (1, H_kv, T, D) float32
    value: torch.Tensor  # (1, H_kv, T, D) float32
    positions: torch.Tensor  # (S,) long, ascending
    scaling: float


def _capture_attention(module, query, key, value, attention_mask, *args, **kwargs):
    from .attention import kvquant_attention

    store = getattr(module, "_kvquant_capture", None)
    if store is not None:
        store.append((query.detach().float(), key.detach().float(), value.detach().float(),
                      kwargs.get("scaling")))
    return kvquant_attention(module, query, key, value, attention_mask, *args, **kwargs)


@torch.no_grad()  # not inference_mode: the captured tensors feed autograd in fit_rotation
def capture(
    model, documents: Sequence[torch.Tensor], *, queries: int = 256, seed: int = 0, multiple: int = 64
) -> list[list[Captured]]:
    """[layer][document] attention inputs: one forward per document (ids (1, T), cut to a multiple of
    `multiple` tokens so channel-group codecs tile it), `queries` query positions sampled per document
    (seeded) from the second quarter on (early queries see few keys)."""
    from transformers import AttentionInterface, DynamicCache

    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
    attn = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    if not attn:
        raise ValueError("no attention modules (with q_proj and layer_idx) found to capture from")
    before = model.config._attn_implementation
    g = torch.Generator().manual_seed(seed)
    out: list[list[Captured]] = [[] for _ in attn]
    try:
        model.set_attn_implementation(CAPTURE_ATTENTION)
        for ids in documents:
            t = ids.shape[1] - ids.shape[1] % multiple
            if t < multiple:
                raise ValueError(f"a calibration document of {ids.shape[1]} tokens is below {multiple}")
            for m in attn:
                m._kvquant_capture = []
            model.get_decoder()(input_ids=ids[:, :t], cache=DynamicCache(config=model.config), use_cache=True)
            lo = t // 4
            pos = torch.randperm(t - lo, generator=g)[: min(queries, t - lo)].sort().values + lo
            for i, m in enumerate(attn):
                ((q, k, v, scaling),) = m._kvquant_capture
                scale = scaling if scaling is not None else 1 / math.sqrt(q.shape[-1])
                out[i].append(Captured(q[:, :, pos].clone(), k.clone(), v.clone(), pos, float(scale)))
    finally:
        for m in attn:
            m.__dict__.pop("_kvquant_capture", None)
        model.set_attn_implementation(before)
    return out


# ------------------------------------------------------------------------------------------------ fitting


def _attend(c: Captured, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Causal attention output (1, H_q, S, D) of c's queries over key/value (1, H_kv, T, D)."""
    group = c.query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    scores = (c.query @ k.transpose(-1, -2)) * c.scaling  # (1, H_q, S, T)
    cols = torch.arange(key.shape[2])
    scores = scores.masked_fill(cols[None, :] > c.positions[:, None], -torch.inf)
    return torch.softmax(scores, dim=-1) @ v


def _quantized(codec: Codec, x: torch.Tensor, m: torch.Tensor, rope) -> torch.Tensor:
    """x (1, H, T, D) as the cache holds it after `-crot` with matrix m (pre-RoPE when rope is given)."""
    if rope is not None:
        x = rope.invert(x, 0)
    y = surrogate_roundtrip(codec, x @ m) @ m.T
    return rope.apply(y, 0) if rope is not None else y


def attention_error(
    caps: Sequence[Captured], spec: QuantSpec, role: str, matrix: torch.Tensor, *, levels=None, rope=None
) -> float:
    """Relative error |o_hat - o|^2 / |o|^2 of the attention output over the documents when `role` ("k" or
    "v") is stored as `spec` rotated by `matrix` (D, D) and the other is exact."""
    with torch.no_grad():
        return float(_loss(caps, _inner_codec(spec, caps, levels), role, matrix, rope, _refs(caps)))


def _inner_codec(spec: QuantSpec, caps: Sequence[Captured], levels) -> Codec:
    inner = inner_spec(dataclasses.replace(spec, prerope=False))
    h, d = caps[0].key.shape[1], caps[0].key.shape[3]
    codec = codec_for(inner, h, d, torch.float32)
    if isinstance(inner.family, Codebook):
        if levels is None:
            raise ValueError(f"{spec}: a codebook spec needs its levels to fit or score a rotation")
        codec.set_levels(levels)
    return codec


def _refs(caps: Sequence[Captured]) -> list[torch.Tensor]:
    return [_attend(c, c.key, c.value) for c in caps]


def _loss(caps, codec, role, m, rope, refs) -> torch.Tensor:
    num = den = 0.0
    for c, ref in zip(caps, refs, strict=True):
        if role == "k":
            o = _attend(c, _quantized(codec, c.key, m, rope), c.value)
        else:
            o = _attend(c, c.key, _quantized(codec, c.value, m, None))
        num = num + (o - ref).square().sum()
        den = den + ref.square().sum()
    return num / den


@dataclass(frozen=True)
class RotationFit:
    matrix: torch.Tensor  # (D, D) float32, orthogonal
    start_loss: float  # the Hadamard start's calibration loss
    loss: float  # the kept matrix's calibration loss
    steps: int


def fit_rotation(
    caps: Sequence[Captured],
    spec: QuantSpec,
    role: str,
    *,
    steps: int = 200,
    lr: float = 2e-3,
    levels: torch.Tensor | None = None,
    rope=None,
    seed: int = 0,
) -> RotationFit:
    """Learn M (see the module docstring) for one layer's `role` stored as `spec` on the captured documents.
    rope: the model's `kvquant.rope.Rope` for `-prerope` keys (the codec then sees pre-RoPE keys)."""
    if role not in ("k", "v"):
        raise ValueError(f"role must be 'k' or 'v', got {role!r}")
    if spec.prerope and rope is None:
        raise ValueError(f"{spec} stores keys before RoPE: fit_rotation needs the model's rope")
    d = caps[0].key.shape[-1]
    codec = _inner_codec(spec, caps, levels)
    m0 = hadamard_matrix(d, seed)
    refs = _refs(caps)
    rope = rope if spec.prerope and role == "k" else None
    w = torch.zeros(d, d, requires_grad=True)
    opt = torch.optim.Adam([w], lr=lr)
    eye = torch.eye(d)
    best, best_loss, start = m0, math.inf, math.nan
    for step in range(steps + 1):
        a = w - w.T
        m = m0 @ torch.linalg.solve(eye - a, eye + a)  # Cayley: orthogonal for every w
        loss = _loss(caps, codec, role, m, rope, refs)
        value = loss.item()
        if step == 0:
            start = value
        if value < best_loss:
            best, best_loss = m.detach().clone(), value
        if step == steps:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    # re-orthogonalize the kept matrix (float32 solve leaves ~1e-6): nearest orthogonal via SVD
    u, _, vh = torch.linalg.svd(best.double())
    return RotationFit((u @ vh).float(), start, best_loss, steps)


def _crot_of(codec: Codec) -> CalibRotationCodec:
    """The `-crot` codec inside codec (itself, or under -prerope / -center)."""
    while not isinstance(codec, CalibRotationCodec):
        codec = codec.inner
    return codec


def _fit_levels(caps, spec, role, matrix, rope, *, seed: int, max_samples: int) -> torch.Tensor:
    """A nuqN-crot codebook fitted on the values its codebook sees once rotated by matrix."""
    from .calibration import fit_codebook

    h, d = caps[0].key.shape[1], caps[0].key.shape[3]
    codec = codec_for(spec, h, d, torch.float32, rope=rope if spec.prerope else None)
    _crot_of(codec).set_matrix(matrix)
    values = torch.cat([codec.codebook_values(c.key if role == "k" else c.value, 0) for c in caps])
    return fit_codebook(values, spec.bits, seed=seed, max_samples=max_samples)


def fit_rotations(
    model,
    documents: Sequence[torch.Tensor],
    entries,
    *,
    held_out: Sequence[torch.Tensor] = (),
    steps: int = 100,
    queries: int = 128,
    seed: int = 0,
    max_samples: int = 1_000_000,
    report: list | None = None,
    progress=None,
) -> dict[str, torch.Tensor]:
    """Every table of the `-crot` specs among entries (`kvquant.calibration.Entry`): the rotation, and for a
    nuqN-crot spec its codebook (fitted, the rotation fitted against it, then refitted). report, when given,
    receives one dict per (layer, role, spec): calibration loss at the Hadamard start and at the kept M, and
    on the held_out documents the attention-output error of `-rot` (seed 0) and of `-crot`."""
    from .calibration import Entry

    ropes = None  # each layer's RoPE (Gemma-3: one per layer type)
    crot = {(e.layer, e.role, e.spec) for e in entries if CalibRotate() in e.spec.transforms}
    specs = sorted(crot, key=str)
    if any(s.prerope for _, _, s in specs):
        from .rope import Rope

        ropes = Rope.for_layers(model.config)
    caps = capture(model, documents, queries=queries, seed=seed)
    held = capture(model, held_out, queries=queries, seed=seed + 1) if held_out else None
    tables: dict[str, torch.Tensor] = {}
    for n, (layer, role, spec) in enumerate(specs):
        c = caps[layer]
        rope = ropes[layer] if ropes is not None else None
        d = c[0].key.shape[-1]
        m0 = hadamard_matrix(d)
        levels0 = levels = None
        if isinstance(spec.family, Codebook):
            levels0 = _fit_levels(c, spec, role, m0, rope, seed=seed, max_samples=max_samples)
        fit = fit_rotation(c, spec, role, steps=steps, levels=levels0, rope=rope)
        tables[Entry(layer, role, spec, "rotation").name] = fit.matrix
        if isinstance(spec.family, Codebook):
            levels = _fit_levels(c, spec, role, fit.matrix, rope, seed=seed, max_samples=max_samples)
            tables[Entry(layer, role, spec).name] = levels
        row = {"layer": layer, "role": role, "spec": str(spec), "calib_hadamard": fit.start_loss,
               "calib_crot": fit.loss}
        if held is not None:
            row["heldout_hadamard"] = attention_error(held[layer], spec, role, m0, levels=levels0, rope=rope)
            row["heldout_crot"] = attention_error(held[layer], spec, role, fit.matrix, levels=levels,
                                                  rope=rope)
        # the errors travel with the file: calibration -rot, calibration -crot, held-out -rot, held-out -crot
        tables[f"rotation_error/{layer}/{role}/{spec}"] = torch.tensor(
            [row["calib_hadamard"], row["calib_crot"], row.get("heldout_hadamard", math.nan),
             row.get("heldout_crot", math.nan)]
        )
        logger.info("rotation %d/%d %s", n + 1, len(specs), row)
        if report is not None:
            report.append(row)
        if progress is not None:
            progress(n + 1, len(specs))
    return tables
