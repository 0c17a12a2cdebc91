"""The architectures hf_bole verifies trees on, one file each (see `hf_bole.models.family`)."""

from hf_bole.models.families.bailing_hybrid import BAILING_HYBRID
from hf_bole.models.families.glm5_next import GLM5_NEXT
from hf_bole.models.families.kimi_linear import KIMI_LINEAR
from hf_bole.models.families.lara_mini import LARA_MINI
from hf_bole.models.families.olmo_hybrid import OLMO_HYBRID
from hf_bole.models.families.qwen3_5 import QWEN3_5
from hf_bole.models.families.qwen3_next import QWEN3_NEXT
from hf_bole.models.families.qwen4_exp import QWEN4_EXP

FAMILIES = (QWEN3_5, QWEN3_NEXT, OLMO_HYBRID, LARA_MINI, KIMI_LINEAR, BAILING_HYBRID, QWEN4_EXP, GLM5_NEXT)

__all__ = [
    "BAILING_HYBRID", "FAMILIES", "GLM5_NEXT", "KIMI_LINEAR", "LARA_MINI", "OLMO_HYBRID", "QWEN3_5", "QWEN3_NEXT",
    "QWEN4_EXP",
]  # fmt: skip
