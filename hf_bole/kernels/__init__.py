"""Exact tree verification kernels for Gated DeltaNet, Kimi Delta Attention and full-attention layers (Triton, with
torch paths and naive references)."""

from hf_bole.kernels.attention import tree_attention
from hf_bole.kernels.kv_move import kv_commit
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
)
from hf_bole.kernels.tree_kda import tree_kda_commit, tree_kda_verify

__all__ = [
    "kv_commit",
    "tree_ancestor_mask",
    "tree_attention",
    "tree_causal_conv1d",
    "tree_conv_state_commit",
    "tree_depths",
    "tree_gdn_commit",
    "tree_gdn_commit_serial",
    "tree_gdn_verify",
    "tree_gdn_verify_serial",
    "tree_kda_commit",
    "tree_kda_verify",
    "tree_masks",
]
