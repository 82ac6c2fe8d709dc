"""Transform codecs: a spec option that changes K/V before an inner codec encodes them and undoes it after
the inner codec decodes them. Each wraps the codec of the same spec without its option, so they compose in
the grammar's order (outermost first):

    -center[N]   CenterCodec    x - offset          offset: the mean of each N tokens per (head, channel)
    -rot[S]      RotationCodec  R x                 R = H diag(s): Walsh-Hadamard, random signs (seed S)
    -outP        OutlierCodec   x with its top P% magnitudes per (token, head) split off and kept exact

    int4-g64-center-rot-out1: encode = center -> rotate -> split outliers -> int4-g64; decode in reverse.

Fields are the inner codec's plus each transform's own, so bytes, pages and the store follow as for any codec:

    codec      extra field    heads_f   tokens_f   cols_f   dtype
    center     offset         H         N          D        the K/V dtype (16 / N bits per value at FP16)
    rotation   (none)
    outliers   out_values     H         1          k        the K/V dtype   k = ceil(P% of D)
               out_index      H         1          k        uint8 (D <= 256) or int16

Why these designs:
- Rotation is exact for attention without touching the query: decode un-rotates, so the reference path sees
  K and V as they were (up to the quantization error, which the rotation spreads evenly over channels and
  so shrinks for outlier channels). Sink and window tokens are never rotated. The Triton path keeps the
  body rotated instead (`kernel_frame`: the inner codec's kernel reads the pages as stored): the body
  append rotates new tokens exactly as `RotationCodec.encode` does, then packs them with the inner codec's
  kernel (the same bits); decode attention (`kvquant.kernels.decode_attention`) works in the rotated frame,
  since (R_k q).(R_k k) = q.k and sum_j p_j v_j = R_v^T sum_j p_j (R_v v_j): it rotates the query by R_k
  once per step, hands the kernel rotated copies of the few FP sink and window tokens, and un-rotates the
  output by R_v^T. Only what is rotated is transformed (K, V, or both, each with its own seed), always
  with `fwht` (O(D log D)), never a dense matrix.
- The key offset is stored per block of N tokens (not kept as per-sequence state), so a page is
  self-contained: prefix sharing, beams (pages shared by reference) and crops need nothing more, and the
  result does not depend on how tokens were chunked. A slowly drifting offset (the low-frequency RoPE pairs
  that carry most of a key bias) is followed block by block. It costs 16/N bits per value at FP16 and
  holds up to N - 1 more tokens in the FP window. A calibrated per-layer offset (no bytes per token) would
  need
  the layer index and a calibration file; see `kvquant.diagnose` for when any of this is needed.
- Outliers are chosen per (token, head) vector, a fixed count k, so every token costs the same bytes (pages
  need fixed sizes). Their positions are filled, before the inner codec sees them, with the nearest value
  inside the range of the non-outliers of the inner codec's block, so they never widen a block's range.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..scheme import QuantSpec
from ..spec_types import Center, Outliers, Rotate, rotation_block
from .base import Codec, Field, KernelLayout, register

__all__ = [
    "CenterCodec",
    "KernelFrame",
    "OutlierCodec",
    "RotationCodec",
    "fwht",
    "hadamard_signs",
    "kernel_frame",
    "rotate",
    "unrotate",
]


class _Wrapper(Codec):
    """A transform around `inner`, the codec of the same spec without the transform: spec.transforms[0] is
    this wrapper's (`kvquant.codecs.base.codec_for` builds the chain, innermost first)."""

    def __init__(self, spec: QuantSpec, inner: Codec):
        super().__init__(spec, inner.heads, inner.head_dim, inner.dtype)
        self.inner = inner
        self.transform = spec.transforms[0]  # Center, Rotate, CalibRotate or Outliers (kvquant.spec_types)

    def fields(self) -> dict[str, Field]:
        return dict(self.inner.fields())

    @property
    def token_group(self) -> int:
        return math.lcm(*(f.tokens for f in self.fields().values()))

    def kernel_layout(self) -> KernelLayout | None:
        return None  # the kernels do not read the transformed fields as they are (see `kernel_frame`)

    def kernel_frame(self, device: torch.device) -> KernelFrame | None:
        """How the kernels serve this transform around a kernel codec, or None (the reference path)."""
        return None

    def bind(self, *, layer: int | None, role: str | None, calib, spec: QuantSpec) -> None:
        self.inner.bind(layer=layer, role=role, calib=calib, spec=spec)  # a calibrated inner codec's tables

    def batches_with(self, other: Codec) -> bool:
        return type(self) is type(other) and self.spec == other.spec and self.inner.batches_with(other.inner)


