"""The KDA closed form's Triton kernels (closed_form.py holds the checks and the torch path; README.md the derivation).

The tree (T nodes, padded to BT, a power of two >= 32) is held as two halves of BH = BT/2 rows, as in the GDN kernels
(`tree_gdn/closed_form_kernels.py`):

    [I + G00     0   ] [U0]   [R0]        U0 = A0 R0,                 O0 = (Q0 * Gam0) S_pre + C00 U0
    [  G10    I + G11] [U1] = [R1]   =>   U1 = A1 (R1 - G10 U0),      O1 = (Q1 * Gam1) S_pre + C10 U0 + C11 U1

with G_ij = beta_i k_i^T Diag(Gam_i / Gam_j) k_j on strict ancestors, C_ij = q_i^T Diag(Gam_i / Gam_j) k_j on
ancestors-or-self, R = D_beta (V - (K * Gam) S_pre), A0, A1 the inverses of the diagonal blocks, Gam_i the product of
the decays exp(g) on node i's path. The per-channel decay between node i and its ancestor j cannot be split into a
row factor times a column factor without dividing by Gam_j, which overflows for strong decays; so the solve kernel
walks each row's path upwards, one ancestor per step, multiplying a [rows, BK] tile of decays by the next exp(g):
every ratio Gam_i / Gam_j is a product of factors <= 1, formed without a division, an exp of a positive number or a
difference of two long sums. Each step adds the row's interaction with one ancestor (a row sum of
k_i * decay * k_j) to the dense block at that ancestor's column. A tree of depth d takes d + 1 steps.

A solve kernel, one program per (request, value head, block 00, 11 or 10), forms its block's G and C by that walk,
the diagonal blocks' inverses by doubling (`_unit_lower_inverse`), Gam (the walk's last tile, for blocks 00 and 10)
and the rows' inverse norms; an apply kernel, one program per (request, value head, V-tile), forms (K * Gam) S_pre,
(Q * Gam) S_pre and the block products. Only O and U are written as outputs: nothing of size K x V per node exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_bole.kernels.tree_gdn.closed_form_kernels import (
    _inv_norm,
    _load_block,
    _sq_norms,
    _store_block,
    _unit_lower_inverse,
    tree_tile,
)
from hf_bole.kernels.utils import autotune_configs, dim_contiguous, on_device, token_major

# Candidate launch configs, not yet timed on a GPU: those that ptxas for sm_90a (eval/kernel_registers.py's way)
# compiles with at most ~0.5 KB of spills a thread at T = 64 and 128. The solve kernel's GATHER (see `_walk`) trades
# repeated loads and exps for registers, and only its timing can choose. BK = 64 with 4 warps spilled 0.2-2 KB in the
# solve kernel (the walk holds five [BH, BK] fp32 tiles and two [BH, BH] blocks) and 1.1-2.1 KB in the apply kernel
# (3xTF32 operands). BK = 128 with 8 warps walks all channels in one step, so each step updates the [BH, BH] blocks
# once, not once a chunk (253 registers, no spills at T = 64; 1.1 KB of spills at 128). num_stages stays 1 as in
# the GDN kernels, where 2 (Triton 3.6) made the solve kernel stray from float64 and the apply kernel fault.
SOLVE_CONFIGS = [
    triton.Config({"BK": BK, "GATHER": gather}, num_warps=num_warps, num_stages=1)
    for BK, num_warps, gather in ((32, 8, False), (16, 4, False), (32, 4, False), (64, 8, False), (128, 8, False),
                                  (16, 8, True), (32, 8, True))
]  # fmt: skip
APPLY_CONFIGS = [
    triton.Config({"BK": BK, "BV": BV}, num_warps=num_warps, num_stages=1)
    for BK, BV, num_warps in ((16, 32, 4), (16, 64, 4), (32, 32, 4), (16, 32, 8), (32, 64, 8))
]  # fmt: skip
WORKSPACE_BLOCKS = tl.constexpr(6)  # A0, C00, A1, C11, C10, G10 (a constexpr: the kernels read it too)


def workspace_bytes(B: int, T: int, H: int, K: int) -> int:
    """Bytes the solve kernel hands to the apply kernel (freed with the call): six float32 [BT/2, BT/2] blocks per
    (request, value head), the path decays Gam `[B, T, H, K]` and the rows' inverse norms `[B, T, H, 2]`, float32."""
    half = tree_tile(T) // 2
    return B * H * WORKSPACE_BLOCKS.value * half * half * 4 + B * T * H * (K + 2) * 4


