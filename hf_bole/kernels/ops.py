"""The tree kernels (and the drafter's attention and top-k) as `torch.library` custom ops, for a `torch.compile`d
verify forward (and drafting round).

Dynamo cannot trace a Triton launcher that checks its inputs and picks configs on the host. Left as a
`torch.compiler.disable`d call, each kernel splits the model's graph: a 32-layer Qwen3.5 compiled into about a hundred
graphs, with nothing fused across the cuts. As custom ops the kernels are opaque nodes of one graph: their fake
(meta) forms below give the output shapes, and at run time the op calls the same function as an eager forward.

Same signatures as the functions in `hf_bole.kernels`, keyword arguments included.
"""

from typing import Optional  # the op schemas are read from these annotations at run time: no `X | None`

import torch

from hf_bole.kernels.attention import masked_attention as _masked_attention
from hf_bole.kernels.attention import tree_attention as _tree_attention
from hf_bole.kernels.topk import row_topk as _row_topk
from hf_bole.kernels.tree_gdn import tree_causal_conv1d as _tree_causal_conv1d
from hf_bole.kernels.tree_gdn import tree_gdn_verify as _tree_gdn_verify
from hf_bole.kernels.tree_gdn import tree_gdn_verify_serial as _tree_gdn_verify_serial
from hf_bole.kernels.tree_kda import tree_kda_verify as _tree_kda_verify
from hf_bole.kernels.tree_kda import tree_kda_verify_serial as _tree_kda_verify_serial


@torch.library.custom_op("hf_bole::tree_gdn_verify", mutates_args=())
def _verify_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    initial_state: Optional[torch.Tensor],
    ancestors: Optional[torch.Tensor],
    scale: Optional[float],
    use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _tree_gdn_verify(
        q, k, v, g, beta, parents, initial_state,
        scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, ancestors=ancestors,
    )  # fmt: skip


@_verify_op.register_fake
def _(q, k, v, g, beta, parents, initial_state, ancestors, scale, use_qk_l2norm_in_kernel):
    B, T, H, V = v.shape
    return torch.empty_like(v), v.new_empty(B, T, H, V, dtype=torch.float32), v.new_empty(B, T, H, dtype=torch.float32)


@torch.library.custom_op("hf_bole::tree_gdn_verify_serial", mutates_args=())
def _verify_serial_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    initial_state: Optional[torch.Tensor],
    scale: Optional[float],
    use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # one op for both recurrences' walks: g [B, T, H] (GDN) or [B, T, H, K] (KDA), the same outputs
    verify_serial = _tree_kda_verify_serial if g.dim() == 4 else _tree_gdn_verify_serial
    return verify_serial(
        q, k, v, g, beta, parents, initial_state, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel
    )


@_verify_serial_op.register_fake
def _(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm_in_kernel):
    B, T, H, V = v.shape
    return torch.empty_like(v), v.new_empty(B, T, H, k.shape[-1], V, dtype=torch.float32)


@torch.library.custom_op("hf_bole::tree_kda_verify", mutates_args=())
def _kda_verify_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    initial_state: Optional[torch.Tensor],
    scale: Optional[float],
    use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _tree_kda_verify(
        q, k, v, g, beta, parents, initial_state, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel
    )


@_kda_verify_op.register_fake
def _(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm_in_kernel):
    return torch.empty_like(v), v.new_empty(v.shape, dtype=torch.float32)


@torch.library.custom_op("hf_bole::tree_causal_conv1d", mutates_args=())
def _conv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    parents: torch.Tensor,
    conv_state: torch.Tensor,
    activation: Optional[str],
) -> torch.Tensor:
    return _tree_causal_conv1d(x, weight, bias, parents, conv_state, activation)


@_conv_op.register_fake
def _(x, weight, bias, parents, conv_state, activation):
    return x.new_empty(x.shape)


@torch.library.custom_op("hf_bole::tree_attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    valid: torch.Tensor,
    ancestors: torch.Tensor,
    scale: Optional[float],
) -> torch.Tensor:
    return _tree_attention(q, k, v, lengths, valid, ancestors, scale=scale)


@_attention_op.register_fake
def _(q, k, v, lengths, valid, ancestors, scale):
    B, H, N, D = q.shape
    return q.new_empty(B, N, H, D)


@torch.library.custom_op("hf_bole::masked_attention", mutates_args=())
def _masked_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: Optional[float],
    lengths: Optional[torch.Tensor],
) -> torch.Tensor:
    return _masked_attention(q, k, v, mask, scale=scale, lengths=lengths)


@_masked_attention_op.register_fake
def _(q, k, v, mask, scale, lengths):
    B, H, Q, D = q.shape
    return q.new_empty(B, Q, H, D)


@torch.library.custom_op("hf_bole::row_topk", mutates_args=())
def _topk_op(x: torch.Tensor, k: int, log_softmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _row_topk(x, k, log_softmax)


@_topk_op.register_fake
def _(x, k, log_softmax):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape, dtype=torch.float32), x.new_empty(shape, dtype=torch.int64)


def tree_gdn_verify(
    q, k, v, g, beta, parents, initial_state, *, scale=None, use_qk_l2norm_in_kernel=False, ancestors=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hf_bole.kernels.tree_gdn_verify` (default `dot_precision`) as one node of a compiled graph."""
    return _verify_op(q, k, v, g, beta, parents, initial_state, ancestors, scale, use_qk_l2norm_in_kernel)


def tree_gdn_verify_serial(
    q, k, v, g, beta, parents, initial_state, *, scale=None, use_qk_l2norm_in_kernel=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hf_bole.kernels.tree_gdn_verify_serial` as one node of a compiled graph."""
    return _verify_serial_op(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm_in_kernel)


def tree_kda_verify(
    q, k, v, g, beta, parents, initial_state, *, scale=None, use_qk_l2norm_in_kernel=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hf_bole.kernels.tree_kda_verify` (default `dot_precision`) as one node of a compiled graph."""
    return _kda_verify_op(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm_in_kernel)


def tree_kda_verify_serial(
    q, k, v, g, beta, parents, initial_state, *, scale=None, use_qk_l2norm_in_kernel=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hf_bole.kernels.tree_kda_verify_serial` as one node of a compiled graph."""
    return _verify_serial_op(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm_in_kernel)


def tree_causal_conv1d(x, weight, bias, parents, conv_state, activation="silu") -> torch.Tensor:
    """`hf_bole.kernels.tree_causal_conv1d` as one node of a compiled graph."""
    return _conv_op(x, weight, bias, parents, conv_state, activation)


def tree_attention(q, k, v, lengths, valid, ancestors, *, scale=None) -> torch.Tensor:
    """`hf_bole.kernels.tree_attention` (default split) as one node of a compiled graph."""
    return _attention_op(q, k, v, lengths, valid, ancestors, scale)


def masked_attention(q, k, v, mask, *, scale=None, lengths=None) -> torch.Tensor:
    """`hf_bole.kernels.attention.masked_attention` as one node of a compiled graph (the MTP drafter's rounds)."""
    return _masked_attention_op(q, k, v, mask, scale, lengths)


def row_topk(x, k, log_softmax=False) -> tuple[torch.Tensor, torch.Tensor]:
    """`hf_bole.kernels.topk.row_topk` as one node of a compiled graph (the MTP drafter's rounds)."""
    return _topk_op(x, k, log_softmax)
