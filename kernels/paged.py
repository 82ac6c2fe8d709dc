"""Stand-in paged layers for kernel tests, benchmarks, the compiled report and the kernels' first-use
self-check (no store, no cache needed). `kvquant.kernels.testing` adds the checks against the `_ref` twins.

`make_paged_layer` builds what `kvquant.cache.LayerView` exposes (block_size, fp_k, fp_v, sink, body,
recent, key_codec, value_codec, key_pages, value_pages, shape) from random K/V: pools with spare pages of
random garbage (a wrong address reads garbage, not zeros), page ids in a shuffled order, optionally pages
shared between sequences 0 and 1, and a recent region that starts mid-page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant.codecs.base import Codec, codec_for

from .quantize_pack import write_fields

__all__ = ["Region", "PagedLayer", "make_paged_layer", "demo_levels", "with_demo_levels"]


@dataclass
class Region:
    """Tokens of a layer part: table (B, n_pages) int64 page ids in position order, offset (slot of the
    first token in the first page), length (tokens, the same for every sequence), start (the position of
    its first token, as `kvquant.paging.Region`'s)."""

    table: torch.Tensor
    offset: int
    length: int
    start: int = 0


@dataclass
class PagedLayer:
    """The attributes of kvquant.cache.LayerView that the kernels read."""

    block_size: int
    fp_k: torch.Tensor  # (P_fp, H_kv, FBS, D): FP pages may hold fewer tokens than body pages
    fp_v: torch.Tensor
    sink: Region
    body: Region
    recent: Region
    key_codec: Codec
    value_codec: Codec
    key_pages: dict[str, torch.Tensor]  # field -> (P_b, heads_f, BS // tokens_f, cols_f)
    value_pages: dict[str, torch.Tensor]
    shape: tuple[int, int, int, int]  # (B, H_kv, T, D)

    def decode_args(self) -> tuple:
        """Positional arguments of decode_attention after the query."""
        return (self.fp_k, self.fp_v, self.key_pages, self.value_pages, self.key_codec, self.value_codec,
                self.sink, self.body, self.recent)


def _tables(b: int, n_pages: int, ids: list[int], share: bool) -> torch.Tensor:
    """(B, n_pages) ids drawn in order from ids (already shuffled); sequence 1 reuses sequence 0's first
    page when share (a shared prefix page)."""
    t = torch.tensor(ids[: b * n_pages], dtype=torch.int64).view(b, n_pages)
    if share and b > 1 and n_pages > 0:
        t[1, 0] = t[0, 0]
    return t


def demo_levels(bits: int) -> torch.Tensor:
    """(2^bits,) ascending float32 levels in [-1, 1], denser near 0 (as fitted codebooks are), uneven on
    purpose (a wrong code reads a wrong value): stand-in codebooks for tests and reports."""
    u = torch.linspace(-1, 1, 1 << bits, dtype=torch.float64)
    return (u * (0.35 + 0.65 * u.abs()) + 0.04 * (1 - u * u)).float()  # the bump breaks the symmetry


def with_demo_levels(codec: Codec) -> Codec:
    """codec, with `demo_levels` given to every codebook inside it (wrappers included) that has none."""
    c = codec
    while c is not None:
        if getattr(c, "levels", 0) is None and hasattr(c, "set_levels"):
            c.set_levels(demo_levels(c.spec.bits))
        c = getattr(c, "inner", None)
    return codec


def _garbage_pool(shape, dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return (torch.rand(shape, generator=g) * 4 + 0.5).to(dtype)  # positive (a valid scale), never tiny


def make_paged_layer(
    *, b: int = 2, h_kv: int = 2, d: int = 64, sink: int = 2, body: int = 40, recent: int = 5,
    k: str | Codec = "int4-g32", v: str | Codec = "int4-g32", dtype: torch.dtype = torch.float16,
    device="cpu",
    block_size: int = 16, recent_offset: int = 0, shuffle: bool = True, share: bool = False, seed: int = 0,
    spare: int = 3, fp_block_size: int | None = None,
) -> PagedLayer:
    """A random paged layer. body must be a multiple of both codecs' token groups. k, v: scheme texts,
    or codecs already built (the self-check's probes pass a variant's own; dtype is then the FP pools').
    A codebook spec given as text gets `demo_levels`. fp_block_size: tokens per FP (sink and recent) page,
    default block_size (the cache's FP pages may be smaller than its body pages)."""
    g = torch.Generator().manual_seed(seed)
    kc = k if isinstance(k, Codec) else with_demo_levels(codec_for(k, h_kv, d, dtype))
    vc = v if isinstance(v, Codec) else with_demo_levels(codec_for(v, h_kv, d, dtype))
    bs, fbs = block_size, fp_block_size or block_size
    cdiv = lambda a, n: -(-a // n)
    n_sink, n_body, n_rec = cdiv(sink, fbs), cdiv(body, bs), cdiv(recent_offset + recent, fbs)
    fp_ids = list(range(b * (n_sink + n_rec) + spare))
    body_ids = list(range(b * n_body + spare))
    if shuffle:
        fp_ids = [fp_ids[i] for i in torch.randperm(len(fp_ids), generator=g)]
        body_ids = [body_ids[i] for i in torch.randperm(len(body_ids), generator=g)]
    sink_t = _tables(b, n_sink, fp_ids, share)
    rec_t = _tables(b, n_rec, fp_ids[b * n_sink:], False)
    body_t = _tables(b, n_body, body_ids, share)

    fp_shape = (len(fp_ids), h_kv, fbs, d)
    fp_k, fp_v = _garbage_pool(fp_shape, dtype, g), _garbage_pool(fp_shape, dtype, g)
    rand = lambda n: torch.randn(b, h_kv, n, d, generator=g).to(dtype)
    fp_codec = codec_for("fp16", h_kv, d, dtype)
    for region_t, n, off in ((sink_t, sink, 0), (rec_t, recent, recent_offset)):
        for pool in (fp_k, fp_v):
            if n:
                write_fields({"values": pool}, {"values": rand(n)}, fp_codec, region_t, off)

    pages = []
    for codec, scale in ((kc, 1.5), (vc, 1.0)):
        pools = {name: _garbage_pool((len(body_ids), f.heads, bs // f.tokens, f.cols), f.dtype, g)
                 for name, f in codec.fields().items()}
        if body:
            # encode_at: a position-dependent codec (-prerope keys) encodes the body at positions sink..
            write_fields(pools, codec.encode_at(rand(body) * scale, sink), codec, body_t, 0)
        pages.append({k_: p.to(device) for k_, p in pools.items()})
    dev = lambda t: t.to(device)
    return PagedLayer(
        block_size=bs, fp_k=dev(fp_k), fp_v=dev(fp_v),
        sink=Region(dev(sink_t), 0, sink), body=Region(dev(body_t), 0, body, sink),
        recent=Region(dev(rec_t), recent_offset, recent, sink + body),
        key_codec=kc, value_codec=vc, key_pages=pages[0], value_pages=pages[1],
        shape=(b, h_kv, sink + body + recent, d),
    )
