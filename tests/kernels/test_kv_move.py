import pytest
import torch

from hf_bole.kernels import kv_commit
from hf_bole.kernels.kv_move import kv_commit_torch
from tests.kernels.trees import BACKENDS, backend_device, make_parents, path_to

def storage(NA, B, H, C, D, device, dtype=torch.float32):
    """Every entry distinct (slot, layer, row, head and channel in its value), so any misplaced one shows."""
    return torch.arange(NA * B * H * C * D, dtype=torch.float64).reshape(NA, B, H, C, D).to(device, dtype)


def paths_of(parents, L, gen):
    """[B, L] root-to-node paths, right-padded with -1: row 0's to its deepest node, the others' to random nodes,
    and the last row commits nothing."""
    rows = []
    for b in range(parents.shape[0]):
        node = int(torch.randint(0, parents.shape[1], (1,), generator=gen))
        if b == 0:
            node = max(range(parents.shape[1]), key=lambda i: len(path_to(parents, 0, i)))
        path = path_to(parents, b, node)[:L]
        rows.append(path + [-1] * (L - len(path)))
    rows[-1] = [-1] * L
    return torch.tensor(rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kind,NA,B,H,N,L,D,DV",
    [
        ("chain", 1, 1, 1, 4, 4, 16, 16),
        ("mixed", 3, 3, 2, 20, 7, 32, 32),
        ("deep", 2, 2, 4, 40, 16, 256, 256),
        ("chain", 1, 2, 2, 60, 60, 16, 16),
        ("deep", 1, 3, 2, 90, 20, 16, 16),
        ("star", 1, 2, 1, 9, 2, 8, 8),
        ("mixed", 2, 3, 1, 20, 7, 48, 8),  # MLA's compressed cache: a wide latent, a narrow rotary key
        ("mixed", 2, 3, 1, 20, 7, 24, 0),  # no rotary key (GLM-5-Next's qk_rope_head_dim = 0): empty values
    ],
)
def test_kv_commit_moves_the_path(backend, kind, NA, B, H, N, L, D, DV):
    """Against the torch gather/scatter (the specification), bit for bit, with the path's nodes at their new slots
    and every other slot untouched."""
    device = backend_device(backend)
    gen = torch.Generator().manual_seed(N)
    parents = make_parents(kind, N, B, seed=N)
    parents[:, 0] = -1  # node 0 is every row's root
    path = paths_of(parents, L, gen)
    C = 3 * N + L
    lengths = torch.randint(0, C - N + 1, (B,), generator=gen)
    keys, values = storage(NA, B, H, C, D, device), storage(NA, B, H, C, DV, device) + 1
    expected_k, expected_v = keys.clone(), values.clone()
    kv_commit_torch(expected_k, expected_v, lengths.to(device), path.to(device))
    kv_commit(keys, values, lengths.to(device), path.to(device))
    assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)
    before = storage(NA, B, H, C, D, "cpu")
    for b in range(B):
        L_b = int((path[b] >= 0).sum())
        start = int(lengths[b])
        moved = before[:, b, :, start + path[b, :L_b]]
        assert torch.equal(keys[:, b, :, start : start + L_b].cpu(), moved)
        assert torch.equal(keys[:, b, :, :start].cpu(), before[:, b, :, :start])  # the committed slots stay
        moved_v = storage(NA, B, H, C, DV, "cpu")[:, b, :, start + path[b, :L_b]] + 1
        assert torch.equal(values[:, b, :, start : start + L_b].cpu(), moved_v)


def test_kv_commit_bad_input():
    keys = torch.zeros(1, 2, 1, 8, 4)
    with pytest.raises(ValueError, match="`values` must have shape"):
        kv_commit(keys, torch.zeros(1, 2, 1, 9, 4), torch.zeros(2, dtype=torch.int64), torch.zeros(2, 1).long())
    with pytest.raises(ValueError, match="`values` must be"):
        kv_commit(keys, torch.zeros(2, 1, 8, 4), torch.zeros(2, dtype=torch.int64), torch.zeros(2, 1).long())
    with pytest.raises(ValueError, match="`path` must be"):
        kv_commit(keys, keys.clone(), torch.zeros(2, dtype=torch.int64), torch.zeros(3, 1).long())
    with pytest.raises(ValueError, match="`lengths` must have dtype"):
        kv_commit(keys, keys.clone(), torch.zeros(2), torch.zeros(2, 1).long())
