"""The rotary embedding of an eager verify forward in one kernel per attention layer (`kernels/rotary.py`).

transformers' `apply_rotary_pos_emb` runs about twelve elementwise kernels per full-attention layer (the products,
`rotate_half`'s negation and `cat`, the sum, the `cat` of the pass-through dims, for q and for k): 24 of a house-model
verify forward's ~258 kernels, 96 on the 9B shape's eight attention layers; here they are one launch each.

The `apply_rotary_pos_emb` of the modeling modules of the families whose formula it is (`Family.rotary`: Qwen3.5,
Qwen3-Next, Lara-Mini; a module global their attention layers look up at every call) is wrapped once per process
(`install`): inside `rotary_fused()`, which an eager `tree_forward` enters, the wrapper
calls `rotary` (bit for bit the same result) for the calls made in that thread; every other call, from any other
thread or outside the context, goes to transformers' function. A call it does not cover (another `unsqueeze_dim`,
mixed dtypes, other ranks) goes there too, and a log line says so once. A compiled forward does not enter it:
inductor fuses the rotary embedding itself, and tracing the kernel would put a Triton launch into its graph.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from transformers.utils import logging

from hf_bole.kernels.rotary import rotary
from hf_bole.models.family import all_families

logger = logging.get_logger(__name__)

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


class _Fused(threading.local):
    """Whether this thread is inside `rotary_fused()`."""

    on = False


_FUSED = _Fused()


def _stand_in(original):
    """`original` (the module's `apply_rotary_pos_emb`), as one `rotary` launch inside `rotary_fused()`."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not _FUSED.on:
            return original(q, k, cos, sin, unsqueeze_dim)
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


@functools.cache
def modules() -> tuple:
    """The modeling modules whose `apply_rotary_pos_emb` `rotary` computes: those of the families with `rotary` that
    this transformers version ships."""
    return tuple(f.module(t) for f in all_families() if f.rotary and f.available for t in f.modules)


def install() -> None:
    """Wraps the modeling modules' `apply_rotary_pos_emb` (once per process)."""
    for module in modules():
        current = module.apply_rotary_pos_emb
        if getattr(current, "__hf_bole_original__", None) is None:
            module.apply_rotary_pos_emb = _stand_in(current)


@contextlib.contextmanager
def rotary_fused():
    """A context in which this thread's calls of the attention layers' rotary embeddings (of the `modules()`) run as
    one kernel each."""
    install()
    outer, _FUSED.on = _FUSED.on, True
    try:
        yield
    finally:
        _FUSED.on = outer
