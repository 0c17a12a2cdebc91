"""The oracle drafter: a stand-in for a trained drafter on random-weight models, which have none.

It knows every row's greedy continuation (from an `ar` pass over the same batch) and builds each round a tree
of `depth` levels with `topk` candidates per level. At every level, with probability `accept`, the rank-1
candidate is the true next token; otherwise all candidates are decoys and the truth is absent from that level on,
so greedy verification accepts a geometric number of tokens: 1 + sum_{d=1..depth} accept^d per round on average
(accept = 0.8: 3.7 at depth 5, 3.95 at depth 6, 2.95 at depth 3 with topk 1), whatever the model. Every level
hangs below the previous level's rank-1 candidate, so a tree has the size and shape of a real top-k tree and
costs the verifier the same. Draft probabilities follow the ranks (accept for rank 1, the rest split evenly),
so budget selection keeps rank-1 paths first as it would with a calibrated drafter.

A round's tree is a few vectorised ops on small tensors on the device of the round's lengths (no loop over rows
or levels, no read on the host): the oracle stands in for a drafter whose own cost is not what is measured, so it
should cost next to nothing. A Python loop over rows and levels made the draft phase 1.5-2.1 ms of a 17-22 ms round
at batch 16 on the 9B shape. It reads only `ctx.lengths` and declares `max_depth`, so the decoding loop pipelines
its rounds as it does the MTP drafter's.

Results drafted by it are labelled `drafter: oracle` in every output: they measure the verifier at a chosen
acceptance, not a drafter.
"""

from __future__ import annotations

import math

import torch

from hf_bole import DraftContext, DraftTree


class OracleDrafter:
    """`propose(ctx) -> DraftTree` from known continuations (hf_bole's drafter protocol).

    Args:
        prompt_lengths (`list[int]`): per row, the prompt's length without padding.
        continuations (`list[list[int]]`): per row, the greedy tokens after the prompt (from `ar`).
        depth (`int`), topk (`int`): levels per tree and candidates per level.
        accept (`float`): probability that a level holds the true token.
        vocab_size (`int`): decoys are drawn from `[0, vocab_size)`.
        seed (`int`): decoys and hits are drawn from a generator of this seed, so runs repeat.
    """

    def __init__(
        self,
        prompt_lengths: list[int],
        continuations: list[list[int]],
        *,
        depth: int,
        topk: int,
        accept: float,
        vocab_size: int,
        seed: int = 0,
    ):
        if not 0.0 <= accept <= 1.0:
            raise ValueError(f"--oracle-accept must be a probability in [0, 1], got {accept}")
        if vocab_size <= topk:
            raise ValueError(f"the oracle needs more than topk={topk} tokens in the vocabulary, got {vocab_size}")
        if len(prompt_lengths) != len(continuations):
            raise ValueError(f"{len(prompt_lengths)} prompt lengths but {len(continuations)} continuations")
        self.prompt_lengths = torch.tensor(prompt_lengths)  # [B]
        self.lengths = torch.tensor([len(c) for c in continuations])  # [B]
        width = max([len(c) for c in continuations], default=0) + depth
        # [B, longest + depth]: every row's continuation, 0 past its end (never read as truth: `self.lengths`)
        self.continuations = torch.zeros(len(continuations), width, dtype=torch.long)
        for b, c in enumerate(continuations):
            self.continuations[b, : len(c)] = torch.tensor(c, dtype=torch.long)
        self.depth, self.topk, self.accept, self.vocab_size, self.seed = depth, topk, accept, vocab_size, seed
        self.generator = torch.Generator().manual_seed(seed)
        rest = math.log((1 - accept) / (topk - 1)) if topk > 1 and accept < 1 else -30.0
        # [topk] log p_draft by rank; clamped so that accept = 0 or 1 stays finite (a finite value marks a real node).
        self.rank_logprobs = torch.tensor([math.log(max(accept, 1e-12))] + [rest] * (topk - 1))
        # Level d's candidates hang below level d-1's rank-1 node (index (d-1) * K); level 0 below the root.
        level_parent = torch.arange(-1, depth - 1) * topk  # [D]
        self.parents = torch.where(level_parent < 0, -1, level_parent).repeat_interleave(topk)  # [N]

    @property
    def max_depth(self) -> int:
        """Levels below the root of every tree (hf_bole's `Drafter.max_depth`)."""
        return self.depth

    def _to(self, device: torch.device) -> None:
        """Moves the continuations and constants to `device`, with a generator there seeded as at construction."""
        if self.continuations.device == device:
            return
        for name in ("prompt_lengths", "lengths", "continuations", "rank_logprobs", "parents"):
            setattr(self, name, getattr(self, name).to(device))
        self.generator = torch.Generator(device).manual_seed(self.seed)

    def propose(self, ctx: DraftContext) -> DraftTree:
        B, D, K = ctx.batch_size, self.depth, self.topk
        N, device = D * K, ctx.lengths.device
        self._to(device)
        # generated tokens so far per row, the root included: the next D of its continuation are the truth
        done = ctx.lengths - self.prompt_lengths  # [B]
        index = done[:, None] + torch.arange(D, device=device)  # [B, D]
        truth = self.continuations.gather(1, index.clamp(max=self.continuations.shape[1] - 1))  # [B, D]
        hits = torch.rand(B, D, generator=self.generator, device=device) < self.accept  # [B, D]
        # A level holds the truth while every level above it did and the continuation lasts.
        alive = (hits & (index < self.lengths[:, None])).cumprod(1).bool()  # [B, D]
        # Decoys: K tokens at a random offset 1..V-K past the truth, so distinct and never the truth.
        offset = torch.randint(1, self.vocab_size - K + 1, (B, D, 1), generator=self.generator, device=device)
        decoys = (truth[..., None] + offset + torch.arange(K, device=device)) % self.vocab_size  # [B, D, K]
        with_truth = torch.cat([truth[..., None], decoys[..., : K - 1]], dim=-1)  # the truth first on a hit
        tokens = torch.where(alive[..., None], with_truth, decoys).reshape(B, N)
        parents = self.parents[None].expand(B, N).clone()
        logprobs = self.rank_logprobs.repeat(D)[None].expand(B, N).clone()
        return DraftTree(tokens=tokens, parents=parents, draft_logprobs=logprobs)
