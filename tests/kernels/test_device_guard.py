"""Kernel launches make their tensors' CUDA device current (`kvquant.kernels.registry.device_guard`):
Triton launches on the current device, so in a model split across GPUs a layer on cuda:1 must launch with
cuda:1 current. No GPU here: the guard's choice is checked by type, and the launch path with a recording
stand-in (tensors on the CPU and on `meta` play two devices)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from kvquant.kernels import registry as reg
from tiny_models import make_tiny_model

import kvquant


def test_the_guard_is_cuda_device_for_a_cuda_tensor_and_nothing_elsewhere():
    guard = reg.device_guard(torch.device("cuda", 1))  # made, not entered: needs no CUDA
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    for device in (torch.device("cpu"), torch.device("meta"), None):
        assert isinstance(reg.device_guard(device), contextlib.nullcontext)
    assert reg.launch_device((3, torch.empty(2, device="meta"), torch.empty(1))) == torch.device("meta")
    assert reg.launch_device((3, 4.0)) is None


class _Guards:
    """A stand-in device_guard that records the device of each launch and whether the kernel ran inside."""

    def __init__(self):
        self.entered: list[torch.device | None] = []
        self.inside = False

    def __call__(self, device):
        @contextlib.contextmanager
        def guard():
            self.entered.append(device)
            self.inside = True
            try:
                yield
            finally:
                self.inside = False

        return guard()


def test_launch_runs_the_kernel_inside_the_guard_of_its_tensors_device(monkeypatch):
    guards = _Guards()
    monkeypatch.setattr(reg, "device_guard", guards)
    ran = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: ran.append((args[0].device, guards.inside))

    r = reg.KernelRegistry("test")
    for device in ("cpu", "meta", "cpu"):  # layers on two devices, in the order a forward reaches them
        assert r.launch(Kernel(), (1,), (torch.empty(4, device=device), 7), {}, ("v",))
    devices = [torch.device(d) for d in ("cpu", "meta", "cpu")]
    assert guards.entered == devices and ran == [(d, True) for d in devices]


@pytest.mark.parametrize("scheme", ["int4-g32,window=4"])
def test_every_kernel_launch_of_a_cache_enters_its_layers_device(monkeypatch, scheme):
    """Through the cache (backend triton, interpreted): every launch of a short generation, appends and
    decode attention alike, goes through the guard with the device of its layer's pages."""
    guards = _Guards()
    monkeypatch.setattr(reg, "device_guard", guards)
    model = make_tiny_model(seed=3, num_hidden_layers=2)
    ids = torch.randint(1, 5000, (1, 9), generator=torch.Generator().manual_seed(0))
    cache = kvquant.QuantizedCache(scheme, model.config, backend="triton")
    with torch.no_grad():
        model.generate(ids, cache=cache, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    pages = {layer.body_pool.tensors["k.codes"].device for layer in cache.layers}
    assert guards.entered and set(guards.entered) == pages == {torch.device("cpu")}
