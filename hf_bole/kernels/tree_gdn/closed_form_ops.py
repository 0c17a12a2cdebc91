"""Tile routines shared by the closed form's kernels (closed_form.py, closed_form_split.py): the Gram blocks, the
state products, the key and query norms, the longest chain inside a diagonal block."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chain_length(b_mask):
    """The longest chain inside a diagonal block whose ancestor mask (self included) is b_mask: N with G^N = 0."""
    return tl.max(tl.sum(b_mask.to(tl.int32), axis=1), axis=0)


@triton.jit
def grams(
    p_q,
    p_k,
    o_r,
    m_r,
    o_c,
    m_c,
    stride_qt,
    K: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Raw Gram blocks K_r K_c^T and Q_r K_c^T ([BH, BH]) of the row block o_r against the column block o_c."""
    b_kk = tl.zeros([BH, BH], dtype=tl.float32)
    b_qk = tl.zeros([BH, BH], dtype=tl.float32)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        b_k = tl.load(p_k + o_r[:, None] * stride_qt + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0)
        b_q = tl.load(p_q + o_r[:, None] * stride_qt + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0)
        b_c = tl.load(p_k + o_c[:, None] * stride_qt + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0)
        if UPCAST_DOT:
            b_k, b_q, b_c = b_k.to(tl.float32), b_q.to(tl.float32), b_c.to(tl.float32)
        b_kk = tl.dot(b_k, tl.trans(b_c), b_kk, input_precision=DOT_PRECISION)
        b_qk = tl.dot(b_q, tl.trans(b_c), b_qk, input_precision=DOT_PRECISION)
    return b_kk, b_qk


@triton.jit
def state_products(
    p_q,
    p_k,
    p_h0,
    o_r,
    m_r,
    o_v,
    m_v,
    stride_qt,
    V,
    K: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    SPLIT_STATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Raw K_r S_pre and Q_r S_pre for the V-tile ([BH, BV]) and the squared norms of the rows of k_r, q_r."""
    b_ks = tl.zeros([BH, BV], dtype=tl.float32)
    b_qs = tl.zeros([BH, BV], dtype=tl.float32)
    b_ssk = tl.zeros([BH], dtype=tl.float32)
    b_ssq = tl.zeros([BH], dtype=tl.float32)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        b_k = tl.load(p_k + o_r[:, None] * stride_qt + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0)
        b_q = tl.load(p_q + o_r[:, None] * stride_qt + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0)
        b_ssk += tl.sum(b_k.to(tl.float32) * b_k.to(tl.float32), axis=1)
        b_ssq += tl.sum(b_q.to(tl.float32) * b_q.to(tl.float32), axis=1)
        if USE_INITIAL_STATE:
            b_h = tl.load(p_h0 + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
            if SPLIT_STATE:
                # bf16 q/k are exact in bf16, and S_pre = h1 + h2 + h3 (three bf16 pieces, 24 significant
                # bits): three bf16 products accumulate in fp32 as exactly as an fp32 product, in less than
                # half the tensor-core time of 3xTF32.
                b_h1 = b_h.to(tl.bfloat16)
                b_hr = b_h - b_h1.to(tl.float32)
                b_h2 = b_hr.to(tl.bfloat16)
                b_h3 = (b_hr - b_h2.to(tl.float32)).to(tl.bfloat16)
                if UPCAST_DOT:
                    b_k, b_q = b_k.to(tl.float32), b_q.to(tl.float32)
                    b_h1, b_h2, b_h3 = b_h1.to(tl.float32), b_h2.to(tl.float32), b_h3.to(tl.float32)
                b_ks = tl.dot(b_k, b_h1, b_ks)
                b_ks = tl.dot(b_k, b_h2, b_ks)
                b_ks = tl.dot(b_k, b_h3, b_ks)
                b_qs = tl.dot(b_q, b_h1, b_qs)
                b_qs = tl.dot(b_q, b_h2, b_qs)
                b_qs = tl.dot(b_q, b_h3, b_qs)
            else:
                b_ks = tl.dot(b_k.to(tl.float32), b_h, b_ks, input_precision=DOT_PRECISION)
                b_qs = tl.dot(b_q.to(tl.float32), b_h, b_qs, input_precision=DOT_PRECISION)
    return b_ks, b_qs, b_ssk, b_ssq




@triton.jit
def inv_norms(p_q, p_k, o_r, m_r, stride_qt, K: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    """1 / ||k_r|| and 1 / ||q_r|| ([BH] each) with the eps of transformers' and fla's l2norm, or ones."""
    b_rk = tl.full([BH], 1.0, dtype=tl.float32)
    b_rq = tl.full([BH], 1.0, dtype=tl.float32)
    if USE_QK_L2NORM:
        b_ssk = tl.zeros([BH], dtype=tl.float32)
        b_ssq = tl.zeros([BH], dtype=tl.float32)
        for i_k in range(0, K, BK):
            o_k = i_k + tl.arange(0, BK)
            m = m_r[:, None] & (o_k < K)[None, :]
            b_k = tl.load(p_k + o_r[:, None] * stride_qt + o_k[None, :], mask=m, other=0).to(tl.float32)
            b_q = tl.load(p_q + o_r[:, None] * stride_qt + o_k[None, :], mask=m, other=0).to(tl.float32)
            b_ssk += tl.sum(b_k * b_k, axis=1)
            b_ssq += tl.sum(b_q * b_q, axis=1)
        b_rk = tl.rsqrt(b_ssk + 1e-6)
        b_rq = tl.rsqrt(b_ssq + 1e-6)
    return b_rk, b_rq
