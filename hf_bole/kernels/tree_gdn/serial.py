"""The baseline other engines use for tree drafts on GDN models (SGLang-Tree): walk the nodes in order,
read the parent's state from a snapshot buffer, write every node's full K x V state back to it.

One program per (request, value head, V-tile) walks all nodes; the commit is a copy of the accepted
leaf's snapshot. Exact, but it moves T x K x V x 4 bytes per head per layer. Kept as the baseline of the
benchmark and the `verify="serial"` mode, and as a second oracle in tests. The walk (`serial_walk`) also takes a decay
per key channel, g `[B, T, H, K]`, for Kimi Delta Attention (`tree_kda_verify_serial`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_bole.kernels.tree_gdn.commit import MAX_HEAD_DIM
from hf_bole.kernels.utils import check_path, check_shape, l2norm, next_power_of_2, on_device, use_triton


@triton.heuristics({"USE_INITIAL_STATE": lambda args: args["h0"] is not None})
@triton.jit(do_not_specialize=["T"])
def tree_gdn_serial_fwd_kernel(
    q,
    k,
    v,
    g,
    beta,
    parents,
    h0,
    o,
    states,
    scale,
    T,
    H: tl.constexpr,
    HK: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    PER_KEY_DECAY: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // (H // HK)
    o_k = tl.arange(0, BK)  # the whole key head, BK = K rounded up to a power of two
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_kv = o_k[:, None] * V + o_v[None, :]  # [BK, BV] offsets inside one state
    m_kv = m_k[:, None] & m_v[None, :]
    if USE_INITIAL_STATE:
        b_h0 = tl.load(h0 + i_bh * K * V + p_kv, mask=m_kv, other=0)
    else:
        b_h0 = tl.zeros([BK, BV], dtype=tl.float32)
    p_states = states + i_b * T * H * K * V + i_h * K * V
    for i in range(T):
        i_p = tl.load(parents + i_b * T + i)
        if i_p >= 0:
            b_h = tl.load(p_states + i_p * H * K * V + p_kv, mask=m_kv, other=0)
        else:
            b_h = b_h0
        b_q = tl.load(q + ((i_b * T + i) * HK + i_hk) * K + o_k, mask=m_k, other=0).to(tl.float32)
        b_k = tl.load(k + ((i_b * T + i) * HK + i_hk) * K + o_k, mask=m_k, other=0).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_v = tl.load(v + ((i_b * T + i) * H + i_h) * V + o_v, mask=m_v, other=0).to(tl.float32)
        if PER_KEY_DECAY:
            b_g = tl.load(g + ((i_b * T + i) * H + i_h) * K + o_k, mask=m_k, other=0).to(tl.float32)
            b_h = b_h * tl.exp(b_g)[:, None]
        else:
            b_h = b_h * tl.exp(tl.load(g + (i_b * T + i) * H + i_h).to(tl.float32))
        b_beta = tl.load(beta + (i_b * T + i) * H + i_h).to(tl.float32)
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], axis=0))
        b_h += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * (b_q * scale)[:, None], axis=0)
        tl.store(o + ((i_b * T + i) * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        tl.store(p_states + i * H * K * V + p_kv, b_h, mask=m_kv)
        tl.debug_barrier()  # a child may read this snapshot next


def torch_tree_gdn_serial(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm):
    B, T, HK, K = k.shape
    H, V = v.shape[-2:]
    q, k = (x.float().repeat_interleave(H // HK, dim=2) for x in (q, k))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    s0 = torch.zeros(B, H, K, V, device=v.device) if initial_state is None else initial_state.float()
    states = torch.empty(B, T, H, K, V, device=v.device)
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    rows = torch.arange(B, device=v.device)
    for i in range(T):
        p = parents[:, i]
        s = torch.where((p >= 0)[:, None, None, None], states[rows, p.clamp(min=0)], s0)
        decay = g[:, i].float().exp()  # [B, H] or, per key channel, [B, H, K]
        s = s * (decay[..., None] if g.dim() == 4 else decay[..., None, None])
        u = beta[:, i].float()[..., None] * (v[:, i].float() - torch.einsum("bhkv,bhk->bhv", s, k[:, i]))
        s = s + k[:, i, :, :, None] * u[:, :, None, :]
        o[:, i] = torch.einsum("bhkv,bhk->bhv", s, q[:, i] * scale).to(v.dtype)
        states[:, i] = s
    return o, states


def tree_gdn_verify_serial(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Node-by-node tree verification with a full state snapshot per node (the SGLang-Tree baseline).

    Takes the arguments of `tree_gdn_verify` and returns `o [B, T, H, V]` (dtype of v) and
    `states [B, T, H, K, V]` float32, the state after every node. Commit with `tree_gdn_commit_serial`.
    """
    B, T, HK, K = k.shape
    H = v.shape[-2]
    check_shape("q", q, (B, T, HK, K), "[B, T, Hk, K]")
    check_shape("g", g, (B, T, H), "[B, T, H]")
    check_shape("beta", beta, (B, T, H), "[B, T, H]")
    return serial_walk(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm_in_kernel)


def serial_walk(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm):
    """The walk behind `tree_gdn_verify_serial` and `tree_kda_verify_serial`, their inputs checked: the Triton kernel
    or, on CPU tensors, torch; g `[B, T, H]` (a decay per head) or `[B, T, H, K]` (per key channel)."""
    B, T, HK, K = k.shape
    H, V = v.shape[-2:]
    scale = K**-0.5 if scale is None else float(scale)
    if not use_triton(v):
        return torch_tree_gdn_serial(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm)
    if K > MAX_HEAD_DIM:
        raise ValueError(f"the serial Triton kernel holds a whole key head: K up to {MAX_HEAD_DIM}, got K = {K}")
    q, k, v, g, beta, parents = (x.contiguous() for x in (q, k, v, g, beta, parents))
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    states = torch.empty(B, T, H, K, V, dtype=torch.float32, device=v.device)
    BV = min(32, next_power_of_2(V))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    with on_device(v):
        tree_gdn_serial_fwd_kernel[(triton.cdiv(V, BV), B * H)](
            q, k, v, g, beta, parents, h0, o, states, scale, T,
            H=H, HK=HK, K=K, V=V, BK=next_power_of_2(K), BV=BV, USE_QK_L2NORM=use_qk_l2norm,
            PER_KEY_DECAY=g.dim() == 4, num_warps=4,
        )  # fmt: skip
    return o, states


def tree_gdn_commit_serial(
    initial_state: torch.Tensor, states: torch.Tensor, path: torch.Tensor, *, check_values: bool = True
) -> torch.Tensor:
    """The state after each row's path in the serial scheme: the snapshot of its last node (or the
    committed state for an empty path). `initial_state [B, H, K, V]`, `states [B, T, H, K, V]`;
    `check_values=False`: the caller vouches for `path` (no host read)."""
    B, T = states.shape[:2]
    check_path(path, B, T, check_values=check_values)
    leaf = path.max(dim=1).values  # node indices increase along a path
    rows = torch.arange(B, device=states.device)
    picked = states[rows, leaf.clamp(min=0)]
    return torch.where((leaf >= 0)[:, None, None, None], picked, initial_state)
