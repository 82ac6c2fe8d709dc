"""Paged decode_attention (Triton) against its twin: |out - ref32| <= 2 |ref_same_dtype - ref32| + atol."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kvquant.kernels.decode_attention import (
    _codes,
    _codes_w8,
    _interpreting,
    decode_attention,
    decode_attention_ref,
    gather_region,
)
from kvquant.kernels.testing import DECODE_ATOL, check_decode, make_paged_layer, random_query

ATOL = DECODE_ATOL
query = random_query
check = check_decode


SPECS = [  # (K, V): every bit width and granularity, sym/asym, scale dtypes, dense bodies
    ("int8", "int8"),
    ("int8-head-sbf16", "int8-g32"),
    ("int4-g32", "int4-g32"),
    ("int4-head-sym-sfp32", "int4"),
    ("int4-channel-g8", "int4-g16-sfp16"),
    ("int2-g16", "int2-g32-sym"),
    ("int2-channel-g16-sym", "int2-head"),
    ("int4-g32", "fp16"),
    ("fp16", "fp16"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k,v", SPECS, ids=[f"{k}+{v}" for k, v in SPECS])
def test_specs(k, v, dtype, device):
    """Shuffled page tables, a page shared by two sequences, recent starting mid-page, sink, body."""
    layer = make_paged_layer(k=k, v=v, dtype=dtype, device=device, body=48, recent=5, recent_offset=3,
                             share=True)
    check(layer, query(layer, 3, dtype, device), dtype)


@pytest.mark.parametrize("gqa,h_kv", [(1, 2), (4, 2), (8, 1), (6, 1)])
def test_gqa_and_mqa(gqa, h_kv, device):
    layer = make_paged_layer(h_kv=h_kv, body=32, k="int4-g64", v="int8", device=device)
    check(layer, query(layer, gqa, torch.float16, device), torch.float16)


@pytest.mark.parametrize(
    "sink,body,recent,offset",
    [(0, 16, 0, 0), (0, 0, 1, 0), (4, 0, 0, 0), (3, 16, 0, 0), (0, 144, 7, 9), (4, 144, 13, 15),
     (1, 0, 16, 1)],
)
def test_regions_present_and_absent(sink, body, recent, offset, device):
    layer = make_paged_layer(sink=sink, body=body, recent=recent, recent_offset=offset, k="int4-g64",
                             v="int8-head", device=device)
    check(layer, query(layer, 3, torch.float16, device), torch.float16)


def test_body_partly_filled_last_page_and_block_size_32(device):
    """body 40 tokens in pages of 16 (last page half full), and kivi-style K at block_size 32."""
    layer = make_paged_layer(body=40, k="int4-g32", v="int4-g32", device=device)
    check(layer, query(layer, 3, torch.float16, device), torch.float16)
    layer = make_paged_layer(body=64, k="int4-channel-g32", v="int4-g32", block_size=32, recent=9,
                             recent_offset=20, device=device)
    check(layer, query(layer, 3, torch.float16, device), torch.float16)


def test_fp_pages_smaller_than_body_pages(device):
    """The cache's FP (sink and window) pages hold the requested 16 tokens while channel-wise K groups of 64
    raise body pages to 64: a sink of 5 and a window from mid-page span several FP pages per body page."""
    layer = make_paged_layer(sink=5, body=128, recent=37, recent_offset=7, k="int4-channel-g64",
                             v="int4-g64", block_size=64, fp_block_size=16, device=device)
    assert layer.fp_k.shape[2] == 16 and layer.key_pages["codes"].shape[2] == 64
    check(layer, query(layer, 3, torch.float16, device), torch.float16)


def key_mask(kind: str, b: int, t: int, device) -> torch.Tensor:
    """(B, T) bool, or (1, T) for "broadcast"; True = attend, positions in sink | body | recent order."""
    m = torch.ones(b, t, dtype=torch.bool)
    if kind == "left_padding":  # padding cuts into the sink, the body, all but the recent; a trimmed end
        for i, (start, end) in enumerate([(0, t), (2, t), (30, t), (t - 5, t - 1)][:b]):
            m[i, :start], m[i, end:] = False, False
    elif kind == "holes":
        for i in range(b):
            m[i, i::3] = False
        m[-1, 1:12] = False
    elif kind == "broadcast":
        m = (torch.arange(t) % 4 != 1)[None]
    elif kind == "one_empty_row":
        m[0, :7] = False
        m[1] = False
    return m.to(device)


MASKS = ["left_padding", "holes", "broadcast", "one_empty_row"]


@pytest.mark.parametrize("kind", MASKS)
def test_key_mask(kind, device):
    """Any mask pattern, per sequence or broadcast, across the sink | body | recent seams and splits."""
    layer = make_paged_layer(b=4, sink=3, body=80, recent=6, recent_offset=2, k="int4-channel-g8",
                             v="int4-g32", device=device)
    check(layer, query(layer, 3, torch.float16, device), torch.float16,
          key_mask=key_mask(kind, 4, 89, device), num_splits=2)


def test_all_false_row_gives_zeros_as_sdpa_does(device):
    layer = make_paged_layer(b=2, sink=2, body=16, recent=3, k="int8", v="int8", dtype=torch.float32,
                             device=device)
    q = query(layer, 3, torch.float32, device)
    mask = torch.zeros(2, 21, dtype=torch.bool, device=device)
    mask[0, 3:] = True
    kf = {n: gather_region(p, layer.body, 1) for n, p in layer.key_pages.items()}
    vf = {n: gather_region(p, layer.body, 1) for n, p in layer.value_pages.items()}
    keys = torch.cat([gather_region(layer.fp_k, layer.sink), layer.key_codec.decode(kf, torch.float32),
                      gather_region(layer.fp_k, layer.recent)], dim=2)
    values = torch.cat([gather_region(layer.fp_v, layer.sink), layer.value_codec.decode(vf, torch.float32),
                        gather_region(layer.fp_v, layer.recent)], dim=2)
    sdpa = F.scaled_dot_product_attention(
        q.cpu(), keys.cpu(), values.cpu(), attn_mask=mask.cpu()[:, None, None], enable_gqa=True
    ).transpose(1, 2)
    for out in (decode_attention(q, *layer.decode_args(), key_mask=mask),
                decode_attention_ref(q, *layer.decode_args(), key_mask=mask)):
        assert torch.equal(out[1].cpu(), torch.zeros_like(sdpa[1]))
        torch.testing.assert_close(out.cpu(), sdpa, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("d", [128, 256])
def test_head_dims(d, device):
    layer = make_paged_layer(b=1, h_kv=1, d=d, body=32, k="int4-g64", v="int2-g32", device=device)
    check(layer, query(layer, 4, torch.float16, device), torch.float16)


def test_bf16_and_scaling(device):
    layer = make_paged_layer(b=1, body=32, k="int8", v="int4-g32", dtype=torch.bfloat16, device=device)
    check(layer, query(layer, 3, torch.bfloat16, device), torch.bfloat16, scaling=0.3)


BF16_INT4 = [("int4-g64", "int4-g32"), ("int4-channel-g32", "int4"), ("int4-g32-center", "int4-g64-out1"),
             ("int4-head", "int4-channel-g16")]


@pytest.mark.parametrize("k,v", BF16_INT4, ids=[f"{k}+{v}" for k, v in BF16_INT4])
def test_bf16_asymmetric_int4(k, v, device):
    """Compiled, asymmetric 4-bit codes in bf16 take bf16x2 arithmetic (`kernels.codes.NIB_BF16_*_ASM`,
    codes as bf16 128 + c): groups, channel-wise rows, per-token (folded), -center and -outP; here the
    interpreter's fp32 path (it has no bf16 arithmetic), on a GPU the bf16x2 one."""
    layer = make_paged_layer(k=k, v=v, dtype=torch.bfloat16, device=device, sink=2, body=128, recent=5,
                             recent_offset=3, share=True, block_size=64)
    check(layer, query(layer, 3, torch.bfloat16, device), torch.bfloat16)


