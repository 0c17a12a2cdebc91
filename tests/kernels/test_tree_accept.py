"""tree_greedy_accept: every Acceptance field equals accept_greedy's (the reference walk, naive_tree_greedy_accept), on
hand-written and random verify trees.

The kernel runs compiled on a GPU and under TRITON_INTERPRET=1 on the CPU; accept_greedy runs on the same device.
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_bole.generation import VerifyTree, accept_greedy
from hf_bole.generation.accept import greedy_accept as accept_greedy_kernel
from hf_bole.kernels.utils import MAX_TREE_NODES
from tests.generation.test_acceptance import BUSHY, CHAIN, V, _argmax_scores, _vtree

pytestmark = pytest.mark.interpreter

FIELDS = ("path", "accept_lengths", "tokens", "bonus", "leaf")


@pytest.fixture(autouse=True)
def _trees_on_the_cpu():
    """Trees and scores are built on the CPU (also where the default device is a GPU, HF_BOLE_TEST_DEVICE=cuda), so
    every device sees the same cases; both walks then run on `device`."""
    with torch.device("cpu"):
        yield


def _on(tree: VerifyTree, device) -> VerifyTree:
    return VerifyTree(**{k: getattr(tree, k).to(device) for k in ("input_ids", "parents", "depths", "draft_index",
                                                                  "node_mask", "num_nodes")})  # fmt: skip


def _assert_same(tree: VerifyTree, scores: torch.Tensor, device):
    tree, scores = _on(tree, device), scores.to(device)
    ref = accept_greedy(tree, scores)
    out = accept_greedy_kernel(tree, scores.argmax(-1))
    for name in FIELDS:
        x, y = getattr(out, name), getattr(ref, name)
        got, want = (x.dtype, list(x.shape), x.device), (y.dtype, list(y.shape), y.device)
        assert got == want, f"{name}: {got}, not {want}"
        assert torch.equal(x, y), f"{name} differs:\n{x}\nvs accept_greedy\n{y}"
    return ref


def _widen(tree: VerifyTree, T: int) -> VerifyTree:
    """The same trees padded with padding nodes (token 0, parent -1, depth 0, masked off) to width T."""
    pad = T - tree.input_ids.shape[1]
    f = torch.nn.functional.pad
    return VerifyTree(
        input_ids=f(tree.input_ids, (0, pad)),
        parents=f(tree.parents, (0, pad), value=-1),
        depths=f(tree.depths, (0, pad)),
        draft_index=f(tree.draft_index, (0, pad), value=-1),
        node_mask=f(tree.node_mask, (0, pad)),
        num_nodes=tree.num_nodes,
    )


SHAPES = ("chain", "star", "bushy", "deep", "mixed")


def _random_case(B: int, T: int, shape: str, rng: random.Random, ragged_all: bool = False):
    """B random rows of at most T real nodes and argmax tokens that plant a draft path: every node on the way to a
    goal node (row 0's deepest) carries the argmax of its parent, so acceptance reaches deep. Row 0 fills the width
    unless `ragged_all`; small vocabularies make duplicate sibling tokens common."""
    rows, argmax = [], []
    for b in range(B):
        n = rng.randint(1, T) if (b > 0 or ragged_all) else T
        kind = rng.choice(SHAPES[:-1]) if shape == "mixed" else shape
        parents = [-1]
        for i in range(1, n):
            parents.append(
                {"chain": i - 1, "star": 0, "bushy": rng.randrange(i), "deep": rng.randrange(max(0, i - 3), i)}[kind]
            )
        vocab = rng.choice((1, 2, 3, V))
        tokens = [rng.randrange(V)] + [rng.randrange(vocab) for _ in range(n - 1)]
        depth = [0]
        for p in parents[1:]:
            depth.append(depth[p] + 1)
        goal = max(range(n), key=depth.__getitem__) if b == 0 else rng.randrange(n)
        wants = [rng.randrange(V) for _ in range(T)]
        x = goal
        while parents[x] >= 0:
            wants[parents[x]] = tokens[x]
            x = parents[x]
        if goal == 0 and n < T and rng.random() < 0.5:
            wants[0] = 0  # the token of the padding nodes: they must never be accepted
        rows.append((tokens, parents))
        argmax.append(wants)
    tree = _widen(_vtree(rows), T)
    # as _argmax_scores, with noise below the one-hot's margin: the argmax is exactly the planted one
    scores = torch.nn.functional.one_hot(torch.tensor(argmax), V).float() * 5 + torch.rand(B, T, V)
    return tree, scores, rows


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("T", [1, 5, 32, 64, 128])
def test_accept_kernel_matches_accept_greedy_on_random_trees(T, B, shape, device):
    rng = random.Random(f"{T}-{B}-{shape}")
    for ragged_all in (False, True):
        tree, scores, rows = _random_case(B, T, shape, rng, ragged_all=ragged_all)
        ref = _assert_same(tree, scores, device)
        n0 = len(rows[0][0])
        if n0 > 1:  # the planted path is taken at least one step (an earlier duplicate sibling may take it over)
            assert ref.accept_lengths[0] >= 2
        if shape == "chain":  # no siblings: the whole planted chain
            assert ref.accept_lengths[0] == n0


@pytest.mark.parametrize(
    "rows, argmax",
    [
        pytest.param([CHAIN], [[1, 2, 3, 4]], id="chain-full"),
        pytest.param([CHAIN], [[1, 8, 3, 4]], id="chain-partial"),
        pytest.param([CHAIN], [[4, 2, 3, 4]], id="chain-none"),
        pytest.param([BUSHY], [[2, 0, 6, 0, 0, 7, 0]], id="bushy-deep"),
        pytest.param([BUSHY], [[3, 0, 6, 8, 0, 7, 0]], id="bushy-leaf"),
        pytest.param([BUSHY], [[2, 0, 4, 0, 0, 7, 0]], id="bushy-stop"),
        pytest.param([([9, 1, 1, 5], [-1, 0, 0, 2])], [[1, 8, 5, 0]], id="duplicate-siblings-take-the-first"),
        # a row whose root wants 0, the padding nodes' token; a root-only row
        pytest.param(
            [BUSHY, CHAIN, ([9], [-1])], [[2, 0, 6, 0, 0, 7, 0], [0, 2, 3, 4, 0, 0, 0], [7, 0, 0, 0, 0, 0, 0]],
            id="rows-differ",
        ),
    ],
)
def test_accept_kernel_hand_written_trees(rows, argmax, device):
    _assert_same(_vtree(rows), _argmax_scores(argmax), device)


def test_accept_kernel_extra_roots_and_masked_gaps(device):
    # Not what select_nodes builds, but accept_greedy still defines an outcome: real nodes with parent -1 (walks
    # that start next to the root), a masked-off node in the middle of a row, a root whose own mask is False, and
    # depths counted from the extra roots.
    tokens = [9, 4, 4, 6, 7, 4, 8]
    parents = [-1, -1, 0, 1, 3, -1, 2]
    tree = _vtree([(tokens, parents)] * 4)
    tree.node_mask[1, 2] = False  # row 1: node 2 (the root's child) masked, so is its child 6
    tree.node_mask[2, 0] = False  # row 2: the root masked off
    tree.node_mask[3, 1] = False  # row 3: the first extra root masked, so the second (5, same token) is not a duplicate
    # root wants 4: nodes 1 and 2 (parent -1 and 0) both carry it; 1 wants 6 -> 3 wants 7 -> 4; 2 wants 8 -> 6
    argmax = [[4, 6, 8, 7, 1, 0, 3]] * 4
    _assert_same(tree, _argmax_scores(argmax), device)


def test_accept_kernel_strided_inputs(device):
    tree, scores, _ = _random_case(5, 32, "mixed", random.Random(0))
    # every field a transposed view, the argmax a column slice: the kernel reads through both strides
    fields = {k: getattr(tree, k).T.contiguous().T for k in ("input_ids", "parents", "depths", "node_mask")}
    strided = VerifyTree(**fields, draft_index=tree.draft_index, num_nodes=tree.num_nodes)
    assert not strided.input_ids.is_contiguous()
    tree, strided = _on(tree, device), _on(strided, device)
    scores = scores.to(device)
    wide = torch.cat([scores.argmax(-1), scores.argmax(-1)], dim=1)[:, :32]
    assert not wide.is_contiguous()
    ref = accept_greedy(tree, scores)
    out = accept_greedy_kernel(strided, wide)
    for name in FIELDS:
        assert torch.equal(getattr(out, name), getattr(ref, name)), name


def test_accept_kernel_on_plain_cpu_tensors_takes_the_torch_walk(monkeypatch):
    from hf_bole.kernels.tree_accept import kernel

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(kernel, "_accept_greedy_fwd", None)  # never reached
    tree, scores, _ = _random_case(3, 16, "bushy", random.Random(1))
    ref = accept_greedy(tree, scores)
    out = accept_greedy_kernel(tree, scores.argmax(-1))
    for name in FIELDS:
        assert torch.equal(getattr(out, name), getattr(ref, name)), name


def test_accept_kernel_checks_inputs(device):
    T = MAX_TREE_NODES + 1
    wide = _on(_vtree([(list(range(T)), list(range(-1, T - 1)))]), device)
    with pytest.raises(ValueError, match=f"T = {T} exceeds its limit of {MAX_TREE_NODES}"):
        accept_greedy_kernel(wide, torch.zeros(1, T, dtype=torch.long, device=device))
    tree = _on(_vtree([BUSHY]), device)
    target = torch.zeros(1, 7, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="`target` must have dtype"):
        accept_greedy_kernel(tree, target.int())
    with pytest.raises(ValueError, match=r"`target` must have shape \[B, T\]"):
        accept_greedy_kernel(tree, target[:, :5])
    with pytest.raises(ValueError, match="`node_mask` must have dtype"):
        accept_greedy_kernel(VerifyTree(**{**tree.__dict__, "node_mask": tree.node_mask.long()}), target)


def test_accept_kernel_takes_any_int64_tokens(device):
    # Tokens past int32 and negative ones (the kernel splits them into int32 halves in its tiles), compared with the
    # torch walk on the same argmax tokens (what accept_greedy runs after its argmax)
    from hf_bole.kernels import naive_tree_greedy_accept

    tree, scores, _ = _random_case(8, 64, "mixed", random.Random(2))
    tree = _on(tree, device)
    for offset in (2**40 + 7, -(2**35), 2**63 - 16):
        shifted = VerifyTree(**{**tree.__dict__, "input_ids": tree.input_ids + offset})
        target = scores.argmax(-1).to(device) + offset
        fields = (shifted.input_ids, shifted.parents, shifted.depths, shifted.node_mask, target)
        out, ref = accept_greedy_kernel(shifted, target), naive_tree_greedy_accept(*fields)
        assert ref.accept_lengths.max() > 2
        for name in FIELDS:
            assert torch.equal(getattr(out, name), getattr(ref, name)), name
