"""The RMSNorms of an eager verify forward, one kernel each (`kernels/rmsnorm.py`).

Qwen3.5's decoder runs an RMSNorm before every attention and MLP, on the attention's q and k, inside every GDN
layer (gated by SiLU of `z`) and at the end: 27 a forward on the house model, each about ten elementwise kernels in
transformers' form, over a third of a verify forward's kernels. The classes stood in for are the family's
(`Family.zero_centred_norms`, `Family.gated_norms`): those whose forward the kernels compute bit for bit.

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
from transformers.utils import logging

from hf_bole.kernels.rmsnorm import gated_rms_norm, rms_norm
from hf_bole.models.family import family_of

logger = logging.get_logger(__name__)


class _FusedNorm(nn.Module):
    """Stands in for one norm module in tree mode: its formula in one kernel."""

    def __init__(self, norm: nn.Module, gated: bool):
        super().__init__()
        object.__setattr__(self, "norm", norm)  # not a submodule: the model's state dict stays as it was
        self.gated = gated

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        norm = self.norm
        if self.gated:
            return gated_rms_norm(x, gate, norm.weight, norm.variance_epsilon)
        return rms_norm(x, norm.weight, norm.eps)


def _why_not(norm: nn.Module, gated: bool) -> str | None:
    """Why `norm` keeps its own forward, or None."""
    if hasattr(norm, "_hf_hook"):
        return "accelerate hooks it"
    if norm.weight.device.type == "meta":
        return "its weight is offloaded (meta device)"
    if gated and norm.activation != "silu":
        return f"its gate's activation is {norm.activation!r}, not 'silu'"
    return None


# decoders whose norms that keep their forward were named in a log line
_SAID: weakref.WeakSet = weakref.WeakSet()


def norm_stand_ins(decoder: nn.Module) -> dict[tuple[nn.Module, str], _FusedNorm]:
    """What a tree twin of `decoder` (`models/twin.py`) holds in place of its family's RMSNorms: `{(parent, name):
    stand-in}`. Says once per decoder, in a log line, which norms keep their forward."""
    zero_centred, gated = family_of(decoder.config).norm_classes()
    stand_ins, apart = {}, []
    for parent_name, parent in decoder.named_modules():
        for name, norm in parent._modules.items():
            # exact classes: a subclass may compute something else
            if type(norm) not in zero_centred + gated:
                continue
            reason = _why_not(norm, type(norm) in gated)
            if reason is None:
                stand_ins[parent, name] = _FusedNorm(norm, type(norm) in gated)
            else:
                apart.append(f"{parent_name}.{name} ({reason})".lstrip("."))
    if apart and decoder not in _SAID:
        _SAID.add(decoder)
        logger.warning(
            f"hf_bole: {len(apart)} of {len(apart) + len(stand_ins)} RMSNorms keep transformers' forward (about ten "
            f"kernels each) in the verify forward: {', '.join(apart[:3])}{', ...' if len(apart) > 3 else ''}"
        )
    return stand_ins
