"""Which codecs the quantize+pack kernels append, and how: the one place the pack path asks (no triton import,
so `kvquant.backend` can ask it too without loading a kernel).

    codec                                   packed by                                    `pack_parts`
    affine INT8/4/2, every granularity      `quantize_pack._quantize_token_kernel` /     base
    FP8 (per token, -head, -gN, -tensor)      `_quantize_channel_kernel` (channel-wise     base
    codebook nuq2/3/4 (levels bound)          extents: one token group per program)        base
    `-centerN` / `-outP` around those       the same kernels: offset subtracted and      center, outliers
                                              stored, outliers written and filled in
    llama.cpp q8_0 ... iq4_nl, mxfp4, nvfp4  `pack_engine._engine_kernel` (GGUF blocks)   base
    dense (fp16 body)                       a copy (the reference; nothing to quantize)   base
    `-rot` around any of them               rotated first (`pack_frame`), then the above
    anything else                           None: the codec's PyTorch encoder

The grammar puts `-center` outside `-rot` outside `-outP`, so `-rot` is served only outermost: a rotation
inside `-center` (`int4-g64-center-rot`) takes the encoder, as in the decode kernel.

What the kernels compute is the encoder's arithmetic, step for step. Two steps of it are not arithmetic but
choices that belong to the device's torch library: `-center`'s mean (an fp32 reduction, whose summation
order is torch's) and `-outP`'s topk (which of equal magnitudes comes first is torch's). The launcher asks
the codec for those (`CenterCodec.offsets`, `OutlierCodec.select`, torch on the device), so the pages are
the encoder's bits on any device; the kernel subtracts the offsets, writes and fills the outliers, then
quantizes and packs. llama.cpp's attention rotation of engine rows is a matrix product (BLAS order): the
launcher takes the rows from `EngineCodec.rows` too.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvquant.codecs.base import CodebookCodec, Codec, DenseCodec
from kvquant.codecs.engine import EngineCodec
from kvquant.codecs.fp8 import FP8Codec
from kvquant.codecs.quantize import AffineCodec
from kvquant.codecs.transforms import CenterCodec, KernelFrame, OutlierCodec, RotationCodec

__all__ = ["PackParts", "pack_frame", "pack_parts"]


@dataclass(frozen=True)
class PackParts:
    """A codec as the pack kernels serve it: the base codec whose codes they compute, and the transforms
    around it that they apply first (encode order: the offset subtracted, then the outliers split off).

    center: the `CenterCodec` (`-centerN`) or None; outliers: the `OutlierCodec` (`-outP`) or None."""

    base: Codec
    center: CenterCodec | None = None
    outliers: OutlierCodec | None = None


def _base_packs(codec: Codec) -> bool:
    """Whether a kernel computes this base codec's fields (a dense body is a copy: served, nothing to do).
    A group of channels that does not fill whole packing units (int4-g1, nuq3-g4) takes the encoder."""
    kind = type(codec)
    if kind in (DenseCodec, FP8Codec, EngineCodec):
        return True
    if kind is CodebookCodec and codec.levels is None:
        return False  # nothing to look up yet (no calibration bound)
    if kind not in (AffineCodec, CodebookCodec) or codec.spec.bits not in (2, 3, 4, 8):
        return False
    unit = 8 if codec.spec.bits == 3 else 8 // codec.spec.bits  # codes per packing unit
    return codec.extent.tokens > 1 or codec.extent.channels % unit == 0


def pack_parts(codec: Codec) -> PackParts | None:
    """Peel `-center` (outermost) and `-outP` off a codec; the parts when the kernels append what is left
    (`_base_packs`), else None. Engine formats and dense bodies take no transforms here."""
    center = outliers = None
    c = codec
    if type(c) is CenterCodec:
        center, c = c, c.inner
    if type(c) is OutlierCodec:
        outliers, c = c, c.inner
    if not _base_packs(c):
        return None
    if (center or outliers) and type(c) in (DenseCodec, EngineCodec):
        return None
    return PackParts(c, center, outliers)


def pack_frame(codec: Codec, device) -> KernelFrame | None:
    """How the pack kernels serve `codec` on `device`: as it is (`pack_parts`), or its inner codec in the
    frame rotated by R for `-rot` outermost (the append rotates as `RotationCodec.encode` does, then packs
    the inner codec); None: the codec's PyTorch encoder appends."""
    if pack_parts(codec) is not None:
        return KernelFrame(codec)
    if type(codec) is RotationCodec and pack_parts(codec.inner) is not None:
        return codec.read_frame(device)
    return None
