"""Exact tree verification kernels for Gated DeltaNet, Kimi Delta Attention and full-attention layers, and the
round's node selection and greedy acceptance (Triton, with torch paths and naive references). Kernels take tensors and
import nothing from the rest of hf_bole."""

from hf_bole.kernels.attention import tree_attention
from hf_bole.kernels.kv_move import kv_commit
from hf_bole.kernels.tree_accept import naive_tree_greedy_accept, tree_greedy_accept
from hf_bole.kernels.tree_gdn import (
    tree_ancestor_mask,
    tree_causal_conv1d,
    tree_conv_state_commit,
    tree_depths,
    tree_gdn_commit,
    tree_gdn_commit_serial,
    tree_gdn_verify,
    tree_gdn_verify_serial,
    tree_masks,
    tree_path_window,
)
from hf_bole.kernels.tree_kda import tree_kda_commit, tree_kda_verify, tree_kda_verify_serial
from hf_bole.kernels.tree_select import naive_tree_select_nodes, tree_select_nodes

__all__ = [
    "kv_commit",
    "naive_tree_greedy_accept",
    "naive_tree_select_nodes",
    "tree_ancestor_mask",
    "tree_attention",
    "tree_causal_conv1d",
    "tree_conv_state_commit",
    "tree_depths",
    "tree_gdn_commit",
    "tree_gdn_commit_serial",
    "tree_gdn_verify",
    "tree_gdn_verify_serial",
    "tree_greedy_accept",
    "tree_kda_commit",
    "tree_kda_verify",
    "tree_kda_verify_serial",
    "tree_masks",
    "tree_path_window",
    "tree_select_nodes",
]
