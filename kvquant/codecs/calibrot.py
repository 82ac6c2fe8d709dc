"""`-crot`: a calibrated rotation (OSCAR / SpinQuant style) before any integer or codebook codec.

    int2-g64-crot,calib=FILE       encode: y = x M (M orthogonal (D, D), one per layer and K/V, from FILE),
                                   then int2-g64 on y; decode: int2-g64's decode, then x_hat = y_hat M^T

`-rot` spreads every channel's energy evenly with a *random* Hadamard; `-crot` learns M on calibration text
so that the error the quantizer leaves does the least harm to what attention computes with it: the loss is
the relative error of the attention OUTPUT of every query (softmax(q k_hat^T) v for keys, P v_hat for
values with the FP probabilities P), not the error of K or V themselves. M is stored in the calibration file
(`rotation/<layer>/<k|v>/<spec>`, (D, D) float32, safetensors), keyed by the full spec like a codebook, since
the best rotation depends on the quantizer it serves.

Fitting (`kvquant.rotfit.fit_rotation`; this module is the codec only, so the codecs never import the
attention or calibration code the fit runs), per layer and role, on queries, keys and values captured from
the model (`capture`, one forward per calibration document with an ordinary cache):

    M = M0 cayley(W - W^T)          cayley(A) = (I - A)^-1 (I + A): orthogonal for every W; W = 0 gives M0,
                                    the random Hadamard of `-rot` (signs of seed 0), so M starts where -rot is
    loss = |o_hat - o|^2 / |o|^2    o: FP attention output of a sample of query positions over all keys
    x_hat = sur(y) + (codec(y) - sur(y)).detach()   the forward value is the codec's own decode(encode(y)),
                                    bit for bit; the gradient is a surrogate's: the codec's block statistics
                                    (min/max, absmax, mid-range) computed differentiably and rounding (or the
                                    nearest codebook level) passed straight through (STE). Codecs without a
                                    surrogate (fp8, -out inside) pass the whole quantizer straight through.

Adam on W for `steps` steps; the M with the lowest calibration loss seen is kept (so it never does worse
than the Hadamard start on the calibration text). A `nuqN-crot` spec first fits its codebook on the
Hadamard-rotated values, fits M against it, then refits the codebook on the values rotated by M.

Kernels: the decode kernel serves `-crot` around any codec it reads as `-rot` (`kvquant.kernels.layouts.
decode_frame`): it scores in the rotated frame (q M once per step, the sink and window tokens' copies times M,
the output times M^T once) with a dense (D, D) matmul instead of the Walsh-Hadamard butterflies: D^2
multiply-adds per query head per step, nothing per stored token. Appends take this codec's `encode`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import torch

from ..scheme import CALIBRATE_COMMAND, QuantSpec, SchemeError
from ..spec_types import CalibRotate
from .base import Codec, register
from .transforms import _Wrapper, rotate

__all__ = ["CalibRotationCodec", "hadamard_matrix", "inner_spec"]

logger = logging.getLogger(__name__)

def inner_spec(spec: QuantSpec) -> QuantSpec:
    """The spec a `-crot` codec wraps: the same without the rotation."""
    return dataclasses.replace(spec, transforms=tuple(t for t in spec.transforms if t != CalibRotate()))


def hadamard_matrix(head_dim: int, seed: int = 0) -> torch.Tensor:
    """(D, D) float32 M0 with x M0 = `-rot{seed}`'s R x: the calibrated rotation's starting point."""
    from .transforms import hadamard_signs

    return rotate(torch.eye(head_dim), hadamard_signs(seed, head_dim))


@register(CalibRotate)
class CalibRotationCodec(_Wrapper):
    """`-crot`: encode x M with the inner codec, decode and multiply by M^T. M (D, D) comes from the
    calibration file (`bind`); fields and bytes are the inner codec's (M costs nothing per token)."""

    def __init__(self, spec: QuantSpec, inner: Codec):
        super().__init__(spec, inner)
        self.matrix: torch.Tensor | None = None  # (D, D) float32, from `bind` or `set_matrix`
        self._device_matrix: dict[torch.device, torch.Tensor] = {}

    def bind(self, *, layer: int | None, role: str | None, calib, spec: QuantSpec) -> None:
        if calib is not None and layer is not None and role is not None:
            self.set_matrix(calib.rotation(layer, role, spec))
        self.inner.bind(layer=layer, role=role, calib=calib, spec=spec)

    def set_matrix(self, matrix: torch.Tensor) -> None:
        m = torch.as_tensor(matrix, dtype=torch.float32)
        d = self.head_dim
        if m.shape != (d, d):
            raise ValueError(f"a {self.spec} rotation is ({d}, {d}), got {tuple(m.shape)}")
        err = float((m @ m.T - torch.eye(d)).abs().max())
        if not err < 1e-3:
            raise ValueError(f"a {self.spec} rotation must be orthogonal: |M M^T - I| = {err:.2e}")
        self.matrix = m
        self._device_matrix = {}

    def _m(self, device: torch.device) -> torch.Tensor:
        if self.matrix is None:
            raise SchemeError(
                f"{self.spec} has no calibrated rotation: give the scheme a calibration file (calib=FILE) "
                "written by `" + CALIBRATE_COMMAND.format(scheme=self.spec) + "`, and build the codec with "
                "its layer (codec_for(..., layer=i, role='k', calib=...))"
            )
        if device not in self._device_matrix:  # copied once, not per step
            self._device_matrix[device] = self.matrix.to(device)
        return self._device_matrix[device]

    def matrix_on(self, device: torch.device) -> torch.Tensor:
        """M (D, D) fp32 on `device`, copied once (the decode kernel's frame: the query times M once per
        step, the output times M^T; `kvquant.kernels.layouts.decode_frame`)."""
        return self._m(device)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.inner.encode((x.float() @ self._m(x.device)).to(self.dtype))

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        y = self.inner.decode(fields, torch.float32)
        return (y @ self._m(y.device).T).to(dtype or self.dtype)

    def codebook_values(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        return self.inner.codebook_values(x.float() @ self._m(x.device), start)

    def batches_with(self, other: Codec) -> bool:
        return (
            super().batches_with(other)
            and self.matrix is not None
            and other.matrix is not None
            and torch.equal(self.matrix, other.matrix)
        )