@pytest.mark.parametrize("high", [False, True])
def test_bf16_nibble_ptx_gives_every_code(high):
    """The bf16 nibble PTX (no GPU has run it yet), evaluated instruction by instruction: lane i of output j
    is bf16 0x4300 | nibble (128 + code) of byte 2j + i, low or high nibble, for every byte value."""
    import numpy as np
    from kvquant.kernels.codes import NIB_BF16_HI_ASM, NIB_BF16_LO_ASM
    from ptx_model import run_ptx

    g = np.random.default_rng(1)
    words = np.concatenate([np.arange(256, dtype=np.uint32) * 0x01010101,
                            g.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)])
    lanes = _run_words(NIB_BF16_HI_ASM if high else NIB_BF16_LO_ASM, words, run_ptx)
    for j in range(4):  # output j // 2, lane j % 2 holds byte j's nibble
        byte = (words >> np.uint32(8 * j)) & 0xFF
        nib = (byte >> np.uint32(4)) if high else byte & np.uint32(15)
        np.testing.assert_array_equal(lanes[j], 0x4300 | nib, err_msg=f"byte {j}")


def _run_words(asm: str, words, run_ptx):
    """run_ptx for an asm with two 32-bit outputs $0, $1 (input $2): their four 16-bit lanes, in order."""
    body = asm.strip().strip("{}").replace("$0", "o0").replace("$1", "o1").replace("$2", "$8")
    outs = run_ptx("{ .reg .b32 o0, o1; " + body + "; mov.b32 {$0, $1}, o0; mov.b32 {$2, $3}, o1; }",
                   {8: words})
    return [outs[i] for i in range(4)]


