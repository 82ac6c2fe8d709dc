"""A model's rotary position embedding (RoPE), applied and inverted at given positions: what `-prerope` keys
need.

The cache receives keys after the model applied RoPE. A `-prerope` key spec stores them before it: the cache
inverts the rotation at each key's position on the way in (`Rope.invert`), the codec quantizes the un-rotated
key, and the reference attention path re-applies the rotation after decoding (`Rope.apply`; the decode
kernel applies it in place, from a table of `cos_sin`: `kvquant.kernels.layouts.rope_table`). Quantization
then sees the channels' own statistics, which RoPE otherwise spins at a position-dependent rate (KVQuant,
sec. 3.2).

What is reproduced: transformers' rotate-half RoPE over the whole head dim,

    k_rope = k * cos + rotate_half(k) * sin,   cos, sin = cat(f, f).cos() * a, ...
    with f = position * inv_freq

with cos/sin computed in float32 exactly as the model's rotary embedding does (inv_freq and the attention
scaling a from the model's own rotary module), then cast to the tensor's dtype. The inverse divides by
cos^2 + sin^2 (the 2x2 rotation's determinant, not exactly a^2 in float32), in float64, so invert-then-apply
returns the model's key to the rounding of the compute dtype (1e-16 in float64).

Supported RoPE types: default, linear, llama3, yarn (frequencies fixed once). Refused: dynamic and longrope
(their frequencies change with the sequence length), and models whose RoPE is not rotate-half over the full
head dim (partial rotary factors): `Rope.from_config` raises naming the type. A model with one RoPE per
layer type (Gemma-3: local layers at base 10,000, global ones at 1,000,000) gets each layer's own
(`Rope.from_config(config, layer)`, `Rope.for_layers`: what the cache and the calibration use).

Positions are cache indices: with left padding, a padded row's keys are un-rotated by an angle offset by
its padding (a fixed rotation for the whole row), and re-rotated by the same, so attention is still exact;
only the frame the quantizer sees is turned by that constant.
"""

from __future__ import annotations

import importlib

import torch

from .quirks import LAYER_TYPE_ROPE_MODELS, ROTATE_HALF_MODELS, attention_shape, rope_config

