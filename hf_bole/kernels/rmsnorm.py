"""Qwen3.5's two RMSNorms in one launch each: the zero-centred norm of the decoder layers, the attention's q and k
and the final norm (`weight` stored as an offset from 1), and the GDN layers' norm gated by SiLU of `z`.

Why: transformers runs each as about ten elementwise kernels (cast, square, mean, add, rsqrt, products, casts).
A small model's verify forward has dozens of them a round, over a third of its kernels, each a few microseconds at
a few thousand rows. One program here normalises `ROWS` rows in
registers, in float32 with transformers' roundings:

    rms_norm:        (x * rsqrt(mean(x^2) + eps) * (1 + w)).to(x.dtype)                 all in float32
    gated_rms_norm:  ((w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)) * silu(z)).to(x.dtype)
                     the normalised row rounded to x's dtype first, its product with w in their common dtype

Rows are read in place through up to two strides of the leading dims (the attention's q is a strided view of its
projection, split from the gate), so a view of a fused projection is not copied first; the output is contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hf_bole.kernels.utils import check_dtype, check_same_device, check_shape, next_power_of_2, on_device, use_triton

ROW_ELEMENTS = 4096  # a program's rows times the padded row length: 4 warps, 32 float32 a thread


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The specification of `rms_norm` (transformers' `Qwen3_5RMSNorm.forward`): `x [..., D]`, `weight [D]`."""
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).type_as(x)


def naive_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The specification of `gated_rms_norm` (transformers' `Qwen3_5RMSNormGated.forward`): `x, gate [..., D]`,
    `weight [D]`."""
    y = x.float()
    y = weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The zero-centred RMSNorm of every row of `x [..., D]` (float32, bfloat16 or float16; last dim contiguous or
    copied) with `weight [D]`: `naive_rms_norm` in one launch. Returns a contiguous tensor of x's shape and dtype.

    Triton on CUDA tensors and under `TRITON_INTERPRET=1`; `naive_rms_norm` on CPU tensors otherwise."""
    _check(x, weight, None)
    if not use_triton(x):
        return naive_rms_norm(x, weight, eps)
    return _launch(x, None, weight, eps, round_product=False)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm of every row of `x [..., D]` times SiLU of `gate` (x's shape, any float dtype): as `rms_norm`,
    for `naive_gated_rms_norm`."""
    _check(x, weight, gate)
    if not use_triton(x):
        return naive_gated_rms_norm(x, gate, weight, eps)
    # `weight * normalised` rounds to x's dtype where that is their common dtype (bf16 weights and activations)
    round_product = x.dtype != torch.float32 and torch.promote_types(weight.dtype, x.dtype) == x.dtype
    return _launch(x, gate, weight, eps, round_product)


def _check(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None) -> None:
    check_dtype("x", x, (torch.float32, torch.float16, torch.bfloat16))
    if x.dim() == 0:
        raise ValueError("x must have at least one dim, the one normalised")
    check_shape("weight", weight, (x.shape[-1],), "[D], x's last dim")
    if gate is not None:
        check_shape("gate", gate, tuple(x.shape), "x's shape")
    check_same_device(x=x, weight=weight, gate=gate)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """`x` (copied if it must be) with its leading dims as two levels of rows: (x, inner rows, outer stride, inner
    stride), row r at `(r // inner) * outer + (r % inner) * inner stride`."""
    if x.stride(-1) == 1:
        levels: list[list[int]] = []  # [rows, stride], outer to inner; dims of one merged where they tile
        for n, s in zip(x.shape[:-1], x.stride()[:-1]):
            if n == 1:
                continue
            if levels and levels[-1][1] == n * s:
                levels[-1] = [levels[-1][0] * n, s]
            else:
                levels.append([n, s])
        if len(levels) <= 2:
            levels = [[1, 0]] * (2 - len(levels)) + levels
            return x, levels[1][0], levels[0][1], levels[1][1]
    x = x.contiguous()
    return x, max(1, x.numel() // max(1, x.shape[-1])), 0, x.shape[-1]


def _launch(x, gate, weight, eps: float, round_product: bool) -> torch.Tensor:
    D = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    R = out.numel() // D if D else 0
    if R == 0:
        return out
    x, x_inner, sx_outer, sx_inner = _rows(x)
    g, g_inner, sg_outer, sg_inner = _rows(gate) if gate is not None else (x, x_inner, sx_outer, sx_inner)
    block_d = next_power_of_2(D)
    rows = max(1, min(ROW_ELEMENTS // block_d, next_power_of_2(R)))
    with on_device(x):
        rms_norm_kernel[(triton.cdiv(R, rows),)](
            x, g, weight.contiguous(), out, R, D, x_inner, sx_outer, sx_inner, g_inner, sg_outer, sg_inner, eps,
            ROWS=rows, BLOCK_D=block_d, GATED=gate is not None, ROUND_PRODUCT=round_product, num_warps=4,
        )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["R", "x_inner", "sx_outer", "sx_inner", "g_inner", "sg_outer", "sg_inner"])
def rms_norm_kernel(
    x, g, w, y, R, D, x_inner, sx_outer, sx_inner, g_inner, sg_outer, sg_inner, eps,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, GATED: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
):  # fmt: skip
    """ROWS rows of `x` (row r at `(r // x_inner) * sx_outer + (r % x_inner) * sx_inner`) normalised into `y
    [R, D]`: zero-centred (`* (1 + w)`), or with GATED times SiLU of `g`'s rows (`w *` the normalised row in x's
    dtype, the product rounded to x's dtype with ROUND_PRODUCT)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    o = tl.arange(0, BLOCK_D)
    m = (r < R)[:, None] & (o < D)[None, :]
    at = ((r // x_inner) * sx_outer + (r % x_inner) * sx_inner)[:, None] + o[None, :]
    b_x = tl.load(x + at, mask=m, other=0.0).to(tl.float32)  # [ROWS, BLOCK_D]
    b_w = tl.load(w + o, mask=o < D, other=0.0).to(tl.float32)  # [BLOCK_D]
    b_n = b_x * tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)[:, None]
    if GATED:
        b_n = b_w[None, :] * b_n.to(y.dtype.element_ty).to(tl.float32)
        if ROUND_PRODUCT:
            b_n = b_n.to(y.dtype.element_ty).to(tl.float32)
        at_g = ((r // g_inner) * sg_outer + (r % g_inner) * sg_inner)[:, None] + o[None, :]
        b_g = tl.load(g + at_g, mask=m, other=0.0).to(tl.float32)
        b_y = b_n * (b_g / (1.0 + tl.exp(-b_g)))
    else:
        b_y = b_n * (1.0 + b_w[None, :])
    tl.store(y + r[:, None] * D + o[None, :], b_y.to(y.dtype.element_ty), mask=m)
