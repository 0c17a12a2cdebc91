"""Closed-form tree verification through a Gated DeltaNet layer (derivation: README.md beside this file).

For each (request, value head), with P_i the product of gates on node i's path and A(i) its strict ancestors:

    (I + G) U = R,   G_ij = beta_i (P_i/P_j) k_i.k_j  [j in A(i)],   R = D_beta (V - D_P K S_pre)
    O = D_P Q S_pre + C U,   C_ij = (P_i/P_j) q_i.k_j  [j in A(i) or j = i]

G is nilpotent (G^(d+1) = 0 for a tree of depth d), so U = sum_{m<=d} (-G)^m R: d small matmuls.
The Triton kernel runs one program per (request, value head, V-tile). The tree enters as its ancestor
mask (computed once per tree, shared by every head and layer), so log P is a masked sum and nothing walks
parent pointers. It solves by forward substitution over row blocks: the rows of G and C for a block are built on chip from streamed K chunks, earlier blocks
enter through one matmul with their U, and the Neumann series runs only inside the diagonal block. Only O
and the factors (U, log P) are written. Nothing of size K x V per node exists.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_bole.kernels.tree_gdn.ancestors import tree_ancestor_mask
from hf_bole.kernels.utils import (
    autotune_configs,
    check_dtype,
    check_parents,
    check_same_device,
    check_shape,
    is_interpreter,
    l2norm,
    use_triton,
)

MAX_NODES = 128  # a block's rows of G and C ([BS, T]) and the earlier U ([T, BV]) stay in registers up to here
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# BV trades parallelism (more V-tiles) against recomputing the Gram rows per tile; BS is the row block of
# the forward substitution (off-diagonal blocks in one matmul, the Neumann series only inside a block).
VERIFY_CONFIGS = [
    triton.Config({"BS": BS, "BK": 32, "BV": BV}, num_warps=num_warps, num_stages=num_stages)
    for BS, BV, num_warps, num_stages in (
        (16, 32, 4, 1), (16, 32, 8, 1), (16, 64, 8, 1), (16, 16, 4, 1),
        (32, 64, 8, 1), (16, 128, 8, 1), (16, 32, 4, 2), (16, 64, 8, 2),
    )
]  # fmt: skip


@triton.heuristics({"USE_INITIAL_STATE": lambda args: args["h0"] is not None})
@triton.autotune(configs=autotune_configs(VERIFY_CONFIGS), key=["B", "BT", "H", "HK", "K", "V", "USE_QK_L2NORM"])
@triton.jit(do_not_specialize=["T"])
def tree_gdn_verify_fwd_kernel(
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


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A `[B, T, heads, dim]` tensor whose (heads, dim) block is contiguous, as the q/k/v views that split
    one projection are, is read in place through its (batch, token) strides; anything else is copied."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def tree_gdn_verify_fwd(q, k, v, g, beta, ancestors, initial_state, scale, use_qk_l2norm, dot_precision):
    B, T, HK, K = k.shape
    H, V = v.shape[-2:]
    q, k, v = _rows(q), _rows(k), _rows(v)
    if q.stride() != k.stride():
        q, k = q.contiguous(), k.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    anc = ancestors.contiguous().view(torch.uint8)
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    u = torch.empty(B, T, H, V, dtype=torch.float32, device=v.device)
    log_decay = torch.empty(B, T, H, dtype=torch.float32, device=v.device)
    BT = max(16, triton.next_power_of_2(T))

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]), B * H)

    tree_gdn_verify_fwd_kernel[grid](
        q, k, v, g, beta, anc, initial_state, o, u, log_decay, scale,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), B, T, H, HK,
        K=K, V=V, BT=BT, USE_QK_L2NORM=use_qk_l2norm, DOT_PRECISION=dot_precision,
        UPCAST_DOT=is_interpreter(),
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
