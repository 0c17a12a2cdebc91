"""Which draft tokens the target accepts: greedy and lossless sampling walks over a verified tree, in pure torch.

Notation: `p_target(. | node)` is the target's next-token distribution after the logits processors, given the
committed sequence followed by the node's path (the root's logits predict the first new token). The sampling
rule and its proof are in docs/acceptance.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers.generation import logits_process as lp

from hf_bole.generation.tree import VerifyTree
from hf_bole.kernels import naive_tree_greedy_accept
from hf_bole.kernels.tree_accept.naive import accepted_outputs, walk
from hf_bole.kernels.tree_gdn.ancestors import duplicate_siblings


@dataclass
class Acceptance:
    r"""
    The outcome of one verify round for every request.

    Args:
        path (`torch.LongTensor` of shape `(batch_size, T)`):
            Verify-tree indices of the accepted path from the root (index 0) to the last accepted node, right-padded
            with -1. Its first `accept_lengths` entries are real.
        accept_lengths (`torch.LongTensor` of shape `(batch_size,)`):
            Tokens emitted this round: the accepted draft tokens plus the bonus token (so at least 1).
        tokens (`torch.LongTensor` of shape `(batch_size, T)`):
            The emitted tokens, the accepted path's draft tokens (root excluded) then the bonus, right-padded with -1.
        bonus (`torch.LongTensor` of shape `(batch_size,)`):
            The token the target produced at the last accepted node; the next round's root.
        leaf (`torch.LongTensor` of shape `(batch_size,)`):
            The verify-tree index of the last accepted node (0 when no draft token was accepted), whose state the
            cache commits.
    """

    path: torch.LongTensor
    accept_lengths: torch.LongTensor
    tokens: torch.LongTensor
    bonus: torch.LongTensor
    leaf: torch.LongTensor


def accept_greedy(tree: VerifyTree, scores: torch.Tensor) -> Acceptance:
    r"""
    Greedy acceptance: from the root, descend to the child whose token is the argmax of the current node's scores;
    stop when there is none, and emit the argmax there as the bonus token. The emitted tokens are exactly those
    plain greedy decoding produces from the same scores.

    Args:
        tree (`VerifyTree`): the verified trees, width `T`.
        scores (`torch.FloatTensor` of shape `(batch_size, T, vocab_size)`): processed logits of every node (see
            `process_logits`).

    Returns:
        `Acceptance`.

    Example:

    ```python
    >>> import torch
    >>> from hf_bole.generation import VerifyTree, accept_greedy
    >>> # root(9) -> 1 -> 2; the target's argmax is 1 at the root and 3 at node 1
    >>> tree = VerifyTree(
    ...     input_ids=torch.tensor([[9, 1, 2]]), parents=torch.tensor([[-1, 0, 1]]), depths=torch.tensor([[0, 1, 2]]),
    ...     draft_index=torch.tensor([[-1, 0, 1]]), node_mask=torch.ones(1, 3, dtype=torch.bool),
    ...     num_nodes=torch.tensor([3]),
    ... )
    >>> scores = torch.nn.functional.one_hot(torch.tensor([[1, 3, 0]]), 4).float()
    >>> accept_greedy(tree, scores).tokens  # 1 accepted, then the bonus 3
    tensor([[ 1,  3, -1]])
    ```
    """
    target = scores.argmax(-1)  # [B, T]
    return Acceptance(*naive_tree_greedy_accept(tree.input_ids, tree.parents, tree.depths, tree.node_mask, target))


def accept_sampling(tree: VerifyTree, scores: torch.Tensor, generator: torch.Generator | None = None) -> Acceptance:
    r"""
    Lossless sampling acceptance for trees whose children were chosen by any rule (top-k included): at the current
    node draw `t ~ p_target(. | node)`; if `t` is a child's token, descend to that child and repeat, otherwise emit
    `t` as the bonus token and stop. Every emitted token is an exact sample of the target's conditional, and the
    chance of descending is `p_target(children)`, the most any lossless rule can reach (docs/acceptance.md).

    The draw is split in two without changing its law: one uniform per node decides which child token `t` is, or
    that it is none of them (inverse CDF over the children's probabilities); only the last node then samples its
    bonus from `p_target` restricted to non-child tokens. So besides one logsumexp over the scores there is no
    `[B, T, vocab_size]` work or randomness, and nothing synchronises with the host. Uses torch's RNG only.

    Args:
        tree (`VerifyTree`): the verified trees, width `T`.
        scores (`torch.FloatTensor` of shape `(batch_size, T, vocab_size)`): processed logits of every node
            (temperature, top-k, top-p... already applied, see `process_logits`); `-inf` marks excluded tokens.
        generator (`torch.Generator`, *optional*): the RNG to draw from; torch's default one otherwise.

    Returns:
        `Acceptance`.
    """
    B, T, V = scores.shape
    device = scores.device
    parents = tree.parents.clamp(min=0)
    # log p_target(node's token | parent) for every node: its parent's scores at its token, normalised.
    lse = scores.float().logsumexp(-1)  # [B, T]
    node_logit = _logit_at_parent(scores, parents, tree.input_ids)  # [B, T]
    duplicate = duplicate_siblings(tree.input_ids, tree.parents, tree.node_mask)
    real_child = tree.node_mask & (tree.parents >= 0) & ~duplicate
    p_child = torch.where(real_child, (node_logit - lse.gather(1, parents)).exp(), 0.0)  # [B, T]

    # Inverse CDF over each node's children in index order: child j wins when u(parent) falls below the running
    # sum up to and including j but not below that of any earlier sibling ("none" above the last sum).
    idx = torch.arange(T, device=device)
    siblings = tree.parents[:, :, None] == tree.parents[:, None, :]  # [B, T, T]
    before = siblings & (idx[None, :] < idx[:, None])  # [B, j, k]: k an earlier sibling of j
    running = torch.where(before | torch.eye(T, dtype=torch.bool, device=device), p_child[:, None, :], 0.0).sum(-1)
    u = torch.rand(B, T, device=device, generator=generator)  # one uniform per node, used by its children
    candidate = (u.gather(1, parents) < running) & (p_child > 0)
    chosen = candidate & ~(before & candidate[:, None, :]).any(-1)
    leaf, path = walk(tree.input_ids, tree.parents, tree.depths, tree.node_mask, chosen)

    # The bonus: p_target at the last node restricted to tokens that are not its children ("t is none of them").
    leaf_scores = scores.gather(1, leaf[:, None, None].expand(B, 1, V)).squeeze(1).float()  # [B, V]
    is_child = (tree.parents == leaf[:, None]) & tree.node_mask  # [B, T]
    excluded = torch.zeros(B, V, device=device).scatter_add_(1, tree.input_ids, is_child.float()) > 0
    restricted = leaf_scores.masked_fill(excluded, float("-inf"))
    # If rounding sent the walk past children that hold all the mass, the complement is empty: fall back to the
    # full distribution (an event of probability ~1e-7, and still a draw from p_target).
    restricted = torch.where((restricted > float("-inf")).any(-1, keepdim=True), restricted, leaf_scores)
    bonus = sample_tokens(restricted, generator=generator)
    return Acceptance(*accepted_outputs(tree.input_ids, tree.depths, path, leaf, bonus))


def sample_tokens(scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.LongTensor:
    """`[..., V]` scores -> `[...]` one token drawn from `softmax(scores)` per row, without a CUDA synchronisation
    (the exponential race `argmax(p / Exp(1))`, as in gpt-fast)."""
    probs = scores.float().softmax(-1)
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    # An Exp(1) draw of exactly 0 would make p / 0 = nan win even at p = 0; clamping costs ~1e-38 in probability.
    return (probs / race.clamp_(min=torch.finfo(race.dtype).tiny)).argmax(-1)


def _logit_at_parent(scores: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`[B, T]`: `scores[b, parents[b, i], tokens[b, i]]`, the logit the parent gave to node i's token."""
    B, T, V = scores.shape
    return scores.reshape(B, T * V).gather(1, parents * V + tokens).float()


# Processors whose output depends on the scores alone, never on `input_ids` (checked against transformers'
# generation/logits_process.py): the tree's nodes can go through them in one batched call. Looked up by name
# because older transformers releases lack some (TopH).
CONTEXT_FREE_PROCESSORS: tuple[type, ...] = tuple(
    getattr(lp, name)
    for name in (
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "TopHLogitsWarper",
        "MinPLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "InfNanRemoveLogitsProcessor",
        "LogitNormalization",
        "SuppressTokensLogitsProcessor",
    )
    if hasattr(lp, name)
)

# Processors that compute each row of the scores from that row of `input_ids` alone (its ids and its length),
# whatever its place in the batch (checked against transformers' generation/logits_process.py): the tree's nodes of
# one sequence length can go through them in one call, whatever their rows. Any other processor may treat batch rows
# differently (a `prefix_allowed_tokens_fn`, a user's processor): it is called with each node in its row's place.
ROW_WISE_PROCESSORS: tuple[type, ...] = CONTEXT_FREE_PROCESSORS + tuple(
    getattr(lp, name)
    for name in (
        "RepetitionPenaltyLogitsProcessor",  # a per-row `prompt_ignore_length` is re-indexed by node (`_for_rows`)
        "NoRepeatNGramLogitsProcessor",
        "SequenceBiasLogitsProcessor",
        "NoBadWordsLogitsProcessor",
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
        "ForcedBOSTokenLogitsProcessor",
        "ForcedEOSTokenLogitsProcessor",
        "ExponentialDecayLengthPenalty",
        "SuppressTokensAtBeginLogitsProcessor",
    )
    if hasattr(lp, name)
)

# Processors that need other rows of the batch or keep state across calls: scoring tree nodes would silently change
# what they compute.
_UNSUPPORTED_PROCESSORS: dict[str, str] = {
    "ClassifierFreeGuidanceLogitsProcessor": "it needs the conditional and unconditional batch halves",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "it runs the model on its own cache once per step",
    "SynthIDTextWatermarkLogitsProcessor": "it keeps watermark state across steps",
    "EncoderRepetitionPenaltyLogitsProcessor": "it reads the encoder's input, which a decoder-only model has none of",
    "EncoderNoRepeatNGramLogitsProcessor": "it reads the encoder's input, which a decoder-only model has none of",
}


def is_context_free(logits_processor: lp.LogitsProcessorList | None) -> bool:
    """True when every processor in the list ignores `input_ids` (exact type match: a subclass may not)."""
    return all(type(p) in CONTEXT_FREE_PROCESSORS for p in logits_processor or ())


def check_logits_processor(logits_processor: lp.LogitsProcessorList | None) -> None:
    """Raises a `ValueError` for processors that tree verification cannot apply the way plain `generate` does."""
    for p in logits_processor or ():
        name = type(p).__name__
        if name in _UNSUPPORTED_PROCESSORS:
            raise ValueError(f"hf_bole cannot apply `{name}` to tree nodes: {_UNSUPPORTED_PROCESSORS[name]}")


def process_logits(
    logits_processor: lp.LogitsProcessorList | None,
    logits: torch.Tensor,
    tree: VerifyTree,
    contexts: list[torch.LongTensor] | None = None,
) -> torch.FloatTensor:
    r"""
    Applies a `LogitsProcessorList` to the logits of every verify node exactly as plain `generate` would at the
    step that node predicts: to fp32 copies of the logits, with `input_ids` equal to the node's full sequence.

    When every processor is context-free (temperature, top-k, top-p, min-p, ...) all nodes go through one batched
    call. Otherwise every node's sequence is built as its row's context followed by the tokens on its path below the
    root. When every processor computes a row from that row alone (`ROW_WISE_PROCESSORS`), nodes are grouped by
    sequence length and the processors run once per group (a host loop over distinct lengths, at most batch size x
    tree depth). Any other processor may treat batch rows differently, so it gets `input_ids` as plain decoding
    holds them: `[batch_size, length]`, each call holding one node of each row (of one length) in its row's place
    and padding (token 0) in the rows without one, as many calls as the most nodes of one length in a row.

    Args:
        logits_processor (`LogitsProcessorList`, *optional*): the processors `generate` built.
        logits (`torch.Tensor` of shape `(batch_size, T, vocab_size)`): the target's logits at the verify nodes.
        tree (`VerifyTree`): the verified trees.
        contexts (`list[torch.LongTensor]`, *optional*): per row, the `input_ids` row plain `generate` would hold
            when it samples the token after the root: the prompt with its left padding, the generated tokens, the
            root token last. Needed only when some processor is not context-free (see `is_context_free`).

    Returns:
        `torch.FloatTensor` of shape `(batch_size, T, vocab_size)`: the processed scores (padding nodes' rows are
        left unprocessed).
    """
    B, T, V = logits.shape
    scores = logits.to(dtype=torch.float32, copy=True)
    if not logits_processor:
        return scores
    check_logits_processor(logits_processor)
    if is_context_free(logits_processor):
        ids = tree.input_ids.reshape(B * T, 1)  # never read by these processors; any [rows, length] works
        return logits_processor(ids, scores.reshape(B * T, V)).reshape(B, T, V)
    if contexts is None:
        names = ", ".join(type(p).__name__ for p in logits_processor if type(p) not in CONTEXT_FREE_PROCESSORS)
        raise ValueError(f"process_logits needs `contexts`: {names} read the sequence")

    sequences = _NodeSequences(tree, contexts)
    seq_len = torch.where(tree.node_mask, sequences.context_len[:, None] + tree.depths, -1).reshape(B * T)
    flat = scores.reshape(B * T, V)
    if all(type(p) in ROW_WISE_PROCESSORS for p in logits_processor):
        order = torch.argsort(seq_len, stable=True)
        lengths, counts = torch.unique_consecutive(seq_len[order], return_counts=True)
        for L, group in zip(lengths.tolist(), order.split(counts.tolist())):
            if L >= 0:  # not padding nodes
                b = group // T
                flat[group] = _for_rows(logits_processor, b)(sequences.ids(group, L), flat[group])
        return scores
    # Calls of one node per row: the k-th node of length L of each row goes into call (L, k), in its row's place.
    calls: dict[tuple[int, int], list[int]] = {}
    taken: dict[tuple[int, int], int] = {}
    for node, L in enumerate(seq_len.tolist()):
        if L >= 0:
            k = taken[L, node // T] = taken.get((L, node // T), -1) + 1
            calls.setdefault((L, k), []).append(node)
    for (L, _), nodes in calls.items():
        group = torch.tensor(nodes, device=logits.device)
        rows = group // T
        ids = torch.zeros(B, L, dtype=torch.long, device=logits.device)
        ids[rows] = sequences.ids(group, L)
        call_scores = torch.zeros(B, V, dtype=scores.dtype, device=logits.device)
        call_scores[rows] = flat[group]
        flat[group] = logits_processor(ids, call_scores)[rows]
    return scores


class _NodeSequences:
    """The `input_ids` row of every node of a verified tree: its row's context, then the tokens on its path below the
    root."""

    def __init__(self, tree: VerifyTree, contexts: list[torch.LongTensor]):
        B, T = tree.input_ids.shape
        device = tree.input_ids.device
        # paths[b, i, k]: the token at depth k on node i's path (k = 0 is the root, already the context's last id).
        slot = torch.where(tree.ancestor_mask(), tree.depths[:, None, :], T)  # [B, T, T]
        self.paths = torch.zeros(B, T, T + 1, dtype=torch.long, device=device)
        self.paths.scatter_(2, slot, tree.input_ids[:, None, :].expand(B, T, T))
        self.context = pad_sequence([c.to(device) for c in contexts], batch_first=True)  # [B, C], right-padded
        self.context_len = torch.tensor([len(c) for c in contexts], device=device)  # [B]
        self.T = T

    def ids(self, nodes: torch.Tensor, length: int) -> torch.LongTensor:
        """`[n, length]` the sequences of `nodes` (`[n]` indices into the flattened `[B * T]` nodes), each `length`
        long."""
        b, i = nodes // self.T, nodes % self.T
        pos = torch.arange(length, device=nodes.device)  # [L]
        n_ctx = self.context_len[b][:, None]  # [n, 1]
        from_context = self.context[b[:, None], pos.clamp(max=self.context.shape[1] - 1)]
        from_path = self.paths[b[:, None], i[:, None], (pos - n_ctx + 1).clamp(min=0, max=self.T)]
        return torch.where(pos < n_ctx, from_context, from_path)  # [n, L]


def _for_rows(logits_processor: lp.LogitsProcessorList, rows: torch.Tensor) -> lp.LogitsProcessorList:
    """The processors as they apply to a group of nodes from batch `rows` (`[n]`): a repetition penalty that skips
    each row's left padding (`generate` gives it a per-row `prompt_ignore_length`) is re-indexed by node."""
    out = lp.LogitsProcessorList()
    for p in logits_processor:
        if isinstance(p, lp.RepetitionPenaltyLogitsProcessor) and isinstance(p.prompt_ignore_length, torch.Tensor):
            p = lp.RepetitionPenaltyLogitsProcessor(p.penalty, prompt_ignore_length=p.prompt_ignore_length.to(rows.device)[rows])
        out.append(p)
    return out
