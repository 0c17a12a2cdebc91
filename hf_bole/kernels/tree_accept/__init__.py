"""Greedy acceptance over verified trees: the torch walk and its one-launch kernel."""

from hf_bole.kernels.tree_accept.kernel import tree_greedy_accept
from hf_bole.kernels.tree_accept.naive import AcceptedPaths, naive_tree_greedy_accept

__all__ = ["AcceptedPaths", "naive_tree_greedy_accept", "tree_greedy_accept"]
