from hf_bole.kernels.tree_kda.closed_form import tree_kda_verify
from hf_bole.kernels.tree_kda.commit import tree_kda_commit
from hf_bole.kernels.tree_kda.serial import tree_kda_verify_serial

__all__ = ["tree_kda_commit", "tree_kda_verify", "tree_kda_verify_serial"]
