"""Decode attention over a quantized layer as it is stored: `decode_attention` (Triton) and its twin
`decode_attention_ref` (PyTorch).

One new query token per sequence attends to the layer's tokens in position order

    sink (FP, S tokens) | body (packed INT8/INT4/INT2 + scales/zeros, or dense FP; T_b) | recent (FP, R)

without materializing dequantized K/V. Flash-decoding: the token axis is cut into splits, each program
computes an unnormalized partial (running max m, sum l, accumulator acc) for one split of one
(sequence, KV head), and a reduce kernel merges the splits. Splits 0..n_body-1 read the body, the last
ones read the FP tokens (sink then recent) so each program has one load path. GQA: one program serves
all H_q / H_kv query heads of its KV head, so every K/V byte is read once per step.

Masking (left padding in a batch, or any pattern): key_mask (B, T) bool, True = attend, with positions
in sink | body | recent order. Each program loads the mask bytes of its token block and ANDs them into
the block's valid lanes, so K/V bytes of masked tokens are not read and nothing is checked on the host
(no device->host sync). A sequence with no attended token gets a zero output, as torch SDPA's math path
gives for an all-False bool mask row (both twins agree).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kvquant.quantize import QTensor, dequantize
from kvquant.scheme import Granularity

__all__ = ["decode_attention", "decode_attention_ref"]

_LOG2E = 1.4426950408889634
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------- jit


@triton.jit
def _unpack(packed, BLOCK_T: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """(BLOCK_T, D * BITS // 8) bytes -> (BLOCK_T, D) int32 codes; byte j holds codes per*j .. per*j+per-1,
    lowest bits first (kvquant.packing)."""
    p = packed.to(tl.int32)
    if BITS == 8:
        return p
    elif BITS == 4:
        return tl.reshape(tl.join(p & 15, p >> 4), (BLOCK_T, D))  # [.., j, i] = code 2j + i
    else:
        # join appends a last axis: join(join(c0, c2), join(c1, c3))[.., j, a, c] = code 4j + 2a + c,
        # so the flattened order is c0, c1, c2, c3
        c0, c1, c2, c3 = p & 3, (p >> 2) & 3, (p >> 4) & 3, (p >> 6) & 3
        return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (BLOCK_T, D))


@triton.jit
def _load_body(
    codes_ptr, scale_ptr, zero_ptr,
    s_cb, s_ch, s_ct, s_cd, s_sb, s_sh, s_st, s_sd,
    b, h, t, valid, offs_d,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
    TN: tl.constexpr, DN: tl.constexpr, OUT: tl.constexpr,
):
    """Body tokens t (BLOCK_T,) of (b, h) -> (BLOCK_T, D) in dtype OUT, dequantized in fp32 as
    kvquant.quantize.dequantize does. BITS 16: a dense body. The scale/zero of (token t, channel d) sit at
    row t // TN, column d // DN (token/head: DN = D, one per row; group: DN = N; channel: TN = N, DN = 1)."""
    if BITS == 16:
        ptrs = codes_ptr + b * s_cb + h * s_ch + t[:, None] * s_ct + offs_d[None, :] * s_cd
        return tl.load(ptrs, mask=valid[:, None], other=0.0).to(OUT)
    else:
        PER: tl.constexpr = 8 // BITS
        offs_byte = tl.arange(0, D // PER)
        ptrs = codes_ptr + b * s_cb + h * s_ch + t[:, None] * s_ct + offs_byte[None, :] * s_cd
        codes = _unpack(tl.load(ptrs, mask=valid[:, None], other=0), BLOCK_T, D, BITS).to(tl.float32)
        s_base = scale_ptr + b * s_sb + h * s_sh
        z_base = zero_ptr + b * s_sb + h * s_sh
        if DN == D:  # one scale per (token, head): a vector, broadcast along D
            s_off = (t // TN) * s_st
            scale = tl.load(s_base + s_off, mask=valid, other=0.0).to(tl.float32)[:, None]
            if not SYMMETRIC:
                zero = tl.load(z_base + s_off, mask=valid, other=0.0).to(tl.float32)[:, None]
        else:
            s_off = (t // TN)[:, None] * s_st + (offs_d // DN)[None, :] * s_sd
            scale = tl.load(s_base + s_off, mask=valid[:, None], other=0.0).to(tl.float32)
            if not SYMMETRIC:
                zero = tl.load(z_base + s_off, mask=valid[:, None], other=0.0).to(tl.float32)
        if SYMMETRIC:
            QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
            OFFSET: tl.constexpr = 1 << (BITS - 1)
            x = (codes - OFFSET) * (scale * (1.0 / QMAX))
        else:
            x = codes * scale + zero
        return x.to(OUT)


@triton.jit
def _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_FP32: tl.constexpr):
    """One online-softmax step (log2 domain): q (G_PAD, D), k/v (BLOCK_T, D), valid (BLOCK_T,)."""
    if DOT_FP32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))  # (G_PAD, BLOCK_T), fp32 accumulation
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block must not give NaN
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, sq_b, sq_h, sq_d,
    sink_k_ptr, sink_v_ptr, s_skb, s_skh, s_skt, s_skd, s_svb, s_svh, s_svt, s_svd,
    rec_k_ptr, rec_v_ptr, s_rkb, s_rkh, s_rkt, s_rkd, s_rvb, s_rvh, s_rvt, s_rvd,
    kc_ptr, ks_ptr, kz_ptr, s_kcb, s_kch, s_kct, s_kcd, s_ksb, s_ksh, s_kst, s_ksd,
    vc_ptr, vs_ptr, vz_ptr, s_vcb, s_vch, s_vct, s_vcd, s_vsb, s_vsh, s_vst, s_vsd,
    mask_ptr, s_mb, s_mt,  # key_mask (B, T) as uint8; s_mb = 0 for a broadcast (1, T) mask
    m_ptr, l_ptr, acc_ptr,  # partials (B * H_kv, NSPLIT, G_PAD[, D]), contiguous fp32
    H_KV, S, T_BODY, R, N_BODY_SPLITS, NSPLIT, BODY_CHUNK, FP_CHUNK, qk_scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
    K_BITS: tl.constexpr, K_SYM: tl.constexpr, K_TN: tl.constexpr, K_DN: tl.constexpr,
    V_BITS: tl.constexpr, V_SYM: tl.constexpr, V_TN: tl.constexpr, V_DN: tl.constexpr,
    HAS_MASK: tl.constexpr, DOT_FP32: tl.constexpr,
):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H_KV
    h = bh % H_KV
    b64 = b.to(tl.int64)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BLOCK_T)
    q_ptrs = q_ptr + b64 * sq_b + (h * G + offs_g)[:, None] * sq_h + offs_d[None, :] * sq_d
    q = tl.load(q_ptrs, mask=offs_g[:, None] < G, other=0.0)  # (G_PAD, D): the query heads of KV head h
    mask_row = mask_ptr + b64 * s_mb
    cdt = q.dtype

    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    if split < N_BODY_SPLITS:
        # body tokens [lo, hi); body token i is position S + i
        lo = split * BODY_CHUNK
        hi = tl.minimum(lo + BODY_CHUNK, T_BODY)
        for t0 in tl.range(lo, hi, BLOCK_T):
            t = t0 + offs_t
            valid = t < hi
            if HAS_MASK:
                valid = valid & (tl.load(mask_row + (S + t) * s_mt, mask=valid, other=0) != 0)
            k = _load_body(kc_ptr, ks_ptr, kz_ptr, s_kcb, s_kch, s_kct, s_kcd, s_ksb, s_ksh, s_kst, s_ksd,
                           b64, h, t, valid, offs_d, D, BLOCK_T, K_BITS, K_SYM, K_TN, K_DN, cdt)
            v = _load_body(vc_ptr, vs_ptr, vz_ptr, s_vcb, s_vch, s_vct, s_vcd, s_vsb, s_vsh, s_vst, s_vsd,
                           b64, h, t, valid, offs_d, D, BLOCK_T, V_BITS, V_SYM, V_TN, V_DN, cdt)
            m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_FP32)
    else:
        # FP tokens u in [0, S + R): u < S is sink[u] (position u), else recent[u - S] (position u + T_BODY)
        f = split - N_BODY_SPLITS
        lo = f * FP_CHUNK
        hi = tl.minimum(lo + FP_CHUNK, S + R)
        for u0 in tl.range(lo, hi, BLOCK_T):
            u = u0 + offs_t
            in_sink = u < S
            pos = tl.where(in_sink, u, u + T_BODY)
            valid = u < hi
            if HAS_MASK:
                valid = valid & (tl.load(mask_row + pos * s_mt, mask=valid, other=0) != 0)
            r = tl.where(in_sink, 0, u - S)
            su = tl.where(in_sink, u, 0)
            ks = sink_k_ptr + b64 * s_skb + h * s_skh + su[:, None] * s_skt + offs_d[None, :] * s_skd
            kr = rec_k_ptr + b64 * s_rkb + h * s_rkh + r[:, None] * s_rkt + offs_d[None, :] * s_rkd
            vs = sink_v_ptr + b64 * s_svb + h * s_svh + su[:, None] * s_svt + offs_d[None, :] * s_svd
            vr = rec_v_ptr + b64 * s_rvb + h * s_rvh + r[:, None] * s_rvt + offs_d[None, :] * s_rvd
            k_sink = tl.load(ks, mask=valid[:, None] & in_sink[:, None], other=0.0).to(cdt)
            k_rec = tl.load(kr, mask=valid[:, None] & ~in_sink[:, None], other=0.0).to(cdt)
            v_sink = tl.load(vs, mask=valid[:, None] & in_sink[:, None], other=0.0).to(cdt)
            v_rec = tl.load(vr, mask=valid[:, None] & ~in_sink[:, None], other=0.0).to(cdt)
            k = tl.where(in_sink[:, None], k_sink, k_rec)
            v = tl.where(in_sink[:, None], v_sink, v_rec)
            m_i, l_i, acc = _attend(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_FP32)

    part = bh.to(tl.int64) * NSPLIT + split
    tl.store(m_ptr + part * G_PAD + offs_g, m_i)
    tl.store(l_ptr + part * G_PAD + offs_g, l_i)
    tl.store(acc_ptr + (part * G_PAD + offs_g)[:, None] * D + offs_d[None, :], acc)


