"""Codebook bodies (`nuq2/3/4`, codecs.base.CodebookCodec) read in place by decode_attention: codes exact
(2, 3 dense 8-in-3-bytes, 4 bits; words and bytes), the compiled path's PTX run through a model of its
instructions against the generic path, attention within the float bound |out - ref32| <= 2 |ref - ref32| +
atol (GQA, MQA, D 64/128/256, shuffled and shared pages, sink + body + window, masks, -rot), a wrong lookup
caught by the first-use self-check, and `generate` end to end equal to the torch backend."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from kernel_e2e import FlippedTable, check_matches_torch, generate_both
from kvquant.kernels import codebook as cb
from kvquant.kernels import decode_attention as da
from kvquant.kernels import dispatch
from kvquant.kernels.layouts import decode_frame, describe_unserved, device_levels
from kvquant.kernels.registry import KernelRegistry, SelfCheck
from kvquant.kernels.testing import (
    check_decode,
    demo_calibration,
    demo_levels,
    make_paged_layer,
    random_query,
)
from ptx_model import run_ptx

from kvquant.codecs.base import codec_for
from kvquant.codecs.packing import pack

# ------------------------------------------------------------------------------- codes, bit for bit


@triton.jit
def _codes_kernel(c_ptr, lv_ptr, out_ptr, BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                  WORDS: tl.constexpr, ASM: tl.constexpr = False):
    """(BT, D * BITS / 8) packed codes -> (BT, D) levels, through the decode kernel's own helpers (ASM: the
    compiled path's PTX lookup, on a GPU only)."""
    row = tl.arange(0, BT)
    valid = row < BT
    if WORDS:
        if BITS == 3:
            M: tl.constexpr = D // 32
            base = row[:, None] * (3 * M) + 3 * tl.arange(0, M)[None, :]
            p = (tl.load(c_ptr + base), tl.load(c_ptr + base + 1), tl.load(c_ptr + base + 2))
        else:
            COLW: tl.constexpr = D * BITS // 32
            p = tl.load(c_ptr + row[:, None] * COLW + tl.arange(0, COLW)[None, :])
        t0, t1, t2, t3, t4, t5, t6, t7 = cb.lut_tables(lv_ptr, BITS, ASM)
        x = cb.lut_words(p, lv_ptr, t0, t1, t2, t3, t4, t5, t6, t7, BT, D, BITS, False, ASM)
    else:
        x = cb._level(lv_ptr, da._code_ints(c_ptr, row, valid, BT, D, BITS), False)
    tl.store(out_ptr + row[:, None] * D + tl.arange(0, D)[None, :], x)


@pytest.mark.parametrize("bits,d,words", [(4, 64, True), (3, 64, True), (2, 64, True), (3, 16, False),
                                          (4, 16, False), (2, 32, False)])
def test_codes_unpack_bit_exact(bits, d, words, device):
    """With levels = the code values (exact in fp16), the kernel's lookup returns codecs.packing's codes
    exactly, in channel order: the word path (three words per 32 codes at 3 bits) and the byte path."""
    g = torch.Generator().manual_seed(bits * 100 + d)
    codes = torch.randint(0, 1 << bits, (16, d), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits).to(device)
    table = cb.table_for(torch.arange(1 << bits, dtype=torch.float32), torch.float16, device)
    out = torch.empty(16, d, dtype=torch.float16, device=device)
    _codes_kernel[(1,)](packed.view(torch.int32) if words else packed, table, out, BT=16, D=d, BITS=bits,
                        WORDS=words)
    assert torch.equal(out.cpu(), codes.half())


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_the_compiled_lookup_on_a_gpu_gives_every_level(bits, device):
    """On a GPU (TRITON_INTERPRET=0): the PRMT lookup itself, for random codes and uneven levels, equals the
    generic path bit for bit. The first thing a GPU run must check: no GPU has run this PTX yet."""
    if da._interpreting():
        pytest.skip("inline PTX runs only compiled, on a GPU (the PTX model test covers it here)")
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (64, 128), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits).to(device).view(torch.int32)
    table = cb.table_for(demo_levels(bits) * 3.7, torch.float16, device)
    out = {asm: torch.empty(64, 128, dtype=torch.float16, device=device) for asm in (False, True)}
    for asm, o in out.items():
        _codes_kernel[(1,)](packed, table, o, BT=64, D=128, BITS=bits, WORDS=True, ASM=asm)
    assert torch.equal(out[True].view(torch.int16), out[False].view(torch.int16))
    assert torch.equal(out[False].cpu(), (demo_levels(bits) * 3.7).half()[codes.long()])


