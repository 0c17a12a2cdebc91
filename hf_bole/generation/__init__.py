"""Tree speculative decoding, model-independent parts: draft trees, selection, acceptance, drafters."""

from hf_bole.generation.acceptance import (
    CONTEXT_FREE_PROCESSORS,
    Acceptance,
    accept_greedy,
    accept_sampling,
    check_logits_processor,
    is_context_free,
    process_logits,
    sample_tokens,
)
from hf_bole.generation.drafters import DraftContext, Drafter, NgramDrafter
from hf_bole.generation.select import select_nodes
from hf_bole.generation.tree import DraftTree, VerifyTree

__all__ = [
    "CONTEXT_FREE_PROCESSORS",
    "Acceptance",
    "DraftContext",
    "DraftTree",
    "Drafter",
    "NgramDrafter",
    "VerifyTree",
    "accept_greedy",
    "accept_sampling",
    "check_logits_processor",
    "is_context_free",
    "process_logits",
    "sample_tokens",
    "select_nodes",
]
