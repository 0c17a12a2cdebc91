"""Drafters: the protocol any drafter follows, and the built-in weight-free n-gram drafter."""

from hf_bole.generation.drafters.base import DraftContext, Drafter
from hf_bole.generation.drafters.ngram import NgramDrafter

__all__ = ["DraftContext", "Drafter", "NgramDrafter"]
