"""Ancestor relation of a batch of trees given by parent pointers, in torch, with no host synchronisation."""

from __future__ import annotations

import math

import torch


def tree_ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """`parents [B, T]` (-1 = child of the committed state) -> `[B, T, T]` bool, `mask[b, i, j]` is True
    when node j is node i or one of its ancestors.

    Reachability by repeated squaring of (I + parent matrix): ceil(log2 T) batched matmuls and no
    data-dependent loop, so it can be captured in a CUDA graph.
    """
    B, T = parents.shape
    nodes = torch.arange(T, device=parents.device)
    step = (parents[:, :, None] == nodes[None, None, :]).float()  # [B, T, T] one-hot parent
    reach = step + torch.eye(T, device=parents.device)
    for _ in range(max(1, math.ceil(math.log2(max(T, 2))))):
        reach = torch.bmm(reach, reach).clamp_(max=1.0)
    return reach.bool()


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """`[B, T]` int64: the number of strict ancestors of every node (0 for a child of the committed state)."""
    return tree_ancestor_mask(parents).sum(-1) - 1
