"""`rbqB-lfPbH...`: RoPE frequency blocks of the head dimension at different bits (Block-GTQ style;
`kvquant.spec_types.RopeBlocks`). Two uniform integer codecs side by side, each over its own channels:

    block   channels (rotate-half layout, D = head_dim)                 codec
    low     the rest: 0 .. D/2 - P - 1 and D/2 .. D - P - 1            intB with the spec's grain
    high    the P lowest-frequency pairs: D/2 - P .. D/2 - 1, D - P .. D - 1   intH with the same grain

Fields are each block's own under a prefix ("lo.codes", "lo.scale", "hi.codes", ...), laid out
(B, heads_f, T // tokens_f, cols_f) as every codec's, so pages, bytes and `kvquant.memory` need nothing of
their own. No kernel reads them (the reference path); `-prerope` wraps the codec as for any family.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..scheme import QuantSpec
from ..spec_types import RopeBlocks, UniformInt
from .base import Codec, Field, codec_for, register

__all__ = ["RopeBlocksCodec"]


@register(RopeBlocks)
class RopeBlocksCodec(Codec):
    """K or V split into the low- and high-frequency blocks of `RopeBlocks`, each an integer codec."""

    def __init__(self, spec: QuantSpec, heads: int, head_dim: int, dtype: torch.dtype):
        super().__init__(spec, heads, head_dim, dtype)
        fam: RopeBlocks = spec.family
        lo, hi = fam.blocks(head_dim)
        self._lo = torch.tensor(lo, dtype=torch.long)
        self._hi = torch.tensor(hi, dtype=torch.long)
        def block(bits: int, channels: list[int]) -> Codec:  # int8 symmetric, int4 / int2 asymmetric
            spec = QuantSpec(family=UniformInt(bits, bits == 8), grain=fam.grain)
            return codec_for(spec, heads, len(channels), dtype)

        self.blocks = {"lo": block(fam.bits, lo), "hi": block(fam.high_bits, hi)}

    def fields(self) -> dict[str, Field]:
        return {f"{b}.{n}": f for b, codec in self.blocks.items() for n, f in codec.fields().items()}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for b, idx in (("lo", self._lo), ("hi", self._hi)):
            part = x.index_select(-1, idx.to(x.device))  # (B, H, T, channels of the block)
            out |= {f"{b}.{n}": t for n, t in self.blocks[b].encode(part).items()}
        return out

    def decode(self, fields: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        parts = {
            b: codec.decode({n: fields[f"{b}.{n}"] for n in codec.fields()}, dtype)
            for b, codec in self.blocks.items()
        }
        lo = parts["lo"]
        out = lo.new_empty((*lo.shape[:-1], self.head_dim))
        out[..., self._lo.to(lo.device)] = lo
        out[..., self._hi.to(lo.device)] = parts["hi"]
        return out

