"""Node-by-node references: the specification of every tree KDA kernel.

Written for clarity, with loops; they run in the dtype they are given (pass float64 for a gold result).
Shapes follow fla-core: q, k `[B, T, Hk, K]`, v `[B, T, H, V]`, g `[B, T, H, K]`, beta `[B, T, H]`, states
`[B, H, K, V]`; `parents [B, T]` with -1 for a child of the committed state.
"""

from __future__ import annotations

import torch

from hf_bole.kernels.utils import l2norm


def naive_tree_kda_verify(
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
    output_states: bool = False,
):
    """Walks every node of the tree from its parent's state with Kimi Delta Attention (the gated delta rule with a
    decay per key channel):

        S~ = Diag(exp(g_i)) S_parent;  u_i = beta_i (v_i - S~^T k_i);  S_i = S~ + k_i u_i^T;  o_i = S_i^T (scale q_i)

    Returns `(o, u)` (and every node's state `[B, T, H, K, V]` when `output_states`).
    """
    B, T, HK, K = k.shape
    H, V = v.shape[-2:]
    dtype = v.dtype if v.dtype == torch.float64 else torch.float32
    scale = K**-0.5 if scale is None else scale
    q, k = (x.to(dtype).repeat_interleave(H // HK, dim=2) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    v, g, beta = (x.to(dtype) for x in (v, g, beta))
    s0 = torch.zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype).cpu()
    q, k, v, g, beta = (x.cpu() for x in (q, k, v, g, beta))
    parents = parents.cpu()

    o = torch.zeros(B, T, H, V, dtype=dtype)
    u = torch.zeros(B, T, H, V, dtype=dtype)
    states = torch.zeros(B, T, H, K, V, dtype=dtype)
    for b in range(B):
        for i in range(T):
            p = int(parents[b, i])
            s_parent = s0[b] if p < 0 else states[b, p]  # [H, K, V]
            s = s_parent * g[b, i].exp()[:, :, None]
            u[b, i] = beta[b, i, :, None] * (v[b, i] - torch.einsum("hkv,hk->hv", s, k[b, i]))
            s = s + k[b, i, :, :, None] * u[b, i, :, None, :]
            o[b, i] = torch.einsum("hkv,hk->hv", s, q[b, i] * scale)
            states[b, i] = s
    o = o.to(v.dtype)
    return (o, u, states) if output_states else (o, u)


def naive_tree_kda_commit(
    initial_state: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    path: torch.Tensor,
    *,
    use_qk_l2norm_in_kernel: bool = False,
) -> torch.Tensor:
    """Replays the recurrence along each row's accepted path from the factors of the verify pass:
    `S <- Diag(exp(g_j)) S + k_j u_j^T` for every node j of `path [B, L]` (root-to-leaf, right-padded with -1).
    Returns the new state `[B, H, K, V]`."""
    B, T, HK, K = k.shape
    H = u.shape[2]
    dtype = initial_state.dtype
    k = k.to(dtype).repeat_interleave(H // HK, dim=2)
    if use_qk_l2norm_in_kernel:
        k = l2norm(k)
    g, u = g.to(dtype), u.to(dtype)
    new_state = initial_state.clone()
    for b in range(B):
        for j in path[b].tolist():
            if j < 0:
                break
            new_state[b] = new_state[b] * g[b, j].exp()[:, :, None] + k[b, j, :, :, None] * u[b, j, :, None, :]
    return new_state
