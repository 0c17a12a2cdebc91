"""The rotary embedding of an eager verify forward in one kernel per attention layer (`kernels/rotary.py`).

transformers' `apply_rotary_pos_emb` runs about twelve elementwise kernels per full-attention layer (the products,
`rotate_half`'s negation and `cat`, the sum, the `cat` of the pass-through dims, for q and for k): 24 of a house-model
verify forward's ~258 kernels, 96 on the 9B shape's eight attention layers; here they are one launch each.

Inside `rotary_fused()`, which an eager `tree_forward` enters, the Qwen3.5 modeling modules' `apply_rotary_pos_emb`
(a module global their attention layers look up at every call) is a stand-in that calls `rotary` (bit for bit the
same result); on exit the functions it found are back. A call it does not cover (another `unsqueeze_dim`, mixed
dtypes, other ranks) goes to the original, and a log line says so once. A compiled forward does not enter it:
inductor fuses the rotary embedding itself, and tracing the swap would put a Triton launch into its graph.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.utils import logging

from hf_bole.kernels.rotary import rotary

logger = logging.get_logger(__name__)

MODULES = (modeling_qwen3_5, modeling_qwen3_5_moe)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _uncovered(q, k, cos, sin, unsqueeze_dim) -> str | None:
    """Why `rotary` does not take this call, or None."""
    if unsqueeze_dim != 1:
        return f"unsqueeze_dim={unsqueeze_dim}"
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        return f"q, k, cos, sin of {q.dim()}, {k.dim()}, {cos.dim()}, {sin.dim()} dims (not 4, 4, 3, 3)"
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) > 1 or q.dtype not in DTYPES:
        return f"dtypes {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}"
    return None


@functools.cache
def _stand_in(original):
    """`original` (the module's `apply_rotary_pos_emb` when the context was entered) as one `rotary` launch."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        reason = _uncovered(q, k, cos, sin, unsqueeze_dim)
        if reason is not None:
            logger.warning_once(
                f"hf_bole: a rotary embedding of the verify forward runs as transformers' elementwise kernels "
                f"({reason})"
            )
            return original(q, k, cos, sin, unsqueeze_dim)
        return rotary(q, k, cos, sin)  # [B, H, N, D], [B, Hk, N, D] contiguous, as transformers' `cat` returns them

    apply_rotary_pos_emb.__hf_bole_original__ = original
    return apply_rotary_pos_emb


@contextlib.contextmanager
def rotary_fused():
    """A context in which the Qwen3.5 attention layers' rotary embeddings run as one kernel each."""
    entered = {module: module.apply_rotary_pos_emb for module in MODULES}
    for module, current in entered.items():
        if getattr(current, "__hf_bole_original__", None) is None:  # not ours already (a context inside one)
            module.apply_rotary_pos_emb = _stand_in(current)
    try:
        yield
    finally:
        for module, current in entered.items():
            module.apply_rotary_pos_emb = current
