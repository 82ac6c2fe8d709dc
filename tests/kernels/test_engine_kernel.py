"""GGUF block bodies (`kvquant.codecs.engine`: llama.cpp's q8_0 / q4_0 / q4_1 / q5_0 / q5_1 / iq4_nl, ggml's
mxfp4 / nvfp4) read in place by decode_attention: the blocks' values decoded bit for bit (fp32) in the
kernel's channel order (`kernels.layouts.engine_order`), from words and from bytes; attention in the kernel's
frame (llama.cpp's Hadamard rotation and the channel order applied to the query, undone on the output) within
the float bound |out - ref32| <= 2 |ref - ref32| + atol for every format, GQA / MQA, D 64 / 128 / 256,
shuffled and shared pages, sink + body + window, a left-padding mask over two splits; the first-use
self-check builds its probe for these layouts and catches a wrong table; `generate` end to end equal to the
torch backend with every decode step in the kernel."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from kernel_e2e import FlippedTable, check_matches_torch, generate_both
from kvquant.kernels import decode_attention as da
from kvquant.kernels import dispatch
from kvquant.kernels.codebook import lut_tables
from kvquant.kernels.engine_blocks import engine_body
from kvquant.kernels.layouts import (
    ENGINE_KERNEL_FORMATS,
    EngineKernelLayout,
    decode_frame,
    decode_layout,
    engine_levels,
    engine_order,
)
from kvquant.kernels.registry import KernelRegistry, SelfCheck
from kvquant.kernels.testing import check_decode, make_paged_layer, random_query

from kvquant.codecs.base import codec_for
from kvquant.codecs.engine import BLOCK_TYPES, ggml_dequantize, ggml_quantize

FORMATS = list(ENGINE_KERNEL_FORMATS)
NAMES = {f: (f if f in ("mxfp4", "nvfp4") else f"llama.cpp:{f}") for f in FORMATS}


def test_the_kernel_formats_are_the_codecs_blocks():
    for name, (_kid, block, size, header, nq, table) in ENGINE_KERNEL_FORMATS.items():
        bt = BLOCK_TYPES[name]
        assert (bt.block, bt.type_size) == (block, size), name
        assert header + nq == size and nq * 8 // block in (4, 8), name
        assert (table is None) == (name in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")), name
    assert sorted(k[0] for k in ENGINE_KERNEL_FORMATS.values()) == list(range(1, 9))


# ------------------------------------------------------------------------------- values, bit for bit


@triton.jit
def _blocks_kernel(c_ptr, lv_ptr, out_ptr, BT: tl.constexpr, D: tl.constexpr, ENG: tl.constexpr,
                   OUT_F16: tl.constexpr = False, ASM: tl.constexpr = False):
    """Rows 0..BT-1 of a block pool -> their (BT, D) values (fp32, or fp16 arithmetic), through the decode
    kernel's own helper (ASM: the compiled path's PTX, on a GPU only)."""
    row = tl.arange(0, BT)
    t0, t1, t2, t3, t4, t5, t6, t7 = lut_tables(lv_ptr, 4, ASM and OUT_F16 and ENG >= 6)
    if OUT_F16:
        x = engine_body(c_ptr, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, row, row < BT, BT, D, ENG, tl.float16,
                        ASM)
    else:
        x = engine_body(c_ptr, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, row, row < BT, BT, D, ENG, tl.float32,
                        ASM)
    tl.store(out_ptr + row[:, None] * D + tl.arange(0, D)[None, :], x)


def _rows(fmt: str, d: int, n: int = 16) -> torch.Tensor:
    """(n, D) rows whose blocks cover the awkward cases: all zero, one huge value, tiny values, negative
    maxima, a NaN (skipped by ggml's absmax loops), +-Inf (q4_1: an Inf minimum) avoided where a block would
    decode to NaN on both sides."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(n, d, generator=g) * torch.logspace(-3, 2, n)[:, None]
    x[0] = 0
    x[1, 5] = 1e4
    x[2] = -x[2].abs()
    x[3, :] = 1e-6 * torch.randn(d, generator=g)
    return x


@pytest.mark.parametrize("words", [True, False], ids=["words", "bytes"])
@pytest.mark.parametrize("d", [64, 128, 256])  # 256: mxfp4 in 8-byte units (odd r), nvfp4 in 4 parts
@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_decode_bit_exact_in_kernel_order(fmt, d, words, device):
    """The kernel's values are ggml's dequantized values exactly (fp32), channel p holding element
    engine_order[p]: from int32 words (rows of whole words) and from the bytes (any row)."""
    codec = codec_for(NAMES[fmt], 1, d)
    lay = decode_layout(codec)
    rows = ggml_quantize(_rows(fmt, d), fmt)  # (16, RB) uint8
    pool = rows.to(device)
    if words:
        if rows.shape[1] % 4:
            pytest.skip(f"{fmt} rows of D={d} are {rows.shape[1]} bytes: not whole words (the byte path)")
        pool = pool.view(torch.int32)
    table = engine_levels(lay, device, None, torch.float32) if lay.lut else pool
    out = torch.empty(16, d, dtype=torch.float32, device=device)
    _blocks_kernel[(1,)](pool, table, out, BT=16, D=d, ENG=lay.kernel_id)
    want = ggml_dequantize(rows, fmt)[:, torch.tensor(engine_order(lay, d))]
    assert torch.equal(out.cpu().isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(out.cpu()), torch.nan_to_num(want))


def test_nibble_ptx_gives_every_code(device):
    """The compiled path's PTX for 4-bit codes (`kernels.codes.NIB8_ASM`; no GPU has run it yet), evaluated
    instruction by instruction: output i is fp16 1024 + code i (bits 4i) for every code in every position."""
    from kvquant.kernels.codes import NIB8_ASM
    from ptx_model import run_ptx

    g = np.random.default_rng(0)
    exhaustive = np.array([sum(((c + i) % 16) << (4 * i) for i in range(8)) for c in range(16)], np.uint64)
    words = np.concatenate([exhaustive.astype(np.uint32), g.integers(0, 2**32, 4096, dtype=np.uint64)
                            .astype(np.uint32)])
    outs = run_ptx(NIB8_ASM, {8: words})
    for i in range(8):
        want = 0x6400 | ((words >> np.uint32(4 * i)) & 15)
        np.testing.assert_array_equal(outs[i], want, err_msg=f"code {i}")
    wrong = run_ptx(NIB8_ASM.replace("mov.b32 {$1, $3}, t0", "mov.b32 {$3, $1}, t0"), {8: words})
    assert not np.array_equal(wrong[1], outs[1])  # the model sees a swapped output


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_compiled_blocks_on_a_gpu_equal_the_generic_path(fmt, device):
    """On a GPU (TRITON_INTERPRET=0): the compiled helper (PTX: PRMT byte / nibble conversion, the PRMT
    table lookup) gives the generic path's values bit for bit, fp16 and fp32. The first thing a GPU run
    must check: no GPU has run this code yet."""
    if da._interpreting():
        pytest.skip("inline PTX runs only compiled, on a GPU (the PTX model tests cover it here)")
    codec = codec_for(NAMES[fmt], 1, 128)
    lay = decode_layout(codec)
    rows = ggml_quantize(_rows(fmt, 128, 64), fmt).to(device)
    pool = rows.view(torch.int32)
    for dtype in (torch.float16, torch.float32):
        table = engine_levels(lay, device, None, dtype) if lay.lut else pool
        out = {asm: torch.empty(64, 128, dtype=dtype, device=device) for asm in (False, True)}
        for asm, o in out.items():
            _blocks_kernel[(1,)](pool, table, o, BT=64, D=128, ENG=lay.kernel_id,
                                 OUT_F16=dtype == torch.float16, ASM=asm)
        assert torch.equal(out[True].view(torch.int16 if dtype == torch.float16 else torch.int32),
                           out[False].view(torch.int16 if dtype == torch.float16 else torch.int32))


def test_the_order_check_is_strict():
    """The comparison above fails for an order that forgets the rotation of an unaligned block's bytes."""
    lay = decode_layout(codec_for("llama.cpp:q8_0", 1, 64))
    naive = EngineKernelLayout(**{**lay.__dict__, "header": 0, "type_size": 32})  # r = 0 everywhere
    order, wrong = engine_order(lay, 64), engine_order(naive, 64)
    assert sorted(order) == list(range(64)) and order != wrong
    rows = ggml_dequantize(ggml_quantize(_rows("q8_0", 64), "q8_0"), "q8_0")
    assert not torch.equal(rows[:, torch.tensor(order)], rows[:, torch.tensor(wrong)])


# ------------------------------------------------------------------------------- attention


def _codecs(k: str, v: str, h_kv: int, d: int, dtype):
    """K and V codecs bound to their roles (llama.cpp rotates V by 64 x 64 blocks, K by the largest power of
    two dividing D)."""
    return codec_for(k, h_kv, d, dtype, role="k"), codec_for(v, h_kv, d, dtype, role="v")


SPECS = [  # (K, V, dtype, D): every format; rotated and not; next to other codecs
    ("llama.cpp:q8_0", "llama.cpp:q8_0", torch.float16, 64),
    ("llama.cpp:q4_0", "llama.cpp:q4_1", torch.float32, 64),
    ("llama.cpp:q5_0", "llama.cpp:q5_1", torch.float16, 128),
    ("llama.cpp:iq4_nl-norot", "llama.cpp:q8_0-norot", torch.bfloat16, 64),
    ("mxfp4", "nvfp4", torch.float16, 64),  # mxfp4 rows of 34 bytes: the byte path
    ("nvfp4", "mxfp4", torch.bfloat16, 128),
    ("llama.cpp:q4_0-norot", "int4-g32", torch.float16, 64),
    ("int8", "llama.cpp:q5_0-norot", torch.float32, 64),
]


@pytest.mark.parametrize("k,v,dtype,d", SPECS, ids=[f"{k}+{v}-{str(t)[6:]}-{d}" for k, v, t, d in SPECS])
def test_engine_specs(k, v, dtype, d, device):
    """Shuffled pages, a page shared by two sequences, sink, body and a window from mid-page."""
    kc, vc = _codecs(k, v, 2, d, dtype)
    layer = make_paged_layer(k=kc, v=vc, dtype=dtype, device=device, sink=2, body=64, recent=5,
                             recent_offset=3, share=True, d=d)
    check_decode(layer, random_query(layer, 3, dtype, device), dtype)


@pytest.mark.parametrize("gqa,h_kv,d,k,v", [(4, 2, 128, "llama.cpp:q8_0", "llama.cpp:q4_0"),
                                            (8, 1, 64, "llama.cpp:iq4_nl", "llama.cpp:q5_1")])
def test_engine_gqa_and_mqa(gqa, h_kv, d, k, v, device):
    kc, vc = _codecs(k, v, h_kv, d, torch.float16)
    layer = make_paged_layer(h_kv=h_kv, d=d, body=64, k=kc, v=vc, device=device)
    check_decode(layer, random_query(layer, gqa, torch.float16, device), torch.float16)


def test_engine_d256_mqa_bf16_masked_two_splits(device):
    """D = 256: K rotated by 256 x 256, V by 64 x 64 blocks; left padding into the body, two body splits."""
    kc, vc = _codecs("llama.cpp:q8_0", "llama.cpp:q4_1", 1, 256, torch.bfloat16)
    assert (decode_frame(kc, device).hadamard, decode_frame(vc, device).hadamard) == (256, 64)
    layer = make_paged_layer(b=2, h_kv=1, d=256, sink=3, body=128, recent=6, recent_offset=9, k=kc, v=vc,
                             dtype=torch.bfloat16, device=device)
    mask = torch.ones(2, layer.shape[2], dtype=torch.bool)
    mask[1, :20] = False
    check_decode(layer, random_query(layer, 4, torch.bfloat16, device), torch.bfloat16,
                 key_mask=mask.to(device), num_splits=2)


def test_engine_frames_and_what_is_said(device):
    dev = torch.device(device)
    for name, n in (("llama.cpp:q8_0", 64), ("llama.cpp:q8_0-norot", 0), ("mxfp4", 0)):
        frame = decode_frame(codec_for(name, 2, 64), dev)
        assert frame.hadamard == n and frame.order is not None and frame.codec.spec.engine == name
        assert sorted(frame.order.tolist()) == list(range(64))
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(frame.out_of(frame.into(x)), x, rtol=0, atol=1e-6)
    from kvquant.backend import kernel_fallback

    assert kernel_fallback(codec_for("llama.cpp:q4_0", 2, 64), dev) is None  # read here, packed (pack_engine)
    reg = KernelRegistry("t", SelfCheck(False))
    c = codec_for("llama.cpp:q4_0", 2, 64)
    assert decode_frame(c, dev, reg).order is decode_frame(c, dev, reg).order  # made once per registry


# ------------------------------------------------------------------------------- the self-check


def test_the_self_check_probes_engine_variants(device, monkeypatch, caplog):
    """The probe builds for GGUF layouts (in their frames) and passes a right variant; a wrong table is
    caught, logged once, and the reference path serves."""
    kc, vc = _codecs("llama.cpp:iq4_nl", "llama.cpp:q8_0", 2, 64, torch.float16)
    layer = make_paged_layer(k=kc, v=vc, sink=2, body=64, recent=3, device=device)
    q = random_query(layer, 2, torch.float16, device)
    good = KernelRegistry("t", self_check=SelfCheck(enabled=True))
    assert dispatch.fused_attention(q, layer, None, None, registry=good) is not None
    assert good.self_check.verdicts and not good.self_check.disabled()
    monkeypatch.setattr(da, "_paged_split_kernel", FlippedTable(da._paged_split_kernel))
    bad = KernelRegistry("t", self_check=SelfCheck(enabled=True))
    with caplog.at_level(logging.WARNING, logger="kvquant.kernels"):
        for _ in range(2):
            assert dispatch.fused_attention(q, layer, None, None, registry=bad) is None
    assert len([r for r in caplog.records if "disagrees with its reference twin" in r.getMessage()]) == 1
    ((name, variant, _),) = bad.self_check.disabled()
    assert name == "decode_attention" and ("K_ENG", 6) in variant and ("V_ENG", 1) in variant


# ------------------------------------------------------------------------------- end to end


E2E = [
    "llama.cpp:q8_0,sink=2,window=4",
    "k=llama.cpp:q4_0,v=llama.cpp:q5_1",
    "k=nvfp4,v=llama.cpp:iq4_nl-norot,window=4",
]


@pytest.mark.parametrize("scheme", E2E)
def test_generate_engine_formats_with_kernels_matches_the_torch_backend(scheme, monkeypatch, caplog, device):
    if device.type != "cpu":
        pytest.skip("the cache end to end runs under the interpreter here (on a GPU: gpu_check's e2e phase)")
    ref, got, served = generate_both(scheme, monkeypatch, caplog)
    check_matches_torch(ref, got, served, 4 * 2, caplog)  # every decode step of both layers in the kernel
