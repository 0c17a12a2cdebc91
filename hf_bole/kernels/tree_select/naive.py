"""Batch-shared node selection in plain torch: which draft nodes the target verifies in a round (DESIGN.md §3 step 2,
§5). The specification `tree_select_nodes` (kernel.py) follows in one launch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hf_bole.kernels.tree_gdn.ancestors import tree_ancestor_mask


class SelectedNodes(NamedTuple):
    """The verify trees a selection lays out, width `T = 1 + M` (the root, then the kept nodes in draft order)."""

    input_ids: torch.Tensor  # [B, T] int64, the root token at 0, 0 on padding
    parents: torch.Tensor  # [B, T] int64, -1 for the root and padding
    depths: torch.Tensor  # [B, T] int64, 0 for the root and padding
    draft_index: torch.Tensor  # [B, T] int64, the draft node each came from, -1 for the root and padding
    node_mask: torch.Tensor  # [B, T] bool, True for the root and the kept nodes
    num_nodes: torch.Tensor  # [B] int64, real nodes per row, the root included
    draft_log_rho: torch.Tensor  # [B, N] the ranking key of every draft node (-inf on padding)


def naive_tree_select_nodes(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_logprobs: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int,
    max_nodes_per_row: int,
) -> SelectedNodes:
    r"""
    Keeps the draft nodes with the highest cumulative draft probability `rho(v) = prod p_draft` along the path,
    across the whole batch, and lays them out as verify trees.

    Rules, in order of precedence:
    1. Floor: every row with at least one real draft node keeps its best root child, even past the budget.
    2. Cap: a row keeps at most `max_nodes_per_row` nodes (a kernel limit; the root not counted).
    3. Budget: the remaining `budget - (rows served by the floor)` slots go to the best remaining nodes of the
       whole batch, so the total is exactly `min(budget, nodes available under the cap)` when `budget` covers
       the floor.

    The kept set of every row is prefix-connected (a node is kept only with its parent). Nodes are ranked by
    `min(rho)` over their path, which equals `rho` for log-probabilities <= 0 and keeps that true otherwise,
    then shallower first, then by row and index: a parent always ranks before its children, so every top set
    is a prefix-connected tree. Runs without host synchronisation and with shapes fixed by the arguments.

    Args:
        tokens (`torch.LongTensor` of shape `(batch_size, N)`): the draft nodes' tokens.
        parents (`torch.LongTensor` of shape `(batch_size, N)`): -1 for a child of the root, else an earlier node.
        draft_logprobs (`torch.FloatTensor` of shape `(batch_size, N)`): `log p_draft`, -inf on padding nodes.
        root_tokens (`torch.LongTensor` of shape `(batch_size,)`): the last committed token of every row.
        budget (`int`): total draft nodes to verify across the batch (the roots not counted).
        max_nodes_per_row (`int`): the most draft nodes one row may keep.

    Returns:
        `SelectedNodes` of width `T = 1 + M`, `M = min(max_nodes_per_row, max(budget, 1), N)`. Kept nodes appear in
        their draft order (which is topological) after the root.
    """
    check_selection(tokens, root_tokens, budget, max_nodes_per_row)
    B, N = tokens.shape
    M = min(max_nodes_per_row, max(budget, 1), N)
    device = tokens.device
    if N == 0:  # reductions below need a node: one padding node selects nothing, as an empty tree should
        N, pad = 1, torch.zeros(B, 1, dtype=torch.long, device=device)
        tokens, parents, draft_logprobs = pad, pad - 1, torch.full((B, 1), float("-inf"), device=device)

    anc = tree_ancestor_mask(parents)  # [B, N, N]
    depth = anc.sum(-1) - 1  # [B, N]
    log_rho = torch.where(anc, draft_logprobs[:, None, :], 0).sum(-1)  # [B, N]
    key = torch.where(anc, log_rho[:, None, :], float("inf")).amin(-1)  # [B, N], non-increasing along paths
    real = key > float("-inf")  # a padding node, or anything below one, has rho = 0 (NaN fails too)
    key = torch.where(real, key, float("-inf"))

    rank = _rank(key, depth)  # [B, N], position in the row's order
    floor = real & (rank == 0)  # rank 0 is always a root child: nothing outranks its best root child
    eligible = real & (rank > 0) & (rank < max_nodes_per_row)
    extra = (budget - floor.sum()).clamp(min=0)  # 0-dim tensor: no sync
    # Within one row the batch order below is the row order, so taking a prefix of it keeps every row's
    # selection a prefix of its own order, hence prefix-connected.
    batch_key = torch.where(eligible, key, float("-inf")).reshape(1, B * N)
    batch_rank = _rank(batch_key, depth.reshape(1, B * N)).reshape(B, N)
    selected = floor | (eligible & (batch_rank < extra))  # [B, N]

    # Compaction: a kept node goes to verify index 1 + (kept nodes before it); the rest to a dump column.
    slot = torch.where(selected, selected.cumsum(-1), M + 1)  # [B, N]
    nodes = torch.arange(N, device=device).expand(B, N)
    draft_index = torch.full((B, M + 2), -1, dtype=torch.long, device=device)
    draft_index.scatter_(1, slot, nodes)
    draft_index = draft_index[:, : M + 1]
    draft_index[:, 0] = -1  # the root (the dump column's duplicates were sliced off above)
    node_mask = draft_index >= 0
    node_mask[:, 0] = True
    src = draft_index.clamp(min=0)

    input_ids = torch.where(node_mask, tokens.gather(1, src), 0)
    input_ids[:, 0] = root_tokens
    draft_parent = parents.gather(1, src)  # [B, 1 + M]
    verify_parent = torch.where(draft_parent >= 0, slot.gather(1, draft_parent.clamp(min=0)), 0)
    out_parents = torch.where(node_mask, verify_parent, -1)
    out_parents[:, 0] = -1
    depths = torch.where(node_mask, depth.gather(1, src) + 1, 0)
    depths[:, 0] = 0
    return SelectedNodes(input_ids, out_parents, depths, draft_index, node_mask, node_mask.sum(-1), key)


def check_selection(tokens: torch.Tensor, root_tokens: torch.Tensor, budget: int, max_nodes_per_row: int) -> None:
    """The arguments every selection takes (`naive_tree_select_nodes`, `tree_select_nodes`), checked with a clear
    error."""
    if budget < 0:
        raise ValueError(f"`budget` must be >= 0, got {budget}")
    if max_nodes_per_row < 1:
        raise ValueError(f"`max_nodes_per_row` must be >= 1, got {max_nodes_per_row}")
    B = tokens.shape[0]
    if root_tokens.shape != (B,):
        raise ValueError(f"`root_tokens` must have shape [batch_size={B}], got {list(root_tokens.shape)}")


def _rank(key: torch.Tensor, depth: torch.Tensor) -> torch.LongTensor:
    """`[R, K]`: every entry's position along the last dim in the order (key descending, depth ascending, index
    ascending), by two stable sorts."""
    by_depth = torch.sort(depth, dim=-1, stable=True).indices
    by_key = torch.sort(key.gather(-1, by_depth), dim=-1, descending=True, stable=True).indices
    order = by_depth.gather(-1, by_key)
    positions = torch.arange(key.shape[-1], device=key.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)