WIDE = [  # (K, V) at block_t=128: one or two per family the compiled launcher runs at 128 tokens
    ("int8", "int8-g32-sym"),
    ("int4-channel-g64", "int4-g64"),  # two channel-wise scale rows per block
    ("int4-channel-g128-sfp16", "int2-g16"),  # a scale row the size of the block
    ("int4-g32-center", "int4"),  # -center: two offset rows per block; a folded per-token scale
    ("nuq3-channel-g64", "nuq2-g64"),  # codebook words (8 codes in 3 bytes), the 3-bit recipe's shape
    ("fp8-e4m3", "fp8-e5m2-g32"),
    ("llama.cpp:q8_0", "llama.cpp:q4_1"),
    ("vllm:int8_per_token_head", "vllm:fp8_per_token_head"),
]


@pytest.mark.parametrize("k,v", WIDE, ids=[f"{k}+{v}" for k, v in WIDE])
def test_wide_block_of_128_tokens(k, v, device):
    """block_t=128 (what the compiled launcher takes at D <= 128 where it spills nothing and runs fewer
    instructions; the interpreter's default is 64): 32-token warp slabs, a partly filled last block,
    sink + body + window from mid-page, shuffled and shared pages, left padding, two splits."""
    whole = "g128" in k  # groups of 128 tokens: whole blocks only
    layer = make_paged_layer(b=2, sink=3, body=3 * 128 if whole else 2 * 128 + 64, recent=6, recent_offset=2,
                             k=k, v=v, block_size=128 if whole else 64, fp_block_size=16, share=True,
                             device=device)
    mask = torch.ones(2, layer.shape[2], dtype=torch.bool)
    mask[1, :40] = False  # left padding into the body
    check(layer, query(layer, 3, torch.float16, device), torch.float16, key_mask=mask.to(device),
          num_splits=2, block_t=128)


def test_block_t_must_be_a_power_of_two(device):
    layer = make_paged_layer(body=16, device=device)
    with pytest.raises(ValueError, match="block_t must be a power of two >= 16"):
        decode_attention(query(layer, 3, torch.float16, device), *layer.decode_args(), block_t=96)


def test_many_splits_agree_with_one(device):
    layer = make_paged_layer(b=1, h_kv=1, sink=0, body=304, recent=0, dtype=torch.float32, device=device)
    q = query(layer, 2, torch.float32, device)
    one = decode_attention(q, *layer.decode_args(), num_splits=1)
    many = decode_attention(q, *layer.decode_args(), num_splits=4)
    torch.testing.assert_close(one, many, rtol=1e-5, atol=1e-6)


