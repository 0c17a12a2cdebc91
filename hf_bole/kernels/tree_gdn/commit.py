"""Commit the accepted path of a verified tree into the GDN state (Eq. 10), for one layer or all at once.

    S_new = P_a S_pre + sum_{j on path} (P_a / P_j) k_j u_j^T        (a = last node of the path)

The factors (k, u, log P) come from `tree_gdn_verify`; rejected nodes are simply never read. With
stacked layers `[NL, ...]` one launch commits every GDN layer of a model. The kernel also commits Kimi Delta
Attention's state (`tree_kda_commit`), whose decay is per key channel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_bole.kernels.utils import (
    check_dtype,
    check_path,
    check_same_device,
    check_shape,
    l2norm,
    next_power_of_2,
    on_device,
    use_triton,
)

MAX_HEAD_DIM = 256  # the commit kernel holds a whole key head ([K, BV] in registers); V alike, as tested


@triton.jit
def tree_gdn_commit_fwd_kernel(
    h0,
    k,
    u,
    decay,
    path,
    out,
    B,
    T,
    L,
    H: tl.constexpr,
    HK: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BL: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    NV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    PER_KEY_DECAY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # decay: GDN's log P [.., T, H], or with PER_KEY_DECAY, KDA's g [.., T, H, K] (tree_kda/README.md)
    # one grid axis: layers x batch x heads passes CUDA's 65535 limit of the other axes (24 x 256 x 32 = 196608)
    i_v, i_nbh = tl.program_id(0).to(tl.int64) % NV, tl.program_id(0).to(tl.int64) // NV
    i_nb, i_h = i_nbh // H, i_nbh % H  # i_nb = layer * B + request
    i_b = i_nb % B
    i_hk = i_h // (H // HK)

    o_l = tl.arange(0, BL)
    o_k = tl.arange(0, BK)  # the whole key head, BK = K rounded up to a power of two
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_path = tl.load(path + i_b * L + o_l, mask=o_l < L, other=-1)
    m_l = b_path >= 0
    if PER_KEY_DECAY:
        # log(Gam_a / Gam_j) is the sum of g over the path's nodes after j: a suffix sum of the path's g shifted by one
        # (same-signed terms, not the difference of two sums); log Gam_a the sum over the whole path.
        b_next = tl.load(path + i_b * L + o_l + 1, mask=o_l + 1 < L, other=-1)  # [BL] the node after each
        p_g = decay + (i_nb * T * H + i_h) * K + o_k[None, :]
        b_g = tl.load(p_g + b_path[:, None] * H * K, mask=m_l[:, None] & m_k[None, :], other=0).to(tl.float32)
        b_gn = tl.load(p_g + b_next[:, None] * H * K, mask=(b_next >= 0)[:, None] & m_k[None, :], other=0).to(
            tl.float32
        )  # [BL, BK] g of each path node and of the node after it
        b_w = tl.where(m_l[:, None], tl.exp(tl.cumsum(b_gn, axis=0, reverse=True)), 0.0)  # [BL, BK] Gam_a / Gam_j
        b_pa = tl.exp(tl.sum(b_g, axis=0))[:, None]  # [BK, 1] Gam_a (1 for an empty path)
    else:
        # Node indices increase along a root-to-leaf path (parents come first), so the leaf is the max.
        i_a = tl.max(b_path, axis=0)
        p_lp = decay + i_nb * T * H + i_h
        b_lpa = tl.load(p_lp + i_a * H, mask=i_a >= 0, other=0)
        b_lpj = tl.load(p_lp + b_path * H, mask=m_l, other=0)
        b_w = tl.where(m_l, tl.exp(b_lpa - b_lpj), 0.0)[:, None]  # [BL, 1] P_a / P_j
        b_pa = tl.exp(b_lpa)

    b_k = tl.load(
        k + ((i_nb * T + b_path[:, None]) * HK + i_hk) * K + o_k[None, :], mask=m_l[:, None] & m_k[None, :], other=0
    ).to(tl.float32)  # [BL, BK]
    if USE_QK_L2NORM:
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
    b_u = tl.load(
        u + ((i_nb * T + b_path[:, None]) * H + i_h) * V + o_v[None, :], mask=m_l[:, None] & m_v[None, :], other=0
    )  # [BL, BV]
    p_h = (i_nb * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    m_h = m_k[:, None] & m_v[None, :]
    b_h = tl.load(h0 + p_h, mask=m_h, other=0)  # [BK, BV]
    b_h = b_pa * b_h + tl.dot(tl.trans(b_k * b_w), b_u, input_precision=DOT_PRECISION)
    tl.store(out + p_h, b_h, mask=m_h)


def tree_gdn_commit_fwd(initial_state, k, u, decay, path, out, use_qk_l2norm, dot_precision):
    """Launches the commit kernel; `decay` is GDN's log_decay `[NL, B, T, H]` or KDA's g `[NL, B, T, H, K]`."""
    NL, B, T, HK, K = k.shape
    H, V = u.shape[-2:]
    L = path.shape[1]
    BL = max(16, next_power_of_2(L))
    BV = min(32, max(16, next_power_of_2(V)))  # many small programs: the commit moves states, little else
    NV = triton.cdiv(V, BV)
    grid = (NV * NL * B * H,)  # the V-tiles of one state side by side
    with on_device(out):
        tree_gdn_commit_fwd_kernel[grid](
            initial_state, k, u, decay, path, out, B, T, L,
            H=H, HK=HK, K=K, V=V, BL=BL, BK=max(16, next_power_of_2(K)), BV=BV, NV=NV, USE_QK_L2NORM=use_qk_l2norm,
            PER_KEY_DECAY=decay.dim() == 5, DOT_PRECISION=dot_precision, num_warps=4,
        )  # fmt: skip
    return out


def torch_tree_gdn_commit(initial_state, k, u, log_decay, path, out, use_qk_l2norm):
    NL, B, T, HK, K = k.shape
    H = u.shape[-2]
    valid = path >= 0  # [B, L]
    idx = path.clamp(min=0)
    leaf = path.max(dim=1).values  # [B], -1 keeps the state
    lp = log_decay.float()  # [NL, B, T, H]
    lp_path = lp.gather(2, idx[None, :, :, None].expand(NL, B, -1, H))  # [NL, B, L, H]
    lp_leaf = lp.gather(2, leaf.clamp(min=0)[None, :, None, None].expand(NL, B, 1, H)).squeeze(2)
    lp_leaf = torch.where((leaf >= 0)[None, :, None], lp_leaf, 0.0)  # [NL, B, H]
    w = torch.where(valid[None, :, :, None], torch.exp(lp_leaf[:, :, None] - lp_path), 0.0)
    kp = k.float().gather(2, idx[None, :, :, None, None].expand(NL, B, -1, HK, K)).repeat_interleave(H // HK, dim=3)
    if use_qk_l2norm:
        kp = l2norm(kp)
    up = u.float().gather(2, idx[None, :, :, None, None].expand(NL, B, -1, H, u.shape[-1]))
    new = lp_leaf.exp()[..., None, None] * initial_state + torch.einsum("nblh,nblhk,nblhv->nbhkv", w, kp, up)
    out.copy_(new)
    return out


def stacked_commit_args(initial_state, k, u, decay, path, out, check_values, per_key_decay=False):
    """A commit's arguments checked, and a single layer's made a stack of one: `(stacked, initial_state, k, u, decay,
    out)`, each `[NL, ...]`, `out` allocated where None. `decay` is GDN's log_decay `[B, T, H]` (float32) or, with
    `per_key_decay`, KDA's g `[B, T, H, K]`."""
    stacked = initial_state.dim() == 5
    if not stacked:
        initial_state, k, u, decay = (x.unsqueeze(0) for x in (initial_state, k, u, decay))
        if out is not None:
            out = out.unsqueeze(0)
    if initial_state.dim() != 5 or k.dim() != 5:
        raise ValueError(
            f"initial_state must be [B, H, K, V] (or [NL, B, H, K, V]) and k [B, T, Hk, K] (or [NL, B, T, Hk, K]), "
            f"got {tuple(initial_state.shape)} and {tuple(k.shape)}"
        )
    NL, B, H, K, V = initial_state.shape
    T, HK = k.shape[2], k.shape[3]
    check_shape("k", k, (NL, B, T, HK, K), "[NL, B, T, Hk, K]")
    check_shape("u", u, (NL, B, T, H, V), "[NL, B, T, H, V]")
    if per_key_decay:
        name = "g"
        check_shape(name, decay, (NL, B, T, H, K), "[NL, B, T, H, K]")
        check_dtype(name, decay, (torch.float32, torch.bfloat16, torch.float16))
    else:
        name = "log_decay"
        check_shape(name, decay, (NL, B, T, H), "[NL, B, T, H]")
        check_dtype(name, decay, (torch.float32,))
    if H % HK != 0:
        raise ValueError(f"the value heads H = {H} must be a multiple of the key heads Hk = {HK}")
    check_dtype("initial_state", initial_state, (torch.float32,))
    check_dtype("u", u, (torch.float32,))
    check_path(path, B, T, check_values=check_values)
    check_same_device(initial_state=initial_state, k=k, u=u, path=path, out=out, **{name: decay})
    if out is None:
        out = torch.empty_like(initial_state)
    else:
        check_shape("out", out, tuple(initial_state.shape), "like initial_state")
        check_dtype("out", out, (torch.float32,))
        if not out.is_contiguous():
            raise ValueError("`out` must be contiguous: the state is written in place")
    if use_triton(initial_state):
        if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
            raise ValueError(f"the Triton commit takes head dims K, V up to {MAX_HEAD_DIM}, got K = {K}, V = {V}")
        if path.shape[1] > 256:
            raise ValueError(f"paths of at most 256 nodes can be committed, got L = {path.shape[1]}")
    return stacked, initial_state, k, u, decay, out


