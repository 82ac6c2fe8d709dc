"""Triton kernels for the quantized KV cache; each has a PyTorch `_ref` twin in the same module.

    quantize_pack       quantize + pack new K/V tokens straight into pages (bit-exact with codec.encode):
                        affine, FP8, codebooks, -center / -outP around them
    pack_engine         the same for llama.cpp / GGUF block formats (q8_0 ... iq4_nl, mxfp4, nvfp4)
    pack_layouts        which codecs the pack kernels append (no triton import; backend.py asks it)
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

if __name__ == "kernels":  # this folder imported as the top-level `kernels`, not as kvquant.kernels
    # The repo root is on sys.path (`python -m pytest`, a REPL or `python -c` started there), so this folder
    # shadows the name `kernels`, which belongs to Hugging Face's hub-kernels package: transformers >= 5.25
    # depends on it and imports it by that name when a model module loads. Load the installed package in
    # this module's place (the import statement returns what sys.modules holds once the module has run).
    import sys as _sys
    from importlib.machinery import PathFinder as _PathFinder
    from importlib.util import module_from_spec as _module_from_spec
    from pathlib import Path as _Path

    _root = _Path(__file__).resolve().parents[1]
    _spec = _PathFinder.find_spec(__name__, [p for p in _sys.path if _Path(p or ".").resolve() != _root])
    if _spec is not None and _spec.loader is not None:
        _hub = _module_from_spec(_spec)
        _sys.modules[__name__] = _hub
        _spec.loader.exec_module(_hub)
