"""The last step of growing a top-k draft tree (the MTP and small-model drafters): keep the best nodes."""

from __future__ import annotations

import torch


def best_nodes(
    tokens: torch.Tensor, logp: torch.Tensor, cum: torch.Tensor, parents: torch.Tensor, num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `num_nodes` drafted nodes of largest cumulative draft log-probability, best first: their tokens, parents
    (renumbered) and draft log-probabilities, each `[B, num_nodes]` (a `DraftTree`'s fields).

    `tokens`, `logp` (each edge's), `cum` (each path's) and `parents` (-1 under the root) are `[B, T]`, the nodes
    numbered shallower first, a parent before its children. The kept set is prefix-closed: a child's cumulative
    log-probability never exceeds its parent's, and the stable sort keeps the shallower of equal nodes first. Nodes
    whose cumulative probability underflowed to 0 become padding (log-probability -inf)."""
    batch_size = tokens.shape[0]
    order = cum.sort(dim=1, descending=True, stable=True).indices[:, :num_nodes]  # [B, N]
    rank = torch.full_like(cum, -1, dtype=torch.long)
    rank.scatter_(1, order, torch.arange(num_nodes, device=cum.device).expand(batch_size, -1))
    parents = parents.gather(1, order)
    parents = torch.where(parents >= 0, rank.gather(1, parents.clamp(min=0)), -1)
    logp = torch.where(cum.gather(1, order) > float("-inf"), logp.gather(1, order), float("-inf"))
    return tokens.gather(1, order), parents, logp