# ------------------------------------------------------------------------------- the PTX, modelled


@triton.jit
def _tables_kernel(lv_ptr, out_ptr, BITS: tl.constexpr):
    t0, t1, t2, t3, t4, t5, t6, t7 = cb.lut_tables(lv_ptr, BITS, True)
    tl.store(out_ptr + 0, t0)
    tl.store(out_ptr + 1, t1)
    tl.store(out_ptr + 2, t2)
    tl.store(out_ptr + 3, t3)
    tl.store(out_ptr + 4, t4)
    tl.store(out_ptr + 5, t5)
    tl.store(out_ptr + 6, t6)
    tl.store(out_ptr + 7, t7)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_compiled_lookup_ptx_equals_the_generic_path(bits, device):
    """The PTX the compiled kernel runs (no GPU has run it yet), evaluated instruction by instruction with
    the tables `lut_tables` builds (run here in the interpreter), gives every code's fp16 level bits: all
    codes in every position, and random words with garbage in a 3-bit unit's unused top byte."""
    levels = demo_levels(bits) * 3.7  # distinct low and high bytes
    table = cb.table_for(levels, torch.float16, device)
    planes = torch.zeros(8, dtype=torch.int32, device=device)
    _tables_kernel[(1,)](table, planes, BITS=bits)
    t = [np.uint32(int(x) & 0xFFFFFFFF) for x in planes.cpu().tolist()]
    want16 = table.cpu().numpy().astype(np.uint16).astype(np.uint32)  # fp16 bits of each level
    g = np.random.default_rng(bits)
    n = 4096
    words = g.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    per = 32 // bits if bits != 3 else 8
    exhaustive = np.array([sum(((c + i) % (1 << bits)) << (bits * i) for i in range(per)) for c in
                           range(1 << bits)], dtype=np.uint64).astype(np.uint32)
    words = np.concatenate([exhaustive, words])
    mask = (1 << bits) - 1
    if bits == 4:
        outs = run_ptx(cb.LUT4_ASM, {8: words, **{9 + i: t[i] for i in range(8)}})
        for i in range(8):
            want = want16[(words >> np.uint32(4 * i)) & mask]
            np.testing.assert_array_equal(outs[i], want, err_msg=f"code {i}")
    elif bits == 3:
        outs = run_ptx(cb.LUT3_ASM, {8: words, **{9 + i: t[i] for i in range(4)}})  # top byte: garbage
        for i in range(8):
            want = want16[(words >> np.uint32(3 * i)) & mask]
            np.testing.assert_array_equal(outs[i], want, err_msg=f"code {i}")
    else:
        for half, asm in enumerate(cb.LUT2_ASM):
            outs = run_ptx(asm, {8: words, 9: t[0], 10: t[1]})
            for i in range(8):
                codes = (words >> np.uint32(2 * (8 * half + i))) & mask
                np.testing.assert_array_equal(outs[i], want16[codes], err_msg=f"code {8 * half + i}")


def test_the_ptx_model_catches_a_wrong_selector():
    """The model is strict enough to fail a PTX string with one selector off (the test above can fail)."""
    wrong = cb.LUT3_ASM.replace("prmt.b32 o1, l0, h0, 0x7362", "prmt.b32 o1, l0, h0, 0x7326")
    words = np.arange(0, 2**24, 4099, dtype=np.uint32)
    planes = {9: np.uint32(0x03020100), 10: np.uint32(0x07060504), 11: np.uint32(0x13121110),
              12: np.uint32(0x17161514)}
    good, bad = run_ptx(cb.LUT3_ASM, {8: words, **planes}), run_ptx(wrong, {8: words, **planes})
    np.testing.assert_array_equal(good[2], 0x1000 + 0x101 * ((words >> np.uint32(6)) & 7))
    assert not np.array_equal(good[2], bad[2])


# ------------------------------------------------------------------------------- attention


SPECS = [  # (K, V, dtype, block size): every bit width, granularity and scale kind, next to other codecs
    ("nuq3-g64", "nuq4-g32", torch.float16, 16),
    ("nuq2-g32-sym", "nuq3-head", torch.float32, 16),
    ("nuq4", "nuq3-channel-g16", torch.bfloat16, 16),
    ("nuq3-channel-g64", "int2-g64", torch.float16, 64),  # the best <= 3-bit recipe's kernel part
    ("fp8-e4m3", "nuq2-g64-sym", torch.float16, 16),
]


