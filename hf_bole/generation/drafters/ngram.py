"""Prompt-lookup drafting as a tree: continuations of earlier occurrences of the current suffix, merged into a trie."""

from __future__ import annotations

import math

import torch

from hf_bole.config import BoleConfig
from hf_bole.generation.drafters.base import DraftContext
from hf_bole.generation.tree import DraftTree

# Only the most recent occurrences feed the trie: older ones rarely change the top branches and cost host time
# on long, repetitive sequences.
MAX_MATCHES = 64


class NgramDrafter:
    r"""
    A drafter that needs no weights (prompt lookup, as transformers' `prompt_lookup_num_tokens`, grown into a tree).

    For every row it finds the earlier occurrences of the last `n` committed tokens, trying `n` from
    `ngram_max_size` down to `ngram_min_size` and keeping the longest `n` that occurred. The `depth` tokens that
    followed each occurrence (the most recent `MAX_MATCHES` of them) are merged into a trie, so shared prefixes
    share nodes and distinct continuations become branches. Every node keeps at most `topk` children, the most
    frequent ones. Edge draft log-probabilities are `log(count(child) / count(parent))`, so `rho(v)` is the
    fraction of occurrences whose continuation starts with v's path. Rows keep their `ctx.max_nodes` best nodes.
    Deterministic: ties go to the more recent occurrence.

    Args:
        config (`BoleConfig`, *optional*): reads `depth`, `topk`, `ngram_max_size` and `ngram_min_size`;
            `BoleConfig()` when omitted.

    Example:

    ```python
    >>> import torch
    >>> from hf_bole.generation import DraftContext, NgramDrafter
    >>> # the suffix "7 8 9" occurred twice before, followed by "2 7 8 9" and by "1 7 8 9 2": two branches
    >>> seq = torch.tensor([7, 8, 9, 1, 7, 8, 9, 2, 7, 8, 9])
    >>> tree = NgramDrafter().propose(DraftContext(sequences=[seq], max_nodes=8))
    >>> tree.tokens.tolist(), tree.parents.tolist()
    ([[2, 1, 7, 7, 8, 8, 9, 9]], [[-1, -1, 0, 1, 2, 3, 4, 5]])
    ```
    """

    def __init__(self, config: BoleConfig | None = None):
        config = config if config is not None else BoleConfig()
        self.depth = config.depth
        self.topk = config.topk
        self.max_ngram_size = config.ngram_max_size
        self.min_ngram_size = config.ngram_min_size

    def propose(self, ctx: DraftContext) -> DraftTree:
        """Drafts one trie per row of `ctx.sequences`; rows without a match get only padding.

        Returns:
            `DraftTree` of width `N` = the largest row's node count (at most `ctx.max_nodes`), on the device of
            `ctx.sequences`.
        """
        # A round that verifies no draft (`max_nodes` 0) looks nothing up: the drafter keeps no state.
        rows = [self._row(seq.cpu(), ctx.max_nodes) if ctx.max_nodes else ([], [], []) for seq in ctx.sequences]
        N = max((len(tokens) for tokens, _, _ in rows), default=0)
        tokens = torch.zeros(len(rows), N, dtype=torch.long)
        parents = torch.full((len(rows), N), -1, dtype=torch.long)
        logprobs = torch.full((len(rows), N), float("-inf"))
        for b, (tok, par, lp) in enumerate(rows):
            tokens[b, : len(tok)] = torch.tensor(tok, dtype=torch.long)
            parents[b, : len(par)] = torch.tensor(par, dtype=torch.long)
            logprobs[b, : len(lp)] = torch.tensor(lp)
        device = ctx.sequences[0].device if ctx.sequences else "cpu"
        return DraftTree(tokens=tokens.to(device), parents=parents.to(device), draft_logprobs=logprobs.to(device))

    def _continuations(self, seq: torch.Tensor) -> list[list[int]]:
        """The up-to-`depth` tokens after each earlier occurrence of the longest suffix that occurred, most
        recent first."""
        L = seq.shape[0]
        for n in range(min(self.max_ngram_size, L - 1), self.min_ngram_size - 1, -1):
            # Windows starting at 0 .. L-n-1: each is followed by at least one token, and none is the suffix itself.
            windows = seq.unfold(0, n, 1)[: L - n]  # [L - n, n]
            starts = (windows == seq[L - n :]).all(-1).nonzero().flatten()
            if starts.numel():
                ids = seq.tolist()
                return [ids[s + n : s + n + self.depth] for s in starts[-MAX_MATCHES:].flip(0).tolist()]
        return []

    def _row(self, seq: torch.Tensor, max_nodes: int) -> tuple[list[int], list[int], list[float]]:
        """One row's trie as (tokens, parents, draft_logprobs) lists in breadth-first order."""
        continuations = self._continuations(seq)
        # Trie over (parent node, token); nodes are numbered in order of first (most recent) occurrence.
        node_of: dict[tuple[int, int], int] = {}
        token, parent, depth, count = [], [], [], []
        for continuation in continuations:
            node = -1
            for t in continuation:
                child = node_of.get((node, t))
                if child is None:
                    child = node_of[(node, t)] = len(token)
                    token.append(t)
                    parent.append(node)
                    depth.append(0 if node < 0 else depth[node] + 1)
                    count.append(0)
                count[child] += 1
                node = child

        # Keep the `topk` most frequent children of every node (and nothing below a dropped one), then the
        # `max_nodes` nodes with the largest count; count never grows along a path, so both keep trees.
        children: dict[int, list[int]] = {}
        for v in range(len(token)):
            children.setdefault(parent[v], []).append(v)
        kept, frontier = [], [-1]
        while frontier:
            nxt = []
            for v in frontier:
                nxt += sorted(children.get(v, []), key=lambda c: -count[c])[: self.topk]
            kept += nxt
            frontier = nxt
        kept = sorted(kept, key=lambda v: (-count[v], depth[v], v))[:max_nodes]
        kept.sort(key=lambda v: (depth[v], -count[v], v))  # breadth-first (parents before children), best first

        index = {v: i for i, v in enumerate(kept)}
        total = len(continuations)
        parent_count = [total if parent[v] < 0 else count[parent[v]] for v in kept]
        return (
            [token[v] for v in kept],
            [index[parent[v]] if parent[v] >= 0 else -1 for v in kept],
            [math.log(count[v] / c) for v, c in zip(kept, parent_count)],
        )
