"""Node-by-node references: the specification of every tree GDN kernel.

Written for clarity, with loops; they run in the dtype they are given (pass float64 for a gold result).
Shapes follow fla-core: q, k `[B, T, Hk, K]`, v `[B, T, H, V]`, g, beta `[B, T, H]`, states `[B, H, K, V]`;
`parents [B, T]` with -1 for a child of the committed state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_bole.kernels.utils import l2norm


def naive_tree_gdn_verify(
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
    """Walks every node of the tree from its parent's state with the gated delta rule:

        S~ = exp(g_i) S_parent;  u_i = beta_i (v_i - S~^T k_i);  S_i = S~ + k_i u_i^T;  o_i = S_i^T q_i

    Returns `(o, u, log_decay)` (and every node's state `[B, T, H, K, V]` when `output_states`), where
    `log_decay[b, i, h]` is the sum of g over node i and its ancestors.
    """
    B, T, Hk, K = k.shape
    H, V = v.shape[-2:]
    dtype = v.dtype if v.dtype == torch.float64 else torch.float32
    scale = K**-0.5 if scale is None else scale
    q, k = (x.to(dtype).repeat_interleave(H // Hk, dim=2) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    v, g, beta = (x.to(dtype) for x in (v, g, beta))
    s0 = torch.zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype).cpu()
    q, k, v, g, beta = (x.cpu() for x in (q, k, v, g, beta))
    parents = parents.cpu()

    o = torch.zeros(B, T, H, V, dtype=dtype)
    u = torch.zeros(B, T, H, V, dtype=dtype)
    log_decay = torch.zeros(B, T, H, dtype=dtype)
    states = torch.zeros(B, T, H, K, V, dtype=dtype)
    for b in range(B):
        for i in range(T):
            p = int(parents[b, i])
            s_parent = s0[b] if p < 0 else states[b, p]  # [H, K, V]
            log_decay[b, i] = g[b, i] + (0 if p < 0 else log_decay[b, p])
            s = s_parent * g[b, i].exp()[:, None, None]
            u[b, i] = beta[b, i, :, None] * (v[b, i] - torch.einsum("hkv,hk->hv", s, k[b, i]))
            s = s + k[b, i, :, :, None] * u[b, i, :, None, :]
            o[b, i] = torch.einsum("hkv,hk->hv", s, q[b, i] * scale)
            states[b, i] = s
    o = o.to(v.dtype)
    return (o, u, log_decay, states) if output_states else (o, u, log_decay)


def naive_tree_gdn_commit(
    initial_state: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    log_decay: torch.Tensor,
    path: torch.Tensor,
    *,
    use_qk_l2norm_in_kernel: bool = False,
) -> torch.Tensor:
    """Replays the recurrence along each row's accepted path from the factors of the verify pass:
    `S <- exp(log_decay_j - log_decay_prev) S + k_j u_j^T` for every node j of `path [B, L]`
    (root-to-leaf, right-padded with -1). Returns the new state `[B, H, K, V]`."""
    B, T, Hk, K = k.shape
    H = u.shape[2]
    dtype = initial_state.dtype
    k = k.to(dtype).repeat_interleave(H // Hk, dim=2)
    if use_qk_l2norm_in_kernel:
        k = l2norm(k)
    u, log_decay = u.to(dtype), log_decay.to(dtype)
    new_state = initial_state.clone()
    for b in range(B):
        prev = torch.zeros(H, dtype=dtype, device=log_decay.device)
        for j in path[b].tolist():
            if j < 0:
                break
            decay = (log_decay[b, j] - prev).exp()  # = exp(g_j): the path is a chain in the tree
            new_state[b] = new_state[b] * decay[:, None, None] + k[b, j, :, :, None] * u[b, j, :, None, :]
            prev = log_decay[b, j]
    return new_state


def _predecessor(parents_row: list[int], i: int, r: int) -> int:
    """The r-th predecessor of node i along its path, as a node index >= 0, or -e for the e-th
    committed input above the root (-1 = the last committed input)."""
    node, above = i, 0
    for _ in range(r):
        if node >= 0:
            node = parents_row[node]
            above = 1 if node < 0 else 0
        else:
            above += 1
    return node if node >= 0 else -above


def naive_tree_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: torch.Tensor,
    conv_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv along each node's root-to-node path.

    `x [B, T, D]` pre-conv inputs of the nodes, `weight [D, W]`, `conv_state [B, D, S]` the last S >= W - 1
    committed pre-conv inputs (transformers' layout: oldest first). Node i sees, from oldest to newest, the
    W - 1 inputs before it on its path (its ancestors, then the committed window above the root) and itself.
    Returns `[B, T, D]` in the dtype of x.
    """
    B, T, D = x.shape
    W = weight.shape[1]
    S = conv_state.shape[-1]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, T, D, dtype=dtype)
    xs, ws, st = x.to(dtype).cpu(), weight.to(dtype).cpu(), conv_state.to(dtype).cpu()
    for b in range(B):
        row = parents[b].tolist()
        for i in range(T):
            acc = torch.zeros(D, dtype=dtype) if bias is None else bias.to(dtype).cpu().clone()
            for r in range(W):
                j = _predecessor(row, i, r)
                inp = xs[b, j] if j >= 0 else st[b, :, S + j]
                acc += ws[:, W - 1 - r] * inp
            out[b, i] = acc
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return out.to(x.dtype)


def naive_tree_conv_state_commit(conv_state: torch.Tensor, x: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """The conv window after an accepted path: the last S entries of (old window, x of the path's nodes).
    `conv_state [B, D, S]`, `x [B, T, D]`, `path [B, L]` right-padded with -1. Returns `[B, D, S]`."""
    S = conv_state.shape[-1]
    new_state = conv_state.clone()
    for b in range(conv_state.shape[0]):
        nodes = [j for j in path[b].tolist() if j >= 0]
        seq = torch.cat([conv_state[b], x[b, nodes].to(conv_state.dtype).transpose(0, 1)], dim=-1)
        new_state[b] = seq[:, -S:]
    return new_state
