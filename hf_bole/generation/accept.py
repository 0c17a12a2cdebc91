"""Step 4 of a round, accept: which draft tokens the target accepts in each row's verified tree, greedy or by lossless
sampling (`acceptance.py` holds the rules; `hf_bole.kernels.tree_greedy_accept` walks greedy trees in one launch),
after the logits processors where the call has them. `make_accept` chooses the call's form once."""

from __future__ import annotations

import torch

from hf_bole.generation.acceptance import Acceptance, accept_sampling, is_context_free, process_logits
from hf_bole.generation.tree import VerifyTree
from hf_bole.kernels import tree_greedy_accept


def greedy_accept(tree: VerifyTree, target: torch.LongTensor) -> Acceptance:
    """Greedy acceptance of `tree` from the target's argmax token at every node (`target [B, T]`), in one launch
    (`tree_greedy_accept`; equal to `acceptance.accept_greedy` field by field)."""
    return Acceptance(*tree_greedy_accept(tree.input_ids, tree.parents, tree.depths, tree.node_mask, target))


def make_accept(do_sample: bool, logits_processor, writes, prompt_length: int):
    """Step 4 for a call: `accept(verified, n_gen) -> Acceptance`, greedy or sampling, through the call's
    `logits_processor` (those that read earlier tokens get every row's ids from `writes.seq`, `n_gen` generated after
    `prompt_length` columns of prompt)."""
    if not logits_processor and not do_sample:
        # Greedy reads only the argmax, which the processors' fp32 copy of the logits would not move: without
        # processors it is taken on the logits themselves (a [B, T, V] copy saved: 32 MB a round at batch 1 on the 9B
        # shape's 32 nodes).
        return lambda verified, n_gen: greedy_accept(verified.tree, verified.out.logits.argmax(-1))
    context_free = is_context_free(logits_processor)

    def scores(verified, n_gen: list[int]) -> torch.Tensor:
        contexts = None if context_free else [writes.seq[b, : prompt_length + n] for b, n in enumerate(n_gen)]
        return process_logits(logits_processor, verified.out.logits, verified.tree, contexts)

    if do_sample:
        return lambda verified, n_gen: accept_sampling(verified.tree, scores(verified, n_gen))
    return lambda verified, n_gen: greedy_accept(verified.tree, scores(verified, n_gen).argmax(-1))
