"""QuantizedCache on the tiny GQA model: equality with DynamicCache at fp16, chunking, generation, padding,
crop/reset, beam search, sink/window/body accounting, append-only storage, and bytes held == formula."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model
from transformers import DynamicCache

import kvquant
from kvquant import memory
from kvquant.cache import QuantizedLayer
from kvquant.plan import _pages as _plan_pages
from kvquant.scheme import SchemeError

# ---------------------------------------------------------------------------------------- helpers


def _ids(batch: int = 1, length: int = 40, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 5000, (batch, length), generator=g)


@torch.no_grad()
def _run(model, ids, cache, chunks: list[int] | int | None = None, **kwargs) -> torch.Tensor:
    """Feed ids in chunks (sizes, or one size repeated), each attending to the cache of those before;
    the logits of every position, (B, T, V)."""
    t = ids.shape[1]
    if chunks is None:
        chunks = [t]
    elif isinstance(chunks, int):
        chunks = [chunks] * (t // chunks) + ([t % chunks] if t % chunks else [])
    assert sum(chunks) == t
    out, start = [], 0
    for n in chunks:
        out.append(model(ids[:, start : start + n], cache=cache, **kwargs).logits)
        start += n
    return torch.cat(out, dim=1)


def _held_bytes(layer: QuantizedLayer) -> int:
    """Bytes of the pages a layer's tables hold, counted from its state: sink, body and recent pages
    (every sequence its own pages: no sharing in these tests). FP pages hold the requested block size,
    body pages the size raised to the codecs' token groups."""
    if not layer.is_initialized:
        return 0
    bs, fbs = layer.block_size, layer.fp_pool.block_size
    assert fbs == layer.requested_block_size and bs % fbs == 0
    sink_end = layer.sink_len
    body_lo, body_hi = max(layer.dropped - layer.scheme.sink, 0), layer.body_len
    rec_lo = max(layer.scheme.sink + layer.body_len, layer.dropped) - layer.scheme.sink
    rec_hi = layer.length - layer.scheme.sink
    fp = _plan_pages(0, sink_end, fbs) + _plan_pages(rec_lo, rec_hi, fbs)
    body = _plan_pages(body_lo, body_hi, bs)
    return layer.batch_size * (fp * layer.fp_pool.page_bytes + body * layer.body_pool.page_bytes)


def _check_storage(cache) -> None:
    """The store's invariants hold, pools reserve at least what is held, and held == the layer's state."""
    for layer in cache.layers:
        layer.check()
        assert layer.reserved_bytes() >= layer.nbytes() == _held_bytes(layer)


def _stored_parts(layer: QuantizedLayer) -> dict[str, torch.Tensor]:
    """Every tensor a layer keeps outside its window, by name (gathered from its pages)."""
    st = layer.stored()
    parts = dict(sink_k=st.sink_k, sink_v=st.sink_v)
    parts |= {f"k.{n}": t for n, t in st.key_fields.items()}
    parts |= {f"v.{n}": t for n, t in st.value_fields.items()}
    return parts


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


# -------------------------------------------------------------------------------- fp16 == DynamicCache

FP_SCHEMES = ["fp16", "fp16,sink=4,window=8"]


@pytest.mark.parametrize("scheme", FP_SCHEMES)
def test_fp16_equals_dynamic_cache_unchunked(model, scheme):
    ids = _ids(2, 37)
    ref = _run(model, ids, DynamicCache(config=model.config))
    got = _run(model, ids, kvquant.QuantizedCache(scheme, model.config))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunks", [1, 3, 7, [5, 1, 20, 11], [36, 1]], ids=str)
@pytest.mark.parametrize("scheme", FP_SCHEMES)
def test_fp16_equals_dynamic_cache_chunked(model, scheme, chunks):
    ids = _ids(1, 37, seed=1)
    ref = _run(model, ids, DynamicCache(config=model.config), chunks)
    got = _run(model, ids, kvquant.QuantizedCache(scheme, model.config), chunks)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_heads", [1, 3, 6])  # MQA, GQA 2, MHA (the fixture model is GQA 3)
