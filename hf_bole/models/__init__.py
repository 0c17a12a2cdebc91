"""Model adapters: tree-mode forwards for the supported hybrid model families."""

from hf_bole.models.qwen3_5 import (
    SUPPORTED_CLASSES,
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

__all__ = [
    "SUPPORTED_CLASSES",
    "TreeBatch",
    "TreeForwardOutput",
    "attention_backends",
    "cache_argument",
    "check_supported_model",
    "graph_unsafe_experts",
    "install_adapter",
    "install_adapters",
    "tree_forward",
]
