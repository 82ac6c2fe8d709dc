"""salient=N/G (kvquant.salient): the grammar, bytes held == the formula (and a count by hand), decode-exact
chunks in float64, the choice equal to a brute-force statistic computed from the definition, salient tokens
read as stored, the choice lowering the attention error where a few tokens carry the attention, prefill mode,
and what is refused."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_gemma, make_tiny_model
from transformers import DynamicCache

import kvquant
from kvquant import memory
from kvquant.attention import kvquant_attention
from kvquant.cache import QuantizedLayer, SalientLayer
from kvquant.paging import KVStore
from kvquant.salient import fp_prefill, fp_queries
from kvquant.scheme import FP16, Salient, SchemeError, parse_scheme, parse_spec


def _ids(batch: int = 1, length: int = 63, seed: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 5000, (batch, length), generator=g)


@torch.no_grad()
def _run(model, ids, cache, chunks=None) -> torch.Tensor:
    t = ids.shape[1]
    if chunks is None:
        chunks = [t]
    elif isinstance(chunks, int):
        chunks = [chunks] * (t // chunks) + ([t % chunks] if t % chunks else [])
    out, start = [], 0
    for n in chunks:
        out.append(model(ids[:, start : start + n], cache=cache).logits)
        start += n
    return torch.cat(out, dim=1)


@pytest.fixture(scope="module")
def model64():
    return make_tiny_model(seed=5).double()


# ------------------------------------------------------------------------------------------------ grammar


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("int2-g64,salient=2/64", "int2-g64,salient=2/64"),
        ("int2-g64,salient=2/64:fp16:attn", "int2-g64,salient=2/64"),
        ("k=int4-channel-g64,v=int2-g64,sink=4,window=128,salient=4/64:int8-head",
         "k=int4-channel-g64,v=int2-g64,sink=4,window=128,salient=4/64:int8-head"),
        ("int2-g32,SALIENT=8/64:INT4-G64-ROT:STRIDE", "int2-g32,salient=8/64:int4-g64-rot:stride"),
    ],
)
def test_salient_round_trips(text, canonical):
    s = parse_scheme(text)
    assert str(s) == canonical and parse_scheme(str(s)) == s
    assert s.tokens_per_flush % s.salient.group == 0  # a group leaves the window whole


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("int2-g64,salient=3/64", "N must divide G"),
        ("int2-g64,salient=64/64", "0 < N < G"),
        ("int2-g64,salient=2/64:int8", "per head"),  # one scale over all heads: tokens chosen per head
        ("int2-g64,salient=2/64:int4-channel-g64", "per head"),
        ("int2-g64,salient=2/64:nuq3-g64", "per head"),
        ("int2-g64,salient=2/64:best", "bad quantization spec"),
        ("int2-g64,salient=2/64:stride:fp16", "at most a spec, then a rule"),
        ("int2-g64,salient=two", "salient=N/G"),
        ("int2-g64,salient=2/8192", "at most 4096"),
        ("budget=3.0,calib=x.safetensors,salient=2/64", "budget="),
    ],
)
def test_salient_refusals_name_the_problem(text, match):
    with pytest.raises(SchemeError, match=match):
        parse_scheme(text)
    with pytest.raises(SchemeError):
        Salient(2, 64, parse_spec("int8"))


# ------------------------------------------------------------------------------------------------ bytes


@pytest.mark.parametrize(
    "scheme",
    ["int2-g16,sink=3,window=10,salient=2/16", "k=int4-channel-g8,v=int2-g16,window=6,salient=4/16:int8-head",
     "int2-g32,salient=1/32:stride"],
)
def test_nbytes_equals_the_formula_at_every_length(model64, scheme):
    cache = kvquant.QuantizedCache(scheme, model64.config)
    ids = _ids(2, 70, seed=3)
    for start, n in ((0, 9), (9, 1), (10, 23), (33, 1), (34, 36)):
        _run(model64, ids[:, start : start + n], cache)
        held = cache.nbytes()
        assert held == memory.cache_bytes(model64.config, scheme, start + n, batch=2, dtype=torch.float64)


def test_page_bytes_counted_by_hand():
    """int2-g64 with salient=2/16 (fp16 salient rows), 2 KV heads of 64 channels, at FP16: a 16-token body
    page holds per head 16 x (16 B codes + 4 B scale and zero) for K and again for V, plus 2 salient rows of
    K and V (128 B each) and their 2 one-byte indices; an FP page per head 16 x (128 + 128 B) + 16 x 4 B of
    statistics (fp32)."""
    shape = memory.KVShape(num_layers=1, num_kv_heads=2, head_dim=64)
    plan = memory.layer_plans(shape, "int2-g64,salient=2/16")[0]
    fp, body = plan.page_bytes()
    assert body == 2 * (2 * 16 * 20 + 2 * 2 * 128 + 2)
    assert fp == 2 * 16 * (256 + 4)
    assert memory.bytes_per_token(shape, "int2-g64,salient=2/16") == body / 16
    salient_bits = (2 * 256 + 2) / 16 * 8 / 128  # per K/V value: 2.008 bits on top of int2-g64's 2.5
    assert memory.effective_bits(shape, "int2-g64,salient=2/16") == pytest.approx(2.5 + salient_bits)
    plain = memory.cache_bytes(shape, "int2-g64", 100)
    assert plain < memory.cache_bytes(shape, "int2-g64,salient=2/16", 100)


# ----------------------------------------------------------------------------------------------- decode-exact


def _salient_rows(layer, name: str) -> torch.Tensor:
    """The salient rows written so far of field `name`, (B, H, groups * N, cols), in position order."""
    pool, table = layer.body_pool.tensors[name], layer.body_t.tensor()
    rows = pool[table]  # (B, pages, H, rows per page, cols)
    b, n, h, r, c = rows.shape
    written = layer.body_len // layer.scheme.salient.ratio
    return rows.permute(0, 2, 1, 3, 4).reshape(b, h, n * r, c)[:, :, :written]


WINDOWED = [
    "int2-g16,sink=3,window=10,salient=2/16",
    "k=int4-channel-g8,v=int2-g16,sink=2,window=6,salient=4/16:int8-head",
    "int2-g8,window=5,salient=2/8:stride",
    "k=int2-channel-g16,v=int2-g16,salient=1/16",  # no window: only a group's own queries see it FP
]


@pytest.mark.parametrize("scheme", WINDOWED)
@pytest.mark.parametrize("chunks", [5, 16, [40, 3, 1, 19], None], ids=str)
def test_chunked_equals_token_by_token(model64, scheme, chunks):
    """The statistics need only FP keys and the queries, so a chunk adds its queries' shares at once and
    chooses for the groups it flushed before it attends: any chunking gives the logits of decoding one token
    at a time, and the same salient tokens."""
    ids = _ids(2, 63)
    dec_cache = kvquant.QuantizedCache(scheme, model64.config)
    decoded = _run(model64, ids, dec_cache, 1)
    cache = kvquant.QuantizedCache(scheme, model64.config)
    chunked = _run(model64, ids, cache, chunks)
    torch.testing.assert_close(chunked, decoded, atol=1e-9, rtol=0)
    for a, b in zip(cache.layers, dec_cache.layers, strict=True):
        assert torch.equal(_salient_rows(a, "s.idx"), _salient_rows(b, "s.idx"))  # the same choice
    plain = _run(model64, ids, kvquant.QuantizedCache(scheme.split(",salient")[0], model64.config), 1)
    assert (decoded - plain).abs().max() > 1e-4  # the salient tokens change the logits


# ------------------------------------------------------------------------------------------------ the choice


def _feed(scheme: str, q, k, v, chunks) -> SalientLayer:
    """A salient layer fed K/V (B, H_kv, T, D) in chunks, each chunk's queries q (B, H_q, T, D) attending."""
    layer = QuantizedLayer(parse_scheme(scheme), layer_idx=0)
    assert isinstance(layer, SalientLayer)
    start = 0
    for n in chunks:
        view, _ = layer.update(k[:, :, start : start + n], v[:, :, start : start + n])
        kvquant_attention(None, q[:, :, start : start + n], view, view, None)
        start += n
    return layer


