"""DraftTree: validation errors, depths, cumulative log-probabilities; VerifyTree positions."""

from __future__ import annotations

import pytest
import torch

from hf_bole.generation import DraftTree, VerifyTree, select_nodes

INF = float("-inf")


def _tree(tokens, parents, logprobs) -> DraftTree:
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        draft_logprobs=torch.tensor(logprobs, dtype=torch.float32),
    )


def _good() -> DraftTree:
    # row 0: root -> 10 -> 11, root -> 20; row 1: root -> 30, then padding
    return _tree([[10, 11, 20], [30, 0, 0]], [[-1, 0, -1], [-1, -1, -1]], [[-0.5, -1.0, -2.0], [-0.1, INF, INF]])


def test_validate_accepts_good_tree():
    _good().validate(batch_size=2, vocab_size=64)


def test_validate_accepts_empty_tree():
    _tree([[], []], [[], []], [[], []]).validate(batch_size=2)


@pytest.mark.parametrize(
    "change, message",
    [
        pytest.param(lambda t: setattr(t, "tokens", t.tokens.int()), "tokens must have dtype torch.long", id="dtype"),
        pytest.param(lambda t: setattr(t, "draft_logprobs", t.tokens.clone()), "floating", id="logprob-dtype"),
        pytest.param(lambda t: setattr(t, "parents", t.parents[:, :2]), "share one shape", id="shape"),
        pytest.param(lambda t: setattr(t, "tokens", t.tokens[0]), "tokens must have shape", id="rank"),
        pytest.param(lambda t: setattr(t, "tokens", [[1]]), "must be a torch.Tensor", id="type"),
        pytest.param(lambda t: t.parents.__setitem__((0, 1), 1), r"parents\[0, 1\] = 1", id="self-parent"),
        pytest.param(lambda t: t.parents.__setitem__((0, 0), 2), r"parents\[0, 0\] = 2", id="not-topological"),
        pytest.param(lambda t: t.parents.__setitem__((0, 2), -2), r"parents\[0, 2\] = -2", id="below-minus-one"),
        pytest.param(lambda t: t.draft_logprobs.__setitem__((1, 0), float("nan")), r"NaN at \[1, 0\]", id="nan"),
        pytest.param(lambda t: t.draft_logprobs.__setitem__((0, 2), 3.0), "not logits", id="positive"),
        pytest.param(lambda t: t.draft_logprobs.__setitem__((0, 0), INF), "child of padding node 0", id="pad-parent"),
        pytest.param(lambda t: t.tokens.__setitem__((0, 2), 10), "repeats the token 10", id="dup-sibling"),
        pytest.param(lambda t: t.tokens.__setitem__((0, 1), 64), "outside the vocabulary", id="vocab"),
        pytest.param(
            lambda t: [setattr(t, n, getattr(t, n).to("meta")) for n in ("tokens", "parents", "draft_logprobs")],
            "on the meta device",
            id="meta",
        ),
    ],
)
def test_validate_errors(change, message):
    tree = _good()
    change(tree)
    with pytest.raises(ValueError, match=message):
        tree.validate(batch_size=2, vocab_size=64)


def test_validate_wrong_batch_size():
    with pytest.raises(ValueError, match=r"batch_size=3"):
        _good().validate(batch_size=3)


def test_depths_and_cumulative_logprobs():
    tree = _good()
    # row 0: 10 at depth 0, 11 at depth 1 under it, 20 at depth 0; log rho sums along the path
    assert tree.depths().tolist() == [[0, 1, 0], [0, 0, 0]]
    expected = torch.tensor([[-0.5, -1.5, -2.0], [-0.1, INF, INF]])
    torch.testing.assert_close(tree.cumulative_logprobs(), expected)
    assert tree.node_mask.tolist() == [[True, True, True], [True, False, False]]


def test_verify_tree_position_ids():
    tree = VerifyTree(
        input_ids=torch.tensor([[5, 6, 7, 0]]),
        parents=torch.tensor([[-1, 0, 1, -1]]),
        depths=torch.tensor([[0, 1, 2, 0]]),
        draft_index=torch.tensor([[-1, 0, 1, -1]]),
        node_mask=torch.tensor([[True, True, True, False]]),
        num_nodes=torch.tensor([3]),
    )
    # 10 committed tokens before the root: root at 10, its child at 11, grandchild at 12
    assert tree.position_ids(torch.tensor([10])).tolist() == [[10, 11, 12, 10]]
    assert tree.ancestor_mask()[0, 2].tolist() == [True, True, True, False]


def test_verify_tree_narrowed_drops_only_padding():
    tree = select_nodes(
        DraftTree(
            tokens=torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]),
            parents=torch.tensor([[-1, 0, 1, -1], [-1, 0, 0, 0]]),
            draft_logprobs=torch.tensor([[-0.1, -0.2, -0.3, -5.0], [-3.0, -4.0, -4.5, -6.0]]),
        ),
        root_tokens=torch.tensor([9, 9]),
        budget=4,
        max_nodes_per_row=4,
    )
    assert tree.input_ids.shape[1] == 5 and tree.num_nodes.tolist() == [4, 2]
    narrow = tree.narrowed(int(tree.num_nodes.max()))
    assert narrow.input_ids.shape == (2, 4)
    for name in ("input_ids", "parents", "depths", "draft_index", "node_mask"):
        assert torch.equal(getattr(narrow, name), getattr(tree, name)[:, :4]), name
    assert not tree.node_mask[:, 4:].any() and torch.equal(narrow.num_nodes, tree.num_nodes)
