"""The RMSNorms of an eager verify forward, one kernel each (`kernels/rmsnorm.py`).

Qwen3.5's decoder runs an RMSNorm before every attention and MLP, on the attention's q and k, inside every GDN
layer (gated by SiLU of `z`) and at the end: 27 a forward on the house model, each about ten elementwise kernels in
transformers' form, over a third of a verify forward's kernels.

An eager `tree_forward` runs a twin of the decoder (`models/twin.py`) in which each such module is a `_FusedNorm`
that calls `rms_norm` / `gated_rms_norm` with the module's own weight and eps (read at every call, so a weight moved
or loaded since is the one used) (`norm_stand_ins`); the model's own modules are never swapped. A module stays as it
is, and a log line says which and why, when accelerate hooks it or its weight is offloaded. A compiled forward does
not take them: inductor fuses each norm with its neighbours (the residual add before it), which an opaque op in its
place would prevent.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.utils import logging

from hf_bole.kernels.rmsnorm import gated_rms_norm, rms_norm

logger = logging.get_logger(__name__)

# Exact classes (a subclass may compute something else): `(1 + weight)` norms, and norms gated by SiLU.
ZERO_CENTRED = (modeling_qwen3_5.Qwen3_5RMSNorm, modeling_qwen3_5_moe.Qwen3_5MoeRMSNorm)
GATED = (modeling_qwen3_5.Qwen3_5RMSNormGated, modeling_qwen3_5_moe.Qwen3_5MoeRMSNormGated)


class _FusedNorm(nn.Module):
    """Stands in for one norm module in tree mode: its formula in one kernel."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        object.__setattr__(self, "norm", norm)  # not a submodule: the model's state dict stays as it was
        self.gated = isinstance(norm, GATED)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        norm = self.norm
        if self.gated:
            return gated_rms_norm(x, gate, norm.weight, norm.variance_epsilon)
        return rms_norm(x, norm.weight, norm.eps)


def _why_not(norm: nn.Module) -> str | None:
    """Why `norm` keeps its own forward, or None."""
    if hasattr(norm, "_hf_hook"):
        return "accelerate hooks it"
    if norm.weight.device.type == "meta":
        return "its weight is offloaded (meta device)"
    if isinstance(norm, GATED) and norm.activation != "silu":
        return f"its gate's activation is {norm.activation!r}, not 'silu'"
    return None


# decoders whose norms that keep their forward were named in a log line
_SAID: weakref.WeakSet = weakref.WeakSet()


def norm_stand_ins(decoder: nn.Module) -> dict[tuple[nn.Module, str], _FusedNorm]:
    """What a tree twin of `decoder` (`models/twin.py`) holds in place of its Qwen3.5 RMSNorms: `{(parent, name):
    stand-in}`. Says once per decoder, in a log line, which norms keep their forward."""
    stand_ins, apart = {}, []
    for parent_name, parent in decoder.named_modules():
        for name, norm in parent._modules.items():
            if type(norm) not in ZERO_CENTRED + GATED:
                continue
            reason = _why_not(norm)
            if reason is None:
                stand_ins[parent, name] = _FusedNorm(norm)
            else:
                apart.append(f"{parent_name}.{name} ({reason})".lstrip("."))
    if apart and decoder not in _SAID:
        _SAID.add(decoder)
        logger.warning(
            f"hf_bole: {len(apart)} of {len(apart) + len(stand_ins)} RMSNorms keep transformers' forward (about ten "
            f"kernels each) in the verify forward: {', '.join(apart[:3])}{', ...' if len(apart) > 3 else ''}"
        )
    return stand_ins
