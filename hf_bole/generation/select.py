"""Step 2 of a round, select: which draft nodes the target verifies (DESIGN.md §3 step 2, §5), batch-shared under the
round's budget, laid out as verify trees of a width chosen on the host from the budget alone.

The rule and its reference are `hf_bole.kernels.naive_tree_select_nodes`; the round selects with the one-launch
kernel (`tree_select_nodes`) wherever the batch's draft nodes fit its program, replayed from a CUDA graph per tree
shape and budget with `bole_cuda_graphs` (`SelectGraphs`).
"""

from __future__ import annotations

import weakref

import torch
from transformers.utils import logging

from hf_bole.generation import graphs
from hf_bole.generation.tree import DraftTree, VerifyTree
from hf_bole.kernels import naive_tree_select_nodes, tree_select_nodes
from hf_bole.kernels.tree_select import MAX_ROUND_NODES
from hf_bole.kernels.utils import MAX_TREE_NODES

logger = logging.get_logger(__name__)

# The widths (root included) a row's tree is selected into and verified at: one CUDA graph each, the widest the tree
# kernels' limit. Padding nodes are children of the committed state and are never accepted. 1: the roots alone (a
# round of budget 0, plain decoding); 2: one draft node a row, the floor of selection, where a large batch's forward
# is compute-bound and every column costs.
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, MAX_TREE_NODES)


def select_nodes(tree: DraftTree, root_tokens: torch.LongTensor, budget: int, max_nodes_per_row: int) -> VerifyTree:
    r"""
    Keeps the draft nodes with the highest cumulative draft probability `rho(v) = prod p_draft` along the path,
    across the whole batch, and lays them out as verify trees (`hf_bole.kernels.naive_tree_select_nodes`, whose
    rules these are: every row with a draft keeps its best root child, no row more than `max_nodes_per_row`, the rest
    of the budget to the best nodes of the batch; every row's kept set is prefix-connected).

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
    return VerifyTree(
        *naive_tree_select_nodes(tree.tokens, tree.parents, tree.draft_logprobs, root_tokens, budget, max_nodes_per_row)
    )


def select_round(
    tree: DraftTree,
    root_tokens: torch.LongTensor,
    budget: int,
    max_nodes_per_row: int,
    active: torch.BoolTensor | None = None,
    safe: tuple[int, int] | None = None,
) -> VerifyTree:
    """The decoding loop's selection: `tree_select_nodes` where the batch's `B * N` draft nodes fit its one program
    (`MAX_ROUND_NODES`), else the reference (about 80 small kernels), said once in a warning; of the tree
    `prepared_tree(tree, active, safe)`, so that a replayed selection (`SelectGraphs`) replays that too."""
    tree = prepared_tree(tree, active, safe)
    select = tree_select_nodes
    if tree.tokens.numel() > MAX_ROUND_NODES:
        logger.warning_once(
            f"hf_bole: this batch drafts {tree.tokens.shape[0]} x {tree.tokens.shape[1]} nodes, more than the "
            f"{MAX_ROUND_NODES} the one-launch selection kernel holds; node selection runs as small kernels "
            f"instead (slower by a fraction of a millisecond a round). Fewer rows per call or a smaller draft tree "
            f"(bole_topk, bole_depth) keep it in one launch"
        )
        select = naive_tree_select_nodes
    return VerifyTree(*select(tree.tokens, tree.parents, tree.draft_logprobs, root_tokens, budget, max_nodes_per_row))


def prepared_tree(
    tree: DraftTree, active: torch.BoolTensor | None = None, safe: tuple[int, int] | None = None
) -> DraftTree:
    """What the loop selects from: with `safe = (vocab_size, max_depth)`, a custom drafter's tree made safe to verify
    (`DraftTree.made_safe`: about 15 small kernels); with `active` (`[B]` bool), the drafts of rows that are done
    turned into padding (they verify their root only and take none of the budget)."""
    if safe is not None:
        tree = tree.made_safe(*safe)
    if active is not None:
        tree = DraftTree(tree.tokens, tree.parents, torch.where(active[:, None], tree.draft_logprobs, float("-inf")))
    return tree


def width_bucket(width: int, max_width: int) -> int:
    """The width a tree of `width` nodes is verified at: the next bucket, at most `max_width` (the padded width
    selection gives every row)."""
    return min(next((b for b in WIDTH_BUCKETS if b >= width), max_width), max_width)


def row_width(budget: int, rows: int, max_width: int) -> int:
    """The width (root included) each row's tree is selected into and verified at, from the round's budget alone:
    the smallest bucket (`width_bucket`) whose `rows` rows hold the whole budget, at most `max_width`; 1 (the roots
    alone) for a budget of 0.

    Decided on the host before selection, so no round waits for the device to learn how wide its trees came out (the
    cut to the widest row kept that it replaces was such a read); selection caps every row there, and the forward
    runs at that width, a CUDA graph's. A cap costs a row nodes only where the batch-shared budget would pile more than
    its even share onto it, and then the tree keeps most of its accepted tokens while its forward runs narrower.
    """
    if budget == 0:
        return 1
    return width_bucket(-(-budget // max(rows, 1)) + 1, max_width)


def roots_only(root: torch.Tensor) -> VerifyTree:
    """The trees of a round that verifies no draft (budget 0): every row's root alone, `[B, 1]`."""
    zeros = torch.zeros(root.shape[0], 1, dtype=torch.long, device=root.device)
    return VerifyTree(
        input_ids=root[:, None].clone(), parents=zeros - 1, depths=zeros, draft_index=zeros - 1,
        node_mask=torch.ones_like(zeros, dtype=torch.bool), num_nodes=zeros[:, 0] + 1,
    )  # fmt: skip


