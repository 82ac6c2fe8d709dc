"""Kernel checks for tests and benchmarks: random decode queries and the decode kernel against its `_ref`
twin within the flash-attention bound, over the stand-in paged layers of `kvquant.kernels.paged` (whose
names this module re-exports: tests build layers from here); appends through the pack kernels against
theirs, bit for bit (`check_pack`)."""

from __future__ import annotations

import torch

from .paged import PagedLayer, Region, demo_levels, make_paged_layer, with_demo_levels
from .registry import KernelRegistry, SelfCheck

__all__ = ["DECODE_ATOL", "CountingRegistry", "PagedLayer", "Region", "check_decode", "check_pack",
           "demo_calibration", "demo_levels", "make_paged_layer", "random_query", "with_demo_levels"]

# tolerance added to the flash-attention bound |out - ref32| <= 2 |ref_same_dtype - ref32| + atol
DECODE_ATOL = {torch.float16: 2e-4, torch.bfloat16: 2e-3, torch.float32: 2e-5}


def random_query(layer: PagedLayer, gqa: int, dtype, device, seed: int = 7) -> torch.Tensor:
    """(B, H_kv * gqa, 1, D) decode queries for a paged test layer."""
    b, h_kv, _, d = layer.shape
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h_kv * gqa, 1, d, generator=g).to(dtype).to(device)


def check_decode(layer: PagedLayer, q: torch.Tensor, dtype, **kw) -> None:
    """The decode kernel over `layer` against its `_ref` twin, within the flash-attention bound."""
    from .decode_attention import decode_attention, decode_attention_ref

    args = layer.decode_args()
    out = decode_attention(q, *args, **kw)
    kw.pop("num_splits", None)
    kw.pop("block_t", None)
    ref32 = decode_attention_ref(q, *args, upcast=True, **kw)
    ref = decode_attention_ref(q, *args, **kw)
    assert out is not None and out.shape == ref32.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref32).abs().max().item()
    bound = 2 * (ref.float() - ref32).abs().max().item() + DECODE_ATOL[dtype]
    assert err <= bound, f"error {err:.3g} > bound {bound:.3g}"


class CountingRegistry(KernelRegistry):
    """A `KernelRegistry` that counts the launches it made, by kernel name (`launches`); no first-use
    self-check unless given one."""

    def __init__(self, name: str = "test", self_check: SelfCheck | None = None):
        super().__init__(name, self_check or SelfCheck(enabled=False))
        self.launches: dict[str, int] = {}

    def launch(self, kernel, grid, args: tuple, kwargs: dict, variant) -> bool:
        ok = super().launch(kernel, grid, args, kwargs, variant)
        if ok:
            name = getattr(getattr(kernel, "fn", None), "__name__", str(kernel))
            self.launches[name] = self.launches.get(name, 0) + 1
        return ok


def check_pack(codec, x: torch.Tensor, start: int, block_size: int, device, seed: int = 0) -> str:
    """Append x (B, H, t, D) to pages at region token `start` (mid-page when it is not a multiple of
    block_size) through a shuffled page table, by the pack kernel (`kvquant.kernels.dispatch`'s entry, so
    `-rot` is rotated first) and by its twin (`codec.encode` + index writes, on the same device: the
    encoder's torch steps are the device's), into equal pools of random contents: every pool equal bit for
    bit (NaN equals NaN in float fields), and written by the kernel, not the reference. Returns the name of
    the kernel that served."""
    from .dispatch import quantize_pack_into
    from .quantize_pack import pool_differences, quantize_pack_into_ref, random_pools

    b, t = x.shape[0], x.shape[2]
    gen = torch.Generator().manual_seed(seed)
    n = -(-(start + t) // block_size)
    table = torch.randperm(b * n + 2, generator=gen)[: b * n].view(b, n)  # two spare pages: never written
    pools = random_pools(codec, b * n + 2, block_size, gen)
    got = {k: p.clone().to(device) for k, p in pools.items()}  # copies, even on the CPU
    want = {k: p.clone().to(device) for k, p in pools.items()}
    x, table = x.to(device), table.to(device)
    registry = CountingRegistry()
    quantize_pack_into(x, codec, got, table, start, registry=registry)
    quantize_pack_into_ref(x, codec, want, table, start)  # on the device: torch's mean, topk, matmul there
    assert len(registry.launches) == 1, f"{codec.spec}: launched {registry.launches}, not one pack kernel"
    problems = pool_differences(got, want)
    assert not problems, f"{codec.spec}: " + "; ".join(problems)
    return next(iter(registry.launches))


def demo_calibration(path, scheme: str, config) -> str:
    """Write a calibration file at `path` with stand-in levels (`demo_levels`, a different scale per table)
    for every codebook `scheme` needs on a model of `config`, as `experiments/calibrate.py` writes one;
    returns the path as a string (for `calib=`)."""
    from kvquant.calibration import entries_for, metadata, save_calibration
    from kvquant.memory import KVShape
    from kvquant.scheme import parse_scheme

    shape = KVShape.from_config(config)
    entries = entries_for(parse_scheme(f"{scheme},calib={path}"), shape.num_layers)
    tables = {e.name: demo_levels(e.spec.bits) * (0.9 + 0.05 * i) for i, e in enumerate(entries)}
    save_calibration(path, tables, metadata("tiny", shape, [scheme], entries))
    return str(path)