@triton.jit
def _walk(
    p_q,
    p_k,
    p_g,
    p_par,
    p_gam,
    o_r,
    m_r,
    c0,
    stop,
    stride_qt,
    stride_gt,
    T,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    GATHER: tl.constexpr,
    store_gamma,
):
    """Walks the rows o_r up their paths until every row's current node is below `stop` (0: to the committed state).
    At each step, with j the current node and D the decay from j to the row (1 at the start):
        KK[r, j - c0] += sum_c k_r D k_j,   QK[r, j - c0] += sum_c q_r D k_j    (only for c0 <= j < c0 + BH)
        D *= exp(g_j),   j = parent(j).
    Returns the raw (unnormalised, beta-free) blocks KK (self entries left out) and QK ([BH, BH] each), the rows'
    squared key and query norms ([BH] each) and the longest chain inside the block (N with G^N = 0). With
    `store_gamma`, the rows walk to the committed state and their final D, the path decays Gam, go to p_gam.
    Each step reads k_j and g_j of every row's current node j: from memory (L1 after the first steps) with one exp per
    row and channel, or with GATHER from the whole tree's [BT, BK] tiles of k and exp(g), formed once per chunk and
    gathered in registers (through shared memory): one exp per node and channel, more registers."""
    BH: tl.constexpr = BT // 2
    o_c = tl.arange(0, BH)
    o_t = tl.arange(0, BT)
    b_kk = tl.zeros([BH, BH], dtype=tl.float32)
    b_qk = tl.zeros([BH, BH], dtype=tl.float32)
    b_ssk = tl.zeros([BH], dtype=tl.float32)
    b_ssq = tl.zeros([BH], dtype=tl.float32)
    b_cnt = tl.zeros([BH], dtype=tl.int32)  # per row: the block's entries, self included (the same in every chunk)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        m_rk = m_r[:, None] & m_k[None, :]
        if GATHER:
            m_tk = (o_t < T)[:, None] & m_k[None, :]
            b_kt = tl.load(p_k + o_t[:, None] * stride_qt + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
            b_at = tl.exp(tl.load(p_g + o_t[:, None] * stride_gt + o_k[None, :], mask=m_tk, other=0).to(tl.float32))
        b_k = tl.load(p_k + o_r[:, None] * stride_qt + o_k[None, :], mask=m_rk, other=0).to(tl.float32)
        b_q = tl.load(p_q + o_r[:, None] * stride_qt + o_k[None, :], mask=m_rk, other=0).to(tl.float32)
        b_ssk += tl.sum(b_k * b_k, axis=1)
        b_ssq += tl.sum(b_q * b_q, axis=1)
        b_d = tl.full([BH, BK], 1.0, dtype=tl.float32)  # [BH, BK] decay from the current node to the row
        b_cnt = tl.zeros([BH], dtype=tl.int32)
        cur = tl.where(m_r, o_r, -1)  # [BH] int32
        while tl.max(cur, axis=0) >= stop:
            m_cur = cur >= 0
            m_ck = m_cur[:, None] & m_k[None, :]
            if GATHER:
                idx = tl.broadcast_to(tl.maximum(cur, 0)[:, None], [BH, BK])
                b_kj = tl.where(m_ck, tl.gather(b_kt, idx, 0), 0.0)
                b_aj = tl.where(m_ck, tl.gather(b_at, idx, 0), 1.0)
            else:
                b_kj = tl.load(p_k + cur[:, None] * stride_qt + o_k[None, :], mask=m_ck, other=0).to(tl.float32)
                b_aj = tl.exp(tl.load(p_g + cur[:, None] * stride_gt + o_k[None, :], mask=m_ck, other=0).to(tl.float32))
            b_s = tl.sum(b_k * b_d * b_kj, axis=1)  # [BH]
            b_sq = tl.sum(b_q * b_d * b_kj, axis=1)
            m_in = m_cur & (cur >= c0) & (cur < c0 + BH)
            hit = m_in[:, None] & (o_c[None, :] == (cur - c0)[:, None])  # [BH, BH]
            b_qk += tl.where(hit, b_sq[:, None], 0.0)
            b_kk += tl.where(hit, b_s[:, None], 0.0)  # self entries too: cleared once after the walk
            b_cnt += m_in.to(tl.int32)
            b_d *= b_aj  # rows past the committed state multiply by 1 and keep Gam
            cur = tl.where(m_cur, tl.load(p_par + cur, mask=m_cur, other=-1).to(tl.int32), -1)
        if store_gamma:
            tl.store(p_gam + o_r[:, None] * stride_gt + o_k[None, :], b_d, mask=m_rk)
    b_kk = tl.where(o_c[None, :] == (o_r - c0)[:, None], 0.0, b_kk)  # G has no self entries
    return b_kk, b_qk, b_ssk, b_ssq, tl.max(b_cnt, axis=0)


@triton.autotune(configs=autotune_configs(SOLVE_CONFIGS), key=["B", "BT", "H", "HK", "K", "USE_QK_L2NORM"])
@triton.jit(do_not_specialize=["T"])
def tree_kda_verify_solve_kernel(
    q,
    k,
    g,
    beta,
    parents,
    ws,
    gam,
    rnorm,
    stride_qb,
    stride_qt,
    stride_qh,
    B,
    T,
    H,
    HK,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    GATHER: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program per (block, request x value head). Block 0: rows and columns of the first half: A0, C00, and the
    # first half's Gam and inverse norms; block 1: the second half's rows up to their ancestors in the first half:
    # A1, C11; block 2: the second half's rows walked to the committed state: C10, G10 and the second half's Gam and
    # inverse norms. Blocks 1 and 2 both walk the second half's rows through the second half, so that no block
    # needs another's results.
    BH: tl.constexpr = BT // 2
    i_blk, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HK)
    if i_blk > 0 and BH >= T:
        return

    o_h = tl.arange(0, BH)
    eye = o_h[:, None] == o_h[None, :]
    o_r = tl.where(i_blk == 0, o_h, BH + o_h)
    m_r = o_r < T
    c0 = tl.where(i_blk == 1, BH, 0)
    stop = tl.where(i_blk == 1, BH, 0)
    p_q = q + i_b * stride_qb + i_hk * stride_qh
    p_k = k + i_b * stride_qb + i_hk * stride_qh
    p_g = g + (i_b * T * H + i_h) * K
    p_gam = gam + (i_b * T * H + i_h) * K
    p_par = parents + i_b * T
    p_ws = ws + i_bh * WORKSPACE_BLOCKS * BH * BH
    p_rn = rnorm + (i_b * T * H + i_h) * 2

    b_kk, b_qk, b_ssk, b_ssq, n_chain = _walk(
        p_q, p_k, p_g, p_par, p_gam, o_r, m_r, c0, stop, stride_qt, H * K, T, K, BT, BK, GATHER, i_blk != 1,
    )  # fmt: skip
    b_rk = _inv_norm(b_ssk, USE_QK_L2NORM)  # [BH] the rows' 1 / ||k||
    b_rq = _inv_norm(b_ssq, USE_QK_L2NORM)
    b_beta = tl.load(beta + (i_b * T + o_r) * H + i_h, mask=m_r, other=0).to(tl.float32)
    if i_blk != 1:
        tl.store(p_rn + o_r * H * 2, b_rk, mask=m_r)
        tl.store(p_rn + o_r * H * 2 + 1, b_rq, mask=m_r)
    if i_blk < 2:
        # Columns are the rows themselves.
        b_G = b_kk * (b_beta * b_rk)[:, None] * b_rk[None, :]
        _store_block(p_ws, 2 * i_blk + 1, b_qk * b_rq[:, None] * b_rk[None, :], o_h, BH)
        _store_block(p_ws, 2 * i_blk, _unit_lower_inverse(b_G, eye, n_chain, DOT_PRECISION), o_h, BH)
    else:
        b_rc = _inv_norm(_sq_norms(p_k, o_h, o_h < T, stride_qt, K, BH), USE_QK_L2NORM)  # the first half's 1 / ||k||
        _store_block(p_ws, 4, b_qk * b_rq[:, None] * b_rc[None, :], o_h, BH)
        _store_block(p_ws, 5, b_kk * (b_beta * b_rk)[:, None] * b_rc[None, :], o_h, BH)


@triton.jit
def _state_products(
    p_q,
    p_k,
    p_gam,
    p_h0,
    o_r,
    m_r,
    o_v,
    m_v,
    stride_qt,
    stride_gt,
    V,
    K: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Raw (K * Gam) S_pre and (Q * Gam) S_pre of the rows o_r for the V-tile ([BH, BV] each, zeros without a
    state; the rows' norms are applied by the caller). One half's rows at a time: with 3xTF32 products, both halves'
    operands and accumulators at once spilled 1-2.5 KB a thread (ptxas for sm_90a); the second half reads the state
    tile again, from cache."""
    b_ks = tl.zeros([BH, BV], dtype=tl.float32)
    b_qs = tl.zeros([BH, BV], dtype=tl.float32)
    # A constexpr branch, not an empty loop: the compiler still types a loop's body, and h0 is None without a state.
    if USE_INITIAL_STATE:
        for i_k in range(0, K, BK):
            o_k = i_k + tl.arange(0, BK)
            m_k = o_k < K
            m_rk = m_r[:, None] & m_k[None, :]
            b_h = tl.load(p_h0 + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0)
            b_gam = tl.load(p_gam + o_r[:, None] * stride_gt + o_k[None, :], mask=m_rk, other=0)
            b_k = tl.load(p_k + o_r[:, None] * stride_qt + o_k[None, :], mask=m_rk, other=0).to(tl.float32) * b_gam
            b_ks = tl.dot(b_k, b_h, b_ks, input_precision=DOT_PRECISION)
            b_q = tl.load(p_q + o_r[:, None] * stride_qt + o_k[None, :], mask=m_rk, other=0).to(tl.float32) * b_gam
            b_qs = tl.dot(b_q, b_h, b_qs, input_precision=DOT_PRECISION)
    return b_ks, b_qs


@triton.heuristics({"USE_INITIAL_STATE": lambda args: args["h0"] is not None})
@triton.autotune(configs=autotune_configs(APPLY_CONFIGS), key=["B", "BT", "H", "HK", "K", "V"])
@triton.jit(do_not_specialize=["T"])
def tree_kda_verify_apply_kernel(
    q,
    k,
    v,
    beta,
    h0,
    ws,
    gam,
    rnorm,
    o,
    u,
    scale,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_vb,
    stride_vt,
    B,
    T,
    H,
    HK,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program per (request, value head, V-tile), with the solve kernel's blocks (norms and beta included) and
    # r_k, r_q the rows' 1 / ||k||, 1 / ||q||:
    #   R = D_beta (V - D_rk (K * Gam) S_pre)
    #   U0 = A0 R0                  O0 = D_rq (Q0 * Gam0) S_pre + C00 U0
    #   U1 = A1 (R1 - G10 U0)       O1 = D_rq (Q1 * Gam1) S_pre + C10 U0 + C11 U1
    BH: tl.constexpr = BT // 2
    i_v, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HK)

    o_h = tl.arange(0, BH)
    o_r0 = o_h
    o_r1 = BH + o_h
    m_r0 = o_r0 < T
    m_r1 = o_r1 < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_beta = beta + i_b * T * H + i_h
    p_rn = rnorm + (i_b * T * H + i_h) * 2
    p_v = v + i_b * stride_vb + i_h * V
    p_u = u + (i_b * T * H + i_h) * V
    p_o = o + (i_b * T * H + i_h) * V
    p_ws = ws + i_bh * WORKSPACE_BLOCKS * BH * BH

    p_q = q + i_b * stride_qb + i_hk * stride_qh
    p_k = k + i_b * stride_qb + i_hk * stride_qh
    p_gam = gam + (i_b * T * H + i_h) * K
    p_h0 = h0
    if USE_INITIAL_STATE:
        p_h0 = h0 + i_bh * K * V

    # ---- first half ----
    b_ks, b_qs = _state_products(
        p_q, p_k, p_gam, p_h0, o_r0, m_r0, o_v, m_v, stride_qt, H * K, V, K, BH, BK, BV, USE_INITIAL_STATE,
        DOT_PRECISION,
    )  # fmt: skip
    b_rk = tl.load(p_rn + o_r0 * H * 2, mask=m_r0, other=0)
    b_rq = tl.load(p_rn + o_r0 * H * 2 + 1, mask=m_r0, other=0)
    b_beta = tl.load(p_beta + o_r0 * H, mask=m_r0, other=0).to(tl.float32)
    b_v = tl.load(p_v + o_r0[:, None] * stride_vt + o_v[None, :], mask=m_r0[:, None] & m_v[None, :], other=0)
    b_R = b_beta[:, None] * (b_v.to(tl.float32) - b_rk[:, None] * b_ks)
    b_u0 = tl.dot(_load_block(p_ws, 0, o_h, BH), b_R, input_precision=DOT_PRECISION)
    b_o = tl.dot(_load_block(p_ws, 1, o_h, BH), b_u0, input_precision=DOT_PRECISION)
    b_o += b_rq[:, None] * b_qs
    m_rv = m_r0[:, None] & m_v[None, :]
    tl.store(p_u + o_r0[:, None] * H * V + o_v[None, :], b_u0, mask=m_rv)
    tl.store(p_o + o_r0[:, None] * H * V + o_v[None, :], (scale * b_o).to(p_o.dtype.element_ty), mask=m_rv)

    # ---- second half ----
    if BH < T:
        b_ks, b_qs = _state_products(
            p_q, p_k, p_gam, p_h0, o_r1, m_r1, o_v, m_v, stride_qt, H * K, V, K, BH, BK, BV, USE_INITIAL_STATE,
            DOT_PRECISION,
        )  # fmt: skip
        b_rk = tl.load(p_rn + o_r1 * H * 2, mask=m_r1, other=0)
        b_rq = tl.load(p_rn + o_r1 * H * 2 + 1, mask=m_r1, other=0)
        b_beta = tl.load(p_beta + o_r1 * H, mask=m_r1, other=0).to(tl.float32)
        b_v = tl.load(p_v + o_r1[:, None] * stride_vt + o_v[None, :], mask=m_r1[:, None] & m_v[None, :], other=0)
        b_R = b_beta[:, None] * (b_v.to(tl.float32) - b_rk[:, None] * b_ks)
        b_R -= tl.dot(_load_block(p_ws, 5, o_h, BH), b_u0, input_precision=DOT_PRECISION)
        b_u1 = tl.dot(_load_block(p_ws, 2, o_h, BH), b_R, input_precision=DOT_PRECISION)
        b_o = tl.dot(_load_block(p_ws, 4, o_h, BH), b_u0, input_precision=DOT_PRECISION)
        b_o = tl.dot(_load_block(p_ws, 3, o_h, BH), b_u1, b_o, input_precision=DOT_PRECISION)
        b_o += b_rq[:, None] * b_qs
        m_rv = m_r1[:, None] & m_v[None, :]
        tl.store(p_u + o_r1[:, None] * H * V + o_v[None, :], b_u1, mask=m_rv)
        tl.store(p_o + o_r1[:, None] * H * V + o_v[None, :], (scale * b_o).to(p_o.dtype.element_ty), mask=m_rv)


def tree_kda_verify_fwd(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm, dot_precision):
    """Launches the solve kernel (one program per request, value head and block), then the apply kernel (one per
    request, value head and V-tile). Inputs as `tree_kda_verify` after its checks."""
    # q and k are read through all their strides but the last (views of one projection are read in place).
    q, k, v = dim_contiguous(q), dim_contiguous(k), token_major(v)
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    g, beta, parents = g.contiguous(), beta.contiguous(), parents.contiguous()
    B, T, HK, K = k.shape
    H, V = v.shape[-2:]
    BT = tree_tile(T)
    half = BT // 2
    ws = torch.empty(B * H * WORKSPACE_BLOCKS.value * half * half, dtype=torch.float32, device=v.device)
    gam = torch.empty(B, T, H, K, dtype=torch.float32, device=v.device)
    rnorm = torch.empty(B, T, H, 2, dtype=torch.float32, device=v.device)
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    u = torch.empty(B, T, H, V, dtype=torch.float32, device=v.device)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), B * H)

    with on_device(v):
        tree_kda_verify_solve_kernel[(3, B * H)](
            q, k, g, beta, parents, ws, gam, rnorm, q.stride(0), q.stride(1), q.stride(2), B, T, H, HK,
            K=K, BT=BT, USE_QK_L2NORM=use_qk_l2norm, DOT_PRECISION=dot_precision,
        )  # fmt: skip
        tree_kda_verify_apply_kernel[grid](
            q, k, v, beta, initial_state, ws, gam, rnorm, o, u, scale,
            q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), B, T, H, HK,
            K=K, V=V, BT=BT, DOT_PRECISION=dot_precision,
        )  # fmt: skip
    return o, u
