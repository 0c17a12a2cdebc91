"""Batch-shared node selection: which draft nodes the target verifies this round (DESIGN.md §3 step 2, §5)."""

from __future__ import annotations

import torch

from hf_bole.generation.tree import DraftTree, VerifyTree


def select_nodes(
    tree: DraftTree, root_tokens: torch.LongTensor, budget: int, max_nodes_per_row: int
) -> VerifyTree:
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
        tree (`DraftTree`): the drafter's proposal, `[B, N]`.
        root_tokens (`torch.LongTensor` of shape `(batch_size,)`): the last committed token of every row.
        budget (`int`): total draft nodes to verify across the batch (the roots not counted).
        max_nodes_per_row (`int`): the most draft nodes one row may keep.

    Returns:
        `VerifyTree` of width `T = 1 + M`, `M = min(max_nodes_per_row, max(budget, 1), N)`. Kept nodes appear in
        their draft order (which is topological) after the root.

    Example:

    ```python
    >>> import torch
    >>> from hf_bole.generation import DraftTree, select_nodes
    >>> # rho: a=0.6, a->b=0.3, c=0.25; with a budget of 2 the tree keeps a and a->b
    >>> tree = DraftTree(
    ...     tokens=torch.tensor([[5, 6, 7]]),
    ...     parents=torch.tensor([[-1, 0, -1]]),
    ...     draft_logprobs=torch.tensor([[0.6, 0.5, 0.25]]).log(),
    ... )
    >>> vt = select_nodes(tree, root_tokens=torch.tensor([9]), budget=2, max_nodes_per_row=127)
    >>> vt.input_ids, vt.parents
    (tensor([[9, 5, 6]]), tensor([[-1,  0,  1]]))
    ```
    """
    check_selection(tree, root_tokens, budget, max_nodes_per_row)
    B, N = tree.tokens.shape
    M = min(max_nodes_per_row, max(budget, 1), N)
    device = tree.tokens.device
    if N == 0:  # reductions below need a node: one padding node selects nothing, as an empty tree should
        N, pad = 1, torch.zeros(B, 1, dtype=torch.long, device=device)
        tree = DraftTree(tokens=pad, parents=pad - 1, draft_logprobs=torch.full((B, 1), float("-inf"), device=device))

    anc = tree.ancestor_mask()  # [B, N, N]
    depth = anc.sum(-1) - 1  # [B, N]
    log_rho = torch.where(anc, tree.draft_logprobs[:, None, :], 0).sum(-1)  # [B, N]
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

    input_ids = torch.where(node_mask, tree.tokens.gather(1, src), 0)
    input_ids[:, 0] = root_tokens
    draft_parent = tree.parents.gather(1, src)  # [B, 1 + M]
    verify_parent = torch.where(draft_parent >= 0, slot.gather(1, draft_parent.clamp(min=0)), 0)
    parents = torch.where(node_mask, verify_parent, -1)
    parents[:, 0] = -1
    depths = torch.where(node_mask, depth.gather(1, src) + 1, 0)
    depths[:, 0] = 0
    return VerifyTree(
        input_ids=input_ids,
        parents=parents,
        depths=depths,
        draft_index=draft_index,
        node_mask=node_mask,
        num_nodes=node_mask.sum(-1),
        draft_log_rho=key,
    )


def check_selection(tree: DraftTree, root_tokens: torch.Tensor, budget: int, max_nodes_per_row: int) -> None:
    """The arguments every selection takes (`select_nodes`, `select_nodes_triton`), checked with a clear error."""
    if budget < 0:
        raise ValueError(f"`budget` must be >= 0, got {budget}")
    if max_nodes_per_row < 1:
        raise ValueError(f"`max_nodes_per_row` must be >= 1, got {max_nodes_per_row}")
    B = tree.tokens.shape[0]
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
