import pytest
import torch

from hf_bole.kernels import tree_ancestor_mask, tree_depths
from hf_bole.kernels.tree_gdn import ancestors as module
from tests.kernels.trees import BACKENDS, backend_device, make_parents, path_to

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 40, 128, 129])
def test_tree_ancestor_mask_and_depths(backend, T, monkeypatch):
    """Against a walk up the parents; the kernel (T <= 128) and the torch path (T = 129, or off CUDA) alike."""
    launches = []
    launch = module._tree_ancestors
    monkeypatch.setattr(module, "_tree_ancestors", lambda p: launches.append(1) or launch(p))
    for kind in ("chain", "star", "deep", "bushy", "mixed"):
        parents = make_parents(kind, T, 3, seed=13)
        parents[1, T // 2 :] = -1  # a row of many roots (padding nodes)
        on = parents.to(backend_device(backend))
        mask, depths = tree_ancestor_mask(on).cpu(), tree_depths(on).cpu()
        for b in range(3):
            for i in range(T):
                path = path_to(parents, b, i)
                expected = torch.zeros(T, dtype=torch.bool)
                expected[path] = True
                assert torch.equal(mask[b, i], expected)
                assert depths[b, i] == len(path) - 1
    assert len(launches) == (10 if backend == "triton" and T <= 128 else 0)


@pytest.mark.interpreter
def test_compiled_callers_take_the_torch_path():
    """Inside a torch.compile trace the ops are traced (no launcher to trace through), with the same result."""
    parents = make_parents("mixed", 20, 2)
    compiled = torch.compile(tree_ancestor_mask, backend="eager", fullgraph=True)
    assert torch.equal(compiled(parents), tree_ancestor_mask(parents))
