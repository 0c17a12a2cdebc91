"""The small-model drafter: a causal LM sharing the target's tokenizer grows a top-k tree each round
(`generate(..., assistant_model=small)`, or `bole_drafter=small`).

Every call does two things, all rows of the batch at once:

1. extend: each row's tokens committed since the last call (the whole prompt at the first call; then the accepted
   path's tokens and the bonus token, the new root last) enter the drafter's state as chains of at most `MAX_TREE_NODES`
   nodes, each committed whole (`DraftModelTrees`: a transformer's per-row KV, or a hybrid GDN model's `BoleCache`).
   The drafter's logits after the root give the root's children.
2. draft: the tree grows one depth per forward of the drafter, as the MTP drafter grows it: the `topk` best nodes of
   the deepest level (by cumulative draft probability, the frontier) each get their `topk` likeliest children. Each
   forward runs the drafter over the frontiers drafted so far, a tree hanging from the committed state (`topk` nodes
   a level); nothing of it is committed, so the drafter's state is rolled back to the committed tokens for free, and
   the next call brings the accepted ones in.

Of the `topk + (depth - 1) * topk**2` drafted nodes the best `max_nodes` by cumulative draft probability are returned.
The drafter only proposes: the target's verify forward decides, so greedy output is plain greedy decoding's and
sampling keeps the target's distribution whatever the drafter is.

How it differs from transformers' assisted decoding (`AssistedCandidateGenerator`): one chain of
`num_assistant_tokens` drafter steps per round, batch 1, and (5.25) the target's GDN states rolled back from a recorded
history; here a tree per row under the round's budget, any batch, each row at its own length.
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedModel

from hf_bole.generation.drafters.base import DraftContext
from hf_bole.generation.drafters.topk_tree import TopkLevels
from hf_bole.generation.drafters.model_trees import DraftModelTrees, check_draft_model
from hf_bole.generation.tree import DraftTree
from hf_bole.kernels.topk import MAX_K, naive_row_topk, row_topk
from hf_bole.kernels.utils import MAX_TREE_NODES


class ModelDrafter:
    r"""
    Drafts token trees with a small causal LM that shares the target's tokenizer, keeping its own state of the
    committed tokens across rounds (see the module docstring).

    Args:
        drafter (`PreTrainedModel`):
            The small model: a decoder-only transformer whose layers are all full attention (a tiny Llama, Qwen2,
            Qwen3) or a hybrid GDN model of a supported family (a small Qwen3.5), with attention "sdpa" or "eager".
        target (`PreTrainedModel`):
            The model it drafts for; its vocabulary must be the drafter's.
        depth (`int`):
            The deepest level drafted (1 = the root's children only): `depth` drafter forwards a round after the
            extension.
        topk (`int`):
            Children per expanded node, and nodes expanded per level.

    Reads `ctx.sequences` (each row's committed ids), so the loop runs its rounds one after the other, not pipelined.

    Example:
        ```python
        >>> out = model.generate(input_ids, custom_generate="hf_bole", assistant_model=small, max_new_tokens=64)
        ```
    """

    def __init__(self, drafter: PreTrainedModel, target: PreTrainedModel, *, depth: int, topk: int):
        check_draft_model(drafter)
        vocab = drafter.get_output_embeddings().weight.shape[0]
        target_vocab = target.get_output_embeddings().weight.shape[0]
        if vocab != target_vocab:
            raise ValueError(
                f"the drafter {type(drafter).__name__} predicts {vocab} tokens and the target {target_vocab}: a "
                f"small-model drafter must share the target's tokenizer and vocabulary (token ids are passed as they "
                f"are); pick a drafter of the target's family and vocabulary size"
            )
        if depth < 1 or topk < 1 or topk > vocab:
            raise ValueError(f"the small-model drafter needs depth >= 1 and 1 <= topk <= {vocab}, got {depth}, {topk}")
        if topk * (depth - 1) > MAX_TREE_NODES:
            raise ValueError(
                f"the small-model drafter runs its deepest level's forward over topk * (depth - 1) = {topk * (depth - 1)} "
                f"nodes, at most {MAX_TREE_NODES}: lower bole_topk or bole_depth"
            )
        self.drafter, self.depth, self.topk = drafter, depth, topk
        self._trees: DraftModelTrees | None = None
        self._committed: list[int] = []  # tokens of each row in the drafter's state
        self._root: torch.Tensor | None = None  # [B, vocab] the drafter's logits after each row's root

    @property
    def max_tree_nodes(self) -> int:
        """The number of nodes drafted per row before capping: `topk + (depth - 1) * topk**2`."""
        return self.topk + (self.depth - 1) * self.topk**2

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        """Extends the drafter's state by each row's tokens committed since the last call, then drafts a tree from each
        row's root.

        Returns:
            `DraftTree` with `min(max_tree_nodes, ctx.max_nodes)` nodes per row, on the device of `ctx.sequences`, in
            descending order of cumulative draft probability; a row with no tokens yet gets a meaningless tree.
        """
        if ctx.sequences is None:
            raise ValueError("ModelDrafter reads DraftContext.sequences, the committed ids of every row")
        device = ctx.sequences[0].device
        rows = [seq.to(self._device) for seq in ctx.sequences]
        B = len(rows)
        if self._trees is None or self._trees.batch_size != B or any(len(r) < n for r, n in zip(rows, self._committed)):
            self._trees, self._committed = DraftModelTrees(self.drafter, B), [0] * B
            self._root = None
        self._extend([r[n:] for r, n in zip(rows, self._committed)])
        self._committed = [len(r) for r in rows]
        num_nodes = min(self.max_tree_nodes, ctx.max_nodes)
        return DraftTree(*(x.to(device) for x in self._draft(self._root, num_nodes)))

    @property
    def _device(self) -> torch.device:
        return self.drafter.get_input_embeddings().weight.device

    def _extend(self, new: list[torch.Tensor]) -> None:
        """Commits each row's `new` tokens as chains of at most `MAX_TREE_NODES`, and keeps the logits after each row's
        last one in `_root`."""
        B, device = len(new), self._device
        counts = torch.tensor([len(x) for x in new], device=device)  # [B]
        longest = max(len(x) for x in new)
        for start in range(0, longest, MAX_TREE_NODES):
            width = min(MAX_TREE_NODES, longest - start)
            tokens = pad_sequence([x[start : start + width] for x in new], batch_first=True)  # [B, width]
            steps = torch.arange(width, device=device)
            real = steps < (counts - start)[:, None]  # [B, width] the row's tokens in this chunk
            parents = torch.where(real, steps - 1, -1)  # a chain; padding nodes hang from the committed state
            logits = self._trees.logits(tokens, parents)  # [B, width, vocab]
            self._trees.commit(torch.where(real, steps, -1))
            last = real.sum(1) - 1  # [B] the row's last token in this chunk
            at_last = (last >= 0) & (start + last + 1 == counts)
            root = logits[torch.arange(B, device=device), last.clamp(min=0)].float()  # [B, vocab]
            self._root = root if self._root is None else torch.where(at_last[:, None], root, self._root)

    def _best(self, x: torch.Tensor, log_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The `topk` largest of every row of `x [..., n]` (of its log-softmax with `log_softmax`): values float32,
        indices, each `[..., topk]`, descending."""
        return (naive_row_topk if self.topk > MAX_K else row_topk)(x, self.topk, log_softmax)

    def _draft(self, root: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Grows the tree level by level from the logits after the roots `root [B, vocab]`, then keeps the best
        `num_nodes`: their tokens, parents and draft log-probabilities, each `[B, num_nodes]`."""
        K = self.topk
        B, device = root.shape[0], root.device
        levels = TopkLevels(*self._best(root, log_softmax=True))  # the root's children, [B, K]
        # The drafter's forwards run the frontiers drafted so far: `fed` tokens, their parents among them (-1: a child
        # of the root, the last committed token), each level's frontier `K` more.
        fed_tokens, fed_parents = levels.tokens[0], torch.full_like(levels.tokens[0], -1)
        frontier_fed = torch.arange(K, device=device).expand(B, -1)  # [B, K] the frontier among the fed nodes
        for d in range(1, self.depth):
            logits = self._trees.logits(fed_tokens, fed_parents)  # [B, K * d, vocab]
            out = logits.gather(1, frontier_fed[..., None].expand(-1, -1, logits.shape[-1]))  # [B, K, vocab]
            levels.add(*self._best(out, log_softmax=True))  # [B, K, K]
            if d + 1 < self.depth:
                chosen = levels.advance(self._best)  # [B, K] among the level's K*K children
                fed_tokens = torch.cat([fed_tokens, levels.tokens[-1].gather(1, chosen)], dim=1)
                fed_parents = torch.cat([fed_parents, frontier_fed.gather(1, chosen // K)], dim=1)
                frontier_fed = K * d + torch.arange(K, device=device).expand(B, -1)
        return levels.best_nodes(num_nodes)