class Select:
    """Step 2 as the loop calls it: `select(drafted, root, budget, cap, active)`, each active row capped at `cap`
    draft nodes (`cap(budget, rows)`: its forward's width, `row_width`, less the root), through `select_round` or its
    graphs (`SelectGraphs`), chosen once per call. A budget of 0 verifies the roots alone (`roots`: `roots_only`, or
    the graphs' kept buffer of it): no selection runs."""

    def __init__(self, select, max_nodes_per_row: int, roots=roots_only):
        self.select, self.max_nodes_per_row, self.roots = select, max_nodes_per_row, roots

    def cap(self, budget: int, rows: int) -> int:
        """The most draft nodes a row keeps in a round of `budget` nodes over `rows` active rows (0 for budget 0),
        decided on the host before the round is drafted: the drafter need not draft deeper."""
        return row_width(budget, rows, self.max_nodes_per_row + 1) - 1

    def __call__(self, drafted, root: torch.Tensor, budget: int, cap: int, active: torch.Tensor) -> VerifyTree:
        if budget == 0:
            return self.roots(root)
        return self.select(drafted.tree, root, budget, cap, active, drafted.safe)


class SelectGraphs:
    """`select_round(tree, root_tokens, budget, max_nodes_per_row, active, safe)` replayed from a CUDA graph per
    (tree shape, budget, cap, safe): one kernel, or the reference's hundred small ops past the kernel's size, with
    the tree's preparation (`prepared_tree`) and the copies of the round's tree into the graph's inputs, launched
    while the GPU waits for the round's tree. Returns the graph's buffers, valid until the next call."""

    def __init__(self):
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], VerifyTree]] = {}
        self._pool = None
        self._roots: dict[tuple, VerifyTree] = {}  # (batch size, device) -> `roots_only`'s trees, kept

    def roots_only(self, root: torch.Tensor) -> VerifyTree:
        """`roots_only(root)` in a buffer kept across calls, its root column refilled: the graphs that read a round's
        trees where they are (the greedy tail's, keyed by their addresses) find the same ones every round and call."""
        key = (root.shape[0], root.device)
        if key not in self._roots:
            self._roots[key] = roots_only(root)
        trees = self._roots[key]
        trees.input_ids.copy_(root[:, None])
        return trees

    def __call__(
        self,
        tree: DraftTree,
        root_tokens: torch.Tensor,
        budget: int,
        max_nodes_per_row: int,
        active: torch.Tensor | None = None,
        safe: tuple[int, int] | None = None,
    ) -> VerifyTree:
        inputs = (tree.tokens, tree.parents, tree.draft_logprobs, root_tokens, *([] if active is None else [active]))
        key = (tuple(tree.tokens.shape), tree.draft_logprobs.dtype, budget, max_nodes_per_row, active is None, safe)
        if key not in self._graphs:
            static = tuple(x.clone() for x in inputs)

            def run() -> VerifyTree:
                tree, roots = DraftTree(*static[:3]), static[3]
                return select_round(tree, roots, budget, max_nodes_per_row, *static[4:], safe=safe)

            graph, out = graphs.capture(run, root_tokens.device, self._pool)
            self._pool = graph.pool()
            self._graphs[key] = (graph, static, out)
        graph, static, out = self._graphs[key]
        for buffer, value in zip(static, inputs):
            buffer.copy_(value)
        graph.replay()
        return out


# model -> its `SelectGraphs`, kept across `generate` calls like its verify graphs.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graphed_select(model) -> SelectGraphs:
    """The selection graphs of `model`'s `generate` calls, kept across calls like its verify graphs."""
    if model not in _KEPT:
        _KEPT[model] = SelectGraphs()
    return _KEPT[model]


def drop_select_graphs(model) -> None:
    """Forgets the selection graphs kept for `model` (`hf_bole.release`)."""
    _KEPT.pop(model, None)
