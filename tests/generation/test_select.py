"""Step 2, select (`hf_bole.generation.select`): `select_nodes`, batch-shared top-rho selection with the root-child
floor, a per-row cap and an exact budget; the rows' widths from the budget; selection replayed from graphs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import hf_bole
from hf_bole.generation import DraftTree, select_nodes
from hf_bole.generation import graphs as graphs_module
from hf_bole.generation.budget import synthetic_draft_tree
from hf_bole.generation.select import (
    WIDTH_BUCKETS,
    Select,
    SelectGraphs,
    prepared_tree,
    row_width,
    width_bucket,
)
from tests.generation.recorded_graph import recording_capture

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
INF = float("-inf")


def _tree(tokens, parents, probs) -> DraftTree:
    """Draft probabilities are given as probabilities (0 = padding) for readability."""
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        draft_logprobs=torch.tensor(probs, dtype=torch.float32).log(),
    )


def _kept(vt) -> list[set[int]]:
    """Per row, the draft indices that were selected."""
    return [{i for i in row if i >= 0} for row in vt.draft_index.tolist()]


def _check_structure(vt, tree: DraftTree, roots: torch.Tensor):
    """Invariants of any VerifyTree built from `tree`."""
    B, T = vt.input_ids.shape
    assert vt.input_ids[:, 0].tolist() == roots.tolist()
    assert vt.parents[:, 0].tolist() == [-1] * B and vt.depths[:, 0].tolist() == [0] * B
    for b in range(B):
        n = vt.num_nodes[b].item()
        assert vt.node_mask[b].tolist() == [True] * n + [False] * (T - n)  # real nodes first
        draft_depth = tree.depths()[b]
        for i in range(1, n):
            d = vt.draft_index[b, i].item()
            p = vt.parents[b, i].item()
            assert 0 <= p < i  # topological, inside the real part
            assert vt.input_ids[b, i] == tree.tokens[b, d]
            assert vt.depths[b, i] == draft_depth[d] + 1 == vt.depths[b, p] + 1
            draft_parent = tree.parents[b, d].item()
            assert (p == 0) if draft_parent < 0 else (vt.draft_index[b, p] == draft_parent)
        for i in range(n, T):
            assert vt.parents[b, i] == -1 and vt.draft_index[b, i] == -1 and vt.depths[b, i] == 0


def test_select_budget_across_batch():
    # row 0: a=0.9 (tok 1), a->b: 0.9*0.8=0.72 (tok 2), c=0.05 (tok 3)
    # row 1: d=0.4 (tok 4), d->e: 0.4*0.5=0.2 (tok 5)
    tree = _tree([[1, 2, 3], [4, 5, 0]], [[-1, 0, -1], [-1, 0, -1]], [[0.9, 0.8, 0.05], [0.4, 0.5, 0.0]])
    roots = torch.tensor([7, 8])
    # budget 3: floors a and d, then the best remaining is b (0.72 > 0.2 > 0.05)
    vt = select_nodes(tree, roots, budget=3, max_nodes_per_row=127)
    assert _kept(vt) == [{0, 1}, {0}]
    # width 1 + min(cap, budget, N) = 4: a row could have taken all 3 slots
    assert vt.input_ids.tolist() == [[7, 1, 2, 0], [8, 4, 0, 0]]
    assert vt.parents.tolist() == [[-1, 0, 1, -1], [-1, 0, -1, -1]]
    assert vt.depths.tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]
    assert vt.num_nodes.tolist() == [3, 2]
    _check_structure(vt, tree, roots)
    # budget 4 adds e (0.2); budget 5 adds c (0.05); budget 9 cannot add the padding node
    assert _kept(select_nodes(tree, roots, budget=4, max_nodes_per_row=127)) == [{0, 1}, {0, 1}]
    assert _kept(select_nodes(tree, roots, budget=5, max_nodes_per_row=127)) == [{0, 1, 2}, {0, 1}]
    vt = select_nodes(tree, roots, budget=9, max_nodes_per_row=127)
    assert _kept(vt) == [{0, 1, 2}, {0, 1}] and vt.input_ids.shape == (2, 4)


def test_select_floor_beats_better_nodes_of_other_rows():
    # row 0 has strong nodes (0.9, 0.9*0.9, 0.9^3); row 1 only a weak one (0.01)
    tree = _tree([[1, 2, 3], [4, 0, 0]], [[-1, 0, 1], [-1, -1, -1]], [[0.9, 0.9, 0.9], [0.01, 0.0, 0.0]])
    roots = torch.tensor([0, 0])
    # budget 2: the floor takes 1 node per row, leaving nothing extra
    assert _kept(select_nodes(tree, roots, budget=2, max_nodes_per_row=127)) == [{0}, {0}]
    # budget 1 < rows with drafts: the floor still wins, both rows keep one node
    vt = select_nodes(tree, roots, budget=1, max_nodes_per_row=127)
    assert _kept(vt) == [{0}, {0}] and vt.input_ids.shape == (2, 2)
    # budget 0: likewise (M is at least 1 so the floor fits)
    assert _kept(select_nodes(tree, roots, budget=0, max_nodes_per_row=127)) == [{0}, {0}]


def test_select_cap_per_row():
    # row 0: a chain of 4 strong nodes; row 1: one weak node and a second weaker root child
    tree = _tree(
        [[1, 2, 3, 4], [5, 6, 0, 0]],
        [[-1, 0, 1, 2], [-1, -1, -1, -1]],
        [[0.99, 0.99, 0.99, 0.99], [0.3, 0.2, 0.0, 0.0]],
    )
    roots = torch.tensor([0, 0])
    # cap 2: row 0 stops at 2 nodes even though its 3rd (0.97) beats row 1's 0.2; the budget of 4 is then
    # filled by row 1's second node, and the total is 2 + 2 = 4
    vt = select_nodes(tree, roots, budget=4, max_nodes_per_row=2)
    assert _kept(vt) == [{0, 1}, {0, 1}] and vt.input_ids.shape == (2, 3)
    # cap 2, budget 10: only 4 nodes are available under the cap
    assert select_nodes(tree, roots, budget=10, max_nodes_per_row=2).num_nodes.tolist() == [3, 3]


def test_select_ties_shallower_first():
    # a=0.5 (tok 1) with child a->b of draft prob 1 (rho 0.5, tok 2); c=0.5 (tok 3) another root child
    tree = _tree([[1, 2, 3]], [[-1, 0, -1]], [[0.5, 1.0, 0.5]])
    # budget 2: a by the floor (index breaks the tie with c), then c (depth 0) before b (depth 1)
    vt = select_nodes(tree, torch.tensor([0]), budget=2, max_nodes_per_row=127)
    assert _kept(vt) == [{0, 2}]
    assert vt.parents.tolist() == [[-1, 0, 0]]


def test_select_ties_never_break_prefix_connectedness():
    # a chain whose draft probabilities are all 1: every node ties with its parent; a budget of 2 must take
    # the first two levels, never a node without its parent
    tree = _tree([[1, 2, 3, 4]], [[-1, 0, 1, 2]], [[1.0, 1.0, 1.0, 1.0]])
    vt = select_nodes(tree, torch.tensor([0]), budget=2, max_nodes_per_row=127)
    assert _kept(vt) == [{0, 1}]
    # nodes listed child-before-parent in index order are not allowed, but a later parent index is fine:
    # root -> x(index 0) ; root -> y(index 1) -> z(index 2) with z tied to everything: z needs y first
    tree = _tree([[1, 2, 3]], [[-1, -1, 1]], [[0.5, 0.5, 1.0]])
    assert _kept(select_nodes(tree, torch.tensor([0]), budget=2, max_nodes_per_row=127)) == [{0, 1}]


def test_select_positive_logprobs_stay_prefix_connected():
    # Not a valid DraftTree (log-probabilities > 0) but selection must still never orphan a node:
    # a=0.1 (tok 1), a->b with "prob" 50 (rho 5.0), c=0.2 (tok 3). By path-min b ranks with a (0.1).
    tree = _tree([[1, 2, 3]], [[-1, 0, -1]], [[0.1, 50.0, 0.2]])
    vt = select_nodes(tree, torch.tensor([0]), budget=2, max_nodes_per_row=127)
    assert _kept(vt) == [{2, 0}]  # c (0.2) by the floor, then a (0.1), tie with b broken shallower-first


def test_select_padding_and_empty_rows():
    # row 0 all padding; row 1 real nodes after a padding slot is not allowed, so padding sits at the end
    tree = _tree([[0, 0], [5, 6]], [[-1, -1], [-1, 0]], [[0.0, 0.0], [0.5, 0.5]])
    roots = torch.tensor([1, 2])
    vt = select_nodes(tree, roots, budget=8, max_nodes_per_row=127)
    assert _kept(vt) == [set(), {0, 1}]
    assert vt.num_nodes.tolist() == [1, 3]
    assert vt.node_mask.tolist() == [[True, False, False], [True, True, True]]
    _check_structure(vt, tree, roots)


def test_select_zero_width_tree():
    tree = _tree([[], []], [[], []], [[], []])
    vt = select_nodes(tree, torch.tensor([3, 4]), budget=8, max_nodes_per_row=127)
    assert vt.input_ids.tolist() == [[3], [4]] and vt.num_nodes.tolist() == [1, 1]


def _reference(tree: DraftTree, budget: int, cap: int) -> list[set[int]]:
    """The selection rules written out with loops."""
    B, N = tree.tokens.shape
    log_rho = tree.cumulative_logprobs().tolist()
    depth = tree.depths().tolist()
    parents = tree.parents.tolist()

    def key(b, i):  # min of log rho on the path, then shallower, then row, then index
        k, j = log_rho[b][i], i
        while j >= 0:
            k, j = min(k, log_rho[b][j]), parents[b][j]
        return (-k, depth[b][i], b, i)

    real = [[i for i in range(N) if log_rho[b][i] > -math.inf] for b in range(B)]
    rows = [sorted(real[b], key=lambda i: key(b, i)) for b in range(B)]
    kept = [set(r[:1]) for r in rows]
    left = budget - sum(len(k) for k in kept)
    pool = sorted(((b, i) for b in range(B) for i in rows[b][1:cap]), key=lambda bi: key(*bi))
    for b, i in pool[: max(left, 0)]:
        kept[b].add(i)
    return kept


# (B, N, budget, cap) of random trees; test_select_kernel adds its own
RANDOM_CASES = [
    pytest.param(1, 7, 5, 127, id="B1-N7"),
    pytest.param(3, 13, 11, 4, id="B3-N13-cap4"),
    pytest.param(5, 40, 63, 127, id="B5-N40"),
    pytest.param(4, 63, 3, 127, id="B4-N63-under-floor"),
    pytest.param(6, 30, 500, 9, id="B6-N30-all"),
]


@pytest.mark.parametrize("B, N, budget, cap", RANDOM_CASES)
def test_select_matches_reference_on_random_trees(B, N, budget, cap):
    tree = _random_tree(B, N)
    roots = torch.arange(B)
    vt = select_nodes(tree, roots, budget=budget, max_nodes_per_row=cap)
    kept = _kept(vt)
    assert kept == _reference(tree, budget, cap)
    available = sum(min(len(k), cap) for k in _reference(tree, 10**6, cap))
    floors = sum(1 for k in kept if k)
    assert sum(len(k) for k in kept) == min(max(budget, floors), available)  # exactly the budget
    for b in range(B):
        assert len(kept[b]) <= cap
        assert all(tree.parents[b, i].item() in kept[b] | {-1} for i in kept[b])  # prefix-connected
    _check_structure(vt, tree, roots)
    # every draft node's log rho, selection's ranking key (log-probabilities here are <= 0)
    torch.testing.assert_close(vt.draft_log_rho, tree.cumulative_logprobs())


def _random_tree(B: int, N: int) -> DraftTree:
    g = torch.Generator(torch.get_default_device()).manual_seed(N)
    # random topological parents, coarse probabilities (many ties), ragged rows
    parents = torch.stack([torch.randint(-1, i, (B,), generator=g) for i in range(N)], dim=1)  # parent < own index
    probs = torch.tensor([0.25, 0.5, 1.0])[torch.randint(0, 3, (B, N), generator=g)]
    lengths = torch.randint(0, N + 1, (B,), generator=g)
    probs[torch.arange(N)[None, :] >= lengths[:, None]] = 0.0  # padding at the end of each row: no children
    return _tree(torch.randint(0, 1000, (B, N), generator=g).tolist(), parents.tolist(), probs.tolist())


def test_width_bucket():
    assert [width_bucket(w, 128) for w in (1, 2, 3, 4, 5, 16, 17, 100, 128)] == [1, 2, 4, 4, 8, 16, 32, 128, 128]
    assert width_bucket(20, 24) == 24  # never wider than selection padded the trees
    assert WIDTH_BUCKETS[-1] == hf_bole.kernels.utils.MAX_TREE_NODES  # the kernels' largest tree


def test_row_width_holds_the_budget_in_a_bucket():
    """The smallest bucket whose rows hold the whole budget (root included), never wider than selection pads."""
    assert row_width(192, 8, 64) == 32  # 8 x 31 nodes hold 192
    assert row_width(248, 8, 64) == 32 and row_width(249, 8, 64) == 64
    assert row_width(64, 8, 64) == 16 and row_width(32, 8, 64) == 8
    assert row_width(32, 1, 64) == 64 and row_width(8, 1, 64) == 16  # one row: its budget's bucket
    assert row_width(500, 2, 64) == 64 and row_width(40, 1, 21) == 21  # at most the padded width
    assert row_width(0, 3, 64) == 1 and row_width(5, 0, 64) == 8  # roots only; no active row
    # the floor, one node a row, at width 2: a batch of 256 verifies 512 tokens, not 1024
    assert row_width(256, 256, 128) == 2 and row_width(3, 8, 128) == 2 and row_width(257, 256, 128) == 4


def test_replayed_selection_reads_its_static_inputs(monkeypatch):
    """Selection from graphs (a recorded call in place of a CUDA graph): each call's trees reach the captured
    selection through its static buffers, one capture per (tree shape, dtype, budget, cap)."""
    captured = []
    monkeypatch.setattr(graphs_module, "capture", recording_capture(captured))
    select = SelectGraphs()
    generator = torch.Generator().manual_seed(0)
    for budget in (4, 4, 9, 4, 9):
        tree = synthetic_draft_tree(3, 3, 3, generator)
        roots = torch.randint(0, 50, (3,), generator=generator, device=generator.device)
        replayed, direct = select(tree, roots, budget, 7), select_nodes(tree, roots, budget, 7)
        for field in dataclasses.fields(direct):
            torch.testing.assert_close(getattr(replayed, field.name), getattr(direct, field.name), rtol=0, atol=0)
    assert len(captured) == 2  # budgets 4 and 9


def test_replayed_selection_prepares_the_tree_inside(monkeypatch):
    """The rows that are done and a custom drafter's tree made safe (`prepared_tree`) are part of the replayed
    selection: a tree with a token out of the vocabulary, too deep a node and a finished row selects as
    select_nodes does on the prepared tree, one capture per (budget, safe) whatever rows are active."""
    captured = []
    monkeypatch.setattr(graphs_module, "capture", recording_capture(captured))
    select = SelectGraphs()
    generator = torch.Generator().manual_seed(2)
    for active in ([True, False, True], [True, True, False], [True, False, True]):
        tree = synthetic_draft_tree(3, 3, 3, generator)
        tree.tokens[0, 1] = 10**6  # outside any vocabulary: clamped
        roots = torch.randint(0, 50, (3,), generator=generator, device=generator.device)
        active_t = torch.tensor(active, device=generator.device)
        for safe in ((50, 2), None):
            replayed = select(tree, roots, 6, 7, active_t, safe)
            direct = select_nodes(prepared_tree(tree, active_t, safe), roots, 6, 7)
            for field in dataclasses.fields(direct):
                torch.testing.assert_close(getattr(replayed, field.name), getattr(direct, field.name), rtol=0, atol=0)
        assert not bool(replayed.node_mask[~active_t, 1:].any())  # finished rows verify their root only
    assert len(captured) == 2  # made safe or not


def test_selection_reads_nothing_on_the_host(monkeypatch):
    """What capturing selection relies on: after the trees' one parents check, `select_nodes` reads nothing back."""
    tree = synthetic_draft_tree(3, 3, 3, torch.Generator().manual_seed(1))
    roots = torch.tensor([1, 2, 3])
    select_nodes(tree, roots, 6, 7)  # the parents check reads them here, once
    reads = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)
        record = lambda self, *a, _original=original, _name=name, **k: reads.append(_name) or _original(self, *a, **k)  # noqa: E731
        monkeypatch.setattr(torch.Tensor, name, record)
    select_nodes(tree, roots, 6, 7)
    monkeypatch.undo()
    assert reads == []


