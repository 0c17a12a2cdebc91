import torch

from hf_bole.kernels import tree_ancestor_mask, tree_depths
from tests.kernels.trees import make_parents, path_to


def test_tree_ancestor_mask_and_depths():
    for kind in ("chain", "star", "deep", "bushy", "mixed"):
        parents = make_parents(kind, 40, 3, seed=13)
        mask, depths = tree_ancestor_mask(parents), tree_depths(parents)
        for b in range(3):
            for i in range(40):
                path = path_to(parents, b, i)
                expected = torch.zeros(40, dtype=torch.bool)
                expected[path] = True
                assert torch.equal(mask[b, i], expected)
                assert depths[b, i] == len(path) - 1
