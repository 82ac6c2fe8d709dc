"""Codecs: how one of K or V is turned into stored page fields and back (the `Codec` seam).

    base          Codec, Field, DenseCodec (fp16), CodebookCodec (nuqN), PreRopeCodec, the registry, codec_for
    quantize      the uniform INT8/4/2 arithmetic (quantize, dequantize, QTensor), AffineCodec, fake_quantize
    fp8           FP8 E4M3 / E5M2 codes with absmax scales
    transforms    -center, -rot (Hadamard), -out wrappers around a base codec
    calibrot      -crot: the calibrated orthogonal rotation, fitted per layer
    turbo         TurboQuant (rotation + Lloyd-Max levels + stored norm)
    ropeblocks    rbqB-lfPbH: RoPE frequency blocks of the head dim at different bits (Block-GTQ style)
    engine        llama.cpp block formats, MXFP4, NVFP4, bit-exact with ggml
    engine_vllm   vLLM's --kv-cache-dtype formats and TurboQuant presets
    packing       bit packing of codes into bytes

Each family module registers its codec against its family config type (`kvquant.spec_types`) with one line,
`@register(FP8)` above `class FP8Codec`; `codec_for` dispatches on the spec's typed parts. The imports below
are that registry: importing any kvquant.codecs module runs them first, so every family is registered before
`codec_for` is called, and `base` never imports a family module (no import circle). A new family is its
module plus its line here.
"""

# the registry: base (fp16, nuqN), quantize (intN) and each family module register their codecs on import
from . import base, calibrot, engine, engine_vllm, fp8, quantize, ropeblocks, transforms, turbo  # noqa: F401