def test_a_budget_of_0_verifies_the_roots_alone():
    """No selection runs: every row's root alone; from graphs, in one buffer kept across calls and refilled each
    round (the graphs that read it keep reading the round's roots)."""
    select = Select(lambda *a: pytest.fail("a budget of 0 selects nothing"), max_nodes_per_row=0)
    assert select.cap(0, 3) == 0
    first = select(None, torch.tensor([4, 5, 6]), budget=0, cap=0, active=torch.ones(3, dtype=torch.bool))
    assert first.input_ids.tolist() == [[4], [5], [6]] and first.parents.tolist() == [[-1]] * 3
    assert first.node_mask.all() and first.num_nodes.tolist() == [1, 1, 1] and first.depths.tolist() == [[0]] * 3
    kept = SelectGraphs()
    graphed = Select(kept, max_nodes_per_row=0, roots=kept.roots_only)
    first = graphed(None, torch.tensor([4, 5, 6]), budget=0, cap=0, active=torch.ones(3, dtype=torch.bool))
    again = Select(kept, 0, kept.roots_only)(None, torch.tensor([7, 8, 9]), 0, 0, torch.ones(3, dtype=torch.bool))
    assert again.input_ids is first.input_ids and first.input_ids.tolist() == [[7], [8], [9]]