@pytest.mark.parametrize("k,v,dtype,bs", SPECS, ids=[f"{k}+{v}-{str(t)[6:]}" for k, v, t, _ in SPECS])
def test_codebook_specs(k, v, dtype, bs, device):
    """Shuffled pages, a page shared by two sequences, sink, body and a window from mid-page."""
    layer = make_paged_layer(k=k, v=v, dtype=dtype, device=device, sink=2, body=64, recent=5,
                             recent_offset=3, share=True, block_size=bs)
    check_decode(layer, random_query(layer, 3, dtype, device), dtype)


@pytest.mark.parametrize("gqa,h_kv,d,k,v", [(4, 2, 128, "nuq3-g64", "nuq3-g64"),
                                            (8, 1, 64, "nuq4-g64", "nuq2-g64")])
def test_codebook_gqa_and_mqa(gqa, h_kv, d, k, v, device):
    layer = make_paged_layer(h_kv=h_kv, d=d, body=64, k=k, v=v, device=device)
    check_decode(layer, random_query(layer, gqa, torch.float16, device), torch.float16)


def test_codebook_d256_mqa_bf16_masked_two_splits(device):
    layer = make_paged_layer(b=2, h_kv=1, d=256, sink=3, body=128, recent=6, recent_offset=9, k="nuq3-g64",
                             v="nuq4-g64", dtype=torch.bfloat16, device=device)
    mask = torch.ones(2, layer.shape[2], dtype=torch.bool)
    mask[1, :20] = False  # left padding into the body
    check_decode(layer, random_query(layer, 4, torch.bfloat16, device), torch.bfloat16,
                 key_mask=mask.to(device), num_splits=2)


def test_rotated_codebook_is_served_in_the_rotated_frame(device):
    layer = make_paged_layer(k="nuq3-g64-rot", v="nuq2-g32-rot7", sink=2, body=64, recent=5,
                             recent_offset=3, device=device)
    assert decode_frame(layer.key_codec, torch.device(device)).signs is not None
    check_decode(layer, random_query(layer, 3, torch.float16, device), torch.float16)


def test_levels_are_copied_once_per_cache_registry(device, monkeypatch):
    codec = codec_for("nuq3-g64", 2, 64, torch.float16)
    codec.set_levels(demo_levels(3))
    reg = KernelRegistry("t", SelfCheck(False))
    a = device_levels(codec, device, reg, torch.float16)
    assert device_levels(codec, device, reg, torch.float16) is a  # no host copy on later steps
    assert device_levels(codec, device, reg, torch.float32).dtype == torch.float32
    codec.set_levels(demo_levels(3) * 0.5)  # new levels (a recalibration): a new table
    assert not torch.equal(device_levels(codec, device, reg, torch.float16), a)


def test_what_the_kernels_serve_is_said_per_codec(device):
    dev = torch.device(device)
    nuq = codec_for("nuq3-g64", 2, 64, torch.float16)
    assert decode_frame(nuq, dev) is None  # no levels yet: nothing to read
    nuq.set_levels(demo_levels(3))
    assert decode_frame(nuq, dev) is not None
    assert "decode attention runs in the Triton kernel" in describe_unserved(nuq, dev)
    pre = codec_for("nuq3-channel-g16-prerope", 2, 64, torch.float16)
    assert "no Triton kernel reads" in describe_unserved(pre, dev)
    assert describe_unserved(codec_for("int4-g32", 2, 64, torch.float16), dev) is None
    from kvquant.backend import kernel_fallback

    assert kernel_fallback(nuq, dev) is None  # appends are packed too (kvquant.kernels.pack_layouts)
    assert kernel_fallback(pre, dev) == describe_unserved(pre, dev)


# ------------------------------------------------------------------------------- -center and -outP


CENTER_OUT = [  # (K, V, dtype, block size)
    ("int4-channel-g16-center", "int4-g32-out2", torch.float16, 64),  # offset row per block; outliers on V
    ("int8-center16-out1", "nuq4-g32-center32-out2", torch.float16, 32),  # both; per-token scale unfolded
    ("nuq3-g64-center", "int8-out3", torch.float32, 64),
    ("int4-center128", "int4-g32-rot-out1", torch.float16, 128),  # N > 64: a row per token; -rot over -out
]


