"""Closed-form tree verification through a Kimi Delta Attention layer (derivation: README.md beside this file).

For each (request, value head), with Gam_i the product of the decays exp(g) on node i's path (a vector over the key
channels) and A(i) its strict ancestors:

    (I + G) U = R,   G_ij = beta_i k_i^T Diag(Gam_i / Gam_j) k_j  [j in A(i)],   R = D_beta (V - (K * Gam) S_pre)
    O = (Q * Gam) S_pre + C U,   C_ij = q_i^T Diag(Gam_i / Gam_j) k_j  [j in A(i) or j = i]

`Gam_i / Gam_j` is formed as the product of the decays between j and i, walking up from i, never as a quotient.
`tree_kda_verify` checks its inputs and runs the Triton kernels (closed_form_kernels.py) or, on CPU tensors, the same
closed form in torch. Only O and U are written: nothing of size K x V per node exists.
"""

from __future__ import annotations

import torch

from hf_bole.kernels.tree_gdn.closed_form import check_triton_limits, check_verify_inputs
from hf_bole.kernels.tree_kda.closed_form_kernels import tree_kda_verify_fwd
from hf_bole.kernels.utils import l2norm, use_triton


def path_interactions(q, k, g, parents):
    """The walk of README.md in torch: for q, k `[B, H, T, K]` (normalised) and g `[B, H, T, K]`, the raw
    interactions `KK[b, h, i, j] = k_i^T Diag(Gam_i / Gam_j) k_j` on strict ancestors j, `QK` the same with q_i on
    ancestors-or-self (both `[B, H, T, T]`), and the path decays `Gam [B, H, T, K]`."""
    B, H, T, K = k.shape
    node = torch.arange(T, device=k.device)
    cur = node.expand(B, T)  # [B, T] the current ancestor of every row
    decay = torch.ones_like(k)  # [B, H, T, K] from the current ancestor to the row
    kk = torch.zeros(B, H, T, T, dtype=k.dtype, device=k.device)
    qk = torch.zeros_like(kk)
    while bool((cur >= 0).any()):
        valid = cur >= 0
        idx = cur.clamp(min=0)[:, None, :, None]  # [B, 1, T, 1]
        kj = k.gather(2, idx.expand(B, H, T, K))
        s_k = torch.where(valid[:, None] & (cur != node)[:, None], (k * decay * kj).sum(-1), 0.0)
        s_q = torch.where(valid[:, None], (q * decay * kj).sum(-1), 0.0)
        kk.scatter_add_(3, idx.expand(B, H, T, 1), s_k[..., None])
        qk.scatter_add_(3, idx.expand(B, H, T, 1), s_q[..., None])
        decay = decay * torch.where(valid[:, None, :, None], g.gather(2, idx.expand(B, H, T, K)).exp(), 1.0)
        cur = torch.where(valid, parents.gather(1, cur.clamp(min=0)), -1)
    return kk, qk, decay


def torch_tree_kda_verify(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm):
    """The same closed form in plain torch (the walk, batched matmuls and a triangular solve): the CPU path."""
    B, T, HK, K = k.shape
    H, V = v.shape[-2:]
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k = (x.to(dtype).repeat_interleave(H // HK, dim=2).transpose(1, 2) for x in (q, k))  # [B, H, T, K]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    vv, gg = (x.to(dtype).transpose(1, 2) for x in (v, g))  # [B, H, T, V], [B, H, T, K]
    bb = beta.to(dtype).transpose(1, 2)  # [B, H, T]
    kk, qk, gam = path_interactions(q, k, gg, parents)
    s0 = torch.zeros(B, H, K, V, dtype=dtype, device=v.device) if initial_state is None else initial_state.to(dtype)
    r = bb[..., None] * (vv - (k * gam) @ s0)
    eye = torch.eye(T, dtype=dtype, device=v.device)
    U = torch.linalg.solve_triangular(eye + bb[..., None] * kk, r, upper=False, unitriangular=True)
    O = scale * ((q * gam) @ s0 + qk @ U)
    return O.transpose(1, 2).to(v.dtype).contiguous(), U.transpose(1, 2).float().contiguous()


def tree_kda_verify(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs a whole draft tree through one Kimi Delta Attention layer in parallel, exactly.

    Every node gets the output the node-by-node recurrence (the gated delta rule with a decay per key channel) gives
    along its root-to-node path, computed from the committed state, which is not modified. No per-node K x V state
    is formed: the factors u returned here, with k and g, let `tree_kda_commit` build the state after any accepted
    path.

    Args:
        q, k: `[B, T, Hk, K]` queries and keys. Views whose last dim is contiguous are read in place through their
            other strides (q and k sharing them); others are copied.
        v: `[B, T, H, V]` values; H is a multiple of Hk (each q/k head serves H // Hk consecutive value heads).
        g: `[B, T, H, K]` log-decay per key channel, <= 0 (transformers' and fla's `g` of KDA).
        beta: `[B, T, H]` write strength.
        parents: `[B, T]` int64, `-1 <= parents[b, i] < i`; -1 marks a child of the committed state.
            Padding nodes may be given parent -1: they never influence other nodes.
        initial_state: `[B, H, K, V]` float32 committed state, or None for zeros. Never modified.
        scale: query scale, `K ** -0.5` by default.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (Kimi-Linear and GLM-5-Next do).
        dot_precision: how float32 matmuls run on the GPU: "tf32x3" (default, ~1e-6 relative) or "ieee".

    Returns:
        o: `[B, T, H, V]` in the dtype of v.
        u: `[B, T, H, V]` float32, the delta-rule write of every node.

    Runs the Triton kernels on CUDA tensors (and on CPU tensors under `TRITON_INTERPRET=1`), otherwise the same
    closed form in torch. Any depth is exact; the kernels take one step per tree level.

    Example:
        >>> B, T, H, K, V = 1, 3, 2, 16, 16
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> g, beta = -torch.rand(B, T, H, K), torch.rand(B, T, H)
        >>> parents = torch.tensor([[-1, 0, 0]])  # a root with two children
        >>> o, u = tree_kda_verify(q, k, v, g, beta, parents, torch.zeros(B, H, K, V), use_qk_l2norm_in_kernel=True)
        >>> o.shape
        torch.Size([1, 3, 2, 16])
    """
    check_verify_inputs(q, k, v, g, beta, parents, initial_state, dot_precision, per_key_decay=True)
    K = k.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)

    if not use_triton(v) or v.dtype == torch.float64:
        return torch_tree_kda_verify(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm_in_kernel)
    check_triton_limits(k, v)
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    return tree_kda_verify_fwd(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm_in_kernel, dot_precision)