def tree_gdn_commit(
    initial_state: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    log_decay: torch.Tensor,
    path: torch.Tensor,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    out: torch.Tensor | None = None,
    dot_precision: str = "tf32x3",
    check_values: bool = True,
) -> torch.Tensor:
    """The GDN state after each request's accepted path, from the factors of `tree_gdn_verify` (Eq. 10).

    Args:
        initial_state: `[B, H, K, V]` float32 committed state (or `[NL, B, H, K, V]` for NL stacked layers).
        k: `[B, T, Hk, K]` the keys given to `tree_gdn_verify` (`[NL, B, T, Hk, K]` stacked).
        u: `[B, T, H, V]` float32 factors from `tree_gdn_verify` (`[NL, ...]` stacked).
        log_decay: `[B, T, H]` float32 factors from `tree_gdn_verify` (`[NL, ...]` stacked).
        path: `[B, L]` int64 node indices in root-to-leaf order, right-padded with -1; shared by the
            stacked layers. A row of only -1 keeps its state.
        use_qk_l2norm_in_kernel: as given to `tree_gdn_verify`.
        out: where to write the result (may be `initial_state` itself: each program reads its tile of
            the state before writing it). A new tensor by default.
        dot_precision: as in `tree_gdn_verify`.
        check_values: read `path` on the host to check it (False: the caller vouches for it, no synchronisation).

    Returns:
        The new state, shaped like `initial_state`: exactly the recurrent state after the path's tokens.

    Example:
        >>> from hf_bole.kernels.tree_gdn import tree_gdn_verify
        >>> B, T, H, K, V = 1, 3, 2, 16, 16
        >>> q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        >>> v, g, beta = torch.randn(B, T, H, V), -torch.rand(B, T, H), torch.rand(B, T, H)
        >>> s0, parents = torch.zeros(B, H, K, V), torch.tensor([[-1, 0, 0]])
        >>> o, u, log_decay = tree_gdn_verify(q, k, v, g, beta, parents, s0)
        >>> s1 = tree_gdn_commit(s0, k, u, log_decay, torch.tensor([[0, 2]]))  # accept root, then node 2
    """
    stacked, initial_state, k, u, log_decay, out = stacked_commit_args(
        initial_state, k, u, log_decay, path, out, check_values
    )
    if use_triton(initial_state):
        args = (x.contiguous() for x in (initial_state, k, u, log_decay, path))
        tree_gdn_commit_fwd(*args, out, use_qk_l2norm_in_kernel, dot_precision)
    else:
        torch_tree_gdn_commit(initial_state, k, u, log_decay, path, out, use_qk_l2norm_in_kernel)
    return out if stacked else out.squeeze(0)
