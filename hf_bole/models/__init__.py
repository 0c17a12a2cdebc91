"""Model adapters: tree-mode forwards for the supported hybrid model families (`hf_bole.models.family`)."""

from hf_bole.models.adapter import (
    TreeBatch,
    TreeForwardOutput,
    attention_backends,
    cache_argument,
    check_supported_model,
    graph_unsafe_experts,
    install_adapter,
    tree_forward,
)
from hf_bole.models.family import Family, all_families, family_of
from hf_bole.models.placement import Placement, execution_device, placement

__all__ = [
    "Family",
    "Placement",
    "TreeBatch",
    "TreeForwardOutput",
    "all_families",
    "attention_backends",
    "cache_argument",
    "check_supported_model",
    "execution_device",
    "family_of",
    "graph_unsafe_experts",
    "install_adapter",
    "placement",
    "tree_forward",
]
