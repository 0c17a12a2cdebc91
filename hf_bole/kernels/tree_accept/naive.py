"""Greedy acceptance over verified trees in plain torch: the walk from the root along the target's argmax tokens. The
specification `tree_greedy_accept` (kernel.py) follows in one launch; sampling acceptance
(`hf_bole.generation.acceptance`) walks its own choices with `walk` and `accepted_outputs`."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hf_bole.kernels.tree_gdn.ancestors import duplicate_siblings, tree_ancestor_mask


class AcceptedPaths(NamedTuple):
    """Every row's outcome of one verify round (`hf_bole.generation.acceptance.Acceptance` holds the same fields)."""

    path: torch.Tensor  # [B, T] int64 root-to-leaf tree indices, right-padded with -1
    accept_lengths: torch.Tensor  # [B] int64 tokens emitted: the accepted draft tokens and the bonus
    tokens: torch.Tensor  # [B, T] int64 the emitted tokens, right-padded with -1
    bonus: torch.Tensor  # [B] int64 the target's token at the leaf, the next round's root
    leaf: torch.Tensor  # [B] int64 the last accepted node


def naive_tree_greedy_accept(
    input_ids: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, node_mask: torch.Tensor, target: torch.Tensor
) -> AcceptedPaths:
    """Greedy acceptance from the target's argmax token at every node (`target [B, T]`): from the root, descend to the
    child whose token is the argmax at the current node; stop where there is none and emit the argmax there as the
    bonus token. The trees (`[B, T]` each) are a `VerifyTree`'s fields, nodes in topological order."""
    chosen = input_ids == target.gather(1, parents.clamp(min=0))
    leaf, path = walk(input_ids, parents, depths, node_mask, chosen)
    return accepted_outputs(input_ids, depths, path, leaf, target.gather(1, leaf[:, None]).squeeze(1))


def walk(
    input_ids: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, node_mask: torch.Tensor, chosen: torch.Tensor
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Follows `chosen [B, T]` (node i is where the walk goes from its parent) down from the root.

    Returns `leaf [B]`, the last accepted node, and `path [B, T]`, root-to-leaf indices right-padded with -1.
    Among siblings with equal tokens only the first can be chosen, so the accepted nodes form one path.
    """
    B, T = chosen.shape
    is_root = torch.arange(T, device=chosen.device) == 0
    chosen = (chosen & node_mask & ~duplicate_siblings(input_ids, parents, node_mask)) | is_root
    anc = tree_ancestor_mask(parents)  # [B, T, T]
    accepted = ~(anc & ~chosen[:, None, :]).any(-1)  # every node on the path from the root was chosen
    leaf = torch.where(accepted, depths, -1).argmax(-1)  # [B]
    on_path = anc.gather(1, leaf[:, None, None].expand(B, 1, T)).squeeze(1)  # [B, T]
    slot = torch.where(on_path, depths, T)  # position on the path = depth; others to a dump column
    path = torch.full((B, T + 1), -1, dtype=torch.long, device=chosen.device)
    path.scatter_(1, slot, torch.arange(T, device=chosen.device).expand(B, T))
    return leaf, path[:, :T]


def accepted_outputs(
    input_ids: torch.Tensor, depths: torch.Tensor, path: torch.Tensor, leaf: torch.Tensor, bonus: torch.Tensor
) -> AcceptedPaths:
    """The emitted tokens of a walk's `path [B, T]` to `leaf [B]`, then `bonus [B]`."""
    accept_lengths = depths.gather(1, leaf[:, None]).squeeze(1) + 1
    path_tokens = torch.where(path >= 0, input_ids.gather(1, path.clamp(min=0)), -1)
    tokens = torch.cat([path_tokens[:, 1:], torch.full_like(path_tokens[:, :1], -1)], dim=1)
    tokens.scatter_(1, (accept_lengths - 1)[:, None], bonus[:, None])
    return AcceptedPaths(path, accept_lengths, tokens, bonus, leaf)
