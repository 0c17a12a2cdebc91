import pytest
import torch

from hf_bole.kernels import tree_gdn_commit, tree_gdn_verify
from hf_bole.kernels.tree_gdn.naive import naive_tree_gdn_commit, naive_tree_gdn_verify
from tests.kernels.test_closed_form import BACKENDS, backend_device
from tests.kernels.trees import gdn_inputs, make_parents, path_to, rel_err


def random_paths(parents: torch.Tensor, gen: torch.Generator, empty_rows=()) -> torch.Tensor:
    """One root-to-node path per row, ending at a random node, right-padded with -1."""
    B, T = parents.shape
    paths = [[] if b in empty_rows else path_to(parents, b, int(torch.randint(T, (1,), generator=gen))) for b in range(B)]
    L = max(1, max(map(len, paths)))
    return torch.tensor([p + [-1] * (L - len(p)) for p in paths], dtype=torch.int64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kind,B,T,HK,H,K,V", [("mixed", 3, 40, 2, 4, 32, 32), ("deep", 2, 70, 1, 2, 16, 16), ("bushy", 2, 30, 1, 2, 40, 80)]
)
def test_commit_equals_sequential_state(backend, kind, B, T, HK, H, K, V):
    device = backend_device(backend)
    q, k, v, g, beta, h0 = gdn_inputs(B, T, HK, H, K, V, device=device, seed=7)
    parents = make_parents(kind, T, B, seed=7)
    o, u, log_decay = tree_gdn_verify(q, k, v, g, beta, parents.to(device), h0, use_qk_l2norm_in_kernel=True)
    f64 = [x.double().cpu() for x in (q, k, v, g, beta)]
    *_, states = naive_tree_gdn_verify(*f64, parents, h0.double().cpu(), use_qk_l2norm_in_kernel=True, output_states=True)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        path = random_paths(parents, gen, empty_rows=(1,))
        new = tree_gdn_commit(h0, k, u, log_decay, path.to(device), use_qk_l2norm_in_kernel=True)
        leaf = path.max(1).values
        ref = torch.stack([states[b, leaf[b]] if leaf[b] >= 0 else h0[b].double().cpu() for b in range(B)])
        assert rel_err(new, ref) <= 1e-5
        assert torch.equal(new[1], h0[1]), "an all -1 path keeps the state"
        # the naive replay of the factors is the same thing
        naive = naive_tree_gdn_commit(h0.double().cpu(), k.cpu(), u.cpu(), log_decay.cpu(), path, use_qk_l2norm_in_kernel=True)
        assert rel_err(naive, ref) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_commit_stacked_layers_and_in_place(backend):
    device = backend_device(backend)
    NL, B, T, HK, H, K, V = 3, 2, 20, 2, 4, 16, 32
    parents = make_parents("mixed", T, B, seed=8)
    layers = [gdn_inputs(B, T, HK, H, K, V, device=device, seed=10 + n) for n in range(NL)]
    factors = [tree_gdn_verify(q, k, v, g, b, parents.to(device), h0, use_qk_l2norm_in_kernel=True) for q, k, v, g, b, h0 in layers]
    path = random_paths(parents, torch.Generator().manual_seed(8)).to(device)
    per_layer = [
        tree_gdn_commit(layer[5], layer[1], f[1], f[2], path, use_qk_l2norm_in_kernel=True) for layer, f in zip(layers, factors)
    ]
    states = torch.stack([layer[5] for layer in layers])
    stacked = tree_gdn_commit(
        states,
        torch.stack([layer[1] for layer in layers]),
        torch.stack([f[1] for f in factors]),
        torch.stack([f[2] for f in factors]),
        path,
        use_qk_l2norm_in_kernel=True,
        out=states,  # in place
    )
    assert stacked.data_ptr() == states.data_ptr()
    for n in range(NL):
        torch.testing.assert_close(stacked[n], per_layer[n], rtol=1e-6, atol=1e-6)


def test_commit_rejects_bad_input():
    B, T, HK, H, K, V = 1, 4, 1, 2, 16, 16
    h0, k = torch.zeros(B, H, K, V), torch.randn(B, T, HK, K)
    u, lp = torch.randn(B, T, H, V), torch.zeros(B, T, H)
    with pytest.raises(ValueError, match="right-padded"):
        tree_gdn_commit(h0, k, u, lp, torch.tensor([[0, -1, 2]]))
    with pytest.raises(ValueError, match="root-to-leaf chain"):
        tree_gdn_commit(h0, k, u, lp, torch.tensor([[0, 2, 1]]))
    with pytest.raises(ValueError, match=r"node indices in \[0, 4\)"):
        tree_gdn_commit(h0, k, u, lp, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match=r"`u` must have shape"):
        tree_gdn_commit(h0, k, u[:, :3], lp, torch.tensor([[0]]))
    with pytest.raises(ValueError, match="dtype"):
        tree_gdn_commit(h0, k, u.double(), lp, torch.tensor([[0]]))