@triton.jit
def _decode_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, so_b, so_h, so_d,
    H_KV, NSPLIT,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, SPLIT_PAD: tl.constexpr,
):
    """Merge the splits of one query head: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    bh = tl.program_id(0)
    g = tl.program_id(1)
    b = bh // H_KV
    h = bh % H_KV
    offs_s = tl.arange(0, SPLIT_PAD)
    offs_d = tl.arange(0, D)
    rows = (bh.to(tl.int64) * NSPLIT + offs_s) * G_PAD + g
    m = tl.load(m_ptr + rows, mask=offs_s < NSPLIT, other=float("-inf"))
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # (SPLIT_PAD,); 0 for empty splits
    denom = tl.sum(w * tl.load(l_ptr + rows, mask=offs_s < NSPLIT, other=0.0), axis=0)
    acc = tl.zeros((D,), tl.float32)
    for s in tl.range(0, NSPLIT):
        row = (bh.to(tl.int64) * NSPLIT + s) * G_PAD + g
        w_s = tl.exp2(tl.load(m_ptr + row) - m_max)
        acc += w_s * tl.load(acc_ptr + row * D + offs_d)
    out = acc / tl.where(denom > 0, denom, 1.0)  # no valid token at all -> zeros, not NaN
    o_ptrs = out_ptr + b.to(tl.int64) * so_b + (h * G + g) * so_h + offs_d * so_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------- launcher


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _body_args(body, h_kv: int, d: int, like: torch.Tensor):
    """(codes, scale, zero, 8 strides, BITS, SYM, TN, DN) for a body part; dummies when there is none."""
    if body is None:
        return (like, like, like, 0, 0, 0, 0, 0, 0, 0, 0, 16, False, 1, d)
    if isinstance(body, torch.Tensor):
        return (body, body, body, *body.stride(), 0, 0, 0, 0, 16, False, 1, d)
    spec = body.spec
    if body.codes.dtype != torch.uint8:
        raise TypeError(f"decode_attention: packed codes must be uint8, got {body.codes.dtype}")
    scale, zero = body.scale, body.zero if body.zero is not None else body.scale
    if zero.stride() != scale.stride():  # one set of strides serves both
        scale, zero = scale.contiguous(), zero.contiguous()
    ss = list(scale.stride())
    if body.scale.shape[1] == 1:  # token granularity: one scale for every head
        ss[1] = 0
    tn, dn = 1, d
    if spec.granularity is Granularity.GROUP:
        dn = spec.group_size
    elif spec.granularity is Granularity.CHANNEL:
        tn, dn = spec.group_size, 1
    return (body.codes, scale, zero, *body.codes.stride(), *ss, spec.bits, spec.symmetric, tn, dn)


def _fp_args(k: torch.Tensor | None, v: torch.Tensor | None, like: torch.Tensor):
    """(k, v, 4 K strides, 4 V strides) for an FP part; a dummy pointer when absent (it is never read)."""
    if k is None:
        return (like, like) + (0,) * 8
    return (k, v, *k.stride(), *v.stride())


def _num_splits(bh: int, t_body: int, block_t: int, device: torch.device) -> int:
    """Enough body splits to give every SM about two programs, none shorter than 4 blocks."""
    if t_body == 0:
        return 0
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 2  # the interpreter runs programs one after another
    want = triton.cdiv(target, bh)
    return max(1, min(want, triton.cdiv(t_body, 4 * block_t)))


def _mask_arg(key_mask: torch.Tensor | None, bsz: int, total: int, like: torch.Tensor):
    """(mask as uint8, stride_b, stride_t, HAS_MASK) for the split kernel; a dummy pointer when None."""
    if key_mask is None:
        return like, 0, 0, False
    if key_mask.dtype != torch.bool:
        raise TypeError(f"decode_attention: key_mask must be bool (True = attend), got {key_mask.dtype}")
    if key_mask.dim() != 2 or key_mask.shape[0] not in (1, bsz) or key_mask.shape[1] != total:
        raise ValueError(f"decode_attention: key_mask must be (B={bsz} or 1, T={total}), "
                         f"got {tuple(key_mask.shape)}")
    if key_mask.device != like.device:
        raise ValueError(f"decode_attention: key_mask is on {key_mask.device}, query on {like.device}")
    m = key_mask.expand(bsz, total).view(torch.uint8)  # a view: (1, T) -> stride 0 along B, no copy
    return m, m.stride(0), m.stride(1), True


def _launch(query, sink_k, sink_v, key_body, value_body, recent_k, recent_v, scaling, key_mask,
            num_splits, block_t, num_warps):
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"decode_attention: query must be (B, H_q, 1, D), got {tuple(query.shape)}")
    if query.dtype not in _FLOAT:
        raise TypeError(f"decode_attention: query must be fp16, bf16 or fp32, got {query.dtype}")
    bsz, h_q, _, d = query.shape
    if d < 16 or d & (d - 1):
        raise ValueError(f"decode_attention: head_dim must be a power of two >= 16, got {d}")
    parts = {"sink_k": sink_k, "sink_v": sink_v, "recent_k": recent_k, "recent_v": recent_v}
    shapes = {}
    for name, t in parts.items():
        if t is None or t.shape[2] == 0:
            parts[name] = None
            continue
        if t.dim() != 4 or t.shape[0] != bsz or t.shape[3] != d or t.dtype not in _FLOAT:
            raise ValueError(f"decode_attention: {name} must be float (B={bsz}, H_kv, n, D={d}), "
                             f"got {tuple(t.shape)} {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"decode_attention: {name} is on {t.device}, query on {query.device}")
        shapes[name] = t.shape
    bodies = {"key_body": key_body, "value_body": value_body}
    for name, body in bodies.items():
        if body is None:
            continue
        shape = body.shape
        if len(shape) != 4 or shape[0] != bsz or shape[3] != d:
            raise ValueError(f"decode_attention: {name} must be (B={bsz}, H_kv, T, D={d}), "
                             f"got {tuple(shape)}")
        shapes[name] = shape
    if not shapes:
        raise ValueError("decode_attention: the layer holds no tokens")
    h_kv = next(iter(shapes.values()))[1]
    if h_q % h_kv:
        raise ValueError(f"decode_attention: H_q={h_q} is not a multiple of H_kv={h_kv}")
    for name, shape in shapes.items():
        if shape[1] != h_kv:
            raise ValueError(f"decode_attention: {name} has {shape[1]} KV heads, expected {h_kv}")
    if (parts["sink_k"] is None) != (parts["sink_v"] is None) or (
        (parts["recent_k"] is None) != (parts["recent_v"] is None)
    ):
        raise ValueError("decode_attention: K and V parts must be present together")
    s_len = 0 if parts["sink_k"] is None else parts["sink_k"].shape[2]
    r_len = 0 if parts["recent_k"] is None else parts["recent_k"].shape[2]
    t_body = 0
    if key_body is not None or value_body is not None:
        if key_body is None or value_body is None or key_body.shape[2] != value_body.shape[2]:
            raise ValueError("decode_attention: key_body and value_body must hold the same tokens")
        t_body = key_body.shape[2]
    total = s_len + t_body + r_len

    g = h_q // h_kv
    g_pad = max(16, triton.next_power_of_2(g))  # tl.dot needs M >= 16
    bh = bsz * h_kv
    n_body = _num_splits(bh, t_body, block_t, query.device) if num_splits is None else min(num_splits, t_body)
    n_body = n_body if t_body else 0
    body_chunk = triton.cdiv(triton.cdiv(t_body, n_body), block_t) * block_t if n_body else block_t
    n_body = triton.cdiv(t_body, body_chunk) if n_body else 0
    fp_chunk = 4 * block_t
    n_fp = triton.cdiv(s_len + r_len, fp_chunk)
    nsplit = n_body + n_fp

    mask, s_mb, s_mt, has_mask = _mask_arg(key_mask, bsz, total, query)

    scale = (1.0 / math.sqrt(d)) if scaling is None else float(scaling)
    dot_fp32 = query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and _interpreting())
    m = torch.empty((bh, max(nsplit, 1), g_pad), dtype=torch.float32, device=query.device)
    l_ = torch.empty_like(m)
    acc = torch.empty((bh, max(nsplit, 1), g_pad, d), dtype=torch.float32, device=query.device)
    out = torch.empty((bsz, 1, h_q, d), dtype=query.dtype, device=query.device)
    if nsplit == 0:
        return out.zero_()

    q3 = query[:, :, 0, :]  # (B, H_q, D)
    kb = _body_args(key_body, h_kv, d, query)
    vb = _body_args(value_body, h_kv, d, query)
    kb_t, vb_t = kb[:11], vb[:11]
    _decode_split_kernel[(nsplit, bh)](
        q3, *q3.stride(),
        *_fp_args(parts["sink_k"], parts["sink_v"], query),
        *_fp_args(parts["recent_k"], parts["recent_v"], query),
        *kb_t, *vb_t,
        mask, s_mb, s_mt,
        m, l_, acc,
        h_kv, s_len, t_body, r_len, n_body, nsplit, body_chunk, fp_chunk, scale * _LOG2E,
        G=g, G_PAD=g_pad, D=d, BLOCK_T=block_t,
        K_BITS=kb[11], K_SYM=kb[12], K_TN=kb[13], K_DN=kb[14],
        V_BITS=vb[11], V_SYM=vb[12], V_TN=vb[13], V_DN=vb[14],
        HAS_MASK=has_mask, DOT_FP32=dot_fp32,
        num_warps=num_warps,
    )
    o3 = out[:, 0]  # (B, H_q, D)
    _decode_reduce_kernel[(bh, g)](
        m, l_, acc, o3, *o3.stride(), h_kv, nsplit,
        G=g, G_PAD=g_pad, D=d, SPLIT_PAD=triton.next_power_of_2(nsplit),
    )
    return out


# ----------------------------------------------------------------------------------------------- public


def decode_attention(
    query: torch.Tensor,
    sink_k: torch.Tensor | None,
    sink_v: torch.Tensor | None,
    key_body: QTensor | torch.Tensor | None,
    value_body: QTensor | torch.Tensor | None,
    recent_k: torch.Tensor | None,
    recent_v: torch.Tensor | None,
    scaling: float | None = None,
    key_mask: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_t: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Attention of one query token per sequence over sink | body | recent, read as stored.

    query: (B, H_q, 1, D), fp16/bf16/fp32, D a power of two >= 16 (64, 128, 256 in practice).
    sink_k/v, recent_k/v: (B, H_kv, S or R, D) float, or None. H_q is a multiple of H_kv (GQA).
    key_body/value_body: QTensor of (B, H_kv, T_b, D) (any bits and granularity), a dense float
        (B, H_kv, T_b, D) tensor (fp16 spec), or None; both present or both absent, same T_b.
    scaling: softmax scale; None = 1/sqrt(D).
    key_mask: (B, T) or (1, T) bool, T = S + T_b + R, True = attend, positions in sink | body | recent
        order; any pattern (left padding, holes); any strides (an expanded view is read in place);
        None = every token. num_splits: body splits per (sequence, KV head); None = fill the GPU.
    Returns (B, 1, H_q, D) in query's dtype (the layout transformers' attention functions return).
    A sequence whose mask row is all False gets zeros (torch SDPA's math path does the same), not NaN.
    K/V are dequantized in fp32, rounded to query's dtype, and multiplied with fp32 accumulation.
    """
    return _launch(query, sink_k, sink_v, key_body, value_body, recent_k, recent_v, scaling, key_mask,
                   num_splits, block_t, num_warps)


