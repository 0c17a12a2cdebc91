import pytest
import torch

from hf_bole.kernels import tree_gdn_commit_serial, tree_gdn_verify_serial
from hf_bole.kernels.tree_gdn.naive import naive_tree_gdn_verify
from tests.kernels.test_closed_form import BACKENDS, backend_device
from tests.kernels.test_commit import random_paths
from tests.kernels.trees import gdn_inputs, make_parents, rel_err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("K,V", [(32, 32), (40, 80)])
def test_serial_equals_naive(backend, K, V):
    device = backend_device(backend)
    B, T, HK, H = 2, 30, 2, 4
    q, k, v, g, beta, h0 = gdn_inputs(B, T, HK, H, K, V, device=device, seed=12)
    parents = make_parents("mixed", T, B, seed=12)
    o, states = tree_gdn_verify_serial(q, k, v, g, beta, parents.to(device), h0, use_qk_l2norm_in_kernel=True)
    f64 = [x.double().cpu() for x in (q, k, v, g, beta)]
    ref_o, _, _, ref_states = naive_tree_gdn_verify(
        *f64, parents, h0.double().cpu(), use_qk_l2norm_in_kernel=True, output_states=True
    )
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(states, ref_states) <= 1e-5
    path = random_paths(parents, torch.Generator().manual_seed(12), empty_rows=(0,))
    new = tree_gdn_commit_serial(h0, states, path.to(device))
    assert torch.equal(new[0], h0[0])
    assert rel_err(new[1], ref_states[1, path[1].max()]) <= 1e-5
