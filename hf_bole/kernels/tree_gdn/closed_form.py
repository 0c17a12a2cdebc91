"""Closed-form tree verification through a Gated DeltaNet layer (derivation: README.md beside this file).

For each (request, value head), with P_i the product of gates on node i's path and A(i) its strict ancestors:

    (I + G) U = R,   G_ij = beta_i (P_i/P_j) k_i.k_j  [j in A(i)],   R = D_beta (V - D_P K S_pre)
    O = D_P Q S_pre + C U,   C_ij = (P_i/P_j) q_i.k_j  [j in A(i) or j = i]

G is nilpotent (G^(d+1) = 0 for a tree of depth d), so (I + G)^-1 = sum_{m<=d} (-G)^m. `tree_gdn_verify` checks its
inputs and runs the Triton kernels (closed_form_kernels.py: the V-independent blocks once per request and value
head, then matmuls per V-tile) or, on CPU tensors, the same closed form in torch. Only O and the factors (U, log P)
are written: nothing of size K x V per node exists.
"""

from __future__ import annotations

import torch

from hf_bole.kernels.tree_gdn.ancestors import tree_ancestor_mask
from hf_bole.kernels.tree_gdn.closed_form_kernels import tree_gdn_verify_fwd
from hf_bole.kernels.tree_gdn.commit import MAX_HEAD_DIM
from hf_bole.kernels.utils import (
    MAX_TREE_NODES,
    check_dtype,
    check_parent_values,
    check_parents,
    check_same_device,
    check_shape,
    l2norm,
    use_triton,
)

# One TF32 pass ("tf32") is not offered: u then strays 4.2e-4 from float64 where the commit needs 1.6e-7 (README.md).
DOT_PRECISIONS = ("tf32x3", "ieee")
MAX_GRID_Y = 65535  # CUDA's limit on a launch grid's second and third axes
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_INPUT_DTYPES = frozenset(FLOAT_DTYPES + (torch.float64,))
_STATE_DTYPES = frozenset((torch.float32, torch.float64))


def check_verify_inputs(q, k, v, g, beta, parents, initial_state, dot_precision, per_key_decay=False) -> None:
    """The checks every tree verification function makes: shapes, dtypes, the tree, one device, the precision. g is
    `[B, T, H]` (a decay per head, GDN) or with `per_key_decay` `[B, T, H, K]` (per key channel, KDA)."""
    if _well_formed(q, k, v, g, beta, parents, initial_state, dot_precision, per_key_decay):
        check_parent_values(parents)  # read once per tensor
        return
    _explain_inputs(q, k, v, g, beta, parents, initial_state, dot_precision, per_key_decay)


def _well_formed(q, k, v, g, beta, parents, initial_state, dot_precision, per_key_decay) -> bool:
    """All of `_explain_inputs`'s conditions but the parents' values, read in one pass: an eager forward calls the
    verify once per GDN layer, and the separate checks cost several microseconds of host time each call."""
    ks, vs = k.shape, v.shape
    if len(ks) != 4 or len(vs) != 4 or q.shape != ks:
        return False
    B, T, HK, K = ks
    H = vs[2]
    device = v.device
    return (
        vs[0] == B and vs[1] == T and H % HK == 0
        and g.shape == ((B, T, H, K) if per_key_decay else (B, T, H)) and beta.shape == (B, T, H)
        and parents.shape == (B, T) and parents.dtype == torch.int64
        and q.dtype == k.dtype and q.dtype in _INPUT_DTYPES and v.dtype in _INPUT_DTYPES
        and g.dtype in _INPUT_DTYPES and beta.dtype in _INPUT_DTYPES
        and q.device == device and k.device == device and g.device == device
        and beta.device == device and parents.device == device
        and (initial_state is None or (
            initial_state.shape == (B, H, K, vs[3]) and initial_state.dtype in _STATE_DTYPES
            and initial_state.device == device
        ))
        and dot_precision in DOT_PRECISIONS
    )  # fmt: skip


