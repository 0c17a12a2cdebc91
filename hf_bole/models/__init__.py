"""Model adapters: tree-mode forwards for the supported hybrid model families (`hf_bole.models.family`)."""

from hf_bole.models.adapter import (
    TreeBatch,
    TreeForwardOutput,
    attention_backends,
    cache_argument,
    check_supported_model,
    graph_unsafe_experts,
    install_adapter,
    install_adapters,
    tree_forward,
)
from hf_bole.models.family import Family, all_families, family_of

__all__ = [
    "Family",
    "TreeBatch",
    "TreeForwardOutput",
    "all_families",
    "attention_backends",
    "cache_argument",
    "check_supported_model",
    "family_of",
    "graph_unsafe_experts",
    "install_adapter",
    "install_adapters",
    "tree_forward",
]
