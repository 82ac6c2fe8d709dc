"""TurboQuant as published (Zandieh, Daliri, Hadian, Mirrokni: "TurboQuant: Online Vector Quantization with
Near-optimal Distortion Rate", ICLR 2026, arXiv:2504.19874): the `turboB...` specs (`scheme.TurboSpec`).

Per (token, head) vector x of D channels, for each channel group g (all of D, or the paper's outlier split):

    n_g = |x_g|, u_g = x_g / n_g                       the norm, stored fp16 (Algorithm 1 takes unit vectors)
    y_g = P_g u_g                                      P_g: Haar orthogonal (QR of a seeded Gaussian, the
                                                       paper's) or, with -had, H diag(s) (kvquant's -rot)
    code_j = argmin_i |y_gj - c_i|                     c: Lloyd-Max levels of a coordinate of a uniform unit
                                                       vector in R^d_g, density ~ (1 - x^2)^((d_g - 3) / 2)
    x_hat_g = n_g P_g^T c[code]                        (-nc stores n_g / |c[code]| so |x_hat_g| = |x_g|)

  -qjl (TurboQuant_prod, Algorithm 2): the codes above at B - 1 bits, then on the residual r = x - x_hat
    (all D channels, as decoded): z = sign(S r), S (D, D) i.i.d. N(0, 1) seeded, and gamma = |r| (fp16);
    decode returns x_hat + sqrt(pi / 2) / D * gamma * S^T z. The paper's unbiased inner-product estimator is
    <q, x_hat> + gamma <q, sqrt(pi/2)/D S^T z>, linear in the key, so it is exactly q . decode(k): the
    attention path needs nothing of its own (E_S[q . decode(k)] = q . k; `tests/test_codec_turbo.py`).
  outlier split (turboB.25 / .5 / .75): that fraction of the D channels, the largest by energy (sum of x^2)
    over each block of N tokens (-blockN, default 16: a page) per head, at B + 1 bits, the rest at B, each
    group an independent TurboQuant instance (its norm, rotation and levels for its own dimension), as the
    paper's 2.5 / 3.5-bit configurations ("32 outlier channels are quantized at 3 bits, while the remaining 96
    use 2 bits"). The paper does not say how a streaming cache picks the outliers; here a D-bit mask per head
    and block of N tokens is stored (1/N bit per value), so every page is self-contained and no calibration
    is needed; up to N - 1 tokens wait in the FP window until their block is complete (as -channel-gN keys).

Fields, laid out (B, heads_f, T // tokens_f, cols_f) as every codec's (`kvquant.codecs.base`):

    field   heads_f  tokens_f  cols_f                          dtype
    codes   H        1         sum_g ceil(d_g * b_g / 8)       uint8: each group's codes packed in turn
                                                               (kvquant.codecs.packing for 2/3/4 bits; 1 bit:
                                                               8 codes per byte, LSB first)
    norm    H        1         groups (1 or 2)                 fp16
    qjl     H        1         D / 8                           uint8 (-qjl): sign bits, LSB first
    rnorm   H        1         1                               fp16 (-qjl): gamma
    mask    H        N         D / 8                           uint8 (split specs): outlier channels

so `kvquant.memory.cache_bytes` reports exactly what is stored (D = 64: turbo3 26 bytes per (token, head),
3.25 bits; turbo3.5 32.5 bytes, 4.06 bits: two fp16 norms cost 0.5 bit and the mask 1/16 at this head_dim).

Levels are computed, not copied: Lloyd-Max iterations (threshold = midpoint, level = conditional mean)
with the bin probabilities from the regularized incomplete beta function (x^2 ~ Beta(1/2, (d - 1) / 2)) and
the bins' first moments in closed form (`lloyd_max_levels`); each codec caches them per (d, b). No kernel
serves these codecs yet (`kernel_layout` is None: the reference attention path).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from ..scheme import QuantSpec
from ..spec_types import TurboSpec
from .base import Codec, Field, register
from .packing import pack, packed_size, unpack
from .transforms import hadamard_signs, rotate, unrotate

__all__ = ["TurboCodec", "lloyd_max_levels", "turbo_density"]

_SEED_STRIDE = 1_000_003  # group g's rotation seed = seed + g * stride; the QJL projection's: seed - 1 - ...
_QJL_SEED = 0x5EED_0A1


def turbo_density(x: np.ndarray, d: int) -> np.ndarray:
    """Density of one coordinate of a uniformly random unit vector in R^d at x in [-1, 1] (the paper's
    Lemma 1): Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) (1 - x^2)^((d-3)/2)."""
    from scipy import special

    log_c = special.gammaln(d / 2) - 0.5 * math.log(math.pi) - special.gammaln((d - 1) / 2)
    return np.exp(log_c) * np.clip(1 - np.asarray(x, dtype=np.float64) ** 2, 0, None) ** ((d - 3) / 2)


def lloyd_max_levels(d: int, bits: int, tol: float = 1e-11, max_iter: int = 100_000) -> np.ndarray:
    """The 2^bits MSE-optimal levels (ascending, float64) for a coordinate of a uniform unit vector in R^d.

    Lloyd-Max: thresholds t at the midpoints of the levels, each level the mean of its bin,
    c_i = (M(t_i) - M(t_{i-1})) / (F(t_i) - F(t_{i-1})), with F the CDF (regularized incomplete beta:
    x^2 ~ Beta(1/2, (d-1)/2)) and M(t) = int_{-1}^t x f(x) dx = -C (1 - t^2)^((d-1)/2) / (d - 1) in closed
    form. Starts from Gaussian quantiles (the d -> oo limit, N(0, 1/d)) and stops when no level moves by
    more than tol / sqrt(d)."""
    from scipy import special, stats

    if d < 2 or not 1 <= bits <= 8:
        raise ValueError(f"Lloyd-Max levels need d >= 2 and 1..8 bits, got d={d}, bits={bits}")
    k = 1 << bits
    half = (d - 1) / 2
    c_norm = math.exp(special.gammaln(d / 2) - 0.5 * math.log(math.pi) - special.gammaln(half))

    def cdf(t: np.ndarray) -> np.ndarray:
        return 0.5 + np.sign(t) * 0.5 * special.betainc(0.5, half, t * t)

    def moment(t: np.ndarray) -> np.ndarray:
        return -c_norm * (1 - t * t) ** half / (2 * half)

    scale = 1 / math.sqrt(d)
    levels = np.clip(stats.norm.ppf((np.arange(k) + 0.5) / k) * scale, -1 + 1e-9, 1 - 1e-9)
    for _ in range(max_iter):
        t = np.concatenate([[-1.0], (levels[1:] + levels[:-1]) / 2, [1.0]])
        new = (moment(t[1:]) - moment(t[:-1])) / (cdf(t[1:]) - cdf(t[:-1]))
        done = np.max(np.abs(new - levels)) < tol * scale
        levels = new
        if done:
            break
    else:
        raise RuntimeError(f"Lloyd-Max levels for d={d}, {bits} bits did not converge in {max_iter} steps")
    return levels


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) uint8 codes -> (..., ceil(n * bits / 8)) bytes: codecs.packing, or 8 one-bit codes a byte."""
    if bits != 1:
        return pack(codes.contiguous(), bits)
    n = codes.shape[-1]
    c = torch.nn.functional.pad(codes, (0, (-n) % 8)).reshape(*codes.shape[:-1], -1, 8)
    weights = (1 << torch.arange(8, device=codes.device)).to(torch.uint8)
    return (c * weights).sum(-1, dtype=torch.uint8)  # distinct powers of two: the sum is the or


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    if bits != 1:
        return unpack(packed, bits, n)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(*packed.shape[:-1], -1)[..., :n]


