"""A tree's ancestor relation, and what a verify forward derives from it (depths, position ids, the attention mask over
the cache's slots), each in one Triton launch, with torch paths that are the specification.

Why: before every verify forward the decoding round builds, from the tree's parent pointers and the KV cache's
bookkeeping, the ancestor mask, every node's position id and the attention mask over the cache's slots
(`BoleCache.tree_mode`). In torch (`tree_masks_torch`) that is about 40 small kernels, almost all of their time
launch latency even inside a CUDA graph: ceil(log2 T) batched matmuls of the repeated squaring alone take 15.
`tree_masks` writes the same three tensors in one launch, and `tree_ancestor_mask` / `tree_depths` (which drafting,
selection and acceptance call) take the same kernel's first program alone.

Exactness: every output is a 0/1 or integer value computed by the same rules, so the kernel's equal the torch path's bit
for bit, for any values of `parents` and `lengths` (the tests compare them by `torch.equal`):

- The ancestors are the same reachability matrix: the one-hot parent pointers that land in `[0, N)` plus the identity,
  squared and clamped to 1. On 0/1 tiles `tl.dot` sums at most 128 ones (exact in fp16 inputs with fp32
  accumulation), and the `log2 BT` squarings here (against torch's `ceil(log2 N)`) change nothing: once walks of `N - 1`
  steps are covered the matrix is the transitive closure, which squaring keeps.
- Node i of row b sees slot c where `rel = c - lengths[b]` is in `[0, N)` and `anc[i, rel]` (its tree window), or where
  `rel < 0` and `valid[b, c]` (the committed part); slots outside `[0, C)` are never written, so a window that runs past
  the capacity is cut off as torch's `in_tree` cuts it.

The grid is `(B, 1 + cdiv(C, BLOCK_C))` (`(B, 1)` for the ancestors alone), and the programs of a row write disjoint
parts of its outputs:

1. Program 0 holds the row's `N <= 128` nodes in a block of `BT = next_power_of_2(N)` lanes (at least 16, `tl.dot`'s
   smallest tile) and builds the ancestor matrix in registers by repeated squaring. It writes `ancestors[b]`, the
   position ids (`positions[b]` plus the number of strict ancestors; the depths alone without masks) and the attention
   mask's tree window: the window is `anc` itself shifted by `lengths[b]` columns, so it is a plain store at shifted
   addresses, with no gather.
2. Program k >= 1 writes the slots `[(k - 1) * BLOCK_C, k * BLOCK_C)` outside the tree window. There a node's mask does
   not depend on the node, so it is one `[BLOCK_C]` vector (committed and valid), stored once per node row. The mask
   (`B * N * C` bytes, C up to tens of thousands) is most of what the kernel writes, and these programs spread it
   over the GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from transformers.utils import logging

from hf_bole.kernels.launch import CachedLaunch, alignment
from hf_bole.kernels.utils import (
    MAX_TREE_NODES,
    check_dtype,
    check_same_device,
    check_shape,
    next_power_of_2,
    on_device,
    use_triton,
)

logger = logging.get_logger(__name__)

# Slots of the attention mask per program k >= 1: a node row's [BLOCK_C] vector is 8 bytes a thread at 4 warps.
BLOCK_C = 1024


@triton.jit(do_not_specialize=["N"])
def tree_masks_fwd_kernel(
    parents,
    lengths,
    positions,
    valid,
    ancestors,
    position_ids,
    attention_mask,
    stride_pb,
    stride_pt,
    stride_lb,
    stride_ob,
    stride_vb,
    stride_vc,
    N,
    C,
    BT: tl.constexpr,
    LOG_BT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    MASKS: tl.constexpr,
):
    """MASKS False: the ancestors and the depths (into `position_ids`) only; lengths, positions, valid and the mask
    are not touched."""
    b = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    p_mask = attention_mask + b * N * C  # [N, C], contiguous
    if k == 0:
        # Lane o is node o while o < N. In the [BT, BT] tiles the row axis is node i, the column axis node j.
        o_n = tl.arange(0, BT)
        m_n = o_n < N
        b_par = tl.load(parents + b * stride_pb + o_n * stride_pt, mask=m_n, other=-1)
        # I + one-hot parent, the parents in [0, N) only (as torch's one-hot); padding lanes (i, j >= N) are only
        # reached from themselves, so they never enter a real node's row.
        t_step = (o_n[:, None] == o_n[None, :]) | ((b_par[:, None] == o_n[None, :]) & m_n[None, :])
        b_anc = t_step.to(tl.float16)
        for _ in tl.static_range(LOG_BT):
            b_anc = tl.minimum(tl.dot(b_anc, b_anc), 1.0).to(tl.float16)
        m_anc = b_anc > 0

        m_nn = m_n[:, None] & m_n[None, :]
        tl.store(ancestors + b * N * N + o_n[:, None] * N + o_n[None, :], m_anc.to(tl.uint8), mask=m_nn)
        b_pos = tl.sum(m_anc.to(tl.int32), axis=1).to(tl.int64) - 1  # [BT] depths
        if MASKS:
            b_pos += tl.load(positions + b * stride_ob)
            # the tree window: slot lengths[b] + j holds anc[:, j], where that slot is in [0, C)
            o_s = tl.load(lengths + b * stride_lb) + o_n  # [BT] int64
            m_s = (o_s >= 0) & (o_s < C)
            tl.store(p_mask + o_n[:, None] * C + o_s[None, :], m_anc.to(tl.uint8), mask=m_nn & m_s[None, :])
        tl.store(position_ids + b * N + o_n, b_pos, mask=m_n)
    else:
        n_len = tl.load(lengths + b * stride_lb)
        o_c = (k - 1) * BLOCK_C + tl.arange(0, BLOCK_C)
        m_c = o_c < C
        b_rel = o_c - n_len  # [BLOCK_C] int64
        b_ok = tl.load(valid + b * stride_vb + o_c * stride_vc, mask=m_c, other=0) != 0
        b_see = ((b_rel < 0) & b_ok).to(tl.uint8)
        m_out = m_c & ((b_rel < 0) | (b_rel >= N))  # the tree window is program 0's
        for i in range(N):
            tl.store(p_mask + i * C + o_c, b_see, mask=m_out)


def _ancestor_mask_torch(parents: torch.Tensor) -> torch.Tensor:
    """Reachability by repeated squaring of (I + parent matrix): ceil(log2 T) batched matmuls and no data-dependent
    loop, so it can be captured in a CUDA graph."""
    B, T = parents.shape
    nodes = torch.arange(T, device=parents.device)
    step = (parents[:, :, None] == nodes[None, None, :]).float()  # [B, T, T] one-hot parent
    reach = step + torch.eye(T, device=parents.device)
    for _ in range(max(1, math.ceil(math.log2(max(T, 2))))):
        reach = torch.bmm(reach, reach).clamp_(max=1.0)
    return reach.bool()


def _use_kernel(parents: torch.Tensor) -> bool:
    """The kernel for a nonempty tree of at most MAX_TREE_NODES nodes on CUDA (or the interpreter), outside a
    `torch.compile` trace (which takes the torch ops; the verify forward's kernels are custom ops of their own).
    A wider tree (only `tree_forward(..., verify="serial")` takes one: the decoding loop's are at most 128 nodes)
    takes the torch path, said once."""
    B, N = parents.shape
    if not use_triton(parents) or B == 0 or N == 0 or torch.compiler.is_compiling():
        return False
    if N > MAX_TREE_NODES:
        logger.warning_once(
            f"hf_bole: trees of more than {MAX_TREE_NODES} nodes (here {N}) get their ancestor mask and the round's "
            f"masks from torch's repeated squaring (about 40 small kernels), not the one-launch kernel"
        )
        return False
    return True


def tree_ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """`parents [B, T]` (-1 = child of the committed state) -> `[B, T, T]` bool, `mask[b, i, j]` is True
    when node j is node i or one of its ancestors. One launch of the kernel (see the module docstring) for
    `T <= MAX_TREE_NODES` on CUDA, the torch path's repeated squaring otherwise; no host synchronisation either way."""
    if not _use_kernel(parents):
        return _ancestor_mask_torch(parents)
    return _tree_ancestors(parents)[0]


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """`[B, T]` int64: the number of strict ancestors of every node (0 for a child of the committed state)."""
    if not _use_kernel(parents):
        return _ancestor_mask_torch(parents).sum(-1) - 1
    return _tree_ancestors(parents)[1]


_ANCESTORS = CachedLaunch(tree_masks_fwd_kernel)


def _tree_ancestors(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, N = parents.shape
    ancestors = torch.empty(B, N, N, dtype=torch.bool, device=parents.device)
    depths = torch.empty(B, N, dtype=torch.int64, device=parents.device)
    BT = max(16, next_power_of_2(N))
    stride_pb, stride_pt = parents.stride()
    # What the kernel is specialized on (`CachedLaunch`): the parents' dtype, shape, strides and alignment, the device.
    key = (parents.device, parents.dtype, B, N, stride_pb, stride_pt, alignment(parents.data_ptr()))
    with on_device(parents):
        _ANCESTORS(
            key, (B, 1),
            (parents, parents, parents, parents, ancestors.view(torch.uint8), depths, ancestors,  # unread: no masks
             stride_pb, stride_pt, 0, 0, 0, 0, N, 0),
            lambda: dict(BT=BT, LOG_BT=(BT - 1).bit_length(), BLOCK_C=BLOCK_C, MASKS=False,
                         num_warps=4 if BT <= 64 else 8),
        )  # fmt: skip
    return ancestors, depths


def tree_masks_torch(
    parents: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tree_masks` in torch (about 40 small kernels, no host synchronisation): the specification."""
    anc = _ancestor_mask_torch(parents)  # [B, N, N]
    position_ids = positions[:, None] + anc.sum(-1) - 1
    return anc, position_ids, tree_attention_mask(lengths, valid, anc)[:, None]  # mask [B, 1, N, C]


def tree_attention_mask(lengths: torch.Tensor, valid: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
    """`[B, N, C]` bool: node i of row b sees slot c where it is committed and not padding (`c < lengths[b]` and
    `valid[b, c]`), or where it holds one of i's ancestors or i itself (`0 <= c - lengths[b] < N` and
    `ancestors[b, i, c - lengths[b]]`); `lengths [B]`, `valid [B, C]`, `ancestors [B, N, N]`."""
    B, N, _ = ancestors.shape
    C = valid.shape[1]
    rel = torch.arange(C, device=valid.device)[None, :] - lengths[:, None]  # [B, C]
    in_tree = (rel >= 0) & (rel < N)
    tree_part = ancestors.gather(2, rel.clamp(0, N - 1)[:, None, :].expand(B, N, C)) & in_tree[:, None, :]
    return ((rel < 0) & valid)[:, None, :] | tree_part


def _tree_masks_fwd(
    parents: torch.Tensor,
    lengths: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    ancestors: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> None:
    """Launches the kernel into contiguous outputs `ancestors [B, N, N]` bool, `position_ids [B, N]` int64 and
    `attention_mask [B, 1, N, C]` bool; every element is written."""
    B, N = parents.shape
    C = valid.shape[1]
    BT = max(16, next_power_of_2(N))
    with on_device(parents):
        tree_masks_fwd_kernel[(B, 1 + triton.cdiv(C, BLOCK_C))](
            parents, lengths, positions, valid.view(torch.uint8),
            ancestors.view(torch.uint8), position_ids, attention_mask.view(torch.uint8),
            *parents.stride(), lengths.stride(0), positions.stride(0), *valid.stride(),
            N, C,
            BT=BT, LOG_BT=(BT - 1).bit_length(), BLOCK_C=BLOCK_C, MASKS=True,
            num_warps=4 if BT <= 64 else 8,  # program 0's [128, 128] fp32 product: 64 registers a thread at 8 warps
        )  # fmt: skip


def tree_masks(
    parents: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""
    The ancestor mask, position ids and attention mask of a tree-verify forward, in one Triton launch with no host
    synchronisation (it can be captured in a CUDA graph). Triton runs on CUDA tensors and, under `TRITON_INTERPRET=1`,
    on CPU tensors; on plain CPU tensors (and for an empty batch or tree) this calls `tree_masks_torch`, which gives
    the same outputs.

    Args:
        parents (`torch.LongTensor` of shape `(batch_size, N)`): parent of every node, `-1 <= parents[b, i] < i`
            (-1: a root or a padding node); the kernel takes `N <= 128` (`MAX_TREE_NODES`), wider trees the torch path.
            The values are not checked here.
        lengths (`torch.LongTensor` of shape `(batch_size,)`): committed KV slots of each row; the tree's nodes
            take the slots `lengths[b] + i`.
        positions (`torch.LongTensor` of shape `(batch_size,)`): the position of each row's next token.
        valid (`torch.BoolTensor` of shape `(batch_size, C)`): False at padding slots of the KV storage, whose
            capacity is C (`lengths[b] + N <= C`).

    Returns:
        ancestors (`torch.BoolTensor` of shape `(batch_size, N, N)`): `ancestors[b, i, j]` is True when node j is
            node i or one of its ancestors (`tree_ancestor_mask(parents)`).
        position_ids (`torch.LongTensor` of shape `(batch_size, N)`): `positions[b] + depth(i)`.
        attention_mask (`torch.BoolTensor` of shape `(batch_size, 1, N, C)`): node i of row b sees the row's
            valid committed slots (`c < lengths[b]`), its tree ancestors and itself.
    """
    inputs = {"parents": parents, "lengths": lengths, "positions": positions, "valid": valid}
    for name, x in inputs.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
        check_dtype(name, x, (torch.bool,) if name == "valid" else (torch.int64,))
    if parents.dim() != 2:
        raise ValueError(f"`parents` must have shape [B, N], got {tuple(parents.shape)}")
    B, N = parents.shape
    check_shape("lengths", lengths, (B,), "[B]")
    check_shape("positions", positions, (B,), "[B]")
    if valid.dim() != 2 or valid.shape[0] != B:
        raise ValueError(f"`valid` must have shape [B, C] with B = {B}, got {tuple(valid.shape)}")
    check_same_device(**inputs)
    if not _use_kernel(parents):
        return tree_masks_torch(parents, lengths, positions, valid)
    C = valid.shape[1]
    ancestors = torch.empty(B, N, N, dtype=torch.bool, device=parents.device)
    position_ids = torch.empty(B, N, dtype=torch.int64, device=parents.device)
    attention_mask = torch.empty(B, 1, N, C, dtype=torch.bool, device=parents.device)
    _tree_masks_fwd(parents, lengths, positions, valid, ancestors, position_ids, attention_mask)
    return ancestors, position_ids, attention_mask


def duplicate_siblings(tokens: torch.Tensor, parents: torch.Tensor, node_mask: torch.Tensor) -> torch.BoolTensor:
    """`[B, N]`: True for a real node that repeats the token of a real sibling with a smaller index."""
    N = tokens.shape[1]
    earlier = torch.ones(N, N, dtype=torch.bool, device=tokens.device).tril(-1)  # [i, j]: j < i
    same = (tokens[:, :, None] == tokens[:, None, :]) & (parents[:, :, None] == parents[:, None, :])
    return node_mask & (same & earlier & node_mask[:, None, :]).any(-1)