def test_fp16_equals_dynamic_cache_gqa_variants(kv_heads):
    m = make_tiny_model(seed=1, num_key_value_heads=kv_heads, num_hidden_layers=1)
    ids = _ids(2, 20, seed=2)
    for chunks in (None, [12, 1, 7]):
        ref = _run(m, ids, DynamicCache(config=m.config), chunks)
        got = _run(m, ids, kvquant.QuantizedCache("fp16", m.config), chunks)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    c = kvquant.QuantizedCache("int8", m.config)
    _run(m, ids, c)
    assert c.layers[0].stored().key_fields["codes"].shape == (2, kv_heads, 20, 64)


@pytest.mark.parametrize("scheme", ["int8", "int4-g32", "int2-head", "int4-g16-sym-sfp32"])
@pytest.mark.parametrize("chunks", [1, 5, [30, 1, 2, 4]], ids=str)
def test_token_schemes_independent_of_chunking(model, scheme, chunks):
    """With no window and per-token scales, every token is quantized alone on arrival, so feeding the
    text in chunks of any size gives the same logits as one forward."""
    ids = _ids(1, 37, seed=3)
    whole = _run(model, ids, kvquant.QuantizedCache(scheme, model.config))
    chunked = _run(model, ids, kvquant.QuantizedCache(scheme, model.config), chunks)
    # K/V projected in a batch of 37 or of 1 differ in the last bits, which can flip a code at a rounding
    # boundary (seen at int8: 3e-5); the quantization error itself is 1e-2 and up
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=0)
    fp = _run(model, ids, DynamicCache(config=model.config))
    assert (whole - fp).abs().max() > 50 * (chunked - whole).abs().max()


@pytest.fixture(scope="module")
def model64():
    """The tiny model in float64: fp rounding noise (1e-16) then never flips a quantization code, so
    chunked and token-by-token runs can be compared tightly."""
    return make_tiny_model(seed=5).double()


WINDOWED = [
    "k=int4-channel-g8,v=int4-g16,sink=3,window=10",
    "k=int2-channel-g16,v=int2-g16,window=20",  # KIVI-2's shape, scaled to 63 tokens
    "int8,window=6",
    "k=int2-channel-g4,v=fp16,sink=2",
    "int4-g32,sink=5",
    "k=int4-channel-g8-rot,v=int4-g16-rot,sink=3,window=10",  # rotated values: summed in their frame
]


@pytest.mark.parametrize("scheme", WINDOWED)
@pytest.mark.parametrize("chunks", [5, 16, [40, 3, 1, 19], None], ids=str)
def test_chunked_equals_token_by_token(model64, scheme, chunks):
    """Every query of a chunk sees each key as the cache held it when that query would have been decoded
    (FP inside the window, quantized once flushed), so any chunking gives the logits of decoding one
    token at a time: windows, sinks and channel-wise token groups included."""
    ids = _ids(2, 63, seed=11)
    decoded = _run(model64, ids, kvquant.QuantizedCache(scheme, model64.config), 1)
    chunked = _run(model64, ids, kvquant.QuantizedCache(scheme, model64.config), chunks)
    torch.testing.assert_close(chunked, decoded, atol=1e-9, rtol=0)
    fp = _run(model64, ids, DynamicCache(config=model64.config))
    assert (decoded - fp).abs().max() > 1e-4  # the scheme does change the logits


def test_chunk_attends_to_its_own_tokens_unquantized_inside_the_window(model64):
    """A query in a chunk of 60 with window 32 sees its own 32 last tokens in FP, as a decoder would,
    although the cache stores most of the chunk quantized once the forward has run."""
    scheme = "int2-g32,window=32"
    ids = _ids(1, 60, seed=2)
    fp = _run(model64, ids, DynamicCache(config=model64.config))
    cache = kvquant.QuantizedCache(scheme, model64.config)
    got = _run(model64, ids, cache)
    assert cache.layers[0].body_len == 28  # 60 - window: stored quantized after the forward
    torch.testing.assert_close(got[:, :32], fp[:, :32], atol=1e-9, rtol=0)  # positions 0..31: all in window
    assert (got[:, 32:] - fp[:, 32:]).abs().max() > 1e-3  # from 32 on, token 0 is quantized


