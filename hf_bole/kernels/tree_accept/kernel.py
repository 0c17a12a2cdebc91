"""`naive_tree_greedy_accept` as one Triton launch, one program per batch row.

Why: `naive_tree_greedy_accept` (naive.py, the reference and the specification) walks the verified tree in about 60
small torch kernels (the target's argmax at every node's parent, the duplicate-sibling test, the ancestor mask's
repeated squaring, the accepted set, the leaf, the path's scatter and the emitted tokens), almost all of their time
launch latency. This kernel does the same walk in one launch, from the argmax tokens.

Exactness: every output is an integer computed by the same rules, so `tree_greedy_accept` equals
`naive_tree_greedy_accept` bit for bit on every verify tree (nodes in topological order, `-1 <= parents[b, i] < i`),
also where a row has padding in between or real nodes with parent -1; the tests compare every
field by `torch.equal`, on the CPU under the interpreter and compiled on a GPU.

One program holds a row's `T <= 128` nodes in a block of `BT = next_power_of_2(T)` lanes and never gathers: every
"value at another node" is a reduction over a `[BT, BT]` one-hot tile in registers.

1. `chosen[i]`: node i's token is the argmax at its parent (the root's for parent -1, as the reference clamps), it is
   real, and no real earlier sibling carries the same token; the root is always chosen.
2. `accepted[i]`: i and all its ancestors are chosen, by pointer jumping with self-loops at the roots: after round k,
   `up[i]` is i's 2^k-th ancestor (or its root) and `accepted[i]` covers i's 2^k nearest ancestors-or-self; the
   rounds stop once one moves no pointer (`ceil(log2 depth) + 1` of them), at most `log2 BT`. `up` then names every
   node's root.
3. `leaf`: the accepted node of greatest depth, the first on ties (torch's `argmax`).
4. The leaf's path: the accepted nodes with the leaf's root and an index up to the leaf's. Only the first of a node's
   children with the parent's argmax token can be chosen, so the accepted nodes below one root form a single chain
   from it, and (topological order) the chain's nodes up to the leaf come first. `path[k]` is the path's node of
   depth k, `tokens[k]` the token of its node of depth k + 1, then the bonus `target[leaf]` at `depth[leaf]`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_bole.kernels.tree_accept.naive import AcceptedPaths, naive_tree_greedy_accept
from hf_bole.kernels.utils import (
    MAX_TREE_NODES,
    check_dtype,
    check_same_device,
    check_shape,
    next_power_of_2,
    on_device,
    use_triton,
)

_INT64_MIN = tl.constexpr(-(2**63))


@triton.jit
def _pick(t_hit, x):
    """`[BT, BT]` one-hot rows, `[BT]` int64 -> `[BT]` int64: x at row i's hit (0 where none), in two int32 halves
    (an int64 tile takes twice the registers)."""
    b_lo = tl.sum(tl.where(t_hit, (x & 0xFFFFFFFF).to(tl.int32)[None, :], 0), axis=1)
    b_hi = tl.sum(tl.where(t_hit, (x >> 32).to(tl.int32)[None, :], 0), axis=1)
    return (b_hi.to(tl.int64) << 32) | (b_lo.to(tl.int64) & 0xFFFFFFFF)


@triton.jit(do_not_specialize=["T"])
def accept_greedy_fwd_kernel(
    input_ids,
    parents,
    depths,
    node_mask,
    target,
    path,
    accept_lengths,
    tokens,
    bonus,
    leaf,
    stride_ib,
    stride_it,
    stride_pb,
    stride_pt,
    stride_db,
    stride_dt,
    stride_mb,
    stride_mt,
    stride_gb,
    stride_gt,
    T,
    BT: tl.constexpr,
    LOG_BT: tl.constexpr,
):
    # Row b; lane o is node o while o < T. In the [BT, BT] tiles the row axis is node i, the column axis node j.
    b = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, BT)
    m_n = o_n < T
    b_ids = tl.load(input_ids + b * stride_ib + o_n * stride_it, mask=m_n, other=0)
    b_par = tl.load(parents + b * stride_pb + o_n * stride_pt, mask=m_n, other=-1)
    b_dep = tl.load(depths + b * stride_db + o_n * stride_dt, mask=m_n, other=0)
    b_real = tl.load(node_mask + b * stride_mb + o_n * stride_mt, mask=m_n, other=0) != 0
    b_tgt = tl.load(target + b * stride_gb + o_n * stride_gt, mask=m_n, other=0)

    # Parents as int32 for the tiles: a VerifyTree's are in [-1, T) (the reference's gather fails on larger ones).
    b_p32 = tl.minimum(tl.maximum(b_par, -1), T).to(tl.int32)

    # 1. chosen: node i's token is the argmax at its parent (the root's for parent -1, as the reference's gather
    # clamps), i is real, and no real earlier sibling carries the same token. Such a sibling is chosen by the same
    # test, so "the same token" is "also a candidate": the sibling tile compares parents alone.
    t_par = o_n[None, :] == tl.maximum(b_p32, 0)[:, None]  # [i, j]: j is i's parent
    m_cand = b_real & (b_ids == _pick(t_par, b_tgt))
    t_sib = (b_p32[:, None] == b_p32[None, :]) & (o_n[None, :] < o_n[:, None]) & m_cand[None, :]
    m_dup = tl.max(t_sib.to(tl.int32), axis=1) > 0
    b_acc = ((m_cand & ~m_dup) | (o_n == 0)).to(tl.int32)

    # 2. accepted, by pointer jumping. An ancestor is a parent in [0, T), as in tree_ancestor_mask; nodes with
    # none (the root, padding, parent -1) point at themselves, so a finished chain ANDs its root's flag again. The
    # flag and the pointer travel packed in one int32, 2 * up + accepted: one reduction a round. Once a round moves
    # no pointer every `up` is a root and that round has ANDed it in: a tree of depth d stops after ceil(log2 d) + 1
    # rounds, and LOG_BT rounds reach every root of any row.
    b_up = tl.where((b_p32 >= 0) & (b_p32 < T), b_p32, o_n)
    n_moving = tl.sum((b_up != o_n).to(tl.int32), axis=0)
    n_round = 0
    while (n_moving > 0) & (n_round < LOG_BT):
        t_up = b_up[:, None] == o_n[None, :]  # [i, j]: j = up[i], exactly one j per row
        b_got = tl.sum(tl.where(t_up, (2 * b_up + b_acc)[None, :], 0), axis=1)
        b_acc = b_acc & b_got
        n_moving = tl.sum(((b_got >> 1) != b_up).to(tl.int32), axis=0)
        b_up = b_got >> 1
        n_round += 1
    m_acc = b_acc != 0

    # 3. the leaf: argmax of where(accepted, depth, -1) over the T nodes, the first index on ties.
    b_key = tl.where(m_n, tl.where(m_acc, b_dep, -1), _INT64_MIN)
    b_top = tl.max(b_key, axis=0)
    i_leaf = tl.min(tl.where(b_key == b_top, o_n, BT), axis=0)
    m_leaf = o_n == i_leaf
    d_leaf = tl.sum(tl.where(m_leaf, b_dep, 0), axis=0)
    t_bonus = tl.sum(tl.where(m_leaf, b_tgt, 0), axis=0)
    r_leaf = tl.sum(tl.where(m_leaf, b_up, 0), axis=0)

    # 4. the leaf's path (ancestor_mask's row of the leaf): its chain of accepted nodes up to the leaf. Depths in
    # int32 for the tiles, those outside [0, T] (none in a VerifyTree) as -1: equal to a slot k in [0, T] alike.
    m_path = m_acc & (b_up == r_leaf) & (o_n <= i_leaf)
    b_d32 = tl.where((b_dep >= 0) & (b_dep <= T), b_dep, -1).to(tl.int32)
    o_k = o_n[:, None]  # [k, j]: k a depth on the path, j a node
    t_at = m_path[None, :] & (b_d32[None, :] == o_k)
    b_path = tl.max(tl.where(t_at, o_n[None, :], -1), axis=1)
    # tokens[k]: the draft token of path[k + 1] (the last column has none), then the bonus at depth[leaf]
    t_next = m_path[None, :] & (b_d32[None, :] == o_k + 1) & (o_k + 1 < T)
    b_tok = tl.where(tl.max(t_next.to(tl.int32), axis=1) > 0, _pick(t_next, b_ids), -1)
    b_tok = tl.where(o_n == d_leaf, t_bonus, b_tok)

    tl.store(path + b * T + o_n, b_path.to(tl.int64), mask=m_n)
    tl.store(tokens + b * T + o_n, b_tok.to(tl.int64), mask=m_n)
    tl.store(accept_lengths + b, d_leaf + 1)
    tl.store(bonus + b, t_bonus)
    tl.store(leaf + b, i_leaf.to(tl.int64))


def _accept_greedy_fwd(
    input_ids: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, node_mask: torch.Tensor, target: torch.Tensor
) -> AcceptedPaths:
    B, T = target.shape
    device = target.device
    path, tokens = (torch.empty(B, T, dtype=torch.long, device=device) for _ in range(2))
    accept_lengths, bonus, leaf = (torch.empty(B, dtype=torch.long, device=device) for _ in range(3))
    BT = max(16, next_power_of_2(T))
    with on_device(target):
        accept_greedy_fwd_kernel[(B,)](
            input_ids, parents, depths, node_mask, target,
            path, accept_lengths, tokens, bonus, leaf,
            *input_ids.stride(), *parents.stride(), *depths.stride(), *node_mask.stride(), *target.stride(),
            T,
            BT=BT, LOG_BT=(BT - 1).bit_length(),
            num_warps=4 if BT <= 32 else 8 if BT <= 64 else 32,  # the fastest on an H200, fewest spills at 128
        )  # fmt: skip
    return AcceptedPaths(path, accept_lengths, tokens, bonus, leaf)


def tree_greedy_accept(
    input_ids: torch.LongTensor,
    parents: torch.LongTensor,
    depths: torch.LongTensor,
    node_mask: torch.BoolTensor,
    target: torch.LongTensor,
) -> AcceptedPaths:
    r"""
    `naive_tree_greedy_accept` in one Triton launch: the same walk and the same outputs (dtypes, shapes, device,
    values), with no host synchronisation, so it can be captured in a CUDA graph.

    Triton runs on CUDA tensors and, under `TRITON_INTERPRET=1`, on CPU tensors; on plain CPU tensors (and for an
    empty batch) this calls the reference's torch walk instead, which gives the same outputs.

    Args:
        input_ids, parents, depths (`torch.LongTensor` of shape `(batch_size, T)`), node_mask (`torch.BoolTensor` of
            shape `(batch_size, T)`): the verified trees (a `VerifyTree`'s fields), width `T <= 128`
            (`MAX_TREE_NODES`), nodes in topological order.
        target (`torch.LongTensor` of shape `(batch_size, T)`): the target's argmax token at every node.

    Returns:
        `AcceptedPaths`, equal to `naive_tree_greedy_accept`'s field by field.
    """
    fields = {"input_ids": input_ids, "parents": parents, "depths": depths, "node_mask": node_mask, "target": target}
    for name, x in fields.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
        check_dtype(name, x, (torch.bool,) if name == "node_mask" else (torch.int64,))
    if input_ids.dim() != 2:
        raise ValueError(f"`input_ids` must have shape [B, T], got {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    for name, x in fields.items():
        check_shape(name, x, (B, T), "[B, T]")
    check_same_device(**fields)
    if T == 0:
        raise ValueError("tree_greedy_accept needs the root: the trees have width T = 0")
    if T > MAX_TREE_NODES:
        raise ValueError(
            f"tree_greedy_accept holds a row's T x T node pairs in one program: T = {T} exceeds its limit of "
            f"{MAX_TREE_NODES}; use naive_tree_greedy_accept"
        )
    if not use_triton(target) or B == 0:
        return naive_tree_greedy_accept(input_ids, parents, depths, node_mask, target)
    return _accept_greedy_fwd(input_ids, parents, depths, node_mask, target)
