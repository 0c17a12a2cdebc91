"""The closed form's Triton kernels (closed_form.py holds the derivation's summary, the checks and the torch path).

The tree (T <= 128 nodes, padded to BT, a power of two >= 32) is held as two halves of BH = BT/2 rows:

    [I + G00     0   ] [U0]   [R0]        U0 = A0 R0,                 O0 = D_P Q0 S_pre + C00 U0
    [  G10    I + G11] [U1] = [R1]   =>   U1 = A1 (R1 - G10 U0),      O1 = D_P Q1 S_pre + C10 U0 + C11 U1

with A0 = (I + G00)^-1, A1 = (I + G11)^-1 and R = D_beta (V - D_P K S_pre). Nothing of that but R depends on V.
So a solve kernel, one program per (request, value head, block: 00, 11 or 10), forms the Gram block, the decays
and G, C of its block and, on the diagonal, the inverse by doubling, (I - G)(I + G^2)(I + G^4)..., as many
factors as the bits of the longest chain inside the block: log(depth) dependent matmuls, not depth. The six
[BH, BH] float32 blocks A0, C00, A1, C11, C10, G10 go to a workspace (`workspace_bytes`, freed with the call).
A tree that fits in the first half is one block (block 00 alone, one program): trees of up to 16 nodes, and of up
to 64 nodes as one block of 64 rows over at least `ONE_BLOCK_MIN_PAIRS` (request, value head) pairs (`verify_tile`).
With q and k L2-normalised in the kernel, the key norms come from the diagonal of K K^T; only the inverses need
them inside; C and the off-diagonal blocks are stored without the row and column norms the apply kernel can apply
to their products (its rows' 1 / ||k||, 1 / ||q||, which the solve kernel writes after the blocks), so that neither
kernel squares [BH, BK] tiles elementwise, which had filled their registers (spills of 1-4 KB a thread at T = 128).
An apply kernel, one program per (request, value head, V-tile), reads the state tile once for both halves, forms
K S_pre and Q S_pre as three exact bf16 matmuls against a bf16 split of the fp32 state (for trees of up to 64 rows
one matmul of both halves' rows, split after), and applies the blocks.
The tree enters as its ancestor mask (built once per tree, shared by every head and layer), so log P is a masked
row sum. Only O and the factors (U, log P) are written: nothing of size K x V per node exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_bole.kernels.launch import CachedLaunch, alignment
from hf_bole.kernels.utils import (
    autotune_configs,
    dim_contiguous,
    is_interpreter,
    next_power_of_2,
    on_device,
    token_major,
    use_pdl,
)

# Launch configs, from `eval/tune_kernels.py` on an H200. At
# T = 128 both kernels hold [64, 64] float32 tiles, two programs of 4 warps per SM, and 8 warps took 1.6-2x as long;
# the 8-warp configs serve the smaller tiles (T <= 64), where runs without them were 5-10%
# slower. The solve kernel's Gram loop is fastest in one step (BK = 128). The apply kernel's BV = 64 halves how often
# the workspace is read (B = 16, T = 128: 0.209 against 0.235 ms at BV = 32), BV = 32 doubles the programs a small
# batch spreads over the GPU (B = 1: 31.1 against 39.1 us). num_stages stays 1: with 2 (Triton 3.6) the solve kernel's
# two-step Gram loop strayed from float64 (o off by 1.5e-2) and the apply kernel made an illegal memory access; the
# cause was not isolated. Each config compiles once per tree tile BT (and batch of one or more).
SOLVE_CONFIGS = [
    triton.Config({"BK": BK}, num_warps=num_warps, num_stages=1)
    for BK, num_warps in ((128, 4), (64, 4), (64, 8))
]  # fmt: skip
APPLY_CONFIGS = [
    triton.Config({"BK": BK, "BV": BV}, num_warps=num_warps, num_stages=1)
    for BK, BV, num_warps in ((32, 64, 4), (32, 32, 4), (64, 32, 4), (64, 32, 8), (64, 64, 8))
]  # fmt: skip
WORKSPACE_BLOCKS = 6  # A0, C00, A1, C11, C10, G10; a tree of one block: A0, C00
# From this many (request, value head) pairs, trees of 33-64 nodes are one block of 64 rows, not two halves of 32
# (`verify_tile`). On an H100 (9B layer, Hk = 16, bench_kernels.py, two passes in turns) one block took 0.092 against
# 0.108 ms at H = 32 B = 16 T = 64, 0.047 against 0.054 at H = 32 B = 8 and 0.072 against 0.080 at H = 48 B = 8
# (Hopper's warpgroup matmuls take 64 rows, and one solve program does what three did), but 0.0195 against 0.0173 at
# H = 32 B = 1, where the three programs a pair spread a small batch over more of the GPU.
ONE_BLOCK_MIN_PAIRS = 256


def full_tile_prune(BK: int, num_warps: int):
    """An autotuner's `early_config_prune`: at BT = 128 only the configs of this `BK` and `num_warps`, all of them at
    smaller tiles. At BT = 128 the H200's sweep (`eval/tune_kernels.py`) found the same BK and warps best
    at both target shapes, so the tuner is left to choose BV only (64 at B = 16, 32 at B = 1). Timed alone, the apply
    kernel ran BK = 64 fastest at B = 1, but beside the solve kernel it overlaps (programmatic dependent launch) that
    was 5% slower than BK = 32 (32.7 against 31.1 us)."""

    def prune(configs, named_args, **kwargs):
        if kwargs["BT"] < 128 or kwargs["ONE_HALF"]:
            return configs
        kept = [c for c in configs if c.kwargs["BK"] == BK and c.num_warps == num_warps]
        return kept or configs  # a test pins one config of any kind: keep it

    return prune


def workspace_bytes(B: int, T: int, H: int, HK: int) -> int:
    """Bytes of what the solve kernel hands to the apply kernel (freed with the call): the float32 blocks of every
    request and value head, then the rows' inverse key and query norms (`[B, T, HK, 2]` float32)."""
    BT, one_half = verify_tile(T, B * H)
    return (B * H * workspace_blocks(one_half) * (BT // 2) ** 2 + B * T * HK * 2) * 4


def workspace_blocks(one_half: bool) -> int:
    """The [BH, BH] blocks the workspace holds per request and value head."""
    return 2 if one_half else WORKSPACE_BLOCKS


# The same count inside the kernels. The host calls the plain function: a constexpr function costs about 3 us a call
# from Python, and `workspace_bytes` runs at every GDN layer of an eager forward.
_blocks = triton.constexpr_function(workspace_blocks)


@triton.jit
def _norms_of(ws, i_b, i_hk, B, T, H, HK, BH: tl.constexpr, ONE_HALF: tl.constexpr):
    """Where the rows' inverse norms of request i_b and key head i_hk start: after the blocks in the workspace."""
    return ws + B * H * _blocks(ONE_HALF) * BH * BH + (i_b * T * HK + i_hk) * 2


@triton.jit
def _chain_length(b_mask):
    """The longest chain inside a diagonal block whose ancestor mask (self included) is b_mask: N with G^N = 0."""
    return tl.max(tl.sum(b_mask.to(tl.int32), axis=1), axis=0)


@triton.jit
def _grams(
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
    DIAG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Raw Gram blocks K_r K_c^T and Q_r K_c^T ([BH, BH]) of the row block o_r against the column block o_c (the
    same block when DIAG). No norms here: squaring [BH, BK] tiles elementwise is what filled the kernels' registers;
    the keys' come from the diagonal of K_r K_r^T, the queries' from `_sq_norms`."""
    b_kk = tl.zeros([BH, BH], dtype=tl.float32)
    b_qk = tl.zeros([BH, BH], dtype=tl.float32)
    for i_k in range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m_k = o_k < K
        b_k = tl.load(p_k + o_r[:, None] * stride_qt + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0)
        b_q = tl.load(p_q + o_r[:, None] * stride_qt + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0)
        if DIAG:
            b_c = b_k
        else:
            b_c = tl.load(p_k + o_c[:, None] * stride_qt + o_k[None, :], mask=m_c[:, None] & m_k[None, :], other=0)
        if UPCAST_DOT:
            b_k, b_q, b_c = b_k.to(tl.float32), b_q.to(tl.float32), b_c.to(tl.float32)
        b_kk = tl.dot(b_k, tl.trans(b_c), b_kk, input_precision=DOT_PRECISION)
        b_qk = tl.dot(b_q, tl.trans(b_c), b_qk, input_precision=DOT_PRECISION)
    return b_kk, b_qk


@triton.jit
def _sq_norms(p_x, o_r, m_r, stride_qt, K: tl.constexpr, BH: tl.constexpr):
    """Squared norms ([BH]) of the rows o_r, 32 columns at a time (few registers)."""
    b_ss = tl.zeros([BH], dtype=tl.float32)
    for i_k in range(0, K, 32):
        o_k = i_k + tl.arange(0, 32)
        b_x = tl.load(p_x + o_r[:, None] * stride_qt + o_k[None, :], mask=m_r[:, None] & (o_k < K)[None, :], other=0)
        b_ss += tl.sum(b_x.to(tl.float32) * b_x.to(tl.float32), axis=1)
    return b_ss


@triton.jit
def _inv_norm(b_ss, USE_QK_L2NORM: tl.constexpr):
    """1 / ||x|| from the squared norm, with the eps of transformers' and fla's l2norm; ones without it."""
    if USE_QK_L2NORM:
        return tl.rsqrt(b_ss + 1e-6)
    else:
        return tl.full(b_ss.shape, 1.0, dtype=tl.float32)


@triton.jit
def _unit_lower_inverse(b_G, eye, n_chain, DOT_PRECISION: tl.constexpr):
    """(I + G)^-1 = sum_{m < N} (-G)^m for G with G^N = 0, as (I - G)(I + G^2)(I + G^4)...: each factor doubles
    the number of terms, so ceil(log2 N) - 1 squarings."""
    b_X = tl.where(eye, 1.0, 0.0) - b_G
    b_P = b_G
    terms = n_chain * 0 + 2
    while terms < n_chain:
        b_P = tl.dot(b_P, b_P, input_precision=DOT_PRECISION)
        b_X += tl.dot(b_X, b_P, input_precision=DOT_PRECISION)
        terms *= 2
    return b_X


@triton.jit
def _mask_block(p_anc, o_r, m_r, o_c, m_c, T):
    """The ancestor mask's block of rows o_r and columns o_c (False off the tree)."""
    return tl.load(p_anc + o_r[:, None] * T + o_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0) != 0


@triton.jit
def _log_p(p_anc, b_g, o_r, m_r, o_t, T):
    """log P of the rows o_r ([BH]): the sum of g ([BT], the whole tree's) over each row's ancestors and itself."""
    b_m = _mask_block(p_anc, o_r, m_r, o_t, o_t < T, T)  # [BH, BT]
    return tl.sum(tl.where(b_m, b_g[None, :], 0.0), axis=1)


@triton.jit
def _store_block(p_ws, i_block, b_x, o_h, BH: tl.constexpr):
    tl.store(p_ws + i_block * BH * BH + o_h[:, None] * BH + o_h[None, :], b_x)


@triton.jit
def _load_block(p_ws, i_block, o_h, BH: tl.constexpr):
    return tl.load(p_ws + i_block * BH * BH + o_h[:, None] * BH + o_h[None, :])


@triton.jit
def _diagonal_block(
    p_q,
    p_k,
    p_ws,
    p_rn,
    i_block,
    o_r,
    m_r,
    b_m,
    b_lp,
    b_beta,
    stride_qt,
    WRITE_NORMS,
    HK,
    K: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """The diagonal block of the rows o_r (ancestor mask b_m, log P b_lp): (I + G)^-1 and C D_rq^-1 (C without
    the queries' norms, which the apply kernel applies), written to the workspace's blocks i_block and i_block + 1;
    with WRITE_NORMS (one value head per key head) also the rows' 1 / ||k|| and 1 / ||q|| to p_rn."""
    b_kk, b_qk = _grams(p_q, p_k, o_r, m_r, o_r, m_r, stride_qt, K, BH, BK, True, DOT_PRECISION, UPCAST_DOT)
    o_h = tl.arange(0, BH)
    eye = o_h[:, None] == o_h[None, :]
    b_rk = _inv_norm(tl.sum(tl.where(eye, b_kk, 0.0), axis=1), USE_QK_L2NORM)  # ||k_i||^2 = (K K^T)_ii
    if USE_QK_L2NORM:
        if WRITE_NORMS:
            tl.store(p_rn + o_r * HK * 2, b_rk, mask=m_r)
            tl.store(p_rn + o_r * HK * 2 + 1, _inv_norm(_sq_norms(p_q, o_r, m_r, stride_qt, K, BH), True), mask=m_r)
    # P_i / P_j on the ancestor mask only (an entry off it would overflow).
    b_dec = tl.exp(tl.where(b_m, b_lp[:, None] - b_lp[None, :], float("-inf")))
    b_G = tl.where(eye, 0.0, b_dec) * (b_kk * (b_beta * b_rk)[:, None] * b_rk[None, :])
    # C first: its Gram block and the decays are then dead during the inverse's matmuls (fewer live registers).
    _store_block(p_ws, i_block + 1, b_dec * (b_qk * b_rk[None, :]), o_h, BH)
    _store_block(p_ws, i_block, _unit_lower_inverse(b_G, eye, _chain_length(b_m), DOT_PRECISION), o_h, BH)


@triton.autotune(
    configs=autotune_configs(SOLVE_CONFIGS),
    key=["B", "BT", "H", "HK", "K", "USE_QK_L2NORM", "ONE_HALF"],
    prune_configs_by={"early_config_prune": full_tile_prune(BK=128, num_warps=4)},
)
@triton.jit(do_not_specialize=["T"])
def tree_gdn_verify_solve_kernel(
    q,
    k,
    g,
    beta,
    anc,
    ws,
    log_decay,
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
    ONE_HALF: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per (block, request x value head); a tree of one block (ONE_HALF) has block 0 alone. Block 0: A0
    # and C00, and log P of the first half's rows; block 1: A1 and C11, and log P of the second half's; block 2: C10
    # and G10 without norms or beta (the apply kernel scales their products). None needs another's results. The
    # diagonal blocks' programs of each key head's first value head write the rows' inverse norms ([B, T, HK, 2]:
    # keys, queries) after the blocks, which the apply kernel reads.
    if USE_PDL:
        # The apply kernel may start now: its state products need nothing of this kernel's, and it waits for
        # this kernel's end before it reads the workspace.
        tl.extra.cuda.gdc_launch_dependents()
    BH: tl.constexpr = BT // 2
    i_blk, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HK)

    o_h = tl.arange(0, BH)
    o_t = tl.arange(0, BT)
    p_anc = anc + i_b * T * T
    p_beta = beta + i_b * T * H + i_h
    p_q = q + i_b * stride_qb + i_hk * stride_qh
    p_k = k + i_b * stride_qb + i_hk * stride_qh
    p_ws = ws + i_bh * _blocks(ONE_HALF) * BH * BH
    p_rn = _norms_of(ws, i_b, i_hk, B, T, H, HK, BH, ONE_HALF)
    b_g = tl.load(g + (i_b * T + o_t) * H + i_h, mask=o_t < T, other=0).to(tl.float32)  # [BT]

    if i_blk < 2:
        # One call site for both diagonal blocks, so that their code (the inverse's matmuls) is compiled once: with
        # one per block, Nsight Compute put half of the stalls at batch 1 on instruction fetch.
        o_r = i_blk * BH + o_h
        m_r = o_r < T
        if i_blk * BH < T:
            b_lp = _log_p(p_anc, b_g, o_r, m_r, o_t, T)
            tl.store(log_decay + (i_b * T + o_r) * H + i_h, b_lp, mask=m_r)
            b_beta = tl.load(p_beta + o_r * H, mask=m_r, other=0).to(tl.float32)
            _diagonal_block(
                p_q, p_k, p_ws, p_rn, 2 * i_blk, o_r, m_r, _mask_block(p_anc, o_r, m_r, o_r, m_r, T), b_lp, b_beta,
                stride_qt, i_h % (H // HK) == 0, HK, K, BH, BK, USE_QK_L2NORM, DOT_PRECISION, UPCAST_DOT,
            )  # fmt: skip
    elif BH < T:
        o_r0, o_r1 = o_h, BH + o_h
        m_r0, m_r1 = o_r0 < T, o_r1 < T
        b_lp0 = _log_p(p_anc, b_g, o_r0, m_r0, o_t, T)
        b_lp1 = _log_p(p_anc, b_g, o_r1, m_r1, o_t, T)
        b_kk, b_qk = _grams(p_q, p_k, o_r1, m_r1, o_r0, m_r0, stride_qt, K, BH, BK, False, DOT_PRECISION, UPCAST_DOT)
        b_m10 = _mask_block(p_anc, o_r1, m_r1, o_r0, m_r0, T)
        b_dec = tl.exp(tl.where(b_m10, b_lp1[:, None] - b_lp0[None, :], float("-inf")))
        _store_block(p_ws, 4, b_dec * b_qk, o_h, BH)
        _store_block(p_ws, 5, b_dec * b_kk, o_h, BH)


@triton.jit
def _row_norms(p_rn, o_r, m_r, HK, BH: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    """The rows' 1 / ||k|| and 1 / ||q|| ([BH] each) the solve kernel wrote, or ones without the L2 norm."""
    if USE_QK_L2NORM:
        return tl.load(p_rn + o_r * HK * 2, mask=m_r, other=0), tl.load(p_rn + o_r * HK * 2 + 1, mask=m_r, other=0)
    else:
        return tl.full([BH], 1.0, dtype=tl.float32), tl.full([BH], 1.0, dtype=tl.float32)


@triton.jit
def _state_rows(p_h0, o_k, o_v, m_v, K: tl.constexpr, V):
    """The state's rows o_k of the V-tile ([BK, BV] float32, zeros past K)."""
    return tl.load(p_h0 + o_k[:, None] * V + o_v[None, :], mask=(o_k < K)[:, None] & m_v[None, :], other=0)


@triton.jit
def _state_chunk(b_h, SPLIT_STATE: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """A chunk of the state (float32) as three bf16 pieces h1 + h2 + h3 (24 significant bits) with SPLIT_STATE, else
    as is: bf16 q/k are exact in bf16, so three bf16 products accumulate in fp32 as exactly as an fp32 product, in
    less than half the tensor-core time of 3xTF32."""
    if SPLIT_STATE:
        b_h1 = b_h.to(tl.bfloat16)
        b_hr = b_h - b_h1.to(tl.float32)
        b_h2 = b_hr.to(tl.bfloat16)
        b_h3 = (b_hr - b_h2.to(tl.float32)).to(tl.bfloat16)
        if UPCAST_DOT:
            b_h1, b_h2, b_h3 = b_h1.to(tl.float32), b_h2.to(tl.float32), b_h3.to(tl.float32)
        return b_h1, b_h2, b_h3
    else:
        return b_h, b_h, b_h


@triton.jit
def _rows_state(b_x, b_h1, b_h2, b_h3, b_acc, SPLIT_STATE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                UPCAST_DOT: tl.constexpr):  # fmt: skip
    """b_acc + x S_chunk for rows x of q or k, from `_state_chunk`'s pieces."""
    if SPLIT_STATE:
        if UPCAST_DOT:
            b_x = b_x.to(tl.float32)
        b_acc = tl.dot(b_x, b_h1, b_acc)
        b_acc = tl.dot(b_x, b_h2, b_acc)
        return tl.dot(b_x, b_h3, b_acc)
    else:
        return tl.dot(b_x.to(tl.float32), b_h1, b_acc, input_precision=DOT_PRECISION)


@triton.jit
def _halves(b_x, BH: tl.constexpr, BV: tl.constexpr):
    """The two halves ([BH, BV] each) of a [2 BH, BV] tile."""
    return tl.split(tl.permute(tl.reshape(b_x, (2, BH, BV)), (1, 2, 0)))


@triton.jit
def _state_products(
    p_q,
    p_k,
    p_h0,
    T,
    o_v,
    m_v,
    stride_qt,
    V,
    K: tl.constexpr,
    BH: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    FULL_TILE: tl.constexpr,
    ONE_HALF: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    SPLIT_STATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Raw K S_pre and Q S_pre of both halves' rows for the V-tile ([BH, BV] each, zeros without a state or for the
    second half of a tree of one block); every chunk of the state is read, and split, once for both halves.
    FULL_TILE: one matmul of all 2 BH rows each, split into halves after; else one a half (the first alone with
    ONE_HALF). (The rows' norms come from the solve kernel.) Each chunk's load of the state is issued a step ahead,
    before the previous chunk's matmuls, so that streaming the state does not wait on them (past K it loads nothing).
    """
    # On an H100 the step ahead took 4-11% off the layer at T = 16 (B = 1 to 64), where the state's bytes dominate.
    if FULL_TILE:
        o_t = tl.arange(0, 2 * BH)
        m_t = o_t < T
        b_ks = tl.zeros([2 * BH, BV], dtype=tl.float32)
        b_qs = tl.zeros([2 * BH, BV], dtype=tl.float32)
        if USE_INITIAL_STATE:
            b_next = _state_rows(p_h0, tl.arange(0, BK), o_v, m_v, K, V)
            for i_k in range(0, K, BK):
                o_k = i_k + tl.arange(0, BK)
                m_k = o_k < K
                b_h, b_next = b_next, _state_rows(p_h0, o_k + BK, o_v, m_v, K, V)  # the next load first
                m = m_t[:, None] & m_k[None, :]
                b_k = tl.load(p_k + o_t[:, None] * stride_qt + o_k[None, :], mask=m, other=0)
                b_q = tl.load(p_q + o_t[:, None] * stride_qt + o_k[None, :], mask=m, other=0)
                b_h1, b_h2, b_h3 = _state_chunk(b_h, SPLIT_STATE, UPCAST_DOT)
                b_ks = _rows_state(b_k, b_h1, b_h2, b_h3, b_ks, SPLIT_STATE, DOT_PRECISION, UPCAST_DOT)
                b_qs = _rows_state(b_q, b_h1, b_h2, b_h3, b_qs, SPLIT_STATE, DOT_PRECISION, UPCAST_DOT)
        b_ks0, b_ks1 = _halves(b_ks, BH, BV)
        b_qs0, b_qs1 = _halves(b_qs, BH, BV)
    else:
        o_r0 = tl.arange(0, BH)
        o_r1 = BH + o_r0
        m_r0, m_r1 = o_r0 < T, o_r1 < T
        b_ks0 = tl.zeros([BH, BV], dtype=tl.float32)
        b_qs0 = tl.zeros([BH, BV], dtype=tl.float32)
        b_ks1 = tl.zeros([BH, BV], dtype=tl.float32)
        b_qs1 = tl.zeros([BH, BV], dtype=tl.float32)
        if USE_INITIAL_STATE:
            b_next = _state_rows(p_h0, tl.arange(0, BK), o_v, m_v, K, V)
            for i_k in range(0, K, BK):
                o_k = i_k + tl.arange(0, BK)
                m_k = o_k < K
                b_h, b_next = b_next, _state_rows(p_h0, o_k + BK, o_v, m_v, K, V)  # the next load first
                m0 = m_r0[:, None] & m_k[None, :]
                b_k0 = tl.load(p_k + o_r0[:, None] * stride_qt + o_k[None, :], mask=m0, other=0)
                b_q0 = tl.load(p_q + o_r0[:, None] * stride_qt + o_k[None, :], mask=m0, other=0)
                if not ONE_HALF:
                    m1 = m_r1[:, None] & m_k[None, :]
                    b_k1 = tl.load(p_k + o_r1[:, None] * stride_qt + o_k[None, :], mask=m1, other=0)
                    b_q1 = tl.load(p_q + o_r1[:, None] * stride_qt + o_k[None, :], mask=m1, other=0)
                b_h1, b_h2, b_h3 = _state_chunk(b_h, SPLIT_STATE, UPCAST_DOT)
                b_ks0 = _rows_state(b_k0, b_h1, b_h2, b_h3, b_ks0, SPLIT_STATE, DOT_PRECISION, UPCAST_DOT)
                b_qs0 = _rows_state(b_q0, b_h1, b_h2, b_h3, b_qs0, SPLIT_STATE, DOT_PRECISION, UPCAST_DOT)
                if not ONE_HALF:
                    b_ks1 = _rows_state(b_k1, b_h1, b_h2, b_h3, b_ks1, SPLIT_STATE, DOT_PRECISION, UPCAST_DOT)
                    b_qs1 = _rows_state(b_q1, b_h1, b_h2, b_h3, b_qs1, SPLIT_STATE, DOT_PRECISION, UPCAST_DOT)
    return b_ks0, b_qs0, b_ks1, b_qs1


@triton.heuristics({"USE_INITIAL_STATE": lambda args: args["h0"] is not None})
@triton.autotune(
    configs=autotune_configs(APPLY_CONFIGS),
    key=["B", "BT", "H", "HK", "K", "V", "USE_QK_L2NORM", "ONE_HALF"],
    prune_configs_by={"early_config_prune": full_tile_prune(BK=32, num_warps=4)},
)
@triton.jit(do_not_specialize=["T"])
def tree_gdn_verify_apply_kernel(
    q,
    k,
    v,
    beta,
    h0,
    ws,
    log_decay,
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
    ONE_HALF: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    SPLIT_STATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per (request, value head, V-tile), from R = D_beta (V - D_P K S_pre), with the norms the solve
    # kernel left out of C and of the off-diagonal blocks (r_k, r_q: the rows' 1 / ||k||, 1 / ||q||):
    #   U0 = A0 R0                                          O0 = D_P Q0 S_pre + D_rq0 C00' U0
    #   U1 = A1 (R1 - D_beta1 D_rk1 G10' D_rk0 U0)          O1 = D_P Q1 S_pre + D_rq1 (C10' D_rk0 U0 + C11' U1)
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
    p_lp = log_decay + i_b * T * H + i_h
    p_rn = _norms_of(ws, i_b, i_hk, B, T, H, HK, BH, ONE_HALF)
    p_q = q + i_b * stride_qb + i_hk * stride_qh
    p_k = k + i_b * stride_qb + i_hk * stride_qh
    p_v = v + i_b * stride_vb + i_h * V
    p_u = u + (i_b * T * H + i_h) * V
    p_o = o + (i_b * T * H + i_h) * V
    p_ws = ws + i_bh * _blocks(ONE_HALF) * BH * BH
    p_h0 = h0
    if USE_INITIAL_STATE:
        p_h0 = h0 + i_bh * K * V

    # The state products of all 2 BH rows of two halves in one matmul each where BT <= 64: Hopper's warpgroup matmuls
    # take 64 rows and more, which T = 64's halves of 32 rows do not reach (an H100 took 12-18% less at B = 8 and 16,
    # T = 64); at BT = 128, [128, BV] tiles cost more registers than they save (3.6% slower at B = 16).
    b_ks0, b_qs0, b_ks1, b_qs1 = _state_products(
        p_q, p_k, p_h0, T, o_v, m_v, stride_qt, V, K, BH, BK, BV, BT <= 64 and not ONE_HALF, ONE_HALF,
        USE_INITIAL_STATE, SPLIT_STATE, DOT_PRECISION, UPCAST_DOT,
    )  # fmt: skip
    if USE_PDL:
        # Launched while the solve kernel may still run (it reads the same inputs, writes only the workspace, log P
        # and the norms): wait for its end before reading those, and before any store.
        tl.extra.cuda.gdc_wait()
    b_rk0, b_rq0 = _row_norms(p_rn, o_r0, m_r0, HK, BH, USE_QK_L2NORM)
    b_rk1, b_rq1 = _row_norms(p_rn, o_r1, m_r1, HK, BH, USE_QK_L2NORM)

    # ---- first half ----
    b_beta = tl.load(p_beta + o_r0 * H, mask=m_r0, other=0).to(tl.float32)
    b_p = tl.exp(tl.load(p_lp + o_r0 * H, mask=m_r0, other=0))
    b_v = tl.load(p_v + o_r0[:, None] * stride_vt + o_v[None, :], mask=m_r0[:, None] & m_v[None, :], other=0)
    b_R = b_beta[:, None] * (b_v.to(tl.float32) - (b_p * b_rk0)[:, None] * b_ks0)
    b_u0 = tl.dot(_load_block(p_ws, 0, o_h, BH), b_R, input_precision=DOT_PRECISION)
    b_o = tl.dot(_load_block(p_ws, 1, o_h, BH), b_u0, input_precision=DOT_PRECISION)
    b_o = b_rq0[:, None] * (b_p[:, None] * b_qs0 + b_o)
    m_rv = m_r0[:, None] & m_v[None, :]
    tl.store(p_u + o_r0[:, None] * H * V + o_v[None, :], b_u0, mask=m_rv)
    tl.store(p_o + o_r0[:, None] * H * V + o_v[None, :], (scale * b_o).to(p_o.dtype.element_ty), mask=m_rv)

    # ---- second half ----
    if not ONE_HALF:
        b_beta = tl.load(p_beta + o_r1 * H, mask=m_r1, other=0).to(tl.float32)
        b_p = tl.exp(tl.load(p_lp + o_r1 * H, mask=m_r1, other=0))
        b_v = tl.load(p_v + o_r1[:, None] * stride_vt + o_v[None, :], mask=m_r1[:, None] & m_v[None, :], other=0)
        b_u0 *= b_rk0[:, None]  # stored above; from here on D_rk0 U0
        b_R = b_v.to(tl.float32) - (b_p * b_rk1)[:, None] * b_ks1
        b_R -= b_rk1[:, None] * tl.dot(_load_block(p_ws, 5, o_h, BH), b_u0, input_precision=DOT_PRECISION)
        b_u1 = tl.dot(_load_block(p_ws, 2, o_h, BH), b_beta[:, None] * b_R, input_precision=DOT_PRECISION)
        b_o = tl.dot(_load_block(p_ws, 4, o_h, BH), b_u0, input_precision=DOT_PRECISION)
        b_o = tl.dot(_load_block(p_ws, 3, o_h, BH), b_u1, b_o, input_precision=DOT_PRECISION)
        b_o = b_rq1[:, None] * (b_p[:, None] * b_qs1 + b_o)
        m_rv = m_r1[:, None] & m_v[None, :]
        tl.store(p_u + o_r1[:, None] * H * V + o_v[None, :], b_u1, mask=m_rv)
        tl.store(p_o + o_r1[:, None] * H * V + o_v[None, :], (scale * b_o).to(p_o.dtype.element_ty), mask=m_rv)


_SOLVE = CachedLaunch(tree_gdn_verify_solve_kernel)
_APPLY = CachedLaunch(tree_gdn_verify_apply_kernel)


def tree_gdn_verify_fwd(q, k, v, g, beta, ancestors, initial_state, scale, use_qk_l2norm, dot_precision, pdl=None):
    """Launches the solve kernel (one program per request, value head and block), then the apply kernel (one per
    request, value head and V-tile). Inputs as `tree_gdn_verify` after its checks. With `pdl` (default: where the
    GPU has it, `use_pdl`) the apply kernel launches while the solve kernel runs and forms its state products
    meanwhile, which matters when a small batch leaves most of the GPU idle during the solve."""
    # q and k are read through all their strides but the last: the key heads transformers 5.17 repeats to the value
    # heads (every group-th head kept, `_tree_gated_delta_rule`) are read in place, not copied.
    q, k, v = dim_contiguous(q), dim_contiguous(k), token_major(v)
    stride_q, stride_v = q.stride(), v.stride()
    if stride_q != k.stride():
        q, k = q.contiguous(), k.contiguous()
        stride_q = q.stride()
    B, T, HK, K = k.shape
    _, _, H, V = v.shape
    g, beta, anc = g.contiguous(), beta.contiguous(), ancestors.contiguous()
    device = v.device
    # What both kernels are specialized on (`CachedLaunch`): the shapes, dtypes and strides passed, which addresses
    # are 16-byte aligned (outputs and the workspace are fresh allocations), the constexprs and the device; g, beta,
    # the ancestors and the state are contiguous, their strides follow from the shapes.
    key = (
        device, k.shape, H, V, stride_q, stride_v, q.dtype, v.dtype, g.dtype, beta.dtype,
        initial_state is None, use_qk_l2norm, dot_precision, pdl,  # pdl None: `use_pdl(v)`, given by v's device
        alignment(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), anc.data_ptr(),
                  0 if initial_state is None else initial_state.data_ptr()),
    )  # fmt: skip
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=device)
    u = torch.empty(B, T, H, V, dtype=torch.float32, device=device)
    log_decay = torch.empty(B, T, H, dtype=torch.float32, device=device)
    ws = torch.empty(workspace_bytes(B, T, H, HK) // 4, dtype=torch.float32, device=device)
    BT, one_half = verify_tile(T, B * H)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), B * H)

    with on_device(v):
        _launch_solve(key, q, k, H, g, beta, anc, ws, log_decay, use_qk_l2norm, dot_precision, pdl, BT, one_half)
        _APPLY(
            key, grid,
            (q, k, v, beta, initial_state, ws, log_decay, o, u, scale, *stride_q[:3], *stride_v[:2], B, T, H, HK),
            lambda: dict(
                K=K, V=V, BT=BT, ONE_HALF=one_half, USE_QK_L2NORM=use_qk_l2norm,
                SPLIT_STATE=k.dtype == torch.bfloat16, DOT_PRECISION=dot_precision, UPCAST_DOT=is_interpreter(),
                **_pdl_options(pdl, v),
            ),
        )  # fmt: skip
    return o, u, log_decay


def solve(q, k, H, g, beta, ancestors, use_qk_l2norm, dot_precision, pdl=False):
    """The solve kernel alone (q and k read in place, as `tree_gdn_verify_fwd` passes them): the workspace of
    `workspace_bytes` (the blocks, then the rows' inverse key and query norms, unwritten without `use_qk_l2norm`)
    and log_decay `[B, T, H]`. `pdl`: let the next kernel (the apply kernel, launched with programmatic dependent
    launch) start at once."""
    B, T, HK = k.shape[:3]
    g, beta, anc = g.contiguous(), beta.contiguous(), ancestors.contiguous()
    log_decay = torch.empty(B, T, H, dtype=torch.float32, device=k.device)
    ws = torch.empty(workspace_bytes(B, T, H, HK) // 4, dtype=torch.float32, device=k.device)
    # as `tree_gdn_verify_fwd`'s key, for the solve kernel's arguments
    key = (
        k.device, k.shape, H, q.stride(), q.dtype, g.dtype, beta.dtype, use_qk_l2norm, dot_precision, pdl,
        alignment(q.data_ptr(), k.data_ptr(), g.data_ptr(), beta.data_ptr(), anc.data_ptr()),
    )  # fmt: skip
    with on_device(k):
        _launch_solve(
            key, q, k, H, g, beta, anc, ws, log_decay, use_qk_l2norm, dot_precision, pdl, *verify_tile(T, B * H)
        )  # fmt: skip
    return ws, log_decay


def _pdl_options(pdl: bool | None, x: torch.Tensor, launch: bool = True) -> dict:
    """The constexpr `USE_PDL` and, for the kernel launched while the other runs, Triton's launch option (which only
    NVIDIA's Triton backend knows); `pdl` None: where the GPU has it (`use_pdl`). Resolved at Triton's launches only:
    the compiled kernels keep it."""
    pdl = use_pdl(x) if pdl is None else pdl
    return {"USE_PDL": pdl, **({"launch_pdl": True} if pdl and launch else {})}


def _launch_solve(key, q, k, H, g, beta, anc, ws, log_decay, use_qk_l2norm, dot_precision, pdl, BT, one_half):
    """Launches the solve kernel into the workspace `ws` and `log_decay`, the tree held as `verify_tile` gives."""
    B, T, HK, K = k.shape
    _SOLVE(
        key, (1 if one_half else 3, B * H),
        (q, k, g, beta, anc, ws, log_decay, *q.stride()[:3], B, T, H, HK),
        lambda: dict(
            K=K, BT=BT, ONE_HALF=one_half, USE_QK_L2NORM=use_qk_l2norm, DOT_PRECISION=dot_precision,
            UPCAST_DOT=is_interpreter(), **_pdl_options(pdl, k, launch=False),
        ),
    )  # fmt: skip


def tree_tile(T: int) -> int:
    """BT: the tree padded to a power of two of >= 32 rows, two halves of >= 16 (the smallest tensor-core tile)."""
    return max(32, next_power_of_2(T))


def verify_tile(T: int, pairs: int) -> tuple[int, bool]:
    """The tree tile BT (a power of two >= 32; halves of BH = BT / 2 >= 16 rows, the smallest tensor-core tile) and
    whether the tree is one block, its first half (BH >= T), or both halves, for `pairs` (request, value head) pairs:
    up to 16 nodes one block of 16 rows; up to 32 two halves of 16; up to 64 one block of 64 rows from
    `ONE_BLOCK_MIN_PAIRS` pairs on, two halves of 32 below; up to 128 two halves of 64."""
    if T <= 16:
        return 32, True
    if T <= 32:
        return 32, False
    if T <= 64:
        return (128, True) if pairs >= ONE_BLOCK_MIN_PAIRS else (64, False)
    return 128, False