def _brute_force_choice(layer: SalientLayer, q, k) -> torch.Tensor:
    """The definition, query by query: query p's share of each key it sees unquantized (the sink, and
    quantized_end(p + 1) <= j <= p), summed over the query heads of its KV head; a token's score is its
    summed share over the number of queries that saw it unquantized; per (sequence, KV head, group) the N
    highest, ties to the earlier token. Returns (B, H_kv, groups, N)."""
    plan, sal = layer.plan, layer.scheme.salient
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    stats = torch.zeros(b, hkv, t, dtype=torch.float64)
    seen = torch.zeros(t)
    for p in range(t):
        fp = [j for j in range(t) if j < plan.sink or plan.quantized_end(p + 1) <= j <= p]
        for h in range(hq):
            s = torch.einsum("bd,bnd->bn", q[:, h, p], k[:, h // (hq // hkv), fp]) * d**-0.5
            stats[:, h // (hq // hkv), fp] += torch.softmax(s, dim=-1)
        seen[[j for j in fp if j >= plan.sink]] += 1
    body = plan.quantized_end(t) - plan.sink
    groups = body // sal.group
    score = (stats[:, :, plan.sink : plan.sink + body] / seen[plan.sink : plan.sink + body]).view(
        b, hkv, groups, sal.group)
    out = torch.empty(b, hkv, groups, sal.count, dtype=torch.long)
    for idx in torch.cartesian_prod(torch.arange(b), torch.arange(hkv), torch.arange(groups)).tolist():
        row = score[tuple(idx)].tolist()
        best = sorted(range(sal.group), key=lambda i: (-row[i], i))[: sal.count]
        out[tuple(idx)] = torch.tensor(sorted(best))
    assert torch.equal(seen[plan.sink : plan.sink + body].long(),
                       fp_queries(plan, torch.arange(plan.sink, plan.sink + body)))
    return out


@pytest.mark.parametrize("chunks", [[1] * 50, [17, 1, 32], [50]], ids=["decode", "mixed", "one"])
def test_the_choice_is_the_brute_force_statistics_top_n(chunks):
    """Random queries and keys (some keys scaled up so the shares differ widely) fed to a salient layer; the
    stored indices and salient rows equal what the definition gives when computed query by query."""
    g = torch.Generator().manual_seed(4)
    b, hkv, hq, t, d = 2, 2, 4, 50, 16
    q = torch.randn(b, hq, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64) * (1 + 3 * torch.rand(b, hkv, t, 1,
                                                                                          generator=g))
    v = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64)
    layer = _feed("int2-g16,sink=2,window=5,salient=3/12", q, k, v, chunks)
    want = _brute_force_choice(layer, q, k)
    groups = want.shape[2]
    assert torch.equal(_salient_rows(layer, "s.idx").view(b, hkv, groups, 3).long(), want)
    keys = _salient_rows(layer, "s.k.values")
    pos = 2 + torch.arange(groups)[:, None] * 12 + want  # (B, H, groups, N) positions of the salient keys
    expect = k.gather(2, pos.reshape(b, hkv, -1, 1).expand(-1, -1, -1, d))
    assert torch.equal(keys, expect)  # fp16 salient rows at the run dtype: the keys as they came


def test_keys_read_with_salient_tokens_in_place():
    """`layer.keys` (the materialized view) holds the salient tokens exactly and the codec's decode elsewhere,
    and a decoding query's attention output is softmax over exactly those keys and values."""
    g = torch.Generator().manual_seed(5)
    b, hkv, hq, t, d = 1, 2, 4, 41, 16
    q = torch.randn(b, hq, t + 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, t + 1, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, t + 1, d, generator=g, dtype=torch.float64)
    layer = _feed("int2-g16,sink=1,window=4,salient=2/8", q, k, v, [t])
    keys, values = layer.keys, layer.values
    plain = QuantizedLayer(parse_scheme("int2-g16,sink=1,window=4"), layer_idx=0)
    plain.update(k[:, :, :t], v[:, :, :t])
    exact = (keys == k[:, :, :t]).all(dim=-1)  # (B, H, T)
    body = slice(1, layer.plan.quantized_end(t))
    assert int(exact[:, :, body].sum()) == b * hkv * 2 * (body.stop - body.start) // 8  # N of every G
    torch.testing.assert_close(keys[~exact], plain.keys[~exact], atol=0, rtol=0)
    view, _ = layer.update(k[:, :, t:], v[:, :, t:])
    out = kvquant_attention(None, q[:, :, t:], view, view, None)[0]  # (B, 1, H_q, D)
    keys, values = layer.keys, layer.values
    rep = hq // hkv
    s = q[:, :, t:] @ keys.repeat_interleave(rep, 1).transpose(-1, -2) * d**-0.5
    want = torch.softmax(s, -1) @ values.repeat_interleave(rep, 1)  # (B, H_q, 1, D)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-12, rtol=0)


def test_attention_choice_beats_the_stride_control_where_few_tokens_carry_attention():
    """Keys with a few 'heavy hitters' per group (aligned with every query) on an int2 body: the attn rule
    keeps them, the stride control keeps fixed slots; at the same bytes the attention output's error against
    FP attention is several times lower (can fail: a wrong statistic or choice would not find them)."""
    g = torch.Generator().manual_seed(6)
    b, hkv, hq, t, d = 1, 1, 2, 200, 32
    u = torch.randn(d, generator=g, dtype=torch.float64)
    q = u + 0.3 * torch.randn(b, hq, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64)
    heavy = torch.rand(t, generator=g) < 0.06
    k[:, :, heavy] += 1.2 * u
    v = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64) * 3
    errors = {}
    for rule in ("attn", "stride"):
        layer = _feed(f"int2-g32,window=16,salient=4/32:{rule}", q, k, v, [t - 1])
        view, _ = layer.update(k[:, :, -1:], v[:, :, -1:])
        out = kvquant_attention(None, q[:, :, -1:], view, view, None)[0]
        s = q[:, :, -1:] @ k.repeat_interleave(hq, 1).transpose(-1, -2) * d**-0.5
        ref = (torch.softmax(s, -1) @ v.repeat_interleave(hq, 1)).transpose(1, 2)
        errors[rule] = float((out - ref).norm() / ref.norm())
    assert errors["attn"] < 0.5 * errors["stride"], errors


# ------------------------------------------------------------------------------------------------ prefill


def test_fp_prefill_is_fp_attention_and_chooses_from_the_prompts_queries(model64):
    """In prefill mode the prompt attends to itself unquantized (the logits equal DynamicCache's) while the
    statistics follow the cache-mode rule: layer 0 sees the same queries in both modes, so it keeps the same
    salient tokens as a cache-mode run; the continuation then decodes through the stored cache."""
    scheme = "int2-g16,sink=2,window=8,salient=2/16"
    ids = _ids(1, 60, seed=7)
    cache = kvquant.QuantizedCache(scheme, model64.config)
    with fp_prefill(cache):
        got = _run(model64, ids[:, :50], cache)
    fp = _run(model64, ids[:, :50], DynamicCache(config=model64.config))
    torch.testing.assert_close(got, fp, atol=1e-9, rtol=0)
    assert cache.layers[0].body_len == 32
    ref = kvquant.QuantizedCache(scheme, model64.config)
    _run(model64, ids[:, :50], ref, 7)
    assert torch.equal(_salient_rows(cache.layers[0], "s.idx"), _salient_rows(ref.layers[0], "s.idx"))
    cont = _run(model64, ids[:, 50:], cache, 1)
    assert torch.isfinite(cont).all()
    with pytest.raises(ValueError, match="first one"), fp_prefill(cache):
        _run(model64, ids[:, 50:], cache)


def test_prefill_mode_in_the_evaluation_runs_the_prompt_through_fp_prefill(model64):
    from kvquant.eval.measure import Bucket, evaluate_document

    ids = _ids(1, 64, seed=8)
    got = evaluate_document(model64, ids, ["int2-g16,window=8,salient=2/16"], mode="prefill", chunk=16,
                            buckets=[Bucket(0, 32), Bucket(32, 64)], prefill=32)
    stats = got["int2-g16,window=8,salient=2/16"]
    before, after = stats[Bucket(0, 32)], stats[Bucket(32, 64)]
    assert before.kl < 1e-9 * before.tokens  # FP among the prompt's tokens
    assert after.kl > 1e-6


# ------------------------------------------------------------------------------------------------ refused


def test_what_is_not_supported_is_refused(model64):
    scheme = "int2-g16,window=8,salient=2/16"
    cache = kvquant.QuantizedCache(scheme, model64.config)
    _run(model64, _ids(1, 40), cache)
    with pytest.raises(ValueError, match="crop is not supported"):
        cache.layers[0].crop(-10)
    with pytest.raises(ValueError, match="shared"):
        kvquant.QuantizedCache(scheme, model64.config, store=KVStore(model64.config, scheme))
    with pytest.raises(ValueError, match="sliding-window"):
        kvquant.QuantizedCache(scheme, make_tiny_gemma().config)
    with pytest.raises(ValueError, match="sliding-window"):
        memory.cache_bytes(make_tiny_gemma().config, scheme, 10)
    from kvquant.eval.fakequant import FakeQuantCache

    with pytest.raises(ValueError, match="fake mode"):
        FakeQuantCache(parse_scheme(scheme), model64.config)
    from kvquant.eval.schemes import parse_eval_scheme

    assert parse_eval_scheme(scheme).modes == ("cache", "prefill")


def test_left_padded_batch_keeps_the_full_rows_choice(model64):
    """In a left-padded batch (the model's explicit mask), the unpadded row chooses and predicts as it does
    alone (statistics are per sequence; padded queries give no shares), chunked or not; padded rows stay
    finite."""
    scheme = "int2-g16,sink=2,window=6,salient=2/16"
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(1, 5000, (2, 50), generator=g)
    mask = torch.ones(2, 50, dtype=torch.long)
    mask[1, :13] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    alone = _run(model64, ids[:1], kvquant.QuantizedCache(scheme, model64.config), 1)
    for chunks in ([50], [20, 30]):
        cache = kvquant.QuantizedCache(scheme, model64.config)
        out, start = [], 0
        with torch.no_grad():
            for n in chunks:
                sl = slice(start, start + n)
                out.append(model64(ids[:, sl], cache=cache, attention_mask=mask[:, : start + n],
                                   position_ids=pos[:, sl]).logits)
                start += n
        got = torch.cat(out, dim=1)
        torch.testing.assert_close(got[:1], alone, atol=1e-9, rtol=0)
        assert torch.isfinite(got).all()


def test_generate_and_beams_run_and_hold_what_the_formula_says(model64):
    scheme = "int2-g16,sink=2,window=8,salient=2/16"
    ids = _ids(1, 30, seed=9)
    cache = kvquant.QuantizedCache(scheme, model64.config)
    out = model64.generate(ids, cache=cache, max_new_tokens=12, do_sample=False, num_beams=2,
                           pad_token_id=0)
    assert out.shape[1] == 42
    n = cache.get_seq_length()
    assert cache.nbytes() <= memory.cache_bytes(model64.config, scheme, n, batch=2, dtype=torch.float64)
    for layer in cache.layers:
        layer.check()
    assert Salient(2, 16).spec == FP16
