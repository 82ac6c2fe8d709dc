"""Which codecs the decode kernel reads in place, and how: the one place the kernels ask (no triton import, so
`kvquant.backend` can ask it too without loading a kernel).

    codec                          read as                          `decode_layout` / `decode_frame`
    a codec with a kernel layout   its `kernel_layout()`            as it is (affine INT, FP8, dense)
    codebook (`nuq2/3/4`)          `CodebookKernelLayout`            the levels looked up per code
    `-rot` around either           the inner codec, rotated frame   `RotationCodec.read_frame`
    `-center` / `-outP` around     the inner codec's fields, plus   `decode_parts`: the offset added back,
      either (no `-rot` between)   offset / out_values, out_index   the outliers written at their indices
    anything else                  None: the reference path

Codebook codecs (`kvquant.codecs.base.CodebookCodec`) declare no kernel layout of their own, but store exactly
the affine codec's fields (packed `codes`, `scale` per block of the spec's extent, `zero` unless -sym):
only the meaning differs. A code c decodes to level[c] * scale (+ zero), the scale the block's half range
(or absmax for -sym, never divided by a qmax), level[] the 2^bits calibrated levels (float32). 3-bit codes
are packed 8 per 3 bytes (`kvquant.codecs.packing`). The levels go to the kernel as a (2^bits,) float32 device
tensor, copied once per codec and device (`device_levels`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvquant.codecs.base import CodebookCodec, KernelLayout
from kvquant.codecs.transforms import CenterCodec, KernelFrame, OutlierCodec, RotationCodec, kernel_frame

__all__ = ["CodebookKernelLayout", "DecodeParts", "decode_layout", "decode_frame", "decode_parts",
           "device_levels", "describe_unserved"]


@dataclass(frozen=True)
class CodebookKernelLayout(KernelLayout):
    """A codebook codec's fields as the decode kernel reads them: `KernelLayout`'s geometry (bits 2, 3 or 4;
    symmetric: no zero field, scale = absmax), codes looked up in a table of 2^bits levels."""

    codebook: bool = True


@dataclass(frozen=True)
class DecodeParts:
    """A codec as the decode kernel serves it: the base codec whose codes it dequantizes, plus the
    transforms around it that it undoes in place (decode order: outliers written, then the offset added).

    center: tokens per stored offset row (`-centerN`; 0 = none): x += offset[row // N] per (head, channel).
    outliers: values kept exact per (token, head) (`-outP`'s k; 0 = none): x[index[j]] = value[j]."""

    base: object
    center: int = 0
    outliers: int = 0


def decode_parts(codec) -> DecodeParts:
    """Peel `-center` (outermost) and `-outP` off a codec, in the grammar's order; what is left is the base.
    A `-rot` between them stops the peeling (its frame would need the offset rotated): that base has no
    layout, so the codec takes the reference path."""
    center = outliers = 0
    c = codec
    if isinstance(c, CenterCodec):
        center, c = c.n, c.inner
    if isinstance(c, OutlierCodec):
        outliers, c = c.k, c.inner
    return DecodeParts(c, center, outliers)


def decode_layout(codec) -> KernelLayout | None:
    """How the decode kernel reads `codec`'s fields as stored, or None when it does not (for `-center` and
    `-outP` around a kernel codec: the base codec's layout; `decode_parts` says what is around it)."""
    parts = decode_parts(codec)
    if parts.base is not codec:
        return decode_layout(parts.base)
    lay = codec.kernel_layout()
    if lay is not None:
        return lay
    if isinstance(codec, CodebookCodec) and codec.levels is not None:
        e = codec.extent
        return CodebookKernelLayout(
            bits=codec.spec.bits, symmetric=codec.spec.symmetric, token_extent=e.tokens,
            channel_extent=e.channels, shared_heads=e.heads == codec.heads and codec.heads > 1,
        )
    return None


def decode_frame(codec, device) -> KernelFrame | None:
    """The codec the decode kernel reads and the rotation of its frame (`KernelFrame`), or None (reference).
    `kvquant.codecs.transforms.kernel_frame` for the codecs with a kernel layout, plus codebook codecs and
    `-rot` around one (served in the rotated frame, as around an affine codec)."""
    frame = kernel_frame(codec, device)
    if frame is not None:
        return frame
    if decode_layout(codec) is not None:
        return KernelFrame(codec)
    if isinstance(codec, RotationCodec) and decode_layout(codec.inner) is not None:
        return codec.read_frame(device)
    return None


def device_levels(codec, device, registry=None, dtype=None):
    """The kernel's table of `codec`'s levels on `device` for attention in `dtype`
    (`kvquant.kernels.codebook.table_for`), made once per (codec, device, dtype): kept on the registry (one
    per cache) when it can hold them, so a decode step never copies from the host."""
    import torch

    from .codebook import table_for

    dtype = dtype or torch.float16
    store = getattr(registry, "constants", None)
    key = (id(codec), str(device), dtype)
    if store is not None:
        held = store.get(key)
        if held is not None and held[0] is codec.levels:
            return held[1]
    table = table_for(codec.levels, dtype, device)
    if store is not None:
        store[key] = (codec.levels, table)
    return table


def describe_unserved(codec, device) -> str | None:
    """The log line for a codec the Triton kernels do not fully serve (attention and appends), or None.
    Codebook codecs: attention in the kernel, appends by the codec's encoder (no codebook pack kernel)."""
    frame = decode_frame(codec, device)
    if frame is None:
        return (f"{codec.spec}: no Triton kernel reads this codec yet; the PyTorch reference path serves its "
                "attention and appends")
    if kernel_frame(codec, device) is None:  # read by the kernel, but not packed by one
        return (f"{codec.spec}: decode attention runs in the Triton kernel; appends take the codec's PyTorch "
                "encoder (no quantize+pack kernel for it yet; the same bits)")
    return None
