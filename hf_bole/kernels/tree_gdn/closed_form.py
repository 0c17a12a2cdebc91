"""Closed-form tree verification through a Gated DeltaNet layer (derivation: README.md beside this file).

For each (request, value head), with P_i the product of gates on node i's path and A(i) its strict ancestors:

    (I + G) U = R,   G_ij = beta_i (P_i/P_j) k_i.k_j  [j in A(i)],   R = D_beta (V - D_P K S_pre)
    O = D_P Q S_pre + C U,   C_ij = (P_i/P_j) q_i.k_j  [j in A(i) or j = i]

G is nilpotent (G^(d+1) = 0 for a tree of depth d), so U = sum_{m<=d} (-G)^m R: d small matmuls.
Two Triton kernels, each one program per (request, value head, V-tile); trees of up to ROWS_MAX_NODES nodes go
to the row-block kernel (closed_form_rows.py), larger ones to the two-half kernel here. The tree enters as its
ancestor mask (computed once per tree, shared by every head and layer), so log P is a masked sum and nothing
walks parent pointers. The two-half kernel holds the tree as two halves of BT/2 rows; every Gram block
(K K^T, Q K^T) is formed once per program with one bf16 matmul per K chunk, the state products K S_pre and
Q S_pre from three bf16 pieces of S_pre, each diagonal block is solved by its Neumann series (as many steps
as the longest chain inside it) and the first half enters the second through one matmul with U0. Only O
and the factors (U, log P) are written. Nothing of size K x V per node exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_bole.kernels.tree_gdn.ancestors import tree_ancestor_mask
from hf_bole.kernels.tree_gdn.closed_form_ops import chain_length, grams, state_products
from hf_bole.kernels.tree_gdn.closed_form_rows import tree_gdn_verify_rows_fwd_kernel
from hf_bole.kernels.tree_gdn.closed_form_split import tree_gdn_verify_split_fwd
from hf_bole.kernels.utils import (
    autotune_configs,
    check_dtype,
    check_parents,
    check_same_device,
    check_shape,
    is_interpreter,
    l2norm,
    on_device,
    token_major,
    use_triton,
)

# The row-block kernel beat the two-kernel form on one H200 only for trees of up to 32 nodes of one request
# (results/kernels_h200_split/): few programs, each short.
ROWS_BEST_NODES = 32
ROWS_BEST_PROGRAMS = 64
MAX_NODES = 128  # the tree is held as two halves of BT / 2 <= 64 rows, with their [BT/2, BT/2] blocks on chip
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# BV trades parallelism (V-tiles are separate programs) against repeating the Gram products and the inverse
# of the diagonal blocks, which do not depend on V, in every tile: small BV for a few requests, large for many.
# BK is the chunk of the key dimension streamed for the Gram and state products. Two configs only: each
# compiles in ~10-20 s for sm_90, per tree size. 8 warps: the fewest spills seen at BT = 128 (ptxas, triton 3.6).
# BV = 16 (fewer spills) is left out: on the H200 it ended in an illegal memory access (triton 3.6, 2026-11-30).
VERIFY_CONFIGS = [
    triton.Config({"BK": BK, "BV": BV}, num_warps=num_warps, num_stages=num_stages)
    for BK, BV, num_warps, num_stages in (
        (32, 32, 8, 1), (32, 64, 8, 1),
    )
]  # fmt: skip


@triton.jit
def _unit_lower_solve(b_G, b_R, n_chain, DOT_PRECISION: tl.constexpr):
    """(I + G)^-1 R = sum_{m < N} (-G)^m R for G with G^N = 0: N - 1 steps U <- R - G U (Horner). One
    [BH, BH] x [BH, BV] product per step, on a tile that stays in registers (the doubling form, with its
    squarings of G, used more registers than Triton 3.6 has on sm_90 and spilled)."""
    b_U = b_R
    for _ in range(n_chain - 1):
        b_U = b_R - tl.dot(b_G, b_U, input_precision=DOT_PRECISION)
    return b_U


@triton.heuristics({"USE_INITIAL_STATE": lambda args: args["h0"] is not None})
@triton.autotune(configs=autotune_configs(VERIFY_CONFIGS), key=["B", "BT", "H", "HK", "K", "V", "USE_QK_L2NORM"])
@triton.jit(do_not_specialize=["T"])
def tree_gdn_verify_halves_fwd_kernel(
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
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    SPLIT_STATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # One program per (request, value head, V-tile) holds the whole tree as two halves of BH rows:
    #   [I + G00      0   ] [U0]   [R0]          U0 = (I + G00)^-1 R0
    #   [  G10    I + G11 ] [U1] = [R1]    =>    U1 = (I + G11)^-1 (R1 - G10 U0)
    # with each diagonal block solved by its Neumann series (as many steps as its longest chain).
    # bf16 tiles multiply exactly into fp32 on tensor cores; UPCAST_DOT feeds fp32 tiles instead for
    # Triton's interpreter, which multiplies bf16 tiles as raw bits (seen with triton 3.9).
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
    p_anc = anc + i_b * T * T
    p_g = g + i_b * T * H + i_h
    p_beta = beta + i_b * T * H + i_h
    p_q = q + i_b * stride_qb + i_hk * K
    p_k = k + i_b * stride_qb + i_hk * K
    p_v = v + i_b * stride_vb + i_h * V
    p_u = u + (i_b * T * H + i_h) * V
    p_o = o + (i_b * T * H + i_h) * V
    p_h0 = h0
    if USE_INITIAL_STATE:
        p_h0 = h0 + i_bh * K * V
    eye = o_h[:, None] == o_h[None, :]

    # ---- first half: rows and columns 0 .. BH-1 ----
    b_g0 = tl.load(p_g + o_r0 * H, mask=m_r0, other=0).to(tl.float32)
    b_beta = tl.load(p_beta + o_r0 * H, mask=m_r0, other=0).to(tl.float32)
    b_m = tl.load(p_anc + o_r0[:, None] * T + o_r0[None, :], mask=m_r0[:, None] & m_r0[None, :], other=0) != 0
    b_lp0 = tl.sum(tl.where(b_m, b_g0[None, :], 0.0), axis=1)  # log P: sum of g over ancestors-or-self
    b_ks, b_qs, b_ssk, b_ssq = state_products(
        p_q, p_k, p_h0, o_r0, m_r0, o_v, m_v, stride_qt, V, K, BH, BK, BV,
        USE_INITIAL_STATE, SPLIT_STATE, DOT_PRECISION, UPCAST_DOT,
    )  # fmt: skip
    b_rk0 = tl.full([BH], 1.0, dtype=tl.float32)
    b_rq = tl.full([BH], 1.0, dtype=tl.float32)
    if USE_QK_L2NORM:
        b_rk0 = tl.rsqrt(b_ssk + 1e-6)
        b_rq = tl.rsqrt(b_ssq + 1e-6)
    b_p = tl.exp(b_lp0)
    b_v = tl.load(p_v + o_r0[:, None] * stride_vt + o_v[None, :], mask=m_r0[:, None] & m_v[None, :], other=0)
    b_R = b_beta[:, None] * (b_v.to(tl.float32) - (b_p * b_rk0)[:, None] * b_ks)
    b_o = (b_p * b_rq)[:, None] * b_qs
    b_kk, b_qk = grams(p_q, p_k, o_r0, m_r0, o_r0, m_r0, stride_qt, K, BH, BK, DOT_PRECISION, UPCAST_DOT)
    # P_i / P_j on the ancestor mask only (an entry off it would overflow).
    b_dec = tl.exp(tl.where(b_m, b_lp0[:, None] - b_lp0[None, :], float("-inf")))
    b_G = tl.where(eye, 0.0, b_dec) * (b_kk * (b_beta * b_rk0)[:, None] * b_rk0[None, :])
    b_u0 = _unit_lower_solve(b_G, b_R, chain_length(b_m), DOT_PRECISION)
    b_C = b_dec * (b_qk * b_rq[:, None] * b_rk0[None, :])
    b_o = tl.dot(b_C, b_u0, b_o, input_precision=DOT_PRECISION)
    m_rv = m_r0[:, None] & m_v[None, :]
    tl.store(p_u + o_r0[:, None] * H * V + o_v[None, :], b_u0, mask=m_rv)
    tl.store(p_o + o_r0[:, None] * H * V + o_v[None, :], (scale * b_o).to(p_o.dtype.element_ty), mask=m_rv)
    if i_v == 0:
        tl.store(log_decay + (i_b * T + o_r0) * H + i_h, b_lp0, mask=m_r0)

    # ---- second half: rows BH .. BT-1, against the first half's columns (G10, C10), then its own ----
    if BH < T:
        b_g1 = tl.load(p_g + o_r1 * H, mask=m_r1, other=0).to(tl.float32)
        b_beta = tl.load(p_beta + o_r1 * H, mask=m_r1, other=0).to(tl.float32)
        b_m = tl.load(p_anc + o_r1[:, None] * T + o_r0[None, :], mask=m_r1[:, None] & m_r0[None, :], other=0) != 0
        b_m11 = tl.load(p_anc + o_r1[:, None] * T + o_r1[None, :], mask=m_r1[:, None] & m_r1[None, :], other=0) != 0
        b_lp1 = tl.sum(tl.where(b_m, b_g0[None, :], 0.0), axis=1) + tl.sum(tl.where(b_m11, b_g1[None, :], 0.0), axis=1)
        b_ks, b_qs, b_ssk, b_ssq = state_products(
            p_q, p_k, p_h0, o_r1, m_r1, o_v, m_v, stride_qt, V, K, BH, BK, BV,
            USE_INITIAL_STATE, SPLIT_STATE, DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
        b_rk1 = tl.full([BH], 1.0, dtype=tl.float32)
        b_rq = tl.full([BH], 1.0, dtype=tl.float32)
        if USE_QK_L2NORM:
            b_rk1 = tl.rsqrt(b_ssk + 1e-6)
            b_rq = tl.rsqrt(b_ssq + 1e-6)
        b_p = tl.exp(b_lp1)
        b_v = tl.load(p_v + o_r1[:, None] * stride_vt + o_v[None, :], mask=m_r1[:, None] & m_v[None, :], other=0)
        b_R = b_beta[:, None] * (b_v.to(tl.float32) - (b_p * b_rk1)[:, None] * b_ks)
        b_o = (b_p * b_rq)[:, None] * b_qs
        # The first half's contribution: R1 - G10 U0, and C10 U0 towards the output.
        b_kk, b_qk = grams(p_q, p_k, o_r1, m_r1, o_r0, m_r0, stride_qt, K, BH, BK, DOT_PRECISION, UPCAST_DOT)
        b_dec = tl.exp(tl.where(b_m, b_lp1[:, None] - b_lp0[None, :], float("-inf")))
        b_G = b_dec * (b_kk * (b_beta * b_rk1)[:, None] * b_rk0[None, :])
        b_R -= tl.dot(b_G, b_u0, input_precision=DOT_PRECISION)
        b_C = b_dec * (b_qk * b_rq[:, None] * b_rk0[None, :])
        b_o = tl.dot(b_C, b_u0, b_o, input_precision=DOT_PRECISION)
        # The diagonal block.
        b_kk, b_qk = grams(p_q, p_k, o_r1, m_r1, o_r1, m_r1, stride_qt, K, BH, BK, DOT_PRECISION, UPCAST_DOT)
        b_dec = tl.exp(tl.where(b_m11, b_lp1[:, None] - b_lp1[None, :], float("-inf")))
        b_G = tl.where(eye, 0.0, b_dec) * (b_kk * (b_beta * b_rk1)[:, None] * b_rk1[None, :])
        b_u1 = _unit_lower_solve(b_G, b_R, chain_length(b_m11), DOT_PRECISION)
        b_C = b_dec * (b_qk * b_rq[:, None] * b_rk1[None, :])
        b_o = tl.dot(b_C, b_u1, b_o, input_precision=DOT_PRECISION)
        m_rv = m_r1[:, None] & m_v[None, :]
        tl.store(p_u + o_r1[:, None] * H * V + o_v[None, :], b_u1, mask=m_rv)
        tl.store(p_o + o_r1[:, None] * H * V + o_v[None, :], (scale * b_o).to(p_o.dtype.element_ty), mask=m_rv)
        if i_v == 0:
            tl.store(log_decay + (i_b * T + o_r1) * H + i_h, b_lp1, mask=m_r1)


def verify_kernel(B: int, T: int, H: int) -> str:
    """The kernel that is faster for B trees of T nodes through H value heads: "rows", the row-block kernel, for
    small trees of a few (request, value head) pairs, "split", the two-kernel form, otherwise (one H200:
    results/kernels_h200_split/)."""
    return "rows" if T <= ROWS_BEST_NODES and B * H <= ROWS_BEST_PROGRAMS else "split"


def tree_gdn_verify_fwd(q, k, v, g, beta, ancestors, initial_state, scale, use_qk_l2norm, dot_precision):
    """Launches the kernels `verify_kernel` picks."""
    rows = verify_kernel(k.shape[0], k.shape[1], v.shape[2]) == "rows"
    launch = tree_gdn_verify_rows_fwd if rows else tree_gdn_verify_split_fwd
    return launch(q, k, v, g, beta, ancestors, initial_state, scale, use_qk_l2norm, dot_precision)


def tree_gdn_verify_rows_fwd(q, k, v, g, beta, ancestors, initial_state, scale, use_qk_l2norm, dot_precision):
    BT = max(16, triton.next_power_of_2(k.shape[1]))
    return _launch(tree_gdn_verify_rows_fwd_kernel, BT, q, k, v, g, beta, ancestors, initial_state, scale,
                   USE_QK_L2NORM=use_qk_l2norm, DOT_PRECISION=dot_precision)  # fmt: skip


def tree_gdn_verify_halves_fwd(q, k, v, g, beta, ancestors, initial_state, scale, use_qk_l2norm, dot_precision):
    BT = max(32, triton.next_power_of_2(k.shape[1]))  # two halves of >= 16 rows (the smallest tensor-core tile)
    return _launch(tree_gdn_verify_halves_fwd_kernel, BT, q, k, v, g, beta, ancestors, initial_state, scale,
                   USE_QK_L2NORM=use_qk_l2norm, SPLIT_STATE=k.dtype == torch.bfloat16, DOT_PRECISION=dot_precision)  # fmt: skip


def _launch(kernel, BT, q, k, v, g, beta, ancestors, initial_state, scale, **constexprs):
    """Allocates the outputs and launches one program per (V-tile, request x value head)."""
    B, T, HK, K = k.shape
    H, V = v.shape[-2:]
    q, k, v = token_major(q), token_major(k), token_major(v)
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    anc = ancestors.contiguous().view(torch.uint8)
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    u = torch.empty(B, T, H, V, dtype=torch.float32, device=v.device)
    log_decay = torch.empty(B, T, H, dtype=torch.float32, device=v.device)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), B * H)

    with on_device(v):
        kernel[grid](
            q, k, v, g, beta, anc, initial_state, o, u, log_decay, scale,
            q.stride(0), q.stride(1), v.stride(0), v.stride(1), B, T, H, HK,
            K=K, V=V, BT=BT, UPCAST_DOT=is_interpreter(), **constexprs,
        )  # fmt: skip
    return o, u, log_decay


def torch_tree_gdn_verify(q, k, v, g, beta, ancestors, initial_state, scale, use_qk_l2norm):
    """The same closed form in plain torch (batched matmuls and a triangular solve): the CPU path."""
    B, T, HK, K = k.shape
    H, V = v.shape[-2:]
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k = (x.to(dtype).repeat_interleave(H // HK, dim=2).transpose(1, 2) for x in (q, k))  # [B, H, T, K]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    vv = v.to(dtype).transpose(1, 2)  # [B, H, T, V]
    gg, bb = (x.to(dtype).transpose(1, 2) for x in (g, beta))  # [B, H, T]
    anc = ancestors[:, None]  # [B, 1, T, T]
    logp = torch.einsum("bij,bhj->bhi", anc.squeeze(1).to(dtype), gg)  # [B, H, T]
    diff = logp[..., :, None] - logp[..., None, :]
    dec = torch.exp(torch.where(anc, diff, float("-inf")))  # [B, H, T, T]
    eye = torch.eye(T, dtype=torch.bool, device=v.device)
    G = torch.where(eye, 0.0, dec) * (k @ k.transpose(-1, -2)) * bb[..., :, None]
    s0 = torch.zeros(B, H, K, V, dtype=dtype, device=v.device) if initial_state is None else initial_state.to(dtype)
    p = logp.exp()[..., None]
    r = bb[..., None] * (vv - p * (k @ s0))
    U = torch.linalg.solve_triangular(torch.eye(T, dtype=dtype, device=v.device) + G, r, upper=False, unitriangular=True)
    O = scale * (p * (q @ s0) + (dec * (q @ k.transpose(-1, -2))) @ U)
    return O.transpose(1, 2).to(v.dtype).contiguous(), U.transpose(1, 2).float().contiguous(), logp.transpose(1, 2).float().contiguous()


def tree_gdn_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    dot_precision: str = "tf32x3",
    ancestors: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs a whole draft tree through one Gated DeltaNet layer in parallel, exactly.

    Every node gets the output the node-by-node recurrence gives along its root-to-node path, computed
    from the committed state, which is not modified. No per-node K x V state is formed: the factors
    (u, log_decay) returned here let `tree_gdn_commit` build the state after any accepted path.

    Args:
        q, k: `[B, T, Hk, K]` queries and keys. Views whose (head, dim) block is contiguous, like the
            splits of one projection, are read in place; others are copied.
        v: `[B, T, H, V]` values; H is a multiple of Hk (each q/k head serves H // Hk consecutive value heads).
        g: `[B, T, H]` log-decay, <= 0.
        beta: `[B, T, H]` write strength.
        parents: `[B, T]` int64, `-1 <= parents[b, i] < i`; -1 marks a child of the committed state.
            Padding nodes may be given parent -1: they never influence other nodes.
        initial_state: `[B, H, K, V]` float32 committed state, or None for zeros. Never modified.
        scale: query scale, `K ** -0.5` by default.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (Qwen3.5 does).
        dot_precision: how float32 matmuls run on the GPU: "tf32x3" (default, ~1e-6 relative), "ieee"
            or "tf32" (fast, ~1e-3). bf16 inputs multiply exactly in every mode.
        ancestors: `tree_ancestor_mask(parents)`, `[B, T, T]` bool, when the caller already has it: one
            tree serves every GDN layer of a forward, so a model computes it once. Derived here otherwise.

    Returns:
        o: `[B, T, H, V]` in the dtype of v.
        u: `[B, T, H, V]` float32, the delta-rule write of every node.
        log_decay: `[B, T, H]` float32, the inclusive sum of g along every node's path.

    Runs the Triton kernel on CUDA tensors (and on CPU tensors under `TRITON_INTERPRET=1`), otherwise the
    same closed form in torch.

    Example:
        >>> B, T, Hk, H, K, V = 1, 3, 1, 2, 16, 16
        >>> q, k = torch.randn(B, T, Hk, K), torch.randn(B, T, Hk, K)
        >>> v, g, beta = torch.randn(B, T, H, V), -torch.rand(B, T, H), torch.rand(B, T, H)
        >>> parents = torch.tensor([[-1, 0, 0]])  # a root with two children
        >>> o, u, log_decay = tree_gdn_verify(q, k, v, g, beta, parents, torch.zeros(B, H, K, V),
        ...                                   use_qk_l2norm_in_kernel=True)
        >>> o.shape
        torch.Size([1, 3, 2, 16])
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q and k must be [B, T, Hk, K] and v [B, T, H, V], got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    B, T, HK, K = k.shape
    H, V = v.shape[-2:]
    check_shape("q", q, (B, T, HK, K), "[B, T, Hk, K]")
    check_shape("v", v, (B, T, H, V), "[B, T, H, V]")
    check_shape("g", g, (B, T, H), "[B, T, H]")
    check_shape("beta", beta, (B, T, H), "[B, T, H]")
    if H % HK != 0:
        raise ValueError(f"the value heads H = {H} must be a multiple of the key heads Hk = {HK}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, x, FLOAT_DTYPES + (torch.float64,))
    for name, x in (("g", g), ("beta", beta)):
        check_dtype(name, x, FLOAT_DTYPES + (torch.float64,))
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    check_parents(parents, B, T)
    if initial_state is not None:
        check_shape("initial_state", initial_state, (B, H, K, V), "[B, H, K, V]")
        check_dtype("initial_state", initial_state, (torch.float32, torch.float64))
    if ancestors is None:
        ancestors = tree_ancestor_mask(parents)
    else:
        check_shape("ancestors", ancestors, (B, T, T), "[B, T, T]")
        check_dtype("ancestors", ancestors, (torch.bool,))
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, parents=parents, initial_state=initial_state, ancestors=ancestors)
    if dot_precision not in ("tf32x3", "ieee", "tf32"):
        raise ValueError(f"dot_precision must be 'tf32x3', 'ieee' or 'tf32', got {dot_precision!r}")
    scale = K**-0.5 if scale is None else float(scale)

    if not use_triton(v) or v.dtype == torch.float64:
        return torch_tree_gdn_verify(q, k, v, g, beta, ancestors, initial_state, scale, use_qk_l2norm_in_kernel)
    if K not in SUPPORTED_HEAD_DIMS or V not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the Triton kernel supports head dims K, V in {SUPPORTED_HEAD_DIMS}, got K = {K}, V = {V}")
    if T > MAX_NODES:
        raise ValueError(
            f"the Triton kernel verifies at most {MAX_NODES} nodes per tree in one call, got T = {T}; "
            f"lower the verification budget"
        )
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    return tree_gdn_verify_fwd(q, k, v, g, beta, ancestors, initial_state, scale, use_qk_l2norm_in_kernel, dot_precision)