def _dense(part, dtype: torch.dtype) -> torch.Tensor | None:
    if part is None:
        return None
    return dequantize(part, dtype) if isinstance(part, QTensor) else part.to(dtype)


def decode_attention_ref(
    query: torch.Tensor,
    sink_k: torch.Tensor | None,
    sink_v: torch.Tensor | None,
    key_body: QTensor | torch.Tensor | None,
    value_body: QTensor | torch.Tensor | None,
    recent_k: torch.Tensor | None,
    recent_v: torch.Tensor | None,
    scaling: float | None = None,
    key_mask: torch.Tensor | None = None,
    *,
    upcast: bool = False,
    **unused,
) -> torch.Tensor:
    """The reference twin of `decode_attention` (same arguments and shapes): dequantize, then plain attention.

    upcast=False computes in query's dtype, with K/V dequantized to it (what the PyTorch path does);
    upcast=True computes everything in fp32 from K/V dequantized straight to fp32 (the accuracy yardstick).
    A sequence with an all-False key_mask row gets zeros, as from the kernel.
    """
    dtype = torch.float32 if upcast else query.dtype
    keys = [_dense(p, dtype) for p in (sink_k, key_body, recent_k) if p is not None]
    vals = [_dense(p, dtype) for p in (sink_v, value_body, recent_v) if p is not None]
    k, v = torch.cat(keys, dim=2), torch.cat(vals, dim=2)  # (B, H_kv, T, D)
    bsz, h_q, _, d = query.shape
    g = h_q // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # (B, H_q, T, D)
    scale = (1.0 / math.sqrt(d)) if scaling is None else scaling
    scores = (query.to(dtype) @ k.transpose(-1, -2)).float() * scale  # (B, H_q, 1, T)
    valid = torch.ones(bsz, k.shape[2], dtype=torch.bool, device=query.device)
    if key_mask is not None:
        valid = valid & key_mask.to(query.device)  # (B or 1, T) broadcasts
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # NaN on an all-False row: 0/0
    probs = probs.masked_fill(~valid.any(dim=1)[:, None, None, None], 0.0).to(dtype)
    return (probs @ v).transpose(1, 2)  # (B, 1, H_q, D)
