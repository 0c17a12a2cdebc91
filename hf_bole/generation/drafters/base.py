"""The drafter protocol: what a drafter is given each round and what it must return.

How this differs from transformers' `CandidateGenerator`: `get_candidates(input_ids)` returns one flat
continuation per row, `[batch_size, candidate_length]`, and `update_candidate_strategy` is told how many of
its tokens matched. A drafter here returns a *tree* per row (`DraftTree`: tokens, parent pointers and draft
log-probabilities, ragged rows padded), because the verifier scores many branches in one forward; the rows are
committed ids without padding rather than one padded `input_ids` matrix, since requests advance by different
amounts each round; and there is no separate update call: what was accepted reaches the drafter as the newly
committed entries of the next `DraftContext`. We do not subclass `CandidateGenerator` because neither of its
methods can carry a tree, and transformers' assisted decoding refuses the hybrid models this package targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from hf_bole.generation.tree import DraftTree


@dataclass
class DraftContext:
    r"""
    What a drafter sees at the start of a round.

    Args:
        sequences (`list[torch.LongTensor]` or `None`):
            Per row, the committed token ids: the prompt without padding, then everything generated so far, the
            root (the token the draft tree hangs from) last; copies (writing into them changes nothing else). `None`
            for a drafter with `max_depth` (see `Drafter`) while the loop pipelines rounds: the host does not know
            them yet.
        max_nodes (`int`):
            The most draft nodes one row's tree may hold (the root not counted): the width this round verifies, so
            a drafter need not draft deeper. 0 in a round that verifies no draft (a budget of 0, as `budget="auto"`
            chooses where drafting cannot pay for itself): the drafter takes in the new entries and may return a tree
            of no nodes; whatever it returns is not verified.
        lengths (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Per row, the number of committed tokens, `len(sequences[b])`, on the device; derived from `sequences`
            when not given.
        max_length (`int`, *optional*):
            An upper bound of `lengths` known on the host (for sizing buffers); `max(lengths)` when not given.
        hidden_states (`torch.Tensor` of shape `(batch_size, A, hidden_size)`, *optional*):
            The target's final hidden states at the positions committed since the last call (all prompt positions at
            prefill, the accepted path's positions later), for drafters that read them (MTP).
        next_tokens (`torch.LongTensor` of shape `(batch_size, A)`, *optional*):
            The token that followed each of those positions; a row's last real entry is its root.
        new_mask (`torch.BoolTensor` of shape `(batch_size, A)`, *optional*):
            Which of the `A` entries are real: left padding at prefill, right padding afterwards.
        positions (`torch.LongTensor` of shape `(batch_size, A)`, *optional*):
            The position ids of those entries.
        unseen_prefix (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Per row, how many of its first committed tokens no drafter is shown the hidden states of: those a cache
            the call continued from holds (`past_key_values=`), which keeps no hidden states. The first call's
            `hidden_states` start after them. `None` = 0.

    `hidden_states`, `next_tokens`, `new_mask` and `positions` are valid during `propose`: with CUDA graphs they
    are a graph's buffers, overwritten later in the round. A drafter that keeps them past the call keeps copies.
    """

    sequences: list[torch.LongTensor] | None
    max_nodes: int
    hidden_states: torch.Tensor | None = None
    next_tokens: torch.LongTensor | None = None
    new_mask: torch.BoolTensor | None = None
    positions: torch.LongTensor | None = None
    lengths: torch.LongTensor | None = None
    max_length: int | None = None
    unseen_prefix: torch.LongTensor | None = None

    def __post_init__(self):
        if self.sequences is None and (self.lengths is None or self.max_length is None):
            raise ValueError("DraftContext needs `sequences`, or `lengths` and `max_length` in their place")
        if self.lengths is None:
            device = self.sequences[0].device if self.sequences else "cpu"
            self.lengths = torch.tensor([len(seq) for seq in self.sequences], dtype=torch.long, device=device)
        if self.max_length is None:
            self.max_length = max((len(seq) for seq in self.sequences), default=0)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]


@runtime_checkable
class Drafter(Protocol):
    """Anything with `propose(ctx) -> DraftTree` drafts for hf_bole: `generate(..., bole_drafter=obj)`.

    The returned tree must cover `ctx.batch_size` rows with at most `ctx.max_nodes` nodes each, keep parents
    before children, give siblings distinct tokens and pad ragged rows with `draft_logprobs = -inf`
    (`DraftTree.validate` checks all of it). For lossless sampling the tree may depend on anything committed and
    on the drafter's own randomness, never on the target's samples of the round it drafts for.

    A drafter that reads only the device-side fields of the context (`lengths`, `hidden_states`, `next_tokens`,
    `new_mask`, `positions`; never `sequences`) and never drafts more than a fixed number of levels may say so with
    an int attribute `max_depth`. The loop then pipelines rounds (`BoleConfig.pipeline`): it queues round r + 1
    on the GPU before the host reads round r's tokens, `ctx.sequences` is `None`, and a tree that breaks the rules
    above is made safe to verify and reported by a `ValueError` one round later.
    """

    def propose(self, ctx: DraftContext) -> DraftTree: ...
