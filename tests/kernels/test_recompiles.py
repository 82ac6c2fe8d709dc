"""One compiled variant per scheme across a whole decode: counted with a stand-in launcher
(kvquant.kernels.compiled.SpecializationCounter computes Triton's JIT cache key for sm_90 per launch and
compiles nothing), so this runs on the CPU in seconds."""

from __future__ import annotations

import torch
from kvquant.kernels import dispatch
from kvquant.kernels.compiled import SpecializationCounter
from kvquant.kernels.testing import Region, make_paged_layer

from kvquant.scheme import parse_scheme


def decode_lengths(start: int, stop: int) -> list[int]:
    """Every length to 4,096 (all residues of every page and block size), then a stride of 61 to stop."""
    return list(range(start, min(stop, 4096) + 1)) + list(range(4096 + 61, stop + 1, 61)) + [stop]


def count_decode_variants(scheme_text: str, start: int = 512, stop: int = 32768) -> tuple[dict, dict]:
    scheme = parse_scheme(scheme_text)
    group = scheme.tokens_per_flush
    bs, d, h_kv = max(16, group), 64, 2
    # pools big enough for the longest context; contents do not matter here (nothing runs)
    layer = make_paged_layer(b=1, h_kv=h_kv, d=d, sink=0, body=bs, recent=0, k=str(scheme.key),
                             v=str(scheme.value), block_size=bs, shuffle=False, spare=stop // bs + 2)
    fp_pool = torch.zeros(2 * (stop // bs + 2), h_kv, bs, d, dtype=torch.float16)
    q = torch.zeros(1, 3 * h_kv, 1, d, dtype=torch.float16)
    new_tokens = torch.zeros(1, h_kv, group, d, dtype=torch.float16)  # one flush
    counter = SpecializationCounter()
    with counter:
        for n in decode_lengths(start, stop):
            body_end = scheme.quantized_end(n)
            sink = min(scheme.sink, n)
            body, recent = body_end - sink, n - body_end
            r_off = body_end % bs  # the window region starts where the body stopped
            pages = lambda k, off=0: torch.arange(-(-(off + k) // bs), dtype=torch.int64)[None]  # (1, n)
            view = type(layer)(
                block_size=bs, fp_k=fp_pool, fp_v=fp_pool,
                sink=Region(pages(sink), 0, sink), body=Region(pages(body), 0, body),
                recent=Region(pages(recent, r_off) + 1, r_off, recent),
                key_codec=layer.key_codec, value_codec=layer.value_codec,
                key_pages=layer.key_pages, value_pages=layer.value_pages, shape=(1, h_kv, n, d),
            )
            mask = torch.ones(1, 1, 1, n + 7, dtype=torch.bool)  # a mask sized for a longer buffer
            dispatch.fused_attention(q, view, mask, None)
            if scheme.key.is_quantized and body >= group and body % group == 0:
                dispatch.quantize_pack_into(new_tokens, layer.key_codec, layer.key_pages, view.body.table,
                                            body - group)
    return counter.counts(), counter.calls


def test_one_variant_per_scheme_from_512_to_32k_tokens():
    for scheme in ("int4-g64,sink=4,window=128", "int8", "kivi-4"):
        counts, calls = count_decode_variants(scheme)
        assert calls["_paged_split_kernel"] > 4000
        assert counts["_paged_split_kernel"] == 1, (scheme, counts)
        assert counts["_reduce_kernel"] == 1, (scheme, counts)
        assert counts.get("_quantize_token_kernel", 0) <= 1, (scheme, counts)
        assert counts.get("_quantize_channel_kernel", 0) <= 1, (scheme, counts)
        print(scheme, counts, calls)


# ----------------------------------------------------------------------------------------- the counter itself

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _probe_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit(do_not_specialize=["n"])
def _probe_kernel_dns(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def test_counter_sees_a_recompile_when_a_specialising_argument_changes():
    """The negative control of the test above: the counter must not report 1 because it cannot see.
    Triton specialises an int argument on == 1 and on divisibility by 16, and every constexpr or dtype
    change is a new variant; `do_not_specialize` removes the first kind only."""
    x = torch.zeros(64)
    counter = SpecializationCounter()
    with counter:
        for n in (1, 16, 17, 32, 33):  # ==1, %16, plain, %16, plain -> 3 keys
            _probe_kernel[(1,)](x, n, BLOCK=64)
        for n in (1, 16, 17):
            _probe_kernel_dns[(1,)](x, n, BLOCK=64)
        _probe_kernel_dns[(1,)](x, 5, BLOCK=32)  # a constexpr change
        _probe_kernel_dns[(1,)](x.half(), 5, BLOCK=32)  # a dtype change
    assert counter.counts() == {"_probe_kernel": 3, "_probe_kernel_dns": 3}, counter.counts()
    assert counter.calls == {"_probe_kernel": 5, "_probe_kernel_dns": 5}


def test_counter_sees_a_new_decode_variant():
    """The real launcher through the counter: a new head_dim or query dtype is a new split variant (as
    it must be), while a new length is not."""
    counter = SpecializationCounter()
    with counter:
        for d, dtype, body in ((64, torch.float16, 32), (64, torch.float16, 48), (128, torch.float16, 32),
                               (64, torch.float32, 32)):
            layer = make_paged_layer(b=1, h_kv=2, d=d, sink=2, body=body, recent=3, k="int4-g32", v="int8",
                                     dtype=dtype)
            q = torch.zeros(1, 4, 1, d, dtype=dtype)
            from kvquant.kernels.decode_attention import decode_attention

            decode_attention(q, *layer.decode_args())
    assert counter.counts()["_paged_split_kernel"] == 3, counter.counts()
    assert counter.calls["_paged_split_kernel"] == 4
