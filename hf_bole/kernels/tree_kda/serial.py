"""The baseline other engines would use for tree drafts on KDA models (SGLang-Tree's algorithm): walk the nodes in
order, read the parent's state from a snapshot buffer, write every node's full K x V state back to it. The walk is
the GDN one (`tree_gdn/serial.py`) with a decay per key channel; the commit is a copy of the accepted leaf's snapshot
(`tree_gdn_commit_serial`). Exact, but it moves T x K x V x 4 bytes per head per layer: the benchmark's baseline and a
second oracle in tests.
"""

from __future__ import annotations

import torch

from hf_bole.kernels.tree_gdn.serial import serial_walk
from hf_bole.kernels.utils import check_parents, check_shape


def tree_kda_verify_serial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Node-by-node tree verification through a KDA layer with a full state snapshot per node (the SGLang-Tree
    baseline).

    Takes the arguments of `tree_kda_verify` and returns `o [B, T, H, V]` (dtype of v) and
    `states [B, T, H, K, V]` float32, the state after every node. Commit with `tree_gdn_commit_serial`.
    """
    B, T, HK, K = k.shape
    H = v.shape[-2]
    check_shape("q", q, (B, T, HK, K), "[B, T, Hk, K]")
    check_shape("g", g, (B, T, H, K), "[B, T, H, K]")
    check_shape("beta", beta, (B, T, H), "[B, T, H]")
    check_parents(parents, B, T)
    return serial_walk(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm_in_kernel)
