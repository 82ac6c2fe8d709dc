"""Which codecs the decode kernel reads in place, and how: the one place the kernels ask (no triton import, so
`kvquant.backend` can ask it too without loading a kernel).

    codec                          read as                          `decode_layout` / `decode_frame`
    a codec with a kernel layout   its `kernel_layout()`            as it is (affine INT, FP8, dense)
    codebook (`nuq2/3/4`)          `CodebookKernelLayout`            the levels looked up per code
    `-rot` around either           the inner codec, rotated frame   `RotationCodec.read_frame`
    `-crot` around either          the inner codec, frame x M       `KernelFrame(matrix=M)`
    `-center` / `-outP` around     the inner codec's fields, plus   `decode_parts`: the offset added back,
      either (no `-rot` between)   offset / out_values, out_index   the outliers written at their indices
    `-prerope` keys around any of  the inner codec's fields         `decode_parts.rope`: RoPE at each key's
      these with the model's frame                                  position, after decoding (in the kernel)
    GGUF blocks (`llama.cpp:*`,    `EngineKernelLayout`: the        llama.cpp's rotation (`hadamard`) and
      `mxfp4`, `nvfp4`)            `blocks` bytes in place          the kernel's channel order (`order`)
    vLLM `fp8_per_token_head`,     `FP8KernelLayout` / `SignedInt8KernelLayout`: codes + a per-(token,
      `int8_per_token_head`,       head) scale as stored; `fp8_e4m3` / `fp8_e5m2` at the default scale
      `fp8_e4m3/e5m2` (scale 1)    1.0: FP8 codes, no scale
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

import torch

from kvquant.codecs.base import CodebookCodec, KernelLayout, PreRopeCodec
from kvquant.codecs.calibrot import CalibRotationCodec
from kvquant.codecs.engine import IQ4_NL_VALUES, MXFP4_VALUES, EngineCodec
from kvquant.codecs.engine_vllm import TurboQuantCodec, VLLMCodec, tq_centroids, tq_signs
from kvquant.codecs.fp8 import FP8KernelLayout
from kvquant.codecs.transforms import CenterCodec, KernelFrame, OutlierCodec, RotationCodec, kernel_frame

__all__ = ["CodebookKernelLayout", "DecodeParts", "ENGINE_KERNEL_FORMATS", "EngineKernelLayout",
           "SignedInt8KernelLayout", "SlotKernelLayout", "decode_layout", "decode_frame", "decode_parts",
           "device_levels", "describe_unserved", "engine_levels", "engine_order", "rope_table", "slot_levels"]


@dataclass(frozen=True)
class CodebookKernelLayout(KernelLayout):
    """A codebook codec's fields as the decode kernel reads them: `KernelLayout`'s geometry (bits 2, 3 or 4;
    symmetric: no zero field, scale = absmax), codes looked up in a table of 2^bits levels."""

    codebook: bool = True


@dataclass(frozen=True)
class SignedInt8KernelLayout(KernelLayout):
    """8-bit two's-complement codes (vLLM's `int8_per_token_head`) times a scale stored as the step itself
    (not an absmax to divide by qmax): the kernel flips the sign bits and reads them as int8's biased
    codes."""

    signed: bool = True


@dataclass(frozen=True)
class EngineKernelLayout(KernelLayout):
    """A GGUF block format (`kvquant.codecs.engine`) as the decode kernel reads it (`kernels.engine_blocks`):
    each (token, head) row of the uint8 field `blocks` is D / block blocks of type_size bytes, header bytes
    first, then code_bytes of codes; the kernel's id for the format; lut: 4-bit codes looked up in the
    format's 16 values (`engine_levels`). Values come out in `engine_order`'s channel order."""

    engine: str = "q8_0"
    kernel_id: int = 1
    block: int = 32
    type_size: int = 34
    header: int = 2
    code_bytes: int = 32
    lut: bool = False


# format: (kernel id, block, type_size, header bytes, code bytes, 16-value table or None); the kernel reads
# them at compile time by its id (`engine_format`); tests check them against kvquant.codecs.engine.BLOCK_TYPES
ENGINE_KERNEL_FORMATS: dict[str, tuple] = {
    "q8_0": (1, 32, 34, 2, 32, None),
    "q4_0": (2, 32, 18, 2, 16, None),
    "q4_1": (3, 32, 20, 4, 16, None),
    "q5_0": (4, 32, 22, 6, 16, None),
    "q5_1": (5, 32, 24, 8, 16, None),
    "iq4_nl": (6, 32, 18, 2, 16, IQ4_NL_VALUES),
    "mxfp4": (7, 32, 17, 1, 16, MXFP4_VALUES),
    "nvfp4": (8, 64, 36, 4, 32, MXFP4_VALUES),
}


# (kernel id, block, type_size, header, code bytes) of each format: plain integers, which Triton can hash as
# a global of the compile-time function below (the table's 16 values are tensors)
_KERNEL_FORMATS = tuple(tuple(f[:5]) for f in ENGINE_KERNEL_FORMATS.values())


def engine_format(kernel_id: int) -> tuple:
    """(block, type_size, header bytes, code bytes) of the format the kernel knows by `kernel_id`
    (`kernels.engine_blocks.engine_body` calls this at compile time: no method calls in it, which
    Triton's dependency walk refuses)."""
    for f in _KERNEL_FORMATS:
        if f[0] == kernel_id:
            return f[1:]
    raise ValueError(f"no GGUF kernel format has id {kernel_id}")


def engine_layout(codec: EngineCodec) -> EngineKernelLayout:
    key = codec.block_type.name.lower()
    kid, block, size, header, nq, table = ENGINE_KERNEL_FORMATS[key]
    return EngineKernelLayout(bits=8 if nq == block else 4, symmetric=True, channel_extent=block, engine=key,
                              kernel_id=kid, block=block, type_size=size, header=header, code_bytes=nq,
                              lut=table is not None)


def engine_parts(kernel_id: int, nb: int, type_size: int, code_bytes: int, block: int) -> tuple:
    """How the decode kernel reads a row of nb GGUF blocks (`kernels.engine_blocks.engine_body`, which calls
    this at compile time, and `engine_order`): (a, ng, wg, runs). a: the unit of reads, 8 bytes where rows
    and codes are whole 8-byte words (32-blocks), else 4; ng groups of blocks x wg groups of each block's
    code words make the row's parts (q8_0, iq4_nl, mxfp4: 4 groups of words, 2 where 4 would split a unit;
    nvfp4: a block a part, up to 4; q4_x, q5_x: 2 x 2); runs: the parts are joined as runs of channels
    (kernel channel C s + c is channel c of part s, C = D / parts), else interleaved (P c + s)."""
    a = 8 if (nb * type_size) % 8 == 0 and code_bytes % 8 == 0 and block == 32 else 4
    words = kernel_id in (1, 6, 7)  # parts of words
    ng = 1 if words else min(4 if kernel_id == 8 else 2, nb)
    wg0 = 4 if words else 1 if kernel_id == 8 else 2
    nqw = code_bytes // 4
    wg = wg0 if nqw // wg0 * 4 >= a else nqw * 4 // a  # a part's words: whole units
    return a, ng, wg, kernel_id == 1 or kernel_id >= 6


def engine_order(lay: EngineKernelLayout, d: int) -> list[int]:
    """The element (0..D-1, in the frame the blocks store) that each channel of the kernel decodes.
    Within block b, kernel channel p: its code bytes rotated by r = (b * type_size + header) % a, a = 8 where
    rows and codes are whole 8-byte words (32-blocks), else 4 (kernel byte j = code byte (j - r) mod
    code_bytes; the kernel reads an unaligned block from the unit before its codes), then in the word
    helpers' order: 8-bit, one byte per element; 4-bit, byte j's low nibble then its high nibble, which
    ggml's 32-blocks give elements j and j + 16 and nvfp4's 16-sub-blocks (8 bytes each) elements j and j + 8.
    The kernel reads a row in parts (`engine_parts`: ng groups of blocks x wg groups of each block's words)
    and joins them: part s's channel c is kernel channel s * D / parts + c (q8_0, iq4_nl, mxfp4, nvfp4) or
    c * parts + s (q4_x, q5_x)."""
    nq, nb = lay.code_bytes, d // lay.block
    nqw, vpw = nq // 4, lay.block // (nq // 4)  # code words per block, values per word
    a, ng, wg, cat = engine_parts(lay.kernel_id, nb, lay.type_size, nq, lay.block)
    parts, nbp, kw = ng * wg, nb // ng, nqw // wg
    out = []
    for ch in range(d):
        s, c = divmod(ch, d // parts) if cat else (ch % parts, ch // parts)  # part s, its channel c
        b = s // wg * nbp + c // (kw * vpw)
        p = s % wg * kw * vpw + c % (kw * vpw)  # the kernel channel within block b
        r = (b * lay.type_size + lay.header) % a
        if nq == lay.block:  # a byte per element
            e = (p - r) % nq
        else:
            cb = (p // 2 - r) % nq
            e = 16 * (cb // 8) + cb % 8 + 8 * (p % 2) if lay.block == 64 else cb + 16 * (p % 2)
        out.append(b * lay.block + e)
    return out


def _vllm_layout(codec: VLLMCodec) -> KernelLayout | None:
    """vLLM's per-(token, head) formats, and the per-tensor FP8 ones at the default scale 1.0 (a bound
    k_scale / v_scale other than 1 takes the reference path)."""
    fmt, d = codec.format, codec.head_dim
    if fmt.per_token_head and fmt.fp8 is None:
        return SignedInt8KernelLayout(bits=8, symmetric=True, channel_extent=d)
    kind = "e4m3" if fmt.fp8 == torch.float8_e4m3fn else "e5m2"
    if fmt.per_token_head:
        return FP8KernelLayout(bits=8, symmetric=True, channel_extent=d, fp8=kind)
    if codec.scale == 1.0:
        return FP8KernelLayout(bits=8, symmetric=True, channel_extent=d, fp8=kind, unit_scale=True)
    return None


@dataclass(frozen=True)
class SlotKernelLayout(KernelLayout):
    """One half of vLLM's TurboQuant slot (`kvquant.codecs.engine_vllm.TurboQuantCodec`) as the decode kernel
    reads it: (token, head) rows of row_bytes in the uint8 field `slot`, the packed codes first (`bits` per
    value, kvquant's packing), then fp16 stats. kind "mse": 3 / 4-bit keys, Lloyd-Max centroids
    (`slot_levels`) times the fp16 norm, the centroid vector renormalized first when norm_correction (the
    _nc presets), in the frame of the layer's rotation; "fp8": k8v4's E4M3 keys, no scale; "affine": values,
    code * fp16 scale + fp16 zero."""

    kind: str = "affine"
    row_bytes: int = 0
    code_bytes: int = 0
    norm_correction: bool = False


def _slot_layout(codec: TurboQuantCodec) -> SlotKernelLayout:
    p, d = codec.preset, codec.head_dim
    if codec.role == "k":
        kind = "fp8" if p.key_bits == 8 else "mse"
        bits, row = p.key_bits, p.key_bytes(d)
    else:
        kind, bits, row = "affine", p.value_bits, p.value_bytes(d)
    return SlotKernelLayout(bits=bits, symmetric=kind != "affine", channel_extent=d, kind=kind, row_bytes=row,
                            code_bytes=-(-d * bits // 8), norm_correction=kind == "mse" and p.norm_correction)


@dataclass(frozen=True)
class DecodeParts:
    """A codec as the decode kernel serves it: the base codec whose codes it dequantizes, plus the
    transforms around it that it undoes in place (decode order: outliers written, then the offset added).

    center: tokens per stored offset row (`-centerN`; 0 = none): x += offset[row // N] per (head, channel).
    outliers: values kept exact per (token, head) (`-outP`'s k; 0 = none): x[index[j]] = value[j]."""

    base: object
    center: int = 0
    outliers: int = 0
    rope: object | None = None  # -prerope: the model's `kvquant.rope.Rope`, applied after decoding


def decode_parts(codec) -> DecodeParts:
    """Peel `-center` (outermost) and `-outP` off a codec, in the grammar's order; what is left is the base.
    A `-rot` between them stops the peeling (its frame would need the offset rotated): that base has no
    layout, so the codec takes the reference path."""
    center = outliers = 0
    c, rope = codec, None
    if isinstance(c, PreRopeCodec):  # outermost: RoPE at each key's position, after everything else
        c, rope = c.inner, c.rope
    if isinstance(c, CenterCodec):
        center, c = c.n, c.inner
    if isinstance(c, OutlierCodec):
        outliers, c = c.k, c.inner
    return DecodeParts(c, center, outliers, rope)


def decode_layout(codec) -> KernelLayout | None:
    """How the decode kernel reads `codec`'s fields as stored, or None when it does not (for `-center` and
    `-outP` around a kernel codec: the base codec's layout; `decode_parts` says what is around it)."""
    parts = decode_parts(codec)
    if parts.base is not codec:
        return decode_layout(parts.base)
    lay = codec.kernel_layout()
    if lay is not None:
        return lay
    if isinstance(codec, EngineCodec):
        return engine_layout(codec)
    if isinstance(codec, VLLMCodec):
        return _vllm_layout(codec)
    if isinstance(codec, TurboQuantCodec):
        return _slot_layout(codec)
    if isinstance(codec, CodebookCodec) and codec.levels is not None:
        e = codec.extent
        return CodebookKernelLayout(
            bits=codec.spec.bits, symmetric=codec.spec.symmetric, token_extent=e.tokens,
            channel_extent=e.channels, shared_heads=e.heads == codec.heads and codec.heads > 1,
        )
    return None


def decode_frame(codec, device, registry=None) -> KernelFrame | None:
    """The codec the decode kernel reads and the transform of its frame (`KernelFrame`), or None (reference).
    `kvquant.codecs.transforms.kernel_frame` for the codecs with a kernel layout, plus codebook, GGUF block
    (llama.cpp's rotation when the codec has it, and the kernel's channel order) and vLLM codecs, and `-rot`
    / `-crot` around one of these (served in the rotated frame). registry: where the device copies of an
    order are kept (the cache's `KernelRegistry`), so a decode step makes none."""
    if isinstance(codec, PreRopeCodec):  # RoPE pairs the model's channels: the inner frame must be theirs
        inner = decode_frame(codec.inner, device, registry) if codec.rope is not None else None
        return KernelFrame(codec) if inner is not None and inner.identity else None
    frame = kernel_frame(codec, device)
    if frame is not None:
        return frame
    lay = decode_layout(codec)
    if isinstance(lay, EngineKernelLayout):
        order = _device_constant(registry, ("engine_order", lay.engine, codec.head_dim), device,
                                 lambda: torch.tensor(engine_order(lay, codec.head_dim), dtype=torch.long))
        return KernelFrame(codec, hadamard=codec.rotation or 0, order=order)
    if isinstance(lay, SlotKernelLayout) and lay.kind == "mse":  # keys stored in the layer's rotated frame
        signs = _device_constant(registry, ("tq_signs", codec.head_dim, codec.layer), device,
                                 lambda: tq_signs(codec.head_dim, codec.layer).clone())
        return KernelFrame(codec, signs=signs)
    if lay is not None:
        return KernelFrame(codec)
    if isinstance(codec, RotationCodec) and decode_layout(codec.inner) is not None:
        return codec.read_frame(device)
    if isinstance(codec, CalibRotationCodec) and codec.matrix is not None:
        inner = decode_frame(codec.inner, device, registry)
        if inner is not None and inner.identity:
            return KernelFrame(inner.codec, matrix=codec.matrix_on(device))
    return None


def _device_constant(registry, key: tuple, device, make):
    """A small constant tensor on `device`, made once per registry (`KernelRegistry.constants`)."""
    store = getattr(registry, "constants", None)
    key = (*key, str(device))
    if store is not None and key in store:
        return store[key][1]
    t = make().to(device)
    if store is not None:
        store[key] = (None, t)
    return t


def device_levels(codec, device, registry=None, dtype=None):
    """The kernel's table of `codec`'s levels on `device` for attention in `dtype`
    (`kvquant.kernels.codebook.table_for`), made once per (codec, device, dtype): kept on the registry (one
    per cache) when it can hold them, so a decode step never copies from the host."""
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


def engine_levels(lay: EngineKernelLayout, device, registry=None, dtype=None):
    """The kernel's table of a GGUF format's 16 values (`kvquant.kernels.codebook.table_for`: fp16 bits, or
    fp32 for fp32 attention), made once per registry, device and dtype."""
    from .codebook import table_for

    dtype = dtype or torch.float16
    values = ENGINE_KERNEL_FORMATS[lay.engine][5]
    return _device_constant(registry, ("engine_levels", lay.engine, dtype), device,
                            lambda: table_for(torch.tensor(values, dtype=torch.float32), dtype, "cpu"))


def slot_levels(codec: TurboQuantCodec, device, registry=None, dtype=None):
    """The kernel's table of a TurboQuant key's Lloyd-Max centroids for N(0, 1/D) (`tq_centroids`, fp32
    values; fp16 bits for fp16 / bf16 attention), made once per registry, device and dtype."""
    from .codebook import table_for

    dtype = dtype or torch.float16
    d, bits = codec.head_dim, codec.preset.key_bits
    return _device_constant(registry, ("tq_levels", d, bits, dtype), device,
                            lambda: table_for(torch.tensor(tq_centroids(d, bits), dtype=torch.float32), dtype,
                                              "cpu"))


def rope_table(rope, n: int, device, registry=None, dtype=torch.float32) -> torch.Tensor:
    """(P, D) on `device`: cos then sin of `rope`'s D / 2 frequencies at positions 0 .. P - 1, P >= n (a
    power of two, at least 4096), computed by `Rope.cos_sin` on the device in fp32, so the values are those
    the reference path multiplies by; in `dtype` (fp32; fp16 for bf16 attention, whose keys round to bf16,
    8 times coarser, and whose kernel would spill holding fp32 tables); kept on the registry and remade
    larger only when a position passes P."""
    store = getattr(registry, "constants", None)
    key = ("rope", id(rope), str(device), dtype)
    held = store.get(key) if store is not None else None
    if held is not None and held[0] is rope and held[1].shape[0] >= n:
        return held[1]
    cap = max(4096, 1 << max(n - 1, 1).bit_length())
    cos, sin = rope.cos_sin(0, cap, torch.float32, device)  # (P, D), halves equal
    half = cos.shape[1] // 2
    table = torch.cat((cos[:, :half], sin[:, :half]), dim=1).to(dtype).contiguous()
    if store is not None:
        store[key] = (rope, table)
    return table


def describe_unserved(codec, device) -> str | None:
    """This module's view of a codec: the log line when the decode kernel does not read it, or reads it but
    the affine append kernel does not pack it; None when both do. The quantize+pack kernels
    (`kvquant.kernels.pack_layouts`) pack more (codebooks, FP8, GGUF blocks):
    `kvquant.backend.kernel_fallback` combines both views into the line the cache logs."""
    frame = decode_frame(codec, device)
    if frame is None:
        return (f"{codec.spec}: no Triton kernel reads this codec yet; the PyTorch reference path serves its "
                "attention and appends")
    if kernel_frame(codec, device) is None:  # read by the kernel, but not packed by one
        return (f"{codec.spec}: decode attention runs in the Triton kernel; appends take the codec's PyTorch "
                "encoder (no quantize+pack kernel for it yet; the same bits)")
    return None
