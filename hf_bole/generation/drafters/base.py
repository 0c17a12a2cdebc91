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
        sequences (`list[torch.LongTensor]`):
            Per row, the committed token ids: the prompt without padding, then everything generated so far, the
            root (the token the draft tree hangs from) last.
        max_nodes (`int`):
            The most draft nodes one row's tree may hold (the root not counted).
        hidden_states (`torch.Tensor` of shape `(batch_size, A, hidden_size)`, *optional*):
            The target's final hidden states at the positions committed since the last call (all prompt positions at
            prefill, the accepted path's positions later), for drafters that read them (MTP).
        next_tokens (`torch.LongTensor` of shape `(batch_size, A)`, *optional*):
            The token that followed each of those positions; a row's last real entry is its root.
        new_mask (`torch.BoolTensor` of shape `(batch_size, A)`, *optional*):
            Which of the `A` entries are real: left padding at prefill, right padding afterwards.
        positions (`torch.LongTensor` of shape `(batch_size, A)`, *optional*):
            The position ids of those entries.
    """

    sequences: list[torch.LongTensor]
    max_nodes: int
    hidden_states: torch.Tensor | None = None
    next_tokens: torch.LongTensor | None = None
    new_mask: torch.BoolTensor | None = None
    positions: torch.LongTensor | None = None


@runtime_checkable
class Drafter(Protocol):
    """Anything with `propose(ctx) -> DraftTree` drafts for hf_bole: `generate(..., bole_drafter=obj)`.

    The returned tree must cover `len(ctx.sequences)` rows with at most `ctx.max_nodes` nodes each, keep parents
    before children, give siblings distinct tokens and pad ragged rows with `draft_logprobs = -inf`
    (`DraftTree.validate` checks all of it). For lossless sampling the tree may depend on anything committed and
    on the drafter's own randomness, never on the target's samples of the round it drafts for.
    """

    def propose(self, ctx: DraftContext) -> DraftTree: ...
