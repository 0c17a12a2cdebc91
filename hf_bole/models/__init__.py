"""Model adapters: tree-mode forwards for the supported hybrid model families."""

from hf_bole.models.adapter import (
    SUPPORTED_CLASSES,
    TreeBatch,
    TreeForwardOutput,
    attention_backends,
    cache_argument,
    check_supported_model,
    graph_unsafe_experts,
    install_adapter,
    tree_forward,
)
from hf_bole.models.placement import Placement, execution_device, placement

__all__ = [
    "Placement",
    "SUPPORTED_CLASSES",
    "TreeBatch",
    "TreeForwardOutput",
    "attention_backends",
    "cache_argument",
    "check_supported_model",
    "execution_device",
    "graph_unsafe_experts",
    "install_adapter",
    "placement",
    "tree_forward",
]
