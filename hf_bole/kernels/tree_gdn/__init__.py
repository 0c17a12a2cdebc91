from hf_bole.kernels.tree_gdn.ancestors import tree_ancestor_mask, tree_depths, tree_masks
from hf_bole.kernels.tree_gdn.closed_form import tree_gdn_verify
from hf_bole.kernels.tree_gdn.commit import tree_gdn_commit
from hf_bole.kernels.tree_gdn.serial import tree_gdn_commit_serial, tree_gdn_verify_serial
from hf_bole.kernels.tree_gdn.tree_conv import tree_causal_conv1d, tree_conv_state_commit, tree_path_window

__all__ = [
    "tree_ancestor_mask",
    "tree_causal_conv1d",
    "tree_conv_state_commit",
    "tree_depths",
    "tree_gdn_commit",
    "tree_gdn_commit_serial",
    "tree_gdn_verify",
    "tree_gdn_verify_serial",
    "tree_masks",
    "tree_path_window",
]