def _explain_inputs(q, k, v, g, beta, parents, initial_state, dot_precision, per_key_decay) -> None:
    """`check_verify_inputs` one condition at a time, raising a ValueError that names the first one broken."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q and k must be [B, T, Hk, K] and v [B, T, H, V], got q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}"
        )
    B, T, HK, K = k.shape
    H, V = v.shape[-2:]
    check_shape("q", q, (B, T, HK, K), "[B, T, Hk, K]")
    check_shape("v", v, (B, T, H, V), "[B, T, H, V]")
    if per_key_decay:
        check_shape("g", g, (B, T, H, K), "[B, T, H, K] (one log-decay per key channel)")
    else:
        check_shape("g", g, (B, T, H), "[B, T, H]")
    check_shape("beta", beta, (B, T, H), "[B, T, H]")
    if H % HK != 0:
        raise ValueError(f"the value heads H = {H} must be a multiple of the key heads Hk = {HK}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_dtype(name, x, FLOAT_DTYPES + (torch.float64,))
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    check_parents(parents, B, T)
    if initial_state is not None:
        check_shape("initial_state", initial_state, (B, H, K, V), "[B, H, K, V]")
        check_dtype("initial_state", initial_state, (torch.float32, torch.float64))
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, parents=parents, initial_state=initial_state)
    if dot_precision not in DOT_PRECISIONS:
        raise ValueError(f"dot_precision must be one of {DOT_PRECISIONS}, got {dot_precision!r}")


def check_triton_limits(k: torch.Tensor, v: torch.Tensor) -> None:
    """What the Triton verify kernels hold: head dims up to the commit's `MAX_HEAD_DIM` (of any size: the tiles
    are masked), at most `MAX_TREE_NODES` nodes, and a program per request and value head on a grid axis that CUDA
    caps at `MAX_GRID_Y` programs."""
    B, T, K = k.shape[0], k.shape[1], k.shape[-1]
    H, V = v.shape[-2:]
    if B * H > MAX_GRID_Y:
        raise ValueError(
            f"the Triton kernels verify at most {MAX_GRID_Y} (request, value head) pairs in one call, got B x H = "
            f"{B} x {H}; verify the batch in parts of at most {MAX_GRID_Y // H} requests"
        )
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernels take head dims K, V up to {MAX_HEAD_DIM}, got K = {K}, V = {V}")
    if T > MAX_TREE_NODES:
        raise ValueError(
            f"the Triton kernels verify at most {MAX_TREE_NODES} nodes per tree in one call, got T = {T}; "
            f"lower the verification budget"
        )


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
        q, k: `[B, T, Hk, K]` queries and keys. Views whose last dim is contiguous, like the splits of one
            projection or every group-th of repeated heads, are read in place through their other strides (q and k
            sharing them); others are copied.
        v: `[B, T, H, V]` values; H is a multiple of Hk (each q/k head serves H // Hk consecutive value heads).
        g: `[B, T, H]` log-decay, <= 0.
        beta: `[B, T, H]` write strength.
        parents: `[B, T]` int64, `-1 <= parents[b, i] < i`; -1 marks a child of the committed state.
            Padding nodes may be given parent -1: they never influence other nodes.
        initial_state: `[B, H, K, V]` float32 committed state, or None for zeros. Never modified.
        scale: query scale, `K ** -0.5` by default.
        use_qk_l2norm_in_kernel: L2-normalise q and k first (Qwen3.5 does).
        dot_precision: how float32 matmuls run on the GPU: "tf32x3" (default, ~1e-6 relative) or "ieee". bf16
            inputs multiply exactly in both.
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
    check_verify_inputs(q, k, v, g, beta, parents, initial_state, dot_precision)
    B, T = parents.shape
    if ancestors is None:
        ancestors = tree_ancestor_mask(parents)
    elif not (ancestors.shape == (B, T, T) and ancestors.dtype == torch.bool and ancestors.device == v.device):
        check_shape("ancestors", ancestors, (B, T, T), "[B, T, T]")
        check_dtype("ancestors", ancestors, (torch.bool,))
        check_same_device(v=v, ancestors=ancestors)
    K = k.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)

    if not use_triton(v) or v.dtype == torch.float64:
        return torch_tree_gdn_verify(q, k, v, g, beta, ancestors, initial_state, scale, use_qk_l2norm_in_kernel)
    check_triton_limits(k, v)
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
    return tree_gdn_verify_fwd(q, k, v, g, beta, ancestors, initial_state, scale, use_qk_l2norm_in_kernel, dot_precision)
