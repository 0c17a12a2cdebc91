"""The closed form's row-block kernel, for small trees of few requests (closed_form.py dispatches).

Forward substitution over row blocks of BS nodes: for each block the rows of G and C are formed on chip from
streamed K chunks, earlier blocks enter through one matmul with their U (read back from `u`), and the Neumann
series runs only inside the diagonal block. Its small (16-row) matmuls and its recomputation of the Gram rows per
block cost little while the tree is small; on one H200 it beat the two-half kernel at 16 and 64 nodes and lost at
128 (results/kernels_h200.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hf_bole.kernels.utils import autotune_configs

# BV trades parallelism (more V-tiles) against recomputing the Gram rows per tile; BS is the row block of
# the forward substitution (off-diagonal blocks in one matmul, the Neumann series only inside a block).
ROWS_CONFIGS = [
    triton.Config({"BS": BS, "BK": 32, "BV": BV}, num_warps=num_warps, num_stages=num_stages)
    for BS, BV, num_warps, num_stages in (
        (16, 32, 4, 1), (16, 32, 8, 1), (16, 64, 8, 1), (16, 16, 4, 1),
        (32, 64, 8, 1), (16, 128, 8, 1), (16, 32, 4, 2), (16, 64, 8, 2),
    )
]  # fmt: skip


@triton.heuristics({"USE_INITIAL_STATE": lambda args: args["h0"] is not None})
@triton.autotune(configs=autotune_configs(ROWS_CONFIGS), key=["B", "BT", "H", "HK", "K", "V", "USE_QK_L2NORM"])
@triton.jit(do_not_specialize=["T"])
def tree_gdn_verify_rows_fwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    anc,
    h0,
    o,
    u,
    log_decay,
    scale,
    stride_qb,
    stride_qt,
    stride_vb,
    stride_vt,
    B,
    T,
    H,
    HK,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # bf16 tiles multiply exactly into fp32 on tensor cores; UPCAST_DOT feeds fp32 tiles instead for
    # Triton's interpreter, which multiplies bf16 tiles as raw bits (seen with triton 3.9).
    i_v, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HK)

    o_t = tl.arange(0, BT)
    m_t = o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_anc = anc + i_b * T * T
    p_g = g + i_b * T * H + i_h
    p_q = q + i_b * stride_qb + i_hk * K
    p_k = k + i_b * stride_qb + i_hk * K
    p_v = v + i_b * stride_vb + i_h * V
    p_u = u + (i_b * T * H + i_h) * V
    p_o = o + (i_b * T * H + i_h) * V
    if USE_INITIAL_STATE:
        p_h0 = h0 + i_bh * K * V

    b_g = tl.load(p_g + o_t * H, mask=m_t, other=0).to(tl.float32)  # [BT]
    # log P of the nodes of the blocks done so far (the column side of P_i / P_j), filled block by block:
    # a block only looks at columns of earlier blocks.
    b_lp = tl.zeros([BT], dtype=tl.float32)

    # Forward substitution over row blocks of BS nodes. Ancestors come before their descendants, so block
    # s needs U of earlier blocks (written to `u` already) and of its own diagonal block.
    for i_s in range(0, T, BS):
        o_s = i_s + tl.arange(0, BS)
        m_s = o_s < T
        b_beta = tl.load(beta + (i_b * T + o_s) * H + i_h, mask=m_s, other=0).to(tl.float32)
        b_anc = tl.load(p_anc + o_s[:, None] * T + o_t[None, :], mask=m_s[:, None] & m_t[None, :], other=0) != 0
        b_ancd = tl.load(p_anc + o_s[:, None] * T + o_s[None, :], mask=m_s[:, None] & m_s[None, :], other=0) != 0
        b_lps = tl.sum(tl.where(b_anc, b_g[None, :], 0.0), axis=1)  # [BS] log P: sum of g over ancestors-or-self
        b_lp += tl.sum(tl.where(o_t[None, :] == o_s[:, None], b_lps[:, None], 0.0), axis=0)
        # (I + G_ss) is nilpotent of index (longest chain inside the block): that many Neumann terms.
        n_diag = tl.max(tl.sum(b_ancd.to(tl.int32), axis=1), axis=0) - 1

        # Gram rows against all nodes (kk, qk) and within the block (kkd, qkd); K S_pre and Q S_pre.
        b_kk = tl.zeros([BS, BT], dtype=tl.float32)
        b_qk = tl.zeros([BS, BT], dtype=tl.float32)
        b_kkd = tl.zeros([BS, BS], dtype=tl.float32)
        b_qkd = tl.zeros([BS, BS], dtype=tl.float32)
        b_ks = tl.zeros([BS, BV], dtype=tl.float32)
        b_qs = tl.zeros([BS, BV], dtype=tl.float32)
        b_kss = tl.zeros([BT], dtype=tl.float32)
        b_kss_s = tl.zeros([BS], dtype=tl.float32)
        b_qss_s = tl.zeros([BS], dtype=tl.float32)
        for i_k in range(0, K, BK):
            o_k = i_k + tl.arange(0, BK)
            m_k = o_k < K
            b_ka = tl.load(p_k + o_t[:, None] * stride_qt + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0)
            b_ks_ = tl.load(p_k + o_s[:, None] * stride_qt + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0)
            b_qs_ = tl.load(p_q + o_s[:, None] * stride_qt + o_k[None, :], mask=m_s[:, None] & m_k[None, :], other=0)
            if UPCAST_DOT:
                b_ka, b_ks_, b_qs_ = b_ka.to(tl.float32), b_ks_.to(tl.float32), b_qs_.to(tl.float32)
            b_kk += tl.dot(b_ks_, tl.trans(b_ka), input_precision=DOT_PRECISION)
            b_qk += tl.dot(b_qs_, tl.trans(b_ka), input_precision=DOT_PRECISION)
            b_kkd += tl.dot(b_ks_, tl.trans(b_ks_), input_precision=DOT_PRECISION)
            b_qkd += tl.dot(b_qs_, tl.trans(b_ks_), input_precision=DOT_PRECISION)
            if USE_INITIAL_STATE:
                b_h = tl.load(p_h0 + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
                b_ks += tl.dot(b_ks_.to(tl.float32), b_h, input_precision=DOT_PRECISION)
                b_qs += tl.dot(b_qs_.to(tl.float32), b_h, input_precision=DOT_PRECISION)
            if USE_QK_L2NORM:
                b_kaf = b_ka.to(tl.float32)
                b_kss += tl.sum(b_kaf * b_kaf, axis=1)
                b_ksf = b_ks_.to(tl.float32)
                b_kss_s += tl.sum(b_ksf * b_ksf, axis=1)
                b_qsf = b_qs_.to(tl.float32)
                b_qss_s += tl.sum(b_qsf * b_qsf, axis=1)
        if USE_QK_L2NORM:
            b_rk = tl.rsqrt(b_kss + 1e-6)
            b_rks = tl.rsqrt(b_kss_s + 1e-6)
            b_rqs = tl.rsqrt(b_qss_s + 1e-6)
            b_kk = b_kk * b_rks[:, None] * b_rk[None, :]
            b_qk = b_qk * b_rqs[:, None] * b_rk[None, :]
            b_kkd = b_kkd * b_rks[:, None] * b_rks[None, :]
            b_qkd = b_qkd * b_rqs[:, None] * b_rks[None, :]
            b_ks = b_ks * b_rks[:, None]
            b_qs = b_qs * b_rqs[:, None]

        # P_i / P_j on the ancestor mask (never exponentiate an entry off it): earlier blocks, own block.
        b_dec = tl.exp(tl.where(b_anc & (o_t[None, :] < i_s), b_lps[:, None] - b_lp[None, :], float("-inf")))
        b_decd = tl.exp(tl.where(b_ancd, b_lps[:, None] - b_lps[None, :], float("-inf")))
        b_ps = tl.exp(b_lps)

        # R = D_beta (V - D_P K S_pre), minus what the earlier blocks' U contribute.
        b_v = tl.load(p_v + o_s[:, None] * stride_vt + o_v[None, :], mask=m_s[:, None] & m_v[None, :], other=0)
        b_up = tl.load(
            p_u + o_t[:, None] * H * V + o_v[None, :],
            mask=(o_t[:, None] < i_s) & m_v[None, :],
            other=0,
            cache_modifier=".cg",  # written by this program's other threads: read past L1
        )  # [BT, BV]
        b_x = b_beta[:, None] * (b_v.to(tl.float32) - b_ps[:, None] * b_ks)
        b_x -= tl.dot(b_beta[:, None] * b_dec * b_kk, b_up, input_precision=DOT_PRECISION)
        # The diagonal block: U_s = sum_m (-G_ss)^m X, nilpotent within the block.
        b_Gd = tl.where(o_s[:, None] == o_s[None, :], 0.0, b_decd) * b_kkd * b_beta[:, None]
        b_us = b_x
        for _ in range(n_diag):
            b_us = b_x - tl.dot(b_Gd, b_us, input_precision=DOT_PRECISION)

        # O = D_P Q S_pre + C U over earlier blocks and the own block.
        b_os = tl.dot(b_dec * b_qk, b_up, input_precision=DOT_PRECISION)
        b_os += tl.dot(b_decd * b_qkd, b_us, input_precision=DOT_PRECISION)
        b_os = scale * (b_os + b_ps[:, None] * b_qs)

        m_sv = m_s[:, None] & m_v[None, :]
        tl.store(p_u + o_s[:, None] * H * V + o_v[None, :], b_us, mask=m_sv)
        tl.store(p_o + o_s[:, None] * H * V + o_v[None, :], b_os.to(p_o.dtype.element_ty), mask=m_sv)
        if i_v == 0:
            tl.store(log_decay + (i_b * T + o_s) * H + i_h, b_lps, mask=m_s)
        tl.debug_barrier()  # the next block reads this block's U