# ---------------------------------------------------------------------------------------------- rotation


def fwht(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over the last dim in blocks of `block` (a power of two
    dividing it; default all of it): O(D log D) butterflies, no matrix. Its own inverse.
    (..., D) -> (..., D)."""
    return _hadamard(x, block or x.shape[-1])


def _hadamard(
    x: torch.Tensor, n: int, s_in: torch.Tensor | None = None, s_out: torch.Tensor | None = None
) -> torch.Tensor:
    """s_out * fwht(s_in * x) in blocks of n (signs (D,) of +-1, or None): kvquant.native's fused op on the
    CPU where it is built, else the same butterflies in PyTorch (the same bits: tests/test_native.py)."""
    d = x.shape[-1]
    if n & (n - 1) or d % n:
        raise ValueError(
            f"Walsh-Hadamard blocks of {n} do not tile {d} channels (need a power of two dividing it)"
        )
    grad = x.requires_grad and torch.is_grad_enabled()
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not grad:
        from .. import native

        ops = native.ops()
        if ops is not None:
            none = x.new_empty(0)
            sin, sout = (none if s is None else s.to(x.dtype).contiguous() for s in (s_in, s_out))
            return ops.fwht(x.reshape(-1, d).contiguous(), n, sin, sout).view(x.shape)
    if s_in is not None:
        x = x * s_in.to(x.device)
    return _butterflies(x, n, grad) if s_out is None else _butterflies(x, n, grad) * s_out.to(x.device)


def wht_stages(x: torch.Tensor, n: int) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform in blocks of n channels (H H = n I), differentiable: stage
    h = 1, 2, 4, ... turns the channel pairs (i, i + h) of each run of 2h into (a + b, a - b), in that order
    (the fp32 sums of vLLM's `fast_hadamard_transform` butterfly too: `engine_vllm.sylvester_wht`)."""
    lead, d = x.shape[:-1], x.shape[-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, d // (2 * h), 2, h)
        x = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return x.reshape(*lead, d)


def _butterflies(x: torch.Tensor, n: int, grad: bool) -> torch.Tensor:
    """The PyTorch FWHT: `wht_stages`' butterflies, written into two buffers in turn (`grad`: `wht_stages`
    itself, differentiable); then / sqrt(n)."""
    lead, d = x.shape[:-1], x.shape[-1]
    if grad:  # out= below does not record a gradient
        return wht_stages(x, n) * (1.0 / math.sqrt(n))
    src = x.reshape(-1, d)  # (N, D)
    bufs = (torch.empty_like(src), torch.empty_like(src)) if n > 1 else ()
    h, turn = 1, 0
    while h < n:
        dst = bufs[turn]
        y = src.view(-1, d // (2 * h), 2, h)  # pairs (i, i + h) within each run of 2h channels
        o = dst.view(-1, d // (2 * h), 2, h)
        torch.add(y[:, :, 0], y[:, :, 1], out=o[:, :, 0])
        torch.sub(y[:, :, 0], y[:, :, 1], out=o[:, :, 1])
        src, turn, h = dst, turn ^ 1, h * 2
    return (src * (1.0 / math.sqrt(n))).view(*lead, d)


def hadamard_signs(seed: int, head_dim: int) -> torch.Tensor:
    """The fixed random signs (D,) float32 of rotation seed `seed` (the same on every machine: a CPU
    generator)."""
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2, (head_dim,), generator=g).float() * 2 - 1


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R x = H (s * x) over the last dim (fp32 in, fp32 out)."""
    return _hadamard(x, rotation_block(x.shape[-1]), s_in=signs)


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R^T y = s * (H y): the inverse of `rotate` (H is symmetric and orthonormal)."""
    return _hadamard(y, rotation_block(y.shape[-1]), s_out=signs)


@register(Rotate)
class RotationCodec(_Wrapper):
    """`-rot[S]`: encode R x with the inner codec; decode, then apply R^T. Fields and bytes: the inner's.
    (`-crot` is `kvquant.codecs.calibrot.CalibRotationCodec`.)"""

    def __init__(self, spec: QuantSpec, inner: Codec):
        super().__init__(spec, inner)
        self.signs = hadamard_signs(self.transform.seed, self.head_dim)
        self._device_signs: dict[torch.device, torch.Tensor] = {}  # copied once, not per step (a host sync)

    def kernel_frame(self, device: torch.device) -> KernelFrame | None:
        """The inner codec's kernels, in the frame rotated by R (when they serve the inner codec)."""
        if self.inner.kernel_layout() is None:
            return None
        if device not in self._device_signs:
            self._device_signs[device] = self.signs.to(device)
        return KernelFrame(self.inner, self._device_signs[device])

    def read_frame(self, device: torch.device) -> KernelFrame:
        """The inner codec in the frame rotated by R, whatever serves the inner codec (the reference path)."""
        if device not in self._device_signs:
            self._device_signs[device] = self.signs.to(device)
        return KernelFrame(self.inner, self._device_signs[device])

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.inner.encode(rotate(x.float(), self.signs).to(self.dtype))

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        return unrotate(self.inner.decode(fields, torch.float32), self.signs).to(dtype or self.dtype)


@dataclass(frozen=True, eq=False)  # eq would compare the tensors
class KernelFrame:
    """How the Triton kernels serve a codec: they read the fields of `codec` (a kernel layout, or one that
    `kvquant.kernels.layouts.decode_layout` knows) as stored, which hold T x for an orthogonal T; attention
    scores T q against them and maps the output back by T^T. T is the identity when every part is None / 0;
    else, applied in this order:

        signs      (D,) +-1 fp32   R x = H diag(signs) x     `-rot` (fwht over `rotation_block(D)`)
        matrix     (D, D) fp32     x M                        `-crot` (a dense calibrated rotation)
        hadamard   n               x H_n in blocks of n       llama.cpp's attention rotation (fwht, n | D)
        order      (D,) int64      x[..., order]              the channel order a kernel decodes blocks in
                                                              (a permutation: kernels.layouts.engine_order)

    Tensors live on the device of the call. `into` / `out_of` compute in fp32 (fp64 for fp64 input: a float64
    run's decode-exact chunks then equal its token-by-token decode to fp64 rounding, not fp32's)."""

    codec: Codec
    signs: torch.Tensor | None = None
    matrix: torch.Tensor | None = None
    hadamard: int = 0
    order: torch.Tensor | None = None

    @property
    def identity(self) -> bool:
        return self.signs is None and self.matrix is None and not self.hadamard and self.order is None

    def into(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(..., D) -> T x in dtype (default x's), computed in fp32 (`-rot`: as `RotationCodec.encode`
        does); x itself when the frame is the identity."""
        if self.identity:
            return x
        y = x if x.dtype == torch.float64 else x.float()
        if self.signs is not None:
            y = rotate(y, self.signs)
        if self.matrix is not None:
            y = y @ self.matrix.to(y.dtype)
        if self.hadamard:
            y = fwht(y, self.hadamard)
        if self.order is not None:
            y = y[..., self.order]
        return y.to(dtype or x.dtype)

    def out_of(self, y: torch.Tensor) -> torch.Tensor:
        """(..., D) -> T^T y in y's dtype (fp32 arithmetic, fp64 for fp64); y itself when the frame is the
        identity."""
        if self.identity:
            return y
        x = y if y.dtype == torch.float64 else y.float()
        if self.order is not None:
            x = torch.empty_like(x).index_copy_(-1, self.order, x)  # x[..., order[i]] = y[..., i]
        if self.hadamard:
            x = fwht(x, self.hadamard)  # symmetric and its own inverse
        if self.matrix is not None:
            x = x @ self.matrix.T.to(x.dtype)
        if self.signs is not None:
            x = unrotate(x, self.signs)
        return x.to(y.dtype)


def kernel_frame(codec: Codec, device: torch.device) -> KernelFrame | None:
    """How the kernels on `device` serve `codec`: as it is when it has a kernel layout; a transform that
    says how (`RotationCodec.kernel_frame`: its inner codec, rotated); else None (the reference path)."""
    if codec.kernel_layout() is not None:
        return KernelFrame(codec)
    return codec.kernel_frame(device) if isinstance(codec, _Wrapper) else None


# ---------------------------------------------------------------------------------------------- centering


@register(Center)
class CenterCodec(_Wrapper):
    """`-center[N]`: subtract the per-(head, channel) mean of each N tokens (stored in the K/V dtype) before
    the inner codec, add it back after decoding."""

    def __init__(self, spec: QuantSpec, inner: Codec):
        super().__init__(spec, inner)
        self.n = self.transform.tokens

    def fields(self) -> dict[str, Field]:
        return {**self.inner.fields(), "offset": Field(self.heads, self.n, self.head_dim, self.dtype)}

    def offsets(self, xf: torch.Tensor) -> torch.Tensor:
        """xf (B, H, T, D) fp32 (K/V in the K/V dtype, as fp32) -> the stored offsets (B, H, T / N, D) in the
        K/V dtype: each N tokens' mean, torch's fp32 reduction (the kernel append asks for it here)."""
        b, h, t, d = xf.shape
        return xf.reshape(b, h, t // self.n, self.n, d).mean(dim=3).to(self.dtype)

    def centered(self, xf: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """What the inner codec encodes: xf minus its offset row, in fp32, rounded to the K/V dtype."""
        return (xf - offset.float().repeat_interleave(self.n, dim=2)).to(self.dtype)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        xf = x.to(self.dtype).float()
        offset = self.offsets(xf)  # (B, H, T / N, D)
        return {**self.inner.encode(self.centered(xf, offset)), "offset": offset.contiguous()}

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        rest = self.inner.decode(fields, torch.float32)
        out = rest + fields["offset"].float().repeat_interleave(self.n, dim=2)
        return out.to(dtype or self.dtype)


# ---------------------------------------------------------------------------------------------- outliers


@register(Outliers)
class OutlierCodec(_Wrapper):
    """`-outP`: the k = ceil(P% of D) largest magnitudes of each (token, head) vector kept exact (value in the
    K/V dtype + index), the rest encoded by the inner codec over the range of the non-outliers."""

    def __init__(self, spec: QuantSpec, inner: Codec):
        super().__init__(spec, inner)
        self.k = self.transform.count(self.head_dim)
        self.index_dtype = torch.uint8 if self.head_dim <= 256 else torch.int16

    def fields(self) -> dict[str, Field]:
        return {
            **self.inner.fields(),
            "out_values": Field(self.heads, 1, self.k, self.dtype),
            "out_index": Field(self.heads, 1, self.k, self.index_dtype),
        }

    def _fill(self, xf: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """xf with the masked (outlier) elements moved to the nearest value in the range of the unmasked
        elements of their inner block (0 where a block has nothing else), so they do not set its range."""
        extent = getattr(self.inner, "extent", None)
        if extent is None:  # no block statistics to protect (a fixed scale): any in-range value does
            return torch.where(mask, torch.zeros_like(xf), xf)
        blocks, m = extent.blocks(xf), extent.blocks(mask)
        lo = torch.where(m, torch.inf, blocks).amin(dim=-1, keepdim=True)
        hi = torch.where(m, -torch.inf, blocks).amax(dim=-1, keepdim=True)
        filled = torch.where(lo <= hi, torch.minimum(torch.maximum(blocks, lo), hi), 0.0)
        return extent.unblocks(torch.where(m, filled, blocks), xf.shape)

    def select(self, xf: torch.Tensor) -> torch.Tensor:
        """xf (B, H, T, D) fp32 -> the outliers' channels (B, H, T, k) int64, largest magnitude first: torch's
        topk (NaN and Inf count as largest; among equal magnitudes, torch's order), which the kernel
        append asks for here."""
        return xf.abs().topk(self.k, dim=-1).indices

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        xf = x.to(self.dtype).float()
        index = self.select(xf)  # (B, H, T, k)
        values = xf.gather(-1, index)
        mask = torch.zeros_like(xf, dtype=torch.bool).scatter_(-1, index, True)
        fields = self.inner.encode(self._fill(xf, mask).to(self.dtype))
        return {
            **fields,
            "out_values": values.to(self.dtype).contiguous(),
            "out_index": index.to(self.index_dtype).contiguous(),
        }

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        dense = self.inner.decode(fields, torch.float32)
        index = fields["out_index"].long()
        out = dense.scatter(-1, index, fields["out_values"].float())
        return out.to(dtype or self.dtype)
