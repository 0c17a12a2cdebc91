"""The depthwise causal conv of Qwen3.5's GDN layers along tree paths, and the conv window after a path.

A node's conv sees the W - 1 inputs before it on its own root-to-node path: its ancestors, and above the
root the committed window. The window is kept in transformers' layout, `conv_state [B, D, S]` holding the
last S pre-conv inputs oldest first (transformers keeps S = W; the oldest column is then unused).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hf_bole.kernels.utils import (
    check_dtype,
    check_parents,
    check_path,
    check_same_device,
    check_shape,
    dim_contiguous,
    next_power_of_2,
    on_device,
    use_triton,
)


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.jit(do_not_specialize=["T"])
def tree_causal_conv1d_fwd_kernel(
    x,
    weight,
    bias,
    parents,
    conv_state,
    out,
    stride_xb,
    stride_xt,
    stride_sb,
    stride_sd,
    stride_ss,
    T,
    D,
    S,
    W: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_SILU: tl.constexpr,
):
    i_d, i_t, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    p_x = x + i_b * stride_xb + o_d[None, :]
    p_s = conv_state + i_b * stride_sb + o_d[None, :] * stride_sd

    b_cur = tl.where(m_t, o_t, -1)  # the r-th predecessor of each node, while it is a tree node
    b_above = tl.zeros([BT], dtype=tl.int64)  # how many steps above the root, once past it
    b_acc = tl.zeros([BT, BD], dtype=tl.float32)
    for r in tl.static_range(W):
        if r > 0:
            b_nxt = tl.load(parents + i_b * T + b_cur, mask=b_cur >= 0, other=-1)
            b_above = tl.where(b_nxt < 0, b_above + 1, b_above)
            b_cur = b_nxt
        m_node = b_cur >= 0
        m_win = ~m_node & m_t & (b_above <= S)
        b_in = tl.load(p_x + b_cur[:, None] * stride_xt, mask=m_node[:, None] & m_d[None, :], other=0).to(tl.float32)
        m_s = m_win[:, None] & m_d[None, :]
        b_in += tl.load(p_s + (S - b_above)[:, None] * stride_ss, mask=m_s, other=0).to(tl.float32)
        b_w = tl.load(weight + o_d * W + (W - 1 - r), mask=m_d, other=0).to(tl.float32)
        b_acc += b_in * b_w[None, :]
    if HAS_BIAS:
        b_acc += tl.load(bias + o_d, mask=m_d, other=0).to(tl.float32)[None, :]
    if USE_SILU:
        b_acc = b_acc * tl.sigmoid(b_acc)
    p_o = out + (i_b * T + o_t[:, None]) * D + o_d[None, :]
    tl.store(p_o, b_acc.to(p_o.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


@triton.jit
def tree_conv_state_commit_fwd_kernel(
    conv_state,
    x,
    path,
    out,
    stride_xb,
    stride_xt,
    D,
    L,
    S: tl.constexpr,
    BS: tl.constexpr,
    BL: tl.constexpr,
    BD: tl.constexpr,
):
    i_d, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_c = tl.arange(0, BS)
    o_l = tl.arange(0, BL)
    n = tl.sum((tl.load(path + i_b * L + o_l, mask=o_l < L, other=-1) >= 0).to(tl.int64), axis=0)
    # Column c of the new window is the e-th input from the end, e = S - c: a path node when e <= n,
    # otherwise column S - (e - n) of the old window. Read everything before writing (out may alias).
    b_e = S - o_c
    m_node = (b_e <= n) & (o_c < S)
    b_node = tl.load(path + i_b * L + (n - b_e), mask=m_node, other=0)  # [BS]
    b_new = tl.load(
        x + i_b * stride_xb + b_node[None, :] * stride_xt + o_d[:, None], mask=m_d[:, None] & m_node[None, :], other=0
    ).to(out.dtype.element_ty)  # [BD, BS]
    m_old = ~m_node & (o_c < S)
    p_s = (i_b * D + o_d[:, None]) * S
    b_new += tl.load(conv_state + p_s + (S - (b_e - n))[None, :], mask=m_d[:, None] & m_old[None, :], other=0)
    tl.store(out + p_s + o_c[None, :], b_new, mask=m_d[:, None] & (o_c < S)[None, :])


def _predecessors(parents: torch.Tensor, W: int) -> torch.Tensor:
    """`[B, T, W]`: the r-th predecessor of every node on its path (r = 0 is the node), as a node index
    >= 0, or -e for the e-th committed input above the root."""
    B, T = parents.shape
    cur = torch.arange(T, device=parents.device).expand(B, T)
    above = torch.zeros_like(cur)
    preds = [cur]
    for _ in range(1, W):
        nxt = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), -1)
        above = torch.where(nxt < 0, above + 1, above)
        cur = nxt
        preds.append(torch.where(cur >= 0, cur, -above))
    return torch.stack(preds, dim=-1)


def tree_path_window(x: torch.Tensor, parents: torch.Tensor, conv_state: torch.Tensor, width: int) -> torch.Tensor:
    """`[B, T, width, D]`: the last `width` inputs of every node's root-to-node path, oldest first and the node's own
    last, with the committed window above the root (what a causal conv of `width` taps reads at each node).

    Args:
        x: `[B, T, D]` the nodes' inputs.
        parents: `[B, T]` int64, `-1 <= parents[b, i] < i`.
        conv_state: `[B, D, S]` the committed window, oldest first, S >= width - 1.
    """
    B, T, D = x.shape
    S = conv_state.shape[-1]
    preds = _predecessors(parents, width).flip(-1)  # [B, T, width], the node last
    src = torch.cat([conv_state.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, S + T, D]: window, then nodes
    pos = S + preds  # node j -> S + j, the e-th input above the root (-e) -> S - e
    return src.gather(1, pos.reshape(B, T * width, 1).expand(-1, -1, D)).reshape(B, T, width, D)


def torch_tree_causal_conv1d(x, weight, bias, parents, conv_state, use_silu):
    taps = tree_path_window(x.float(), parents, conv_state, weight.shape[1])  # [B, T, W, D]
    out = (taps * weight.float().transpose(0, 1)).sum(2)  # the oldest tap pairs with weight[:, 0]
    if bias is not None:
        out = out + bias.float()
    if use_silu:
        out = F.silu(out)
    return out.to(x.dtype)


def torch_tree_conv_state_commit(conv_state, x, path, out):
    B, D, S = conv_state.shape
    n = (path >= 0).sum(1)  # [B]
    e = S - torch.arange(S, device=path.device)  # [S]
    from_node = e[None, :] <= n[:, None]  # [B, S]
    node = path.gather(1, (n[:, None] - e[None, :]).clamp(min=0)).clamp(min=0)  # [B, S], only read where from_node
    new_x = x.gather(1, node[:, :, None].expand(-1, -1, D)).transpose(1, 2).to(conv_state.dtype)  # [B, D, S]
    old_col = (S - (e[None, :] - n[:, None])).clamp(max=S - 1)
    old = conv_state.gather(2, old_col[:, None, :].expand(-1, D, -1))
    out.copy_(torch.where(from_node[:, None, :], new_x, old))
    return out


def _check_conv_state(conv_state: torch.Tensor, batch: int, dim: int, min_len: int) -> None:
    if conv_state.dim() != 3 or conv_state.shape[0] != batch or conv_state.shape[1] != dim:
        raise ValueError(f"`conv_state` must be [B, D, S] with B = {batch}, D = {dim}, got {tuple(conv_state.shape)}")
    if conv_state.shape[2] < min_len:
        raise ValueError(f"`conv_state` must hold at least W - 1 = {min_len} inputs, got S = {conv_state.shape[2]}")


def tree_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: torch.Tensor,
    conv_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv along every node's root-to-node path.

    Args:
        x: `[B, T, D]` pre-conv inputs of the tree nodes (any strides with the last dim contiguous).
        weight: `[D, W]` depthwise taps (a Conv1d weight `[D, 1, W]` squeezed).
        bias: `[D]` or None.
        parents: `[B, T]` int64, `-1 <= parents[b, i] < i`.
        conv_state: `[B, D, S]`, S >= W - 1: the committed window in transformers' layout (any strides). Not modified.
        activation: "silu" or None.

    Returns:
        `[B, T, D]` in the dtype of x; node i equals the plain causal conv over (window, path to i).

    Example:
        >>> x, w = torch.randn(1, 3, 8), torch.randn(8, 4)
        >>> out = tree_causal_conv1d(x, w, None, torch.tensor([[-1, 0, 0]]), torch.zeros(1, 8, 4))
    """
    if x.dim() != 3:
        raise ValueError(f"`x` must be [B, T, D], got {tuple(x.shape)}")
    B, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"`weight` must be [D, W] with D = {D}, got {tuple(weight.shape)}")
    W = weight.shape[1]
    if bias is not None:
        check_shape("bias", bias, (D,), "[D]")
    check_parents(parents, B, T)
    _check_conv_state(conv_state, B, D, W - 1)
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    check_same_device(x=x, weight=weight, bias=bias, parents=parents, conv_state=conv_state)
    if not use_triton(x):
        return torch_tree_causal_conv1d(x, weight, bias, parents, conv_state, activation == "silu")

    # x and conv_state are read through their strides: the GDN seam passes views of the conv input
    # ([B, D, W + N]: the window, then the nodes), which nothing needs to copy.
    x = dim_contiguous(x)
    weight, parents = weight.contiguous(), parents.contiguous()
    S = conv_state.shape[-1]
    out = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    BT, BD = min(16, max(next_power_of_2(T), 2)), 128
    grid = (triton.cdiv(D, BD), triton.cdiv(T, BT), B)
    with on_device(x):
        tree_causal_conv1d_fwd_kernel[grid](
            x, weight, bias, parents, conv_state, out, x.stride(0), x.stride(1), *conv_state.stride(), T, D, S,
            W=W, BT=BT, BD=BD, USE_SILU=activation == "silu", num_warps=4,
        )  # fmt: skip
    return out


