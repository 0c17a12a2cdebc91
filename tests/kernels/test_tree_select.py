"""tree_select_nodes: every output equals naive_tree_select_nodes' (through `select_nodes`) on the trees test_select
uses, and more.

The kernel runs compiled on a GPU and under TRITON_INTERPRET=1 on the CPU; the reference runs on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from hf_bole.generation import DraftTree, VerifyTree, select_nodes
from hf_bole.generation.select import select_round
from hf_bole.kernels import tree_select_nodes
from hf_bole.kernels.tree_select import MAX_ROUND_NODES
from tests.generation.test_select import RANDOM_CASES, _random_tree, _tree

pytestmark = pytest.mark.interpreter

FIELDS = ("input_ids", "parents", "depths", "draft_index", "node_mask", "num_nodes", "draft_log_rho")


@pytest.fixture(autouse=True)
def _trees_on_the_cpu():
    """Trees are built on the CPU, where select_nodes (the reference) runs, also where the tests' default device is
    a GPU (HF_BOLE_TEST_DEVICE=cuda): the same trees everywhere. Random trees built on a GPU differ, and their float
    path sums can round apart in the last bit between torch's order and the kernel's (the module's docstring)."""
    with torch.device("cpu"):
        yield


def select_nodes_triton(tree: DraftTree, root_tokens, budget: int, max_nodes_per_row: int) -> VerifyTree:
    """The kernel on a DraftTree's fields, as `select_nodes` runs the reference."""
    selected = tree_select_nodes(tree.tokens, tree.parents, tree.draft_logprobs, root_tokens, budget, max_nodes_per_row)
    return VerifyTree(*selected)


def _on(tree: DraftTree, device) -> DraftTree:
    return DraftTree(*(x.to(device) for x in (tree.tokens, tree.parents, tree.draft_logprobs)))


def _assert_same(tree: DraftTree, roots: torch.Tensor, budget: int, cap: int, device):
    ref = select_nodes(_on(tree, "cpu"), roots.cpu(), budget=budget, max_nodes_per_row=cap)
    out = select_nodes_triton(_on(tree, device), roots.to(device), budget=budget, max_nodes_per_row=cap)
    for name in FIELDS:
        x, y = getattr(out, name), getattr(ref, name)
        got, want = (x.dtype, list(x.shape)), (y.dtype, list(y.shape))
        assert got == want, f"{name}: {got}, not {want}"
        assert torch.equal(x.cpu(), y), f"{name} differs:\n{x}\nvs select_nodes\n{y}"


# The hand-written trees of test_select: (tokens, parents, probabilities with 0 = padding).
TREES = {
    "budget-across-batch": ([[1, 2, 3], [4, 5, 0]], [[-1, 0, -1], [-1, 0, -1]], [[0.9, 0.8, 0.05], [0.4, 0.5, 0.0]]),
    "floor-beats-better": ([[1, 2, 3], [4, 0, 0]], [[-1, 0, 1], [-1, -1, -1]], [[0.9, 0.9, 0.9], [0.01, 0.0, 0.0]]),
    "cap": (
        [[1, 2, 3, 4], [5, 6, 0, 0]],
        [[-1, 0, 1, 2], [-1, -1, -1, -1]],
        [[0.99, 0.99, 0.99, 0.99], [0.3, 0.2, 0.0, 0.0]],
    ),
    "ties-shallower-first": ([[1, 2, 3]], [[-1, 0, -1]], [[0.5, 1.0, 0.5]]),
    "ties-chain": ([[1, 2, 3, 4]], [[-1, 0, 1, 2]], [[1.0, 1.0, 1.0, 1.0]]),
    "ties-later-parent": ([[1, 2, 3]], [[-1, -1, 1]], [[0.5, 0.5, 1.0]]),
    "positive-logprobs": ([[1, 2, 3]], [[-1, 0, -1]], [[0.1, 50.0, 0.2]]),
    "padding-and-empty-rows": ([[0, 0], [5, 6]], [[-1, -1], [-1, 0]], [[0.0, 0.0], [0.5, 0.5]]),
    "all-padding": ([[0, 0, 0]], [[-1, -1, -1]], [[0.0, 0.0, 0.0]]),
    "zero-width": ([[], []], [[], []], [[], []]),
}


@pytest.mark.parametrize("name", list(TREES))
def test_select_kernel_hand_written_trees(name, device):
    tree = _tree(*TREES[name])
    roots = torch.arange(7, 7 + tree.batch_size)
    for budget in (0, 1, 2, 3, 4, 5, 9, 10**12):  # budgets and caps past int32 are clamped to B * N and N
        for cap in (1, 2, 127, 10**12):
            _assert_same(tree, roots, budget, cap, device)


@pytest.mark.parametrize(
    "B, N, budget, cap",
    [
        *RANDOM_CASES,
        pytest.param(1, 1, 0, 1, id="B1-N1-budget0"),
        pytest.param(16, 8, 20, 1, id="B16-N8-cap1"),
        pytest.param(7, 9, 0, 3, id="B7-N9-budget0"),
        pytest.param(8, 100, 200, 30, id="B8-N100"),
    ],
)
def test_select_kernel_matches_select_nodes_on_random_trees(B, N, budget, cap, device):
    _assert_same(_random_tree(B, N), torch.arange(B) + 1000, budget, cap, device)


def _random_parents(B: int, N: int, g: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randint(-1, i, (B,), generator=g) for i in range(N)], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_select_kernel_dyadic_logprobs_any_dtype(dtype, device):
    # log-probabilities -k/8: every path sum is exact in each dtype, so the two sums agree to the bit; many ties
    B, N = 3, 50
    g = torch.Generator().manual_seed(3)
    parents = _random_parents(B, N, g)
    logprobs = (-torch.randint(0, 8, (B, N), generator=g) / 8).to(dtype)
    logprobs[2, 30:] = float("-inf")
    tree = DraftTree(torch.randint(0, 100, (B, N), generator=g), parents, logprobs)
    for budget, cap in ((1, 127), (10, 5), (40, 127), (200, 127)):
        _assert_same(tree, torch.arange(B), budget, cap, device)


def test_select_kernel_continuous_logprobs(device):
    B, N = 4, 40
    g = torch.Generator().manual_seed(5)
    parents = _random_parents(B, N, g)
    tree = DraftTree(torch.randint(0, 100, (B, N), generator=g), parents, -3 * torch.rand(B, N, generator=g))
    out = select_nodes_triton(_on(tree, device), torch.arange(B).to(device), budget=37, max_nodes_per_row=20)
    ref = select_nodes(tree, torch.arange(B), budget=37, max_nodes_per_row=20)
    # the sums' rounding may differ (float64 here, torch's float32 order there): log rho to rounding
    torch.testing.assert_close(out.draft_log_rho.cpu(), ref.draft_log_rho)
    for name in FIELDS[:-1]:  # no near-ties at this seed: the same selection
        assert torch.equal(getattr(out, name).cpu(), getattr(ref, name)), name


def test_select_kernel_nan_inf_and_positive_logprobs(device):
    # NaN and +inf - inf paths are not real, +inf and positive log-probabilities rank by the path minimum
    B, N = 3, 24
    g = torch.Generator().manual_seed(7)
    parents = _random_parents(B, N, g)
    logprobs = torch.tensor([-1.0, -0.5, 0.0, 0.5, 2.0])[torch.randint(0, 5, (B, N), generator=g)]
    logprobs[0, 3] = float("nan")
    logprobs[1, 0] = float("inf")
    logprobs[1, 5] = float("-inf")  # may have children here: a path through +inf and -inf is NaN
    logprobs[2, 1] = -0.0
    tree = DraftTree(torch.randint(0, 100, (B, N), generator=g), parents, logprobs)
    for budget, cap in ((2, 127), (12, 4), (100, 127)):
        _assert_same(tree, torch.arange(B), budget, cap, device)


def test_select_kernel_strided_inputs(device):
    tree = _random_tree(5, 12)
    # every field a transposed view: the kernel reads through both strides
    tree = DraftTree(*(x.T.contiguous().T for x in (tree.tokens, tree.parents, tree.draft_logprobs)))
    assert not tree.tokens.is_contiguous()
    _assert_same(tree, torch.arange(5), 17, 6, device)


def test_select_kernel_checks_sizes():
    N = MAX_ROUND_NODES // 4 + 1
    tree = DraftTree(torch.zeros(4, N, dtype=torch.long), torch.full((4, N), -1), torch.zeros(4, N))
    with pytest.raises(ValueError, match=f"exceeds its limit of {MAX_ROUND_NODES}"):
        select_nodes_triton(tree, torch.zeros(4, dtype=torch.long), budget=8, max_nodes_per_row=8)
    small = _random_tree(2, 4)
    with pytest.raises(ValueError, match="draft_logprobs"):
        select_nodes_triton(DraftTree(small.tokens, small.parents, small.draft_logprobs.double()), torch.zeros(2), 2, 2)
    with pytest.raises(ValueError, match="budget"):
        select_nodes_triton(small, torch.zeros(2, dtype=torch.long), budget=-1, max_nodes_per_row=2)
    with pytest.raises(ValueError, match="root_tokens"):
        select_nodes_triton(small, torch.zeros(3, dtype=torch.long), budget=1, max_nodes_per_row=2)


def test_select_round_past_the_kernel_says_so_and_selects_as_select_nodes(caplog, monkeypatch):
    # B * N past the kernel's limit (lowered here, so select_nodes stays quick): select_nodes' small kernels, with a
    # warning that names the limit and the way back
    from hf_bole.generation import select
    from hf_bole.kernels.tree_select import kernel

    monkeypatch.setattr(select, "MAX_ROUND_NODES", 64)
    monkeypatch.setattr(kernel, "_select_nodes_fwd", None)  # never reached
    tree = _random_tree(3, 22)
    roots = torch.arange(3)
    with caplog.at_level("WARNING"):
        out = select_round(tree, roots, budget=30, max_nodes_per_row=20)
    assert "more than the 64" in caplog.text and "bole_topk" in caplog.text
    ref = select_nodes(tree, roots, budget=30, max_nodes_per_row=20)
    for name in FIELDS:
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
