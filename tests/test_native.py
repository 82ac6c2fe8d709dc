"""The fused affine page reads (kvquant.native, C++) against their PyTorch twin (AffineCodec's folded
score_pages / value_pages) and against plain decode-then-matmul, on pools with pages out of order, a region
that starts mid-page, batches and GQA query groups; and the reference attention with either path.

setup.sh builds the library (python -m kvquant.native build); the fixture builds it when it is absent, so
these tests run wherever a C++ compiler is (they fail, not skip, where the build fails)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvquant import native
from kvquant.codecs.base import Codec, PageRead, codec_for
from kvquant.paging import Region

# fp32, |scores| up to ~40 here: the native sum runs channel by channel, the twin by matmul, and both
# reassociate dequantize's A c + Z (cancellation for symmetric codes): 2e-4 absolute plus 1e-5 relative.
ATOL, RTOL = 2e-4, 1e-5


@pytest.fixture(scope="module")
def ops():
    native.build()
    native.ops.cache_clear()
    got = native.ops()
    assert got is not None, "kvquant.native built but did not load"
    return got


def _pool(spec: str, heads: int = 3, d: int = 64, pages: int = 11, bs: int = 16, seed: int = 0):
    """A codec and its pool tensors {name: (P, heads_f, rows, cols)} filled by encoding random pages."""
    g = torch.Generator().manual_seed(seed)
    codec = codec_for(spec, heads, d, torch.float32)
    x = torch.randn(1, heads, pages * bs, d, generator=g) * 2 + 0.3
    fields = codec.encode(x)  # {name: (1, heads_f, pages * rows, cols)}
    out = {}
    for name, f in fields.items():
        rows = bs // codec.fields()[name].tokens
        out[name] = f[0].unflatten(1, (pages, rows)).transpose(0, 1).contiguous()  # (P, heads_f, rows, cols)
    return codec, out


SPECS = ["int4-g64", "int4-g32", "int8", "int8-sym", "int4-head", "int2-g16", "int4-g32-sym", "int2-g64-sym",
         "int2-channel-g32", "int4-channel-g16-sym"]  # the last two: statistics per channel over N tokens


@pytest.mark.parametrize("spec", SPECS)
def test_native_equals_twin_and_decode(ops, spec):
    channel = "channel" in spec  # pages of 32 tokens hold whole groups of the channel-wise statistics
    codec, pages = _pool(spec, pages=12, bs=32 if channel else 16)
    table = torch.tensor([[7, 2, 9, 0, 4], [1, 10, 3, 8, 5]])  # out of order, two sequences
    region = Region(table, offset=0 if channel else 5, length=70, start=5)  # ends mid-page
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 64, generator=g)  # (B, H_kv, m, D): 4 query rows per KV head
    nat = codec.score_pages(q, pages, region, PageRead(tokens=32))
    twin = codec.score_pages(q, pages, region, PageRead(tokens=32, native=False))
    plain = Codec.score_pages(codec, q, pages, region, PageRead(tokens=32))
    assert nat.shape == (2, 3, 4, 70)
    torch.testing.assert_close(nat, twin, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(twin, plain, atol=ATOL, rtol=RTOL)
    p = torch.softmax(plain, dim=-1)
    nat_v = codec.value_pages(p, pages, region, PageRead(tokens=32))
    twin_v = codec.value_pages(p, pages, region, PageRead(tokens=32, native=False))
    plain_v = Codec.value_pages(codec, p, pages, region, PageRead(tokens=32))
    assert nat_v.shape == (2, 3, 4, 64)
    torch.testing.assert_close(nat_v, twin_v, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(twin_v, plain_v, atol=ATOL, rtol=RTOL)


def test_native_rejects_bad_tables(ops):
    """The op checks every page id it reads against the pool and the table's width (no stray reads)."""
    codec, pages = _pool("int4-g64")
    q = torch.randn(1, 3, 2, 64)
    a = z = torch.ones(1, 3, 20, 1)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.affine_scores(q, pages["codes"], torch.tensor([[0, 99]]), a, z, 0, 20, 4, 1)
    with pytest.raises(RuntimeError, match="past its block table"):  # 20 tokens need 2 pages of 16
        ops.affine_scores(q, pages["codes"], torch.tensor([[0]]), a, z, 0, 20, 4, 1)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.affine_scores(q.double(), pages["codes"], torch.tensor([[0, 1]]), a, z, 0, 20, 4, 1)


