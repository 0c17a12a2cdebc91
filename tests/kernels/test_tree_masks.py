"""tree_masks: the Triton kernel's ancestors, position ids and attention mask equal tree_masks_torch's bit for bit, and
both equal a naive walk up the parents.

The kernel runs compiled on a GPU and under TRITON_INTERPRET=1 on the CPU; the torch path runs on the same device.
"""

from __future__ import annotations

import pytest
import torch

from hf_bole.kernels.tree_gdn.ancestors import _tree_masks_fwd, tree_masks, tree_masks_torch
from hf_bole.kernels.utils import MAX_TREE_NODES
from tests.kernels.trees import make_parents, path_to

pytestmark = pytest.mark.interpreter

KINDS = ("chain", "star", "deep", "bushy", "mixed")
WIDTHS = (1, 2, 5, 16, 33, 64, 128)
OUTPUTS = ("ancestors", "position_ids", "attention_mask")


@pytest.fixture(autouse=True)
def _inputs_on_the_cpu():
    """Inputs are built on the CPU (also where the default device is a GPU, HF_BOLE_TEST_DEVICE=cuda), so every
    device sees the same cases; both paths then run on `device`."""
    with torch.device("cpu"):
        yield


def ragged(N: int, B: int, seed: int) -> torch.Tensor:
    """`[B, N]` rows of one to three trees of random kinds one after another (so several roots), then padding nodes
    (parent -1); the last row is full, one tree of N nodes."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(B - 1):
        row, left = [], int(torch.randint(1, N + 1, (1,), generator=gen))
        for _ in range(3):
            if left == 0:
                break
            n = int(torch.randint(1, left + 1, (1,), generator=gen))
            kind = KINDS[int(torch.randint(0, len(KINDS), (1,), generator=gen))]
            tree = make_parents(kind, n, 1, seed=seed + b).tolist()[0]
            row += [p + len(row) if p >= 0 else -1 for p in tree]
            left -= n
        rows.append(row + [-1] * (N - len(row)))
    rows.append(make_parents("mixed", N, 1, seed=seed).tolist()[0])
    return torch.tensor(rows, dtype=torch.int64)


def cache_inputs(N: int, B: int, C: int | None, seed: int):
    """lengths (0 in row 0, the largest in the last row), positions ahead of them (left padding) and valid with random
    padding slots; C = max(lengths) + N unless given."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 300, (B,), generator=gen)
    lengths[0] = 0
    lengths[-1] = lengths.max() + 1
    C = int(lengths.max()) + N if C is None else C
    positions = lengths + torch.randint(0, 50, (B,), generator=gen)
    valid = torch.rand(B, C, generator=gen) > 0.25
    return lengths, positions, valid


def naive(parents, lengths, positions, valid):
    """The three outputs by a walk up the parents of every node (lengths >= 0)."""
    B, N = parents.shape
    C = valid.shape[1]
    anc = torch.zeros(B, N, N, dtype=torch.bool)
    position_ids = torch.zeros(B, N, dtype=torch.int64)
    mask = torch.zeros(B, 1, N, C, dtype=torch.bool)
    for b in range(B):
        L = int(lengths[b])
        for i in range(N):
            path = path_to(parents, b, i)
            anc[b, i, path] = True
            position_ids[b, i] = positions[b] + len(path) - 1
            mask[b, 0, i, :L] = valid[b, :L]
            mask[b, 0, i, [L + j for j in path if 0 <= L + j < C]] = True
    return anc, position_ids, mask


def assert_same(got, want, what="tree_masks_torch"):
    for name, x, y in zip(OUTPUTS, got, want):
        assert (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device), f"{name}: {x.dtype} {x.shape} {x.device}"
        assert torch.equal(x, y), f"{name} differs from {what} at {(x != y).nonzero()[:8].tolist()}"