def test_bad_inputs(device):
    layer = make_paged_layer(body=16, device=device)
    q = query(layer, 3, torch.float16, device)
    args = layer.decode_args()
    with pytest.raises(ValueError, match=r"\(B, H_q, 1, D\)"):
        decode_attention(q.expand(-1, -1, 2, -1), *args)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        decode_attention(q[:, :5], *args)
    t = layer.shape[2]
    with pytest.raises(TypeError, match="must be bool"):
        decode_attention(q, *args, key_mask=torch.ones(2, t, device=device))
    with pytest.raises(ValueError, match=r"key_mask must be \(B=2 or 1, T="):
        decode_attention(q, *args, key_mask=torch.ones(2, t + 1, dtype=torch.bool, device=device))
    codes = layer.key_pages["codes"]
    strided = dict(layer.key_pages, codes=codes.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention(q, layer.fp_k, layer.fp_v, strided, *args[3:])


@triton.jit
def _decode_codes_kernel(w_ptr, b_ptr, out_w_ptr, out_b_ptr, BT: tl.constexpr, D: tl.constexpr,
                         BIAS: tl.constexpr, F16: tl.constexpr, ASM: tl.constexpr):
    """The same 8-bit codes read as int32 words and as bytes, each decoded to (BT, D) code - BIAS."""
    OUT: tl.constexpr = tl.float16 if F16 else tl.float32
    t = tl.arange(0, BT)
    words = tl.load(w_ptr + t[:, None] * (D // 4) + tl.arange(0, D // 4)[None, :])
    bytes_ = tl.load(b_ptr + t[:, None] * D + tl.arange(0, D)[None, :])
    offs = t[:, None] * D + tl.arange(0, D)[None, :]
    tl.store(out_w_ptr + offs, _codes_w8(words, BT, D, BIAS, OUT, ASM))
    tl.store(out_b_ptr + offs, _codes(bytes_, BT, D, 8, BIAS, OUT, ASM))


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [0, 128])
def test_int8_codes_read_as_words_decode_bit_exact(bias, out_dtype, device):
    """8-bit codes loaded as int32 words (byte k of word j = code 4j + k) decode to exactly the values the
    byte path gives, and to code - bias, for all 256 codes."""
    g = torch.Generator().manual_seed(3)
    codes = torch.arange(256, dtype=torch.uint8).repeat(4)[torch.randperm(1024, generator=g)].reshape(16, 64)
    codes = codes.to(device)
    out_w = torch.empty(16, 64, dtype=out_dtype, device=device)
    out_b = torch.empty_like(out_w)
    _decode_codes_kernel[(1,)](codes.view(torch.int32), codes, out_w, out_b, BT=16, D=64, BIAS=bias,
                               F16=out_dtype == torch.float16, ASM=not _interpreting())
    want = (codes.float() - bias).to(out_dtype)
    assert torch.equal(out_w, want) and torch.equal(out_b, want)


class _StubKernel:
    """Stands in for `_paged_split_kernel` in `_block_tokens`: warmup returns the BLOCK_T it was given."""

    def __init__(self):
        self.warmups = []

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append(kwargs["BLOCK_T"])
        return kwargs["BLOCK_T"]


@pytest.mark.parametrize("compiled,expected", [
    ({64: (605, 0), 128: (808, 0)}, 128),  # int8 at D=128: 9.45 -> 6.31 instructions per token
    ({64: (1494, 0), 128: (2562, 56)}, 64),  # -outP: 128 is shorter per token but spills
    ({64: (812, 0), 128: (1612, 0)}, 64),  # nuq4-g64: 0.7% fewer, not worth twice the shared memory
    ({64: (894, 0), 128: (2210, 0)}, 64),  # nvfp4: longer at 128
    ({64: (1599, 48), 128: (2836, 56)}, 128),  # both spill: the shorter per token
])
def test_block_tokens_chooses_from_the_compiled_code(compiled, expected, monkeypatch):
    """The launcher's choice of 64 or 128 tokens per iteration (compiled builds only; here the compiler
    and the SASS reader are stand-ins): 128 only where it spills no more than 64 and issues at most
    WIDE_GAIN of 64's instructions per token; kept per variant on the registry (no second compile); D=256
    and the interpreter take 64 without compiling; a reader that fails keeps 64 and says so."""
    from kvquant.kernels import compiled as compiled_mod
    from kvquant.kernels import decode_attention as da
    from kvquant.kernels.compiled import KernelResources
    from kvquant.kernels.registry import KernelRegistry

    stub = _StubKernel()
    monkeypatch.setattr(da, "_paged_split_kernel", stub)
    monkeypatch.setattr(da, "_interpreting", lambda: False)
    monkeypatch.setattr(compiled_mod, "resources", lambda bt: KernelResources(
        "split", 4, 200, compiled[bt][1], 0, 2, loops=[compiled[bt][0], 1]))
    plan = lambda bt: ((1, 1), (), {"BLOCK_T": bt}, None)  # noqa: E731
    registry = KernelRegistry("test")
    assert da._block_tokens(registry, 128, ("variant",), plan, 4) == expected
    assert stub.warmups == [64, 128]
    assert da._block_tokens(registry, 128, ("variant",), plan, 4) == expected  # kept: no compile
    assert stub.warmups == [64, 128] and registry.blocks == {("variant",): expected}
    assert da._block_tokens(registry, 256, ("other",), plan, 8) == 64 and len(stub.warmups) == 2
    monkeypatch.setattr(da, "_interpreting", lambda: True)
    assert da._block_tokens(KernelRegistry("t2"), 128, ("v",), plan, 4) == 64
    assert len(stub.warmups) == 2


def test_block_tokens_keeps_64_when_the_binary_cannot_be_read(monkeypatch, caplog):
    from kvquant.kernels import compiled as compiled_mod
    from kvquant.kernels import decode_attention as da
    from kvquant.kernels.registry import KernelRegistry

    def broken(kernel):
        raise FileNotFoundError("cuobjdump")

    monkeypatch.setattr(da, "_paged_split_kernel", _StubKernel())
    monkeypatch.setattr(da, "_interpreting", lambda: False)
    monkeypatch.setattr(compiled_mod, "resources", broken)
    with caplog.at_level("WARNING", logger="kvquant.kernels.decode_attention"):
        got = da._block_tokens(KernelRegistry("test"), 128, ("v",),
                               lambda bt: ((1, 1), (), {"BLOCK_T": bt}, None), 4)
    assert got == 64 and "cannot read the compiled kernel (FileNotFoundError" in caplog.text