def tree_conv_state_commit(
    conv_state: torch.Tensor,
    x: torch.Tensor,
    path: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """The conv window after each request's accepted path: the last S entries of (old window, the path's x).

    Args:
        conv_state: `[B, D, S]` committed window (transformers' layout).
        x: `[B, T, D]` pre-conv inputs of the verified nodes.
        path: `[B, L]` int64 node indices root-to-leaf, right-padded with -1 (all -1 keeps the window).
        out: where to write (may be `conv_state` itself); a new tensor by default.
        check_values: read `path` on the host to check it (False: the caller vouches for it, no synchronisation).

    Returns:
        `[B, D, S]` in the dtype of conv_state.
    """
    if conv_state.dim() != 3 or x.dim() != 3:
        raise ValueError(f"conv_state must be [B, D, S] and x [B, T, D], got {tuple(conv_state.shape)} and {tuple(x.shape)}")
    B, D, S = conv_state.shape
    T = x.shape[1]
    check_shape("x", x, (B, T, D), "[B, T, D]")
    check_path(path, B, T, check_values=check_values)
    check_same_device(conv_state=conv_state, x=x, path=path, out=out)
    if out is None:
        out = torch.empty_like(conv_state)
    else:
        check_shape("out", out, tuple(conv_state.shape), "like conv_state")
        check_dtype("out", out, (conv_state.dtype,))
    if not use_triton(x):
        return torch_tree_conv_state_commit(conv_state, x, path, out)
    if not (out.is_contiguous() and conv_state.is_contiguous()):
        raise ValueError("conv_state and out must be contiguous [B, D, S]")
    x = dim_contiguous(x)
    L = path.shape[1]
    BD = 128
    with on_device(x):
        tree_conv_state_commit_fwd_kernel[(triton.cdiv(D, BD), B)](
            conv_state, x, path.contiguous(), out, x.stride(0), x.stride(1), D, L,
            S=S, BS=next_power_of_2(S), BL=max(2, next_power_of_2(L)), BD=BD, num_warps=4,
        )  # fmt: skip
    return out