def test_twin_is_not_native_when_disabled(ops, monkeypatch):
    """PageRead(native=False) really takes the PyTorch path: with the ops made to fail, it still works."""
    codec, pages = _pool("int4-g64")
    region = Region(torch.tensor([[3, 1]]), offset=0, length=32)
    q = torch.randn(1, 3, 2, 64)

    class Broken:
        def affine_scores(self, *a):
            raise AssertionError("native op called")

    monkeypatch.setattr(native, "ops", lambda: Broken())
    codec.score_pages(q, pages, region, PageRead(native=False))
    with pytest.raises(AssertionError, match="native op called"):
        codec.score_pages(q, pages, region, PageRead())


@pytest.mark.parametrize("scheme", ["int4-g64", "k=int4-g32-rot,v=int8,sink=4,window=8", "kivi-2"])
def test_reference_attention_native_on_off(ops, scheme, monkeypatch):
    """One decode step over a cache, with the native ops and with KVQUANT_NATIVE=0: equal within ATOL."""
    from tiny_models import make_tiny_config

    import kvquant
    from kvquant.attention import reference_attention

    cfg = make_tiny_config(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           hidden_size=256, max_position_embeddings=4096)
    cache = kvquant.QuantizedCache(scheme, cfg, backend="torch")
    g = torch.Generator().manual_seed(2)
    cache.update(torch.randn(2, 2, 300, 64, generator=g), torch.randn(2, 2, 300, 64, generator=g), 0)
    view, _ = cache.update(torch.randn(2, 2, 1, 64, generator=g), torch.randn(2, 2, 1, 64, generator=g), 0)
    q = torch.randn(2, 4, 1, 64, generator=g)
    with_native = reference_attention(q, view, None, 0.125)
    monkeypatch.setattr(native, "ops", lambda: None)
    without = reference_attention(q, view, None, 0.125)
    exact = reference_attention(q.double(), view, None, 0.125)  # fp64: decode, then attention
    torch.testing.assert_close(with_native, without, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(with_native.double(), exact, atol=ATOL, rtol=RTOL)


def test_native_disabled_by_env(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    native.ops.cache_clear()
    try:
        assert native.ops() is None
    finally:
        monkeypatch.delenv(native.ENV)
        native.ops.cache_clear()


def test_library_key_follows_source(monkeypatch, tmp_path):
    """The built library is keyed by content: another source gives another path."""
    a = native.library_path()
    for i, source in enumerate(native.SOURCES):
        src = tmp_path / source.name
        src.write_text(source.read_text() + "\n// changed\n")
        monkeypatch.setattr(native, "SOURCES", (*native.SOURCES[:i], src, *native.SOURCES[i + 1 :]))
        assert native.library_path() != a
        monkeypatch.undo()
        assert native.library_path() == a


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("shape", "block"), [((2, 9, 37, 64), 64), ((1, 3, 300, 128), 64), ((5, 256), 256),
                                              ((4, 96), 32), ((7, 8), 8)])
def test_native_fwht_gives_the_pytorch_butterflies_bit_for_bit(ops, monkeypatch, shape, block, dtype):
    """The fused FWHT (kvquant/native/fwht.cpp) and the PyTorch butterflies, with and without the signs of a
    rotation, on inputs spanning several binades: the same bits (each butterfly one IEEE add or subtract)."""
    from kvquant.codecs import transforms as tr

    g = torch.Generator().manual_seed(3)
    spread = torch.logspace(-3, 3, shape[-1], dtype=torch.float64)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * spread).to(dtype)
    signs = tr.hadamard_signs(5, shape[-1])

    def three():  # plain, signs in (rotate), signs out (unrotate)
        return [tr._hadamard(x, block, **s) for s in ({}, {"s_in": signs}, {"s_out": signs})]

    got = three()
    rows = x.numel() // shape[-1]
    none = x.new_empty(0)
    assert ops.fwht(x.reshape(rows, shape[-1]), block, none, none).shape == (rows, shape[-1])
    monkeypatch.setenv(native.ENV, "0")
    native.ops.cache_clear()
    try:
        want = three()
    finally:
        monkeypatch.delenv(native.ENV)
        native.ops.cache_clear()
    for a, b in zip(got, want, strict=True):
        assert a.dtype == dtype and a.shape == x.shape
        assert torch.equal(a, b)
    assert torch.allclose(tr.unrotate(tr.rotate(x, signs), signs), x, atol=1e-4 * float(x.abs().max()))


def test_native_fwht_names_a_bad_block(ops):
    with pytest.raises(RuntimeError, match="do not tile"):
        ops.fwht(torch.zeros(2, 96), 64, torch.zeros(0), torch.zeros(0))


def test_pageread_block_size():
    codec, pages = _pool("int4-channel-g16", bs=16)
    assert PageRead().block_size(pages, codec) == 16
    assert dataclasses.replace(PageRead(), tokens=64).tokens == 64
