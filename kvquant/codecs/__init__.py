"""Codecs: how one of K or V is turned into stored page fields and back (the `Codec` seam).

    base          Codec, Field, AffineCodec (INT8/4/2), CodebookCodec (nuqN), codec_for (spec -> codec)
    fp8           FP8 E4M3 / E5M2 codes with absmax scales
    transforms    -center, -rot (Hadamard), -out wrappers around a base codec
    calibrot      -crot: the calibrated orthogonal rotation, fitted per layer
    turbo         TurboQuant (rotation + Lloyd-Max levels + stored norm)
    engine        llama.cpp block formats, MXFP4, NVFP4, bit-exact with ggml
    engine_vllm   vLLM's --kv-cache-dtype formats and TurboQuant presets
    quantize      fake quantization and QTensor (whole tensors, no pages)
    packing       bit packing of codes into bytes

Nothing is imported here, so `import kvquant.codecs` stays light; import the module you need.
"""