def run_both(parents, lengths, positions, valid, device):
    inputs = [x.to(device) for x in (parents, lengths, positions, valid)]
    got, want = tree_masks(*inputs), tree_masks_torch(*inputs)
    assert_same(got, want)
    return [x.cpu() for x in got]


@pytest.mark.parametrize("N", WIDTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_and_width(kind, N, device):
    """Full trees of every kind at C = max(lengths) + N exactly; against the naive walk too."""
    parents = make_parents(kind, N, 3, seed=N)
    inputs = (parents, *cache_inputs(N, 3, None, seed=N))
    assert_same(run_both(*inputs, device), naive(*inputs), "the naive walk")


@pytest.mark.parametrize("N", WIDTHS)
def test_ragged_forests(N, device):
    """Rows of several trees and trailing padding nodes, in a capacity larger than the trees need (not a power of
    two, more than one block of slots)."""
    parents = ragged(N, 4, seed=100 + N)
    inputs = (parents, *cache_inputs(N, 4, 1337 + N, seed=N))
    assert_same(run_both(*inputs, device), naive(*inputs), "the naive walk")


@pytest.mark.parametrize(
    "N,lengths,C",
    [
        pytest.param(64, [1000, 1024, 960], 2500, id="window-across-blocks"),
        pytest.param(33, [0, 2048, 2015], 2048 + 33, id="window-at-the-end"),
        pytest.param(5, [0, 3, 1], 5 + 3, id="small-capacity"),
    ],
)
def test_tree_window_at_block_edges(N, lengths, C, device):
    """The tree window straddles two blocks of slots, starts at a block's first slot, ends at the capacity."""
    parents = ragged(N, 3, seed=N)
    lengths = torch.tensor(lengths)
    positions = lengths + 3
    valid = torch.rand(3, C) > 0.5
    inputs = (parents, lengths, positions, valid)
    assert_same(run_both(*inputs, device), naive(*inputs), "the naive walk")


def test_any_values_match_the_torch_path(device):
    """Values outside the callers' contract give torch's outputs too: parents anywhere in [-3, N + 3) (cycles, self
    loops, out of range), lengths negative or past the capacity (the window is cut off)."""
    gen = torch.Generator().manual_seed(0)
    for N in (5, 16, 40, 128):
        parents = torch.randint(-3, N + 3, (4, N), generator=gen)
        lengths = torch.tensor([-N // 2, 0, 70, 90])
        positions = torch.tensor([5, -7, 0, 2**40])
        valid = torch.rand(4, 100, generator=gen) > 0.5
        run_both(parents, lengths, positions, valid, device)


def test_strided_inputs(device):
    """Inputs that are views with other strides (a column of a batch table, a slice of a larger storage)."""
    N, B, C = 37, 3, 700
    table = torch.stack([torch.tensor([0, 200, 512]), torch.tensor([4, 260, 600])], dim=1)  # [B, 2]
    parents = torch.cat([ragged(N, B, seed=7), ragged(N, B, seed=8)], dim=1)[:, ::2]
    valid = (torch.rand(C + 9, B) > 0.3).t()[:, 9:]
    lengths, positions = table[:, 0], table[:, 1]
    assert not parents.is_contiguous() and not valid.is_contiguous() and lengths.stride(0) == 2
    run_both(parents, lengths, positions, valid, device)


@pytest.mark.parametrize("poison", [True, False])
def test_every_output_element_is_written(poison, device):
    """The kernel writes every element: outputs filled with True or with False (and position ids with a sentinel)
    come back equal to the torch path's."""
    for N, C in ((1, 40), (33, 1100), (128, 2200)):
        parents = ragged(N, 3, seed=N).to(device)
        lengths, positions, valid = (x.to(device) for x in cache_inputs(N, 3, C, seed=N))
        outs = (
            torch.full((3, N, N), poison, device=device),
            torch.full((3, N), -(2**30), dtype=torch.int64, device=device),
            torch.full((3, 1, N, C), poison, device=device),
        )
        _tree_masks_fwd(parents, lengths, positions, valid, *outs)
        assert_same(outs, tree_masks_torch(parents, lengths, positions, valid))


def test_empty_batch_and_tree(device):
    for B, N in ((0, 4), (2, 0)):
        parents = torch.full((B, N), -1, dtype=torch.int64)
        lengths = torch.zeros(B, dtype=torch.int64)
        valid = torch.ones(B, 10, dtype=torch.bool)
        run_both(parents, lengths, lengths + 1, valid, device)


def test_plain_cpu_tensors_take_the_torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("hf_bole.kernels.tree_gdn.ancestors._tree_masks_fwd", None)  # calling it would fail
    parents = make_parents("mixed", 20, 2)
    inputs = (parents, *cache_inputs(20, 2, 400, seed=0))
    assert_same(tree_masks(*inputs), tree_masks_torch(*inputs))


def _good():
    return make_parents("chain", 4, 2), torch.tensor([0, 3]), torch.tensor([1, 5]), torch.ones(2, 9, dtype=torch.bool)


def _replace(index, value):
    inputs = list(_good())
    inputs[index] = value
    return inputs


@pytest.mark.parametrize(
    "inputs,message",
    [
        pytest.param(_replace(0, [[-1, 0]]), r"`parents` must be a torch.Tensor", id="not-a-tensor"),
        pytest.param(_replace(0, make_parents("chain", 4, 2).int()), r"`parents` must have dtype", id="parents-dtype"),
        pytest.param(_replace(1, torch.tensor([0.0, 3.0])), r"`lengths` must have dtype", id="lengths-dtype"),
        pytest.param(_replace(2, torch.tensor([1, 5]).int()), r"`positions` must have dtype", id="positions-dtype"),
        pytest.param(_replace(3, torch.ones(2, 9, dtype=torch.uint8)), r"`valid` must have dtype", id="valid-dtype"),
        pytest.param(_replace(0, torch.tensor([-1, 0, 1])), r"`parents` must have shape \[B, N\]", id="parents-1d"),
        pytest.param(_replace(1, torch.tensor([[0, 3]])), r"`lengths` must have shape \[B\]", id="lengths-shape"),
        pytest.param(_replace(2, torch.tensor([1, 5, 6])), r"`positions` must have shape \[B\]", id="positions-B"),
        pytest.param(
            _replace(3, torch.ones(3, 9, dtype=torch.bool)), r"`valid` must have shape \[B, C\]", id="valid-B"
        ),
        pytest.param(_replace(3, torch.ones(9, dtype=torch.bool)), r"`valid` must have shape \[B, C\]", id="valid-1d"),
        pytest.param(
            _replace(3, torch.ones(2, 9, dtype=torch.bool, device="meta")), r"one device.*valid on meta", id="device"
        ),
    ],
)
def test_input_errors(inputs, message):
    with pytest.raises(ValueError, match=message):
        tree_masks(*inputs)


def test_wider_trees_take_the_torch_path_and_say_so(monkeypatch, caplog, device):
    """Past the kernel's 128 nodes (only tree_forward's serial verification takes such trees) the torch path gives
    the masks, and a log line says so."""
    import logging

    import hf_bole.kernels.tree_gdn.ancestors as module

    monkeypatch.setattr(module, "_tree_masks_fwd", None)  # calling it would fail
    module.logger.warning_once.cache_clear()  # said once per process: maybe by an earlier test
    parents = make_parents("mixed", MAX_TREE_NODES + 1, 2).to(device)
    lengths, positions, valid = (x.to(device) for x in cache_inputs(MAX_TREE_NODES + 1, 2, None, seed=3))
    with caplog.at_level(logging.WARNING):
        out = tree_masks(parents, lengths, positions, valid)
    assert all(torch.equal(a, b) for a, b in zip(out, tree_masks_torch(parents, lengths, positions, valid)))
    assert "more than 128 nodes (here 129)" in caplog.text
