"""Triton kernels for the quantized KV cache; each has a PyTorch `_ref` twin in the same module.

    quantize_pack       quantize + pack new K/V tokens straight into pages (bit-exact with codec.encode)
    decode_attention    paged flash-decoding over sink | packed body | recent, GQA/MQA, bool key masks
    codebook            nuq2/3/4 level lookup inside decode_attention (PRMT tables in registers, compiled)
    layouts             which codecs decode_attention reads and how (no triton import; backend.py asks it)
    dispatch            the entry points the cache and attention call (on the path kvquant.backend chose)
    registry            KernelRegistry: launches variants, remembers the ones that cannot be built
    compiled            compile for sm_90 without a GPU; registers, spills, smem, SASS loop sizes
    testing             stand-in paged layers (the LayerView attributes) for tests and benchmarks

Importing this package imports triton; `import kvquant` never imports it (kvquant loads
`kvquant.kernels.dispatch` lazily, only when a backend selects the kernels). Submodules are not
imported here, so TRITON_INTERPRET can still be set before the first kernel is defined.
"""