__all__ = ["Rope", "RopeError", "SUPPORTED_ROPE_TYPES", "ROTATE_HALF_MODELS"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RopeError(ValueError):
    """A model whose rotary embedding `-prerope` cannot invert exactly."""


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _check_parameters(rope_type: str | None, params, partial_rotary_factor: float | None) -> None:
    """RopeError unless the RoPE's frequencies are fixed and it turns the whole head dim."""
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise RopeError(
            f"-prerope does not support RoPE type {rope_type!r} ({params}); supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} "
            "(dynamic and longrope change their frequencies with the length)"
        )
    if partial_rotary_factor != 1.0:
        raise RopeError("-prerope supports RoPE over the full head dim only (partial_rotary_factor != 1)")


def _rotary_module(model_type: str, package: str):
    """The rotary embedding class of transformers' `models.<package>` (RopeError unless it has one)."""
    module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    rotary = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding")]
    if len(rotary) != 1:
        raise RopeError(f"cannot find the rotary embedding of model type {model_type!r}")
    return rotary[0]


class Rope:
    """inv_freq (D/2,) float32 and the attention scaling of a model's rotary embedding."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0, rope_type: str = "default"):
        self.inv_freq = inv_freq.detach().float().cpu()
        self.attention_scaling = float(attention_scaling)
        self.rope_type = rope_type
        self.head_dim = 2 * self.inv_freq.numel()

    @classmethod
    def from_config(cls, config, layer: int | None = None) -> Rope:
        """The rotary embedding a transformers model builds from `config` for its decoder layer `layer`
        (RopeError if unsupported). `layer` may be left out where one RoPE serves every layer; a model with
        one per layer type (`LAYER_TYPE_ROPE_MODELS`, Gemma-3) needs it."""
        rc = rope_config(config)
        model_type = rc.model_type
        if model_type in LAYER_TYPE_ROPE_MODELS:
            return cls._of_layer_type(rc, layer)
        if model_type not in ROTATE_HALF_MODELS:
            raise RopeError(
                f"-prerope cannot invert the RoPE of model type {model_type!r}; supported model types: "
                f"{', '.join((*ROTATE_HALF_MODELS, *LAYER_TYPE_ROPE_MODELS))} "
                "(rotate-half RoPE over the full head dim)"
            )
        _check_parameters(rc.rope_type, rc.parameters, rc.partial_rotary_factor)
        emb = _rotary_module(model_type, model_type)(rc.text)
        return cls(emb.inv_freq, emb.attention_scaling, rc.rope_type)

    @classmethod
    def _of_layer_type(cls, rc, layer: int | None) -> Rope:
        """Layer `layer`'s RoPE in a model whose `rope_parameters` hold one dict per layer type."""
        types = rc.layer_kinds
        if not types or not isinstance(rc.parameters, dict):
            raise RopeError(f"model type {rc.model_type!r} names no layer_types / per-type rope_parameters")
        if layer is None:
            kinds = ", ".join(sorted(set(types)))
            raise RopeError(
                f"model type {rc.model_type!r} has one RoPE per layer type ({kinds}): name the layer, "
                "Rope.from_config(config, layer), or take Rope.for_layers(config)"
            )
        if not 0 <= layer < len(types):
            raise RopeError(f"layer {layer} is not one of the model's {len(types)} layers")
        kind = types[layer]
        params = rc.parameters.get(kind)
        if not isinstance(params, dict):
            raise RopeError(f"model type {rc.model_type!r} has no RoPE parameters for layer type {kind!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        factor = float(params.get("partial_rotary_factor", rc.partial_rotary_factor) or 1.0)
        _check_parameters(rope_type, params, factor)
        emb = _rotary_module(rc.model_type, LAYER_TYPE_ROPE_MODELS[rc.model_type])(rc.text)
        return cls(getattr(emb, f"{kind}_inv_freq"), getattr(emb, f"{kind}_attention_scaling"), rope_type)

    @classmethod
    def for_layers(cls, config) -> tuple[Rope, ...]:
        """One Rope per decoder layer: the one RoPE of most models, shared; Gemma-3's per layer type (one
        object per type)."""
        rc = rope_config(config)
        if rc.model_type in LAYER_TYPE_ROPE_MODELS:
            types = rc.layer_kinds
            by_type: dict[str, Rope] = {}
            for i, kind in enumerate(types):
                if kind not in by_type:
                    by_type[kind] = cls.from_config(config, i)
            return tuple(by_type[kind] for kind in types)
        one = cls.from_config(config)
        return (one,) * (attention_shape(config).num_layers or 0)

    def cos_sin(
        self, start: int, length: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (length, D) of positions start.., computed as the model does (float32), cast to dtype."""
        pos = torch.arange(start, start + length, device=device)
        freqs = pos[:, None].float() * self.inv_freq.to(device)[None, :]  # (T, D/2) float32
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.head_dim:
            raise RopeError(f"RoPE of head_dim {self.head_dim} cannot rotate keys of head_dim {x.shape[-1]}")

    def apply(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x (B, H, T, D) at positions start.. -> rotated as the model rotates keys (same ops, x's dtype;
        at least float32 for half-precision x)."""
        self._check(x)
        dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        cos, sin = self.cos_sin(start, x.shape[2], dtype, x.device)
        y = x.to(dtype)
        return (y * cos + rotate_half(y) * sin).to(x.dtype)

    def invert(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The exact inverse of `apply` (in float64): x (B, H, T, D) rotated at positions start.. ->
        pre-RoPE."""
        self._check(x)
        cos, sin = self.cos_sin(start, x.shape[2], x.dtype, x.device)  # the values `apply` multiplies by
        c, s, y = cos.double(), sin.double(), x.double()
        # per pair (y1, y2): apply is [[c, -s], [s, c]]; its inverse is [[c, s], [-s, c]] / (c^2 + s^2)
        return ((y * c - rotate_half(y) * s) / (c * c + s * s)).to(x.dtype)

    def __repr__(self) -> str:
        return f"Rope({self.rope_type}, head_dim={self.head_dim}, scaling={self.attention_scaling})"
