"""hf_bole: fast, exact tree speculative decoding for hybrid-attention (Gated DeltaNet) models in transformers.

    import hf_bole
    model.generate(input_ids, custom_generate="hf_bole", max_new_tokens=128)
"""

from hf_bole.cache import BoleCache
from hf_bole.config import BoleConfig
from hf_bole.generation import DraftContext, DraftTree, NgramDrafter
from hf_bole.generation.entry import generate, install_generate_hooks, release
from hf_bole.generation.output import BoleGenerateOutput
from hf_bole.generation.warmup import warmup
from hf_bole.models import install_adapters

install_generate_hooks()
install_adapters()

__all__ = [
    "BoleCache", "BoleConfig", "BoleGenerateOutput", "DraftContext", "DraftTree", "NgramDrafter", "generate", "release",
    "warmup",
]  # fmt: skip
