"""Shared checks of the kernel suites (tests/kernels/test_*_kernel.py): `generate` end to end with the Triton
kernels forced on (the interpreter on the CPU) against the PyTorch backend, and a deliberately wrong
split kernel for the first-use self-check. Imported as `from kernel_e2e import ...` (tests/ is on
sys.path)."""

from __future__ import annotations

import logging

import torch
from tiny_models import make_tiny_model

import kvquant

__all__ = ["FlippedTable", "check_matches_torch", "generate_both"]


class FlippedTable:
    """A wrong split kernel: the real one (`kvquant.kernels.decode_attention._paged_split_kernel`), handed
    the argument `name` (a table of levels) in reverse order; monkeypatched in, for the self-check to
    catch."""

    def __init__(self, kernel, name: str = "kl_ptr"):
        self.kernel, self.index, self.fn = kernel, kernel.arg_names.index(name), kernel.fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            args = list(args)
            args[self.index] = args[self.index].flip(0)
            self.kernel[grid](*args, **kwargs)
        return launch


def generate_both(scheme: str, monkeypatch, caplog, *, layers: int = 2, new_tokens: int = 5):
    """(ref, got, served): greedy `generate` of 2 x 21 prompt tokens on the tiny Llama (seed 3) with
    `backend="torch"` and `backend="triton"` (logits kept), and for each `kvquant.kernels.dispatch.
    fused_attention` call of the triton run whether the kernel served it (None: the reference path). The
    triton run's log (INFO, logger kvquant) is in caplog."""
    from kvquant.kernels import dispatch

    model = make_tiny_model(seed=3, num_hidden_layers=layers)
    ids = torch.randint(1, 5000, (2, 21), generator=torch.Generator().manual_seed(0))

    def run(backend):
        cache = kvquant.QuantizedCache(scheme, model.config, backend=backend)
        with torch.no_grad():
            return model.generate(ids, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, output_logits=True, return_dict_in_generate=True)

    ref = run("torch")
    served = []
    attend = dispatch.fused_attention

    def spy(*args, **kwargs):
        out = attend(*args, **kwargs)
        served.append(out is not None)
        return out

    monkeypatch.setattr(dispatch, "fused_attention", spy)
    with caplog.at_level(logging.INFO, logger="kvquant"):
        got = run("triton")
    return ref, got, served


def check_matches_torch(ref, got, served: list[bool], kernel_steps: int, caplog, fallback: str | None = None):
    """Tokens equal, logits within 1e-4 of the torch backend, `kernel_steps` decode steps served by the kernel
    (every decode step of every layer it serves); no codec logged as unread, or `fallback` named in the
    log when a layer falls back."""
    assert torch.equal(got.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), rtol=0, atol=1e-4)
    assert served.count(True) == kernel_steps
    messages = [r.getMessage() for r in caplog.records]
    if fallback is None:
        assert not [m for m in messages if "no Triton kernel reads" in m]
    else:
        assert any(fallback in m for m in messages)