def test_long_windowed_chunk_reads_a_band_of_copies_and_equals_token_by_token(model64, monkeypatch):
    """A 600-token chunk (three query tiles of 256) of a windowed scheme: each tile reads only the band of
    FP copies its queries saw unquantized (from the first row's quantized end to the last row's own key), not
    every fresh key with a mask, the band in narrow tiles, and still gives the logits of decoding one token
    at a time."""
    import kvquant.attention as attention

    scheme = "k=int4-channel-g16,v=int4-g16,sink=4,window=32"
    ids = _ids(1, 600, seed=13)
    widths, area = [], []
    flash = attention._FLASH_CPU
    heads = model64.config.num_attention_heads  # q: (B, H_kv, g * r, D), a KV head's query heads as rows

    def spy(q, k, v, *args, **kwargs):
        widths.append(k.shape[2])
        area.append(q.shape[1] * q.shape[2] * k.shape[2] // heads)  # (query, key) pairs of one query head
        return flash(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "_FLASH_CPU", spy)
    chunked = _run(model64, ids, kvquant.QuantizedCache(scheme, model64.config))
    monkeypatch.setattr(attention, "_FLASH_CPU", flash)
    decoded = _run(model64, ids, kvquant.QuantizedCache(scheme, model64.config), 1)
    torch.testing.assert_close(chunked, decoded, atol=1e-9, rtol=0)
    # Each query attends to its own key and those before it once: 600 * 601 / 2 (query, key) pairs a layer.
    # Tiles of 256 queries stop at their last row's key; the keys every row of a tile read as stored go in
    # one call; the band along the diagonal (keys some rows read as stored and some from their FP copies)
    # goes in tiles of 64 rows, so the band each reads is about a window plus 64 keys wide. Measured: 1.30x
    # the pairs attended (469,632 pairs read); 256-row tiles reading whole bands, 2.09x (753,280).
    attended = model64.config.num_hidden_layers * 600 * 601 // 2
    assert sum(area) < 1.4 * attended, (sum(area), attended)
    assert max(widths) < 500, sorted(widths)  # no call reads the whole 560-key body


# ---------------------------------------------------------------------------------------- quality vs fp16

@pytest.mark.parametrize(("scheme", "copies"), [("int4-g16", False), ("int4-g16,window=8", True)])
def test_a_chunk_reads_fp_copies_only_where_a_query_saw_its_keys_unquantized(model64, monkeypatch, scheme,
                                                                             copies):
    """A second chunk gets the model's own (explicit) causal mask. Without a window every query saw the keys
    before it quantized, so no FP copy is read and the stored keys go in whole query tiles (the summation
    order of a cache without a window does not depend on the copies); with one, the copies are read."""
    import kvquant.attention as attention

    seen = []

    class Spy(attention._Masks):
        def __init__(self, *args):
            super().__init__(*args)
            seen.append((self.explicit is not None, self.copies_needed))

    monkeypatch.setattr(attention, "_Masks", Spy)
    ids = _ids(1, 80, seed=2)
    chunked = _run(model64, ids, kvquant.QuantizedCache(scheme, model64.config), [40, 40])
    second = seen[len(seen) // 2 :]  # (the first chunk's layers, then the second's)
    assert second and all(explicit for explicit, _ in second), second  # the model passed its mask
    assert {needed for _, needed in second} == {copies}
    monkeypatch.undo()
    decoded = _run(model64, ids, kvquant.QuantizedCache(scheme, model64.config), 1)
    torch.testing.assert_close(chunked, decoded, atol=1e-9, rtol=0)



def test_quantized_changes_logits_but_not_by_much(model):
    ids = _ids(1, 48, seed=4)
    ref = _run(model, ids, DynamicCache(config=model.config))
    scale = ref.std()
    err = {}
    for scheme in ("int8", "int4-g32", "int2-g32", "kivi-2"):
        got = _run(model, ids, kvquant.QuantizedCache(scheme, model.config))
        err[scheme] = float((got - ref).abs().mean() / scale)  # measured: 0.005, 0.063, 0.30, 3e-7
    assert 0 < err["int8"] < 0.015
    assert err["int8"] * 4 < err["int4-g32"] < 0.15
    assert err["int4-g32"] * 2 < err["int2-g32"] < 0.6
    # 48 tokens fit in kivi's 128-token FP window: equal up to fp32 rounding of the streamed softmax
    assert err["kivi-2"] < 1e-5


# ---------------------------------------------------------------------------------------- generate


@pytest.mark.parametrize(
    "scheme", ["fp16", "int8", "int4-g32", "kivi-2", "k=int4-channel-g8,v=int4-g16,sink=2,window=4"]
)
def test_generate_greedy(model, scheme):
    ids = _ids(1, 12, seed=5)
    cache = kvquant.QuantizedCache(scheme, model.config)
    out = model.generate(ids, cache=cache, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    assert out.shape == (1, 22)
    assert torch.equal(out[:, :12], ids)
    assert cache.get_seq_length() == 21  # the last token is returned, not fed back
    assert cache.nbytes() == memory.cache_bytes(model.config, scheme, 21, dtype=torch.float32)
    if scheme == "fp16":
        ref = model.generate(
            ids,
            cache=DynamicCache(config=model.config),
            max_new_tokens=10,
            do_sample=False,
            min_new_tokens=10,
        )
        assert torch.equal(out, ref)


@pytest.mark.parametrize("scheme", ["fp16", "int4-g32", "kivi-4"])
def test_generate_sampling_seeded(model, scheme):
    ids = _ids(2, 9, seed=6)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=True, top_k=50, temperature=1.0)
    torch.manual_seed(0)
    a = model.generate(ids, cache=kvquant.QuantizedCache(scheme, model.config), **kw)
    torch.manual_seed(0)
    b = model.generate(ids, cache=kvquant.QuantizedCache(scheme, model.config), **kw)
    assert a.shape == (2, 17)
    assert torch.equal(a, b)
    if scheme == "fp16":
        torch.manual_seed(0)
        ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
        assert torch.equal(a, ref)


@pytest.mark.parametrize("scheme", ["fp16", "int8"])
def test_beam_search(model, scheme):
    ids = _ids(2, 10, seed=7)
    kw = dict(max_new_tokens=6, min_new_tokens=6, num_beams=2, do_sample=False)
    cache = kvquant.QuantizedCache(scheme, model.config)
    out = model.generate(ids, cache=cache, **kw)
    assert out.shape == (2, 16)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    if scheme == "fp16":
        assert torch.equal(out, ref)
    else:
        assert (out == ref).float().mean() > 0.8


def test_generate_without_config_creates_layers(model):
    ids = _ids(1, 6, seed=8)
    cache = kvquant.QuantizedCache("int4-g32")
    out = model.generate(ids, cache=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert len(cache.layers) == model.config.num_hidden_layers
    assert cache.get_seq_length() == out.shape[1] - 1


# ---------------------------------------------------------------------------------------- padding


def _left_padded(lengths: list[int], seed: int = 9):
    """A left-padded batch of random sequences with these lengths, its mask, and position ids."""
    t = max(lengths)
    seqs = [_ids(1, n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, t - len(s) :] = s
        mask[i, t - len(s) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return seqs, ids, mask, pos


@pytest.mark.parametrize(
    "scheme, atol", [("fp16", 1e-5), ("int8", 2e-5), ("int4-g32", 2e-5), ("int4-head", 2e-5)]
)
def test_left_padding_matches_sequence_alone(model, scheme, atol):
    """A padded row's outputs for its real tokens match the same sequence run alone: the mask is honoured
    and per-token quantization does not mix tokens (or rows)."""
    seqs, ids, mask, pos = _left_padded([14, 9, 5])
    batched = _run(
        model, ids, kvquant.QuantizedCache(scheme, model.config), attention_mask=mask, position_ids=pos
    )
    for i, s in enumerate(seqs):
        alone = _run(model, s[None], kvquant.QuantizedCache(scheme, model.config))
        torch.testing.assert_close(batched[i, ids.shape[1] - len(s) :], alone[0], atol=atol, rtol=0)


@pytest.mark.parametrize("rows", [slice(None), slice(3, 17)])
def test_merge_of_partial_softmaxes_gives_each_row_its_batch_1_bits(rows):
    """The reference attention's log-sum-exp merge rounds a batch row as if it were alone (B=1), whatever
    B: ATen's logaddexp over one tensor rounds its last elements (a scalar tail) unlike the rest."""
    from kvquant.attention import _Merge

    g = torch.Generator().manual_seed(0)
    b, hq, q, d = 5, 3, 20, 8
    parts = [(torch.randn(b, hq, q, d, generator=g), torch.randn(b, hq, q, generator=g) * 4) for _ in "ab"]
    parts.append((torch.randn(b, hq, q, d, generator=g), torch.randn(b, hq, q, generator=g) * 4))
    parts[1][1][1, 0, 5:9] = float("-inf")  # a row that attended no key of this part
    merged = _Merge((b, hq, q, d), torch.float32, torch.device("cpu"))
    for out, lse in parts:
        merged.add(out[:, :, rows], lse[:, :, rows], rows)
    for i in range(b):
        alone = _Merge((1, hq, q, d), torch.float32, torch.device("cpu"))
        for out, lse in parts:
            alone.add(out[i : i + 1, :, rows], lse[i : i + 1, :, rows], rows)
        assert torch.equal(merged.result()[i], alone.result()[0]) and torch.equal(merged.lse[i], alone.lse[0])


def test_merge_sums_framed_outputs_in_their_frame_and_rotates_back_once():
    """Outputs of values stored as R v are merged in R's frame and taken out of it once at the end: the same
    result as taking each part out of the frame first (R^T is linear), to fp32 rounding; a second frame in
    one layer is refused."""
    from kvquant.attention import _Merge

    class Frame:  # a linear map on the last dim, as KernelFrame.out_of is
        def __init__(self, m):
            self.m, self.calls = m, 0

        def out_of(self, y):
            self.calls += 1
            return y @ self.m

    g = torch.Generator().manual_seed(4)
    b, h, q, d = 2, 3, 10, 8
    frame = Frame(torch.linalg.qr(torch.randn(d, d, generator=g))[0])
    parts = [(torch.randn(b, h, q, d, generator=g), torch.randn(b, h, q, generator=g) * 3, f)
             for f in (None, frame, None, frame)]
    parts[1][1][0, 1, 2:5] = float("-inf")  # rows that attended no key of a framed part
    merged, plain = (_Merge((b, h, q, d), torch.float32, torch.device("cpu")) for _ in "ab")
    for i, (out, lse, f) in enumerate(parts):
        rows = slice(0, q) if i % 2 == 0 else slice(3, 9)
        merged.add(out[:, :, rows], lse[:, :, rows], rows, f)
        plain.add(f.out_of(out[:, :, rows]) if f is not None else out[:, :, rows], lse[:, :, rows], rows)
    frame.calls = 0
    torch.testing.assert_close(merged.result(), plain.result(), atol=1e-6, rtol=1e-5)
    assert frame.calls == 1 and torch.equal(merged.lse, plain.lse)
    with pytest.raises(ValueError, match="one frame"):
        merged.add(parts[0][0], parts[0][1], frame=Frame(torch.eye(d)))


@pytest.mark.parametrize("scheme", ["fp16", "int8"])
def test_left_padding_generate_matches_alone(model, scheme):
    seqs, ids, mask, _ = _left_padded([11, 6], seed=20)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, cache=kvquant.QuantizedCache(scheme, model.config), **kw)
    for i, s in enumerate(seqs):
        alone = model.generate(s[None], cache=kvquant.QuantizedCache(scheme, model.config), **kw)
        assert torch.equal(out[i, ids.shape[1] :], alone[0, len(s) :])


# ---------------------------------------------------------------------------------------- accounting

ACCOUNTING = "k=int4-channel-g16,v=int4-g16,sink=4,window=8"


def _parts(layer: QuantizedLayer) -> tuple[int, int, int]:
    return layer.sink_len, layer.body_len, layer.recent_len


@pytest.mark.parametrize("chunks", [1, 5, [40, 13, 2]], ids=str)
def test_sink_window_body_lengths(model, chunks):
    """After T tokens: sink = min(T, 4); body = the largest multiple of 16 leaving >= 8 recent tokens."""
    cache = kvquant.QuantizedCache(ACCOUNTING, model.config)
    ids = _ids(1, 55, seed=10)
    sizes = [chunks] * 55 if chunks == 1 else ([5] * 11 if chunks == 5 else chunks)
    t = 0
    for n in sizes:
        _run(model, ids[:, t : t + n], cache)
        t += n
        sink = min(t, 4)
        body = max(t - 4 - 8, 0) // 16 * 16
        for layer in cache.layers:
            assert _parts(layer) == (sink, body, t - sink - body), t
            assert layer.stored().value_fields["codes"].shape[2] == body
        assert cache.get_seq_length() == t


def test_append_never_requantizes(model):
    """Snapshot what is stored, feed more tokens: sink and body prefixes are bit-identical."""
    cache = kvquant.QuantizedCache(ACCOUNTING, model.config)
    ids = _ids(1, 90, seed=11)
    _run(model, ids[:, :30], cache)
    snap = [{name: t.clone() for name, t in _stored_parts(layer).items()} for layer in cache.layers]
    assert cache.layers[0].body_len == 16
    for n in (1, 7, 30, 22):
        _run(model, ids[:, 30 : 30 + n] if n else ids, cache)
        ids = torch.cat(
            [ids[:, :30], ids[:, 30 + n :], ids[:, 30 : 30 + n]], dim=1
        )  # keep feeding new tokens
    assert cache.layers[0].body_len == 64
    for layer, old in zip(cache.layers, snap, strict=True):
        new = _stored_parts(layer)
        for name, before in old.items():
            after = new[name]
            assert torch.equal(after[:, :, : before.shape[2]], before), name


def test_body_holds_what_was_quantized_on_arrival(model):
    """The body's codes are quantize() of the tokens as they arrived (no dequantized value written back)."""
    cache = kvquant.QuantizedCache("int4-g32", model.config)
    layer = cache.layers[0]
    k, v = torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64)
    layer.update(k, v)
    q = kvquant.quantize(k, kvquant.parse_scheme("int4-g32").key)
    stored = layer.stored().key_fields
    assert torch.equal(stored["codes"], q.codes) and torch.equal(stored["scale"], q.scale)
    view, _ = layer.update(k[:, :, :1], v[:, :, :1])
    assert view.shape == (1, 2, 6, 64)
    torch.testing.assert_close(view.keys(torch.float32)[:, :, :5], kvquant.dequantize(q), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------- bytes


NBYTES_SCHEMES = [
    "fp16",
    "int8",
    "int8-head-asym",
    "int4-g32",
    "int2-g16-sym-sfp16",
    "k=int4-channel-g8,v=int8,sink=3,window=5",
    "k=int2-channel-g16,v=int2-channel-g4,window=2",
    "kivi-2",
    "fp16,sink=2,window=3",
]


@pytest.mark.parametrize("scheme", NBYTES_SCHEMES)
def test_nbytes_equals_formula_and_storage(model, scheme):
    ids = _ids(2, 45, seed=12)
    for chunks in ([45], [20, 1, 1, 1, 1, 1, 20], [7] * 6 + [3]):
        cache = kvquant.QuantizedCache(scheme, model.config)
        t = 0
        for n in chunks:
            _run(model, ids[:, t : t + n], cache)
            t += n
            expected = memory.cache_bytes(model.config, scheme, t, batch=2, dtype=torch.float32)
            assert cache.nbytes() == expected, (chunks, t)
            _check_storage(cache)


def test_int4_is_packed_two_per_byte(model):
    cache = kvquant.QuantizedCache("int4-g32", model.config)
    _run(model, _ids(1, 10), cache)
    codes = cache.layers[0].stored().key_fields["codes"]
    assert codes.shape == (1, 2, 10, 32) and codes.dtype == torch.uint8
    assert cache.layers[0].body_pool.tensors["k.codes"].shape[1:] == (2, 16, 32)  # (P, H_kv, block, D/2)


# ---------------------------------------------------------------------------------------- crop / reset


@pytest.mark.parametrize("remove", [1, 3, 9, 13, 20, 25, 40])
def test_crop_fp16_matches_dynamic_cache(model, remove):
    ids = _ids(1, 25, seed=13)
    more = _ids(1, 4, seed=14)
    ref_cache, cache = (
        DynamicCache(config=model.config),
        kvquant.QuantizedCache("fp16,sink=4,window=6", model.config),
    )
    _run(model, ids, ref_cache), _run(model, ids, cache)
    ref_cache.crop(-remove)
    cache.crop(-remove)
    keep = max(25 - remove, 0)
    assert cache.get_seq_length() == ref_cache.get_seq_length() == keep
    _check_storage(cache)
    torch.testing.assert_close(_run(model, more, cache), _run(model, more, ref_cache), atol=1e-5, rtol=0)


@pytest.mark.parametrize("remove", [1, 8, 15, 22, 30])
def test_crop_quantized_keeps_prefix(model, remove):
    scheme = "int4-g32,sink=4,window=6"
    ids = _ids(1, 30, seed=15)
    cache = kvquant.QuantizedCache(scheme, model.config)
    _run(model, ids, cache)
    layer = cache.layers[1]
    codes, recent = layer.stored().key_fields["codes"], layer.stored().recent_k
    cache.crop(-remove)
    keep = 30 - remove
    assert cache.get_seq_length() == keep
    sink, body, rec = _parts(layer)
    assert sink == min(keep, 4) and sink + body + rec == keep
    stored = layer.stored()
    assert torch.equal(stored.key_fields["codes"], codes[:, :, :body])
    assert torch.equal(stored.recent_k, recent[:, :, :rec])
    _check_storage(cache)
    _run(model, _ids(1, 3, seed=16), cache)  # and it goes on
    assert cache.get_seq_length() == keep + 3


def test_crop_errors(model):
    cache = kvquant.QuantizedCache("k=int4-channel-g8,v=int4-g32", model.config)
    _run(model, _ids(1, 20), cache)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(5)
    cache.crop(-4)  # 20 -> 16: a whole channel group
    assert cache.get_seq_length() == 16
    with pytest.raises(ValueError, match="splits a channel-wise group of 8 tokens"):
        cache.crop(-3)
    cache.crop(0)
    assert cache.get_seq_length() == 16


def test_reset(model):
    scheme = "int4-g32,sink=2,window=4"
    ids = _ids(1, 20, seed=17)
    cache = kvquant.QuantizedCache(scheme, model.config)
    first = _run(model, ids, cache)
    cache.reset()
    assert cache.get_seq_length() == 0
    assert cache.nbytes() == 0
    torch.testing.assert_close(_run(model, ids, cache), first, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------- errors


def test_model_without_kvquant_attention_is_refused_with_config():
    m = make_tiny_model(num_hidden_layers=1)
    m.set_attn_implementation("sdpa")
    cache = kvquant.QuantizedCache("int8", m.config)
    with pytest.raises(
        ValueError,
        match=r"attention implementation is 'sdpa'.*set_attn_implementation\(kvquant.ATTN_IMPLEMENTATION\)",
    ):
        m(_ids(1, 5), cache=cache)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_model_without_kvquant_attention_is_refused_without_config(impl):
    m = make_tiny_model(num_hidden_layers=1)
    m.set_attn_implementation(impl)
    for length in (5, 1):
        with pytest.raises(
            TypeError, match=r"not kvquant's.*set_attn_implementation\(kvquant.ATTN_IMPLEMENTATION\)"
        ):
            m(_ids(1, length), cache=kvquant.QuantizedCache("int8"))


def test_kvquant_attention_with_dynamic_cache_is_sdpa():
    m = make_tiny_model(num_hidden_layers=1)
    ids = _ids(1, 9)
    ours = _run(m, ids, DynamicCache(config=m.config))
    m.set_attn_implementation("sdpa")
    torch.testing.assert_close(_run(m, ids, DynamicCache(config=m.config)), ours, atol=1e-6, rtol=0)


def test_bad_backend_and_scheme():
    with pytest.raises(ValueError, match="unknown backend 'cuda'.*auto, triton, torch"):
        kvquant.QuantizedCache("int8", backend="cuda")
    with pytest.raises(SchemeError, match="int5"):
        kvquant.QuantizedCache("int5")


def test_repr(model):
    cache = kvquant.QuantizedCache("kivi-2", model.config)
    assert "k=int2-channel-g32,v=int2-g32,window=128" in repr(cache)


@pytest.mark.parametrize(
    "scheme", ["int8", "kivi-2", "k=int4-channel-g16,v=int4-g16,sink=4,window=8", "fp16,sink=3"]
)
def test_vectorized_quantized_ends_equal_the_scalar_rule(scheme):
    from kvquant.plan import LayerPlan

    s = kvquant.parse_scheme(scheme)
    for window in (None, 32):  # a sliding layer's plan drops the sink, in both forms
        plan = LayerPlan.build(s, heads=2, head_dim=64, dtype=torch.float32, sliding_window=window)
        n = torch.arange(0, 400)
        assert plan.quantized_ends(n).tolist() == [plan.quantized_end(int(i)) for i in n]
        assert plan.sink == (0 if window else s.sink)
