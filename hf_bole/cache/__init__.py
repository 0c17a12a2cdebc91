"""BoleCache: per-row committed state of hybrid models, tree-round scratch, and the commit of accepted paths."""

from hf_bole.cache.bole_cache import BoleCache, GDNTreeState

__all__ = ["BoleCache", "GDNTreeState"]
