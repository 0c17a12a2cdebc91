"""Batch-shared selection of the draft nodes a round verifies: the torch reference and its one-launch kernel."""

from hf_bole.kernels.tree_select.kernel import MAX_ROUND_NODES, tree_select_nodes
from hf_bole.kernels.tree_select.naive import SelectedNodes, naive_tree_select_nodes

__all__ = ["MAX_ROUND_NODES", "SelectedNodes", "naive_tree_select_nodes", "tree_select_nodes"]