@pytest.mark.parametrize("k,v,dtype,bs", CENTER_OUT, ids=[f"{k}+{v}" for k, v, _, _ in CENTER_OUT])
def test_center_and_outliers(k, v, dtype, bs, device):
    """The offset added back and the outliers written in place, inside the kernel: made large here (offsets
    shifted by 3, outliers set to +-40), so that a kernel that skipped either would be far off the bound."""
    layer = make_paged_layer(k=k, v=v, dtype=dtype, device=device, sink=2, body=2 * bs if bs > 64 else 64,
                             recent=5, recent_offset=3, share=True, block_size=bs)
    for pages in (layer.key_pages, layer.value_pages):
        if "offset" in pages:
            pages["offset"] += 3.0
        if "out_values" in pages:
            sign = torch.where(pages["out_values"] < 0, -1.0, 1.0).to(pages["out_values"].dtype)
            pages["out_values"].copy_(40 * sign)
    for codec in (layer.key_codec, layer.value_codec):
        assert decode_frame(codec, torch.device(device)) is not None
    check_decode(layer, random_query(layer, 3, dtype, device), dtype)


def test_center_around_a_rotation_takes_the_reference_path(device):
    codec = codec_for("int4-g32-center-rot", 2, 64, torch.float16)
    assert decode_frame(codec, torch.device(device)) is None
    assert "no Triton kernel reads" in describe_unserved(codec, torch.device(device))


# ------------------------------------------------------------------------------- the self-check


def test_a_wrong_codebook_variant_is_caught_and_served_by_the_reference(device, monkeypatch, caplog):
    monkeypatch.setattr(da, "_paged_split_kernel", FlippedTable(da._paged_split_kernel))
    check = KernelRegistry("t", self_check=SelfCheck(enabled=True))
    layer = make_paged_layer(k="nuq3-g64", v="nuq4-g32", sink=2, body=64, recent=3, device=device)
    q = random_query(layer, 2, torch.float16, device)
    with caplog.at_level(logging.WARNING, logger="kvquant.kernels"):
        for _ in range(2):
            assert dispatch.fused_attention(q, layer, None, None, registry=check) is None  # -> reference
    (msg,) = [r.getMessage() for r in caplog.records if "disagrees with its reference twin" in r.getMessage()]
    assert "decode_attention" in msg and float(re.search(r"= ([0-9.e-]+) >", msg).group(1)) > 0.01
    ((name, variant, _),) = check.self_check.disabled()
    assert name == "decode_attention" and ("K_LUT", True) in variant and ("V_LUT", True) in variant


# ------------------------------------------------------------------------------- end to end


def _calibration(tmp_path, scheme: str, config) -> str:
    """A calibration file with stand-in levels for every codebook the scheme needs (a different table per
    layer and K/V), as `experiments/calibrate.py` writes one."""
    return demo_calibration(tmp_path / "levels.safetensors", scheme, config)


E2E = [  # (scheme, layers the kernel serves, the codec a layer falls back for)
    ("k=nuq3-channel-g16,v=nuq4-g32-out2,sink=2,window=4", 2, None),
    # per layer: layer 0 centred keys over 2-bit levels; layer 1's -prerope codebook keys (RoPE in the kernel)
    ("layers=0:int4-channel-g16-center16/nuq2-g32+1:nuq3-channel-g16-prerope/nuq3-g64-sym,window=4", 2, None),
    # layer 1's -center around a rotation takes the reference path, logged
    ("layers=0:nuq3-g64/nuq2-g32+1:int4-g32-center-rot/nuq3-g64-sym,window=4", 1, "int4-g32-center-rot"),
]


@pytest.mark.parametrize("scheme,served_layers,fallback", E2E)
def test_generate_codebook_with_kernels_matches_the_torch_backend(scheme, served_layers, fallback, tmp_path,
                                                                  monkeypatch, caplog, device):
    if device.type != "cpu":
        pytest.skip("the cache end to end runs under the interpreter here (on a GPU: gpu_check's e2e phase)")
    from tiny_models import make_tiny_config

    scheme = f"{scheme},calib={_calibration(tmp_path, scheme, make_tiny_config(num_hidden_layers=2))}"
    ref, got, served = generate_both(scheme, monkeypatch, caplog)
    check_matches_torch(ref, got, served, 4 * served_layers, caplog, fallback)  # every served layer's steps
