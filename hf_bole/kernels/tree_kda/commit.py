"""Commit the accepted path of a verified tree into the KDA state, for one layer or all at once.

    S_new = Diag(Gam_a) S_pre + sum_{j on path} Diag(Gam_a / Gam_j) k_j u_j^T        (a = last node of the path)

`Gam_a / Gam_j` is exp of the sum of g over the path's nodes after j (a suffix sum of same-signed terms, never a
difference of two sums); `Gam_a` that of the whole path. The factors u come from `tree_kda_verify`, k and g are the
layer's inputs; rejected nodes are simply never read. With stacked layers `[NL, ...]` one launch commits every KDA
layer of a model. The Triton kernel is the GDN commit's (`tree_gdn/commit.py`), with a decay per key channel.
"""

from __future__ import annotations

import torch

from hf_bole.kernels.tree_gdn.commit import stacked_commit_args, tree_gdn_commit_fwd
from hf_bole.kernels.utils import l2norm, use_triton


def torch_tree_kda_commit(initial_state, k, g, u, path, out, use_qk_l2norm):
    NL, B, T, HK, K = k.shape
    H, V = u.shape[-2:]
    valid = path >= 0  # [B, L]
    idx = path.clamp(min=0)
    g_path = g.float().gather(2, idx[None, :, :, None, None].expand(NL, B, -1, H, K))  # [NL, B, L, H, K]
    g_path = torch.where(valid[None, :, :, None, None], g_path, 0.0)
    # the sum of g over the nodes after each position, from those nodes only (suffix sums of the shifted path)
    after = torch.cat([g_path[:, :, 1:].flip(2).cumsum(2).flip(2), torch.zeros_like(g_path[:, :, :1])], dim=2)
    w = torch.where(valid[None, :, :, None, None], after.exp(), 0.0)
    gam = g_path.sum(2).exp()  # [NL, B, H, K]
    kp = k.float().gather(2, idx[None, :, :, None, None].expand(NL, B, -1, HK, K)).repeat_interleave(H // HK, dim=3)
    if use_qk_l2norm:
        kp = l2norm(kp)
    up = u.gather(2, idx[None, :, :, None, None].expand(NL, B, -1, H, V))
    new = gam[..., None] * initial_state + torch.einsum("nblhk,nblhv->nbhkv", w * kp, up)
    out.copy_(new)
    return out


def tree_kda_commit(
    initial_state: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    path: torch.Tensor,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    out: torch.Tensor | None = None,
    dot_precision: str = "tf32x3",
    check_values: bool = True,
) -> torch.Tensor:
    """The KDA state after each request's accepted path, from the factors of `tree_kda_verify`.

    Args:
        initial_state: `[B, H, K, V]` float32 committed state (or `[NL, B, H, K, V]` for NL stacked layers).
        k: `[B, T, Hk, K]` the keys given to `tree_kda_verify` (`[NL, B, T, Hk, K]` stacked).
        g: `[B, T, H, K]` the log-decays given to `tree_kda_verify` (`[NL, ...]` stacked).
        u: `[B, T, H, V]` float32 factors from `tree_kda_verify` (`[NL, ...]` stacked).
        path: `[B, L]` int64 node indices in root-to-leaf order, right-padded with -1; shared by the
            stacked layers. A row of only -1 keeps its state.
        use_qk_l2norm_in_kernel: as given to `tree_kda_verify`.
        out: where to write the result (may be `initial_state` itself: each program reads its tile of
            the state before writing it). A new tensor by default.
        dot_precision: as in `tree_kda_verify`.
        check_values: read `path` on the host to check it (False: the caller vouches for it, no synchronisation).

    Returns:
        The new state, shaped like `initial_state`: exactly the recurrent state after the path's tokens.

    Example:
        >>> from hf_bole.kernels import tree_kda_verify
        >>> B, T, H, K, V = 1, 3, 2, 16, 16
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> g, beta = -torch.rand(B, T, H, K), torch.rand(B, T, H)
        >>> s0, parents = torch.zeros(B, H, K, V), torch.tensor([[-1, 0, 0]])
        >>> o, u = tree_kda_verify(q, k, v, g, beta, parents, s0)
        >>> s1 = tree_kda_commit(s0, k, g, u, torch.tensor([[0, 2]]))  # accept root, then node 2
    """
    stacked, initial_state, k, u, g, out = stacked_commit_args(
        initial_state, k, u, g, path, out, check_values, per_key_decay=True
    )
    if use_triton(initial_state):
        args = (x.contiguous() for x in (initial_state, k, u, g, path))
        tree_gdn_commit_fwd(*args, out, use_qk_l2norm_in_kernel, dot_precision)
    else:
        torch_tree_kda_commit(initial_state, k, g, u, path, out, use_qk_l2norm_in_kernel)
    return out if stacked else out.squeeze(0)
