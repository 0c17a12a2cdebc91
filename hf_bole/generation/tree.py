"""Draft trees (what a drafter proposes) and verify trees (what the target scores in one forward).

Both are batches of rooted trees given by parent pointers in topological order (a parent's index is smaller
than its child's). Every tree quantity is derived from the ancestor mask, `mask[b, i, j]` = node j is node i
or one of its ancestors, so depths, path sums and paths are masked reductions with no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_bole.kernels.tree_gdn.ancestors import duplicate_siblings, tree_ancestor_mask, tree_depths

# Draft log-probabilities are log-softmax outputs; a little slack absorbs rounding of low-precision drafters.
_LOGPROB_SLACK = 1e-3


@dataclass
class DraftTree:
    r"""
    A batch of draft trees, one per request, as a drafter proposes them. The root of each tree (the last
    committed token) is not part of it: nodes with parent `-1` are the root's children.

    Rows may hold different numbers of nodes: a row is padded to the common width `N` with padding nodes,
    which carry `draft_logprobs = -inf` and have no children. Siblings must carry distinct tokens.

    Args:
        tokens (`torch.LongTensor` of shape `(batch_size, N)`):
            The token of every draft node (any value for padding nodes, e.g. 0).
        parents (`torch.LongTensor` of shape `(batch_size, N)`):
            `-1` for a child of the root, else the index of the parent node, which must be smaller than the
            node's own index (topological order).
        draft_logprobs (`torch.FloatTensor` of shape `(batch_size, N)`):
            `log p_draft(node | path to node)`, at most 0; `-inf` marks a padding node. Selection keeps the nodes
            with the largest cumulative draft probability, so only their order matters to it.

    Example:

    ```python
    >>> import torch
    >>> from hf_bole.generation import DraftTree
    >>> # root -> 11 -> 12, root -> 21; the second row has a single node and one padding node
    >>> tree = DraftTree(
    ...     tokens=torch.tensor([[11, 12, 21], [31, 0, 0]]),
    ...     parents=torch.tensor([[-1, 0, -1], [-1, -1, -1]]),
    ...     draft_logprobs=torch.tensor([[-0.1, -0.5, -2.0], [-0.3, float("-inf"), float("-inf")]]),
    ... )
    >>> tree.validate(batch_size=2)
    >>> tree.depths()
    tensor([[0, 1, 0],
            [0, 0, 0]])
    ```
    """

    tokens: torch.LongTensor
    parents: torch.LongTensor
    draft_logprobs: torch.FloatTensor

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        """`N`, the padded number of draft nodes per row (the root not counted)."""
        return self.tokens.shape[1]

    @property
    def node_mask(self) -> torch.BoolTensor:
        """`[B, N]`: True for real nodes, False for padding."""
        return self.draft_logprobs > float("-inf")

    def ancestor_mask(self) -> torch.BoolTensor:
        """`[B, N, N]`: `mask[b, i, j]` is True when draft node j is node i or one of its ancestors (the root is
        not a node here)."""
        return tree_ancestor_mask(self.parents)

    def depths(self) -> torch.LongTensor:
        """`[B, N]`: the number of draft ancestors of every node (0 for a child of the root)."""
        return tree_depths(self.parents)

    def cumulative_logprobs(self) -> torch.FloatTensor:
        """`[B, N]`: `log rho(v)`, the sum of `draft_logprobs` along the path from the root to v (-inf on padding)."""
        return _path_sum(self.ancestor_mask(), self.draft_logprobs)

    def validate(self, batch_size: int, vocab_size: int | None = None, max_depth: int | None = None) -> None:
        """Checks that this is a well-formed batch of `batch_size` draft trees and raises a `ValueError` naming
        the first problem found. It reads tensor values on the host (a device synchronisation), so call it on
        trees from drafters you do not trust, not on the hot path of a captured round.

        Args:
            batch_size (`int`): the number of requests the trees must cover.
            vocab_size (`int`, *optional*): when given, real nodes' tokens must lie in `[0, vocab_size)`.
            max_depth (`int`, *optional*): when given, no real node may lie more than `max_depth` levels below the
                root (the root's children are level 1).
        """
        self.check_layout(batch_size)
        self._check_values(vocab_size, max_depth)

    def check_layout(self, batch_size: int) -> None:
        """The part of `validate` that reads no tensor values: types, dtypes, shapes and devices."""
        fields = {"tokens": self.tokens, "parents": self.parents, "draft_logprobs": self.draft_logprobs}
        for name, x in fields.items():
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"DraftTree.{name} must be a torch.Tensor, got {type(x).__name__}")
        for name in ("tokens", "parents"):
            if fields[name].dtype != torch.long:
                raise ValueError(f"DraftTree.{name} must have dtype torch.long, got {fields[name].dtype}")
        if not self.draft_logprobs.is_floating_point():
            raise ValueError(f"DraftTree.draft_logprobs must be a floating tensor, got {self.draft_logprobs.dtype}")
        for name, x in fields.items():
            if x.dim() != 2 or x.shape[0] != batch_size:
                raise ValueError(
                    f"DraftTree.{name} must have shape [batch_size={batch_size}, N], got {list(x.shape)}"
                )
        if not self.tokens.shape == self.parents.shape == self.draft_logprobs.shape:
            shapes = ", ".join(f"{name} {list(x.shape)}" for name, x in fields.items())
            raise ValueError(f"DraftTree fields must share one shape [batch_size, N], got {shapes}")
        devices = {x.device for x in fields.values()}
        if len(devices) > 1:
            raise ValueError(f"DraftTree fields must be on one device, got {sorted(map(str, devices))}")
        if self.tokens.device.type == "meta":
            raise ValueError("DraftTree fields are on the meta device, which holds no values: make them on a device")

    def _check_values(self, vocab_size: int | None, max_depth: int | None) -> None:
        N = self.num_nodes
        own = torch.arange(N, device=self.parents.device)
        bad = (self.parents < -1) | (self.parents >= own)
        if bad.any():
            b, i = _first(bad)
            raise ValueError(
                f"DraftTree.parents must be -1 (child of the root) or the index of an earlier node, "
                f"got parents[{b}, {i}] = {self.parents[b, i].item()}"
            )
        lp = self.draft_logprobs
        if lp.isnan().any():
            b, i = _first(lp.isnan())
            raise ValueError(f"DraftTree.draft_logprobs holds NaN at [{b}, {i}]")
        if (lp > _LOGPROB_SLACK).any():
            b, i = _first(lp > _LOGPROB_SLACK)
            raise ValueError(
                f"DraftTree.draft_logprobs must be log-probabilities (<= 0), got {lp[b, i].item()} at [{b}, {i}]; "
                f"pass log_softmax outputs, not logits"
            )
        real = self.node_mask
        parent_real = real.gather(1, self.parents.clamp(min=0)) | (self.parents == -1)
        if (real & ~parent_real).any():
            b, i = _first(real & ~parent_real)
            raise ValueError(
                f"DraftTree node [{b}, {i}] is a child of padding node {self.parents[b, i].item()} "
                f"(draft_logprobs = -inf marks padding, which must have no children)"
            )
        if vocab_size is not None:
            out = real & ((self.tokens < 0) | (self.tokens >= vocab_size))
            if out.any():
                b, i = _first(out)
                token = self.tokens[b, i].item()
                raise ValueError(f"DraftTree.tokens[{b}, {i}] = {token} is outside the vocabulary [0, {vocab_size})")
        dup = duplicate_siblings(self.tokens, self.parents, real)
        if dup.any():
            b, i = _first(dup)
            raise ValueError(
                f"DraftTree node [{b}, {i}] repeats the token {self.tokens[b, i].item()} of an earlier sibling; "
                f"siblings must carry distinct tokens"
            )
        if max_depth is not None:
            deep = real & (self.depths() >= max_depth)
            if deep.any():
                b, i = _first(deep)
                raise ValueError(
                    f"DraftTree node [{b}, {i}] lies {int(self.depths()[b, i]) + 1} levels below the root, deeper than "
                    f"the drafter's max_depth = {max_depth}"
                )

    def made_safe(self, vocab_size: int, max_depth: int) -> DraftTree:
        """This tree with every value the verifier could trip over replaced, reading nothing on the host: tokens
        clamped into `[0, vocab_size)`, parents that are not earlier nodes made children of the root, and nodes
        deeper than `max_depth` levels, or with NaN or positive log-probabilities, turned into padding. The decoding
        loop verifies this while `validate` checks the original a round later on a host copy."""
        own = torch.arange(self.num_nodes, device=self.parents.device)
        parents = torch.where((self.parents >= -1) & (self.parents < own), self.parents, -1)
        safe = DraftTree(self.tokens.clamp(0, vocab_size - 1), parents, self.draft_logprobs)
        lp = self.draft_logprobs
        keep = (safe.depths() < max_depth) & ~lp.isnan() & (lp <= _LOGPROB_SLACK)
        # a node under padding is padding too: its path's log-probability sums to -inf either way
        safe.draft_logprobs = torch.where(keep, lp, float("-inf"))
        return safe


@dataclass
class VerifyTree:
    r"""
    The trees the target scores in one forward: per request, the root (node 0, the last committed token, whose
    logits predict the first new token) followed by the selected draft nodes, padded to a common width `T = 1 + M`.
    Real nodes come first in every row and are in topological order. Padding nodes have parent `-1`, depth 0 and
    token 0; `node_mask` tells them apart (treat their outputs as garbage).

    Args:
        input_ids (`torch.LongTensor` of shape `(batch_size, T)`): node tokens, the root token at index 0.
        parents (`torch.LongTensor` of shape `(batch_size, T)`): index of the parent in this tree, `-1` for the
            root and for padding.
        depths (`torch.LongTensor` of shape `(batch_size, T)`): 0 for the root, 1 for its children, ...
        draft_index (`torch.LongTensor` of shape `(batch_size, T)`): the `DraftTree` node each came from, `-1` for
            the root and padding.
        node_mask (`torch.BoolTensor` of shape `(batch_size, T)`): True for the root and the selected nodes.
        num_nodes (`torch.LongTensor` of shape `(batch_size,)`): real nodes per row, the root included.
        draft_log_rho (`torch.FloatTensor` of shape `(batch_size, N)`, *optional*): `log rho` of every node of the
            `DraftTree` these were selected from, the key `select_nodes` ranked them by (`-inf` on padding).
    """

    input_ids: torch.LongTensor
    parents: torch.LongTensor
    depths: torch.LongTensor
    draft_index: torch.LongTensor
    node_mask: torch.BoolTensor
    num_nodes: torch.LongTensor
    draft_log_rho: torch.FloatTensor | None = None

    def ancestor_mask(self) -> torch.BoolTensor:
        """`[B, T, T]`: `mask[b, i, j]` is True when node j is node i or one of its ancestors; the tree-attention
        mask of the verify forward over the tree part (padding nodes see only themselves)."""
        return tree_ancestor_mask(self.parents)

    def narrowed(self, width: int) -> VerifyTree:
        """The same trees in the first `width` columns, which must hold every row's real nodes
        (`width >= num_nodes.max()`): real nodes come first, so only padding is dropped."""
        return VerifyTree(*(x[:, :width] for x in (self.input_ids, self.parents, self.depths, self.draft_index,
                                                    self.node_mask)), self.num_nodes, self.draft_log_rho)

    def position_ids(self, past_lengths: torch.LongTensor) -> torch.LongTensor:
        """`[B, T]` position ids of the nodes, given `past_lengths [B]`, the number of committed tokens before the
        root (the root sits at position `past_lengths`, a node at depth d at `past_lengths + d`)."""
        return past_lengths[:, None] + self.depths


def _path_sum(ancestors: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`[B, N]`: the sum of `values` over every node and its ancestors."""
    return torch.where(ancestors, values[:, None, :], 0).sum(-1)


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(mask.nonzero()[0].tolist())
