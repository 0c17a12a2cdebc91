"""BoleCache: per-row committed state of hybrid models, and the commit of a verified tree round's accepted paths."""

from hf_bole.cache.bole_cache import BoleCache, GDNTreeState, TreeRound

__all__ = ["BoleCache", "GDNTreeState", "TreeRound"]