def _packed(n: int, bits: int) -> int:
    return (n + 7) // 8 if bits == 1 else packed_size(n, bits)


@register(TurboSpec)
class TurboCodec(Codec):
    """`turboB[.25|.5|.75][-qjl][-had][-nc][-seedS][-blockN]`: see the module docstring."""

    def __init__(self, spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__(spec, heads, head_dim, dtype)
        self.turbo = spec.turbo
        self.groups = self.turbo.groups(head_dim)  # ((channels, MSE bits), ...), outlier group first
        self._levels: dict[tuple[int, int], torch.Tensor] = {}  # (d, bits) -> (2^bits,) fp32, ascending
        self._mats: dict[tuple[str, int, torch.device], torch.Tensor] = {}  # rotations / projection

    # ---- tables (computed once per codec, on first use)

    def levels(self, d: int, bits: int) -> torch.Tensor:
        """The Lloyd-Max levels (2^bits,) fp32 for a group of d channels."""
        if (d, bits) not in self._levels:
            self._levels[(d, bits)] = torch.from_numpy(lloyd_max_levels(d, bits)).float()
        return self._levels[(d, bits)]

    def _seed(self, group: int) -> int:
        return (self.turbo.seed + group * _SEED_STRIDE) % (1 << 63)

    def rotation(self, group: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Group `group`'s dense rotation P (d, d) fp32 (Haar: QR of a seeded Gaussian, R's diagonal made
        positive), or its Hadamard signs (d,) with -had."""
        key = ("rot", group, torch.device(device))
        if key not in self._mats:
            d = self.groups[group][0]
            if self.turbo.rotation == "hadamard":
                mat = hadamard_signs(self._seed(group), d)
            else:
                g = torch.Generator().manual_seed(self._seed(group))
                q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
                mat = (q * torch.sign(torch.diagonal(r))).float()
            self._mats[key] = mat.to(device)
        return self._mats[key]

    def projection(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The QJL projection S (D, D) fp32, i.i.d. N(0, 1), seeded."""
        key = ("qjl", 0, torch.device(device))
        if key not in self._mats:
            g = torch.Generator().manual_seed((self.turbo.seed + _QJL_SEED) % (1 << 63))
            self._mats[key] = torch.randn(self.head_dim, self.head_dim, generator=g).to(device)
        return self._mats[key]

    def _rotate(self, u: torch.Tensor, group: int) -> torch.Tensor:
        p = self.rotation(group, u.device)
        return rotate(u, p) if self.turbo.rotation == "hadamard" else u @ p.T  # (..., d): P u

    def _unrotate(self, y: torch.Tensor, group: int) -> torch.Tensor:
        p = self.rotation(group, y.device)
        return unrotate(y, p) if self.turbo.rotation == "hadamard" else y @ p  # (..., d): P^T y

    # ---- layout

    def fields(self) -> dict[str, Field]:
        h, d = self.heads, self.head_dim
        out = {
            "codes": Field(h, 1, sum(_packed(n, b) for n, b in self.groups), torch.uint8),
            "norm": Field(h, 1, len(self.groups), torch.float16),
        }
        if self.turbo.qjl:
            out["qjl"] = Field(h, 1, d // 8, torch.uint8)
            out["rnorm"] = Field(h, 1, 1, torch.float16)
        if self.turbo.high:
            out["mask"] = Field(h, self.turbo.block, d // 8, torch.uint8)
        return out

    def _order(self, mask: torch.Tensor) -> torch.Tensor:
        """mask (B, H, T // N, D) bool, the outlier channels -> (B, H, T, D) channel order: the outliers
        ascending, then the rest ascending."""
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)
        return order.repeat_interleave(self.turbo.block, dim=2)

    # ---- encode / decode

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        b, h, t, d = x.shape
        xf = x.to(self.dtype).float()  # (B, H, T, D): the values as the K/V dtype holds them
        finite = torch.isfinite(xf).all(dim=-1, keepdim=True)  # (B, H, T, 1)
        xf = torch.where(finite, xf, 0.0)
        out: dict[str, torch.Tensor] = {}
        order = None
        if self.turbo.high:
            n = self.turbo.block
            energy = xf.reshape(b, h, t // n, n, d).square().sum(dim=3)  # (B, H, T / N, D)
            top = energy.topk(self.groups[0][0], dim=-1).indices
            mask = torch.zeros_like(energy, dtype=torch.bool).scatter_(-1, top, True)
            out["mask"] = _pack(mask.to(torch.uint8), 1)
            order = self._order(mask)
            xg = xf.gather(-1, order)  # (B, H, T, D): outlier channels first
        else:
            xg = xf
        codes, norms, parts = [], [], []
        start = 0
        for gi, (dg, bits) in enumerate(self.groups):
            v = xg[..., start : start + dg]  # (B, H, T, d_g)
            start += dg
            norm = v.norm(dim=-1, keepdim=True)  # (B, H, T, 1)
            u = torch.where(norm > 0, v / norm, 0.0)
            levels = self.levels(dg, bits).to(x.device)
            idx = torch.bucketize(self._rotate(u, gi).contiguous(), (levels[1:] + levels[:-1]) / 2)
            y_hat = levels[idx]  # (B, H, T, d_g)
            if self.turbo.norm_correction:  # |P^T y_hat| = |y_hat|: P is orthogonal
                norm = norm / y_hat.norm(dim=-1, keepdim=True)
            norm = torch.where(finite, norm, torch.nan).to(torch.float16)
            codes.append(_pack(idx.to(torch.uint8), bits))
            norms.append(norm)
            parts.append(norm.float() * self._unrotate(y_hat, gi))
        out = {"codes": torch.cat(codes, dim=-1).contiguous(), "norm": torch.cat(norms, dim=-1).contiguous(),
               **out}  # in `fields()` order: codes, norm, then qjl, rnorm, mask
        if self.turbo.qjl:
            x_hat = self._place(torch.cat(parts, dim=-1), order)
            r = torch.where(finite, xf - x_hat, 0.0)  # (B, H, T, D): the residual of what decode returns
            z = (r @ self.projection(x.device).T) >= 0  # sign(S r), sign(0) = +1
            out["qjl"] = _pack(z.to(torch.uint8), 1)
            out["rnorm"] = r.norm(dim=-1, keepdim=True).to(torch.float16)
        if "mask" in out:
            out["mask"] = out.pop("mask")
        return out

    def _place(self, xg: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
        """Channels in group order (B, H, T, D) -> channel order."""
        return xg if order is None else torch.empty_like(xg).scatter_(-1, order, xg)

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        packed, norms = fields["codes"], fields["norm"].float()
        parts, start = [], 0
        for gi, (dg, bits) in enumerate(self.groups):
            nbytes = _packed(dg, bits)
            idx = _unpack(packed[..., start : start + nbytes], bits, dg).long()  # (B, H, T, d_g)
            start += nbytes
            y_hat = self.levels(dg, bits).to(packed.device)[idx]
            parts.append(norms[..., gi : gi + 1] * self._unrotate(y_hat, gi))
        order = None
        if self.turbo.high:
            mask = _unpack(fields["mask"], 1, self.head_dim).bool()  # (B, H, T / N, D)
            order = self._order(mask)
        x = self._place(torch.cat(parts, dim=-1), order)
        if self.turbo.qjl:
            signs = _unpack(fields["qjl"], 1, self.head_dim).float() * 2 - 1  # (B, H, T, D): z
            gamma = fields["rnorm"].float()  # (B, H, T, 1)
            x = x + math.sqrt(math.pi / 2) / self.head_dim * gamma * (signs @ self.projection(x.device))
        return x.to(dtype or self.dtype)

    def bits_per_value(self) -> float:
        """Bits stored per K or V value in steady state (codes, norms, QJL, masks): what memory reports."""
        return self.bytes(self.token_group) * 8 / (self.token_group * self.heads * self.head_dim)
