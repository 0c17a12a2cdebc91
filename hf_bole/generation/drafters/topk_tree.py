"""A top-k draft tree as the MTP and small-model drafters grow it: level by level, the `topk` best nodes of the
deepest level (by cumulative draft probability, the frontier) each get their `topk` likeliest children; at the end the
best nodes of all levels are kept."""

from __future__ import annotations

from collections.abc import Callable

import torch


class TopkLevels:
    """The nodes drafted so far, numbered level by level (shallower first, a parent before its children), and the
    frontier: the nodes the next level expands.

    Args:
        logp (`torch.FloatTensor` of shape `(batch_size, topk)`): the root's children's draft log-probabilities.
        tokens (`torch.LongTensor` of shape `(batch_size, topk)`): their tokens.
    """

    def __init__(self, logp: torch.Tensor, tokens: torch.Tensor):
        batch_size, self.topk = tokens.shape
        self.tokens, self.logp, self.cum = [tokens], [logp], [logp]
        self.parents = [torch.full_like(tokens, -1)]
        self.frontier_cum = logp  # [B, K]
        self.frontier_ids = torch.arange(self.topk, device=tokens.device).expand(batch_size, -1)  # [B, K]
        self._before = 0  # nodes of the levels before the last

    def add(self, child_logp: torch.Tensor, child_tokens: torch.Tensor) -> None:
        """Adds a level: the frontier's children, `[B, K, K]` log-probabilities and tokens (each node's `K`)."""
        K = self.topk
        self._before += self.tokens[-1].shape[1]
        self.tokens.append(child_tokens.flatten(1))
        self.logp.append(child_logp.flatten(1))
        self.cum.append((self.frontier_cum[..., None] + child_logp).flatten(1))  # [B, K*K]
        self.parents.append(self.frontier_ids.repeat_interleave(K, dim=1))

    def advance(self, best: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Makes the `K` best of the last level (by cumulative log-probability, `best(x)` giving a row's top `K` values
        and indices) the frontier; returns their indices among the level's `K*K` nodes, `[B, K]` (`// K` is their
        parent's index in the frontier before)."""
        self.frontier_cum, chosen = best(self.cum[-1])
        self.frontier_ids = self._before + chosen
        return chosen

    def best_nodes(self, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The `num_nodes` drafted nodes of largest cumulative draft log-probability, best first: their tokens,
        parents (renumbered) and draft log-probabilities, each `[B, num_nodes]` (a `DraftTree`'s fields).

        The kept set is prefix-closed: a child's cumulative log-probability never exceeds its parent's, and the stable
        sort keeps the shallower of equal nodes first. Nodes whose cumulative probability underflowed to 0 become
        padding (log-probability -inf)."""
        tokens, logp, cum, parents = (torch.cat(x, dim=1) for x in (self.tokens, self.logp, self.cum, self.parents))
        batch_size = tokens.shape[0]
        order = cum.sort(dim=1, descending=True, stable=True).indices[:, :num_nodes]  # [B, N]
        rank = torch.full_like(cum, -1, dtype=torch.long)
        rank.scatter_(1, order, torch.arange(num_nodes, device=cum.device).expand(batch_size, -1))
        parents = parents.gather(1, order)
        parents = torch.where(parents >= 0, rank.gather(1, parents.clamp(min=0)), -1)
        logp = torch.where(cum.gather(1, order) > float("-inf"), logp.gather(1, order), float("-inf"))
        return tokens.gather(1, order), parents, logp
