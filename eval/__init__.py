"""kvquant.eval: perplexity vs length, KL vs the unquantized reference and memory for quantized KV caches.

Import-light on purpose: submodules (`data`, `perplexity`, `runner`, ...) import torch/transformers/datasets
when they are imported, not here.
"""
