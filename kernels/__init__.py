"""Triton kernels for the quantized KV cache; each has a PyTorch `_ref` twin in the same module.

    quantize_pack       quantize + pack new K/V tokens (bit-exact with kvquant.quantize.quantize)
    decode_attention    flash-decoding over sink | packed body | recent, GQA, bool key masks
    dispatch            the entry points the cache and attention call (with fallbacks)

Importing this package imports triton; `import kvquant` never imports it (kvquant loads
`kvquant.kernels.dispatch` lazily, only when a backend selects the kernels). Submodules are not
imported here, so TRITON_INTERPRET can still be set before the first kernel is defined.
"""
