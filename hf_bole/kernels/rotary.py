"""Qwen3.5's rotary embedding of the attention's q and k in one launch, bit for bit transformers'
`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`.

Why: transformers runs it as about twelve elementwise kernels per attention layer (for q and for k: the two
products, the negation and the `cat` of `rotate_half`, their sum and the `cat` that puts the pass-through dims
back), each a launch over a few thousand rows at most while verifying a tree. Here one launch reads q and k in
place (they arrive as `.transpose(1, 2)` views of `[B, N, heads, D]` projections) and writes both contiguous
outputs, the rotated dims and the pass-through ones.

Partial rotary: `cos, sin [B, N, R]` with R <= D (Qwen3.5: D 256, R 64); the first R dims of each head are rotated,
the other D - R pass through unchanged. Rounding, as torch's eager ops round each result to the tensors' dtype:

    y[:R] = ((x[:R] * cos).to(dtype) + (rotate_half(x[:R]) * sin).to(dtype)).to(dtype)    products and sum in float32

`rotate_half` only negates and moves (exact); a product of two bfloat16 or float16 values is exact in float32, so
each rounded product is torch's; their float32 sum rounded is torch's sum. For float32 inputs nothing is rounded
but each operation itself, and the launch turns off the fusion of product and sum into an FMA (one rounding fewer
than torch's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_bole.kernels.utils import check_dtype, check_same_device, check_shape, next_power_of_2, on_device, use_triton

ROW_ELEMENTS = 4096  # a program's rows times the padded head dim: 4 warps, 32 elements a thread


def naive_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification of `rotary` (transformers' `apply_rotary_pos_emb` with `unsqueeze_dim=1`): `q [B, H, N,
    D]`, `k [B, Hk, N, D]`, `cos, sin [B, N, R]`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, N, R], broadcast over the heads
    R = cos.shape[-1]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., R // 2 :], x[..., : R // 2]), dim=-1)

    def embed(x: torch.Tensor) -> torch.Tensor:
        rot = x[..., :R]
        return torch.cat([rot * cos + rotate_half(rot) * sin, x[..., R:]], dim=-1)

    return embed(q), embed(k)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of `q [B, H, N, D]` and `k [B, Hk, N, D]` (one dtype: float32, bfloat16 or float16;
    any strides, the last dim contiguous or copied) by `cos, sin [B, N, R]` (q's dtype, R even and <= D): the first
    R dims of every head rotated, the rest copied. Returns `(q_embed, k_embed)`, new contiguous tensors of q's and
    k's shapes and dtype, equal to `naive_rotary`'s bit for bit.

    Triton on CUDA tensors and under `TRITON_INTERPRET=1`; `naive_rotary` on CPU tensors otherwise."""
    _check(q, k, cos, sin)
    if not use_triton(q):
        return naive_rotary(q, k, cos, sin)
    return _launch(q, k, cos, sin)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_dtype("q", q, (torch.float32, torch.float16, torch.bfloat16))
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.dtype != q.dtype:  # torch would promote the mixed products, and the outputs, to the wider dtype
            raise ValueError(f"`{name}` must have q's dtype {_name(q.dtype)}, got {_name(t.dtype)}")
    if q.dim() != 4:
        raise ValueError(f"`q` must have shape [B, H, N, D], got {tuple(q.shape)}")
    B, _, N, D = q.shape
    if k.dim() != 4:
        raise ValueError(f"`k` must have shape [B, Hk, N, D], got {tuple(k.shape)}")
    check_shape("k", k, (B, k.shape[1], N, D), "[B, Hk, N, D] with q's B, N, D")
    if cos.dim() != 3:
        raise ValueError(f"`cos` must have shape [B, N, R], got {tuple(cos.shape)}")
    R = cos.shape[-1]
    check_shape("cos", cos, (B, N, R), "[B, N, R] with q's B, N")
    check_shape("sin", sin, (B, N, R), "[B, N, R], cos's shape")
    if R % 2 or R > D:
        raise ValueError(f"the rotary dim R (cos's last dim) must be even and at most D = {D}, got R = {R}")
    check_same_device(q=q, k=k, cos=cos, sin=sin)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _launch(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, N, D = q.shape
    Hk, R = k.shape[1], cos.shape[-1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    rows_q, rows_k = B * H * N, B * Hk * N  # a row: one head of one token, D elements
    if D == 0 or rows_q + rows_k == 0:
        return q_out, k_out
    # every stride but the last is read as given (the transposed views of the projections stay in place)
    q, k, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, cos, sin))
    block_d = next_power_of_2(D)
    rows = max(1, min(ROW_ELEMENTS // block_d, next_power_of_2(max(rows_q, rows_k))))
    programs_q = triton.cdiv(rows_q, rows)
    with on_device(q):
        rotary_kernel[(programs_q + triton.cdiv(rows_k, rows),)](
            q, k, cos, sin, q_out, k_out, N, H, Hk, D, rows_q, rows_k, programs_q,
            *q.stride()[:3], *k.stride()[:3], *cos.stride()[:2], *sin.stride()[:2],
            R=R, ROWS=rows, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return q_out, k_out


@triton.jit
def _rotate_rows(
    x, y, cos, sin, row0, rows_x, N, heads, D, sx_b, sx_h, sx_n, sc_b, sc_n, ss_b, ss_n,
    R: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows `row0 ..` of `x [B, heads, N, D]` (row r = ((b * heads) + h) * N + n, y's contiguous order) rotated by
    `cos, sin [B, N, R]` into `y`."""
    r = row0 + tl.arange(0, ROWS)  # [ROWS]
    n = r % N
    b = r // N // heads
    h = (r // N) % heads
    o = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    is_rot = o < R
    HALF: tl.constexpr = R // 2
    # rotate_half: the first half takes minus the second, the second the first
    partner = tl.where(o < HALF, o + HALF, o - HALF)
    live = (r < rows_x)[:, None]
    m = live & (o < D)[None, :]  # [ROWS, BLOCK_D]
    m_rot = live & is_rot[None, :]
    at = (b * sx_b + h * sx_h + n * sx_n)[:, None]
    b_x = tl.load(x + at + o[None, :], mask=m, other=0.0)
    b_p = tl.load(x + at + partner[None, :], mask=m_rot, other=0.0).to(tl.float32)
    b_c = tl.load(cos + (b * sc_b + n * sc_n)[:, None] + o[None, :], mask=m_rot, other=0.0).to(tl.float32)
    b_s = tl.load(sin + (b * ss_b + n * ss_n)[:, None] + o[None, :], mask=m_rot, other=0.0).to(tl.float32)
    b_p = tl.where((o < HALF)[None, :], -b_p, b_p)
    # each product rounded to the dtype as torch's `q_rot * cos` and `rotate_half(q_rot) * sin` are, then their sum
    dt = y.dtype.element_ty
    b_xc = (b_x.to(tl.float32) * b_c).to(dt).to(tl.float32)
    b_ps = (b_p * b_s).to(dt).to(tl.float32)
    b_y = tl.where(is_rot[None, :], (b_xc + b_ps).to(dt), b_x)  # the dims past R pass through as loaded
    tl.store(y + r[:, None] * D + o[None, :], b_y, mask=m)


@triton.jit(do_not_specialize=["N", "rows_q", "rows_k", "programs_q", "sq_b", "sq_n", "sk_b", "sk_n", "sc_b", "ss_b"])
def rotary_kernel(
    q, k, cos, sin, q_out, k_out, N, H, Hk, D, rows_q, rows_k, programs_q,
    sq_b, sq_h, sq_n, sk_b, sk_h, sk_n, sc_b, sc_n, ss_b, ss_n,
    R: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The first `programs_q` programs rotate ROWS rows each of q into `q_out [B, H, N, D]`, the others of k into
    `k_out [B, Hk, N, D]`: one launch for both."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < programs_q:
        _rotate_rows(
            q, q_out, cos, sin, pid * ROWS, rows_q, N, H, D, sq_b, sq_h, sq_n, sc_b, sc_n, ss_b, ss_n,
            R=R, ROWS=ROWS, BLOCK_D=BLOCK_D,
        )  # fmt: skip
    else:
        _rotate_rows(
            k, k_out, cos, sin, (pid - programs_q) * ROWS, rows_k, N, Hk, D, sk_b, sk_h, sk_n, sc_b, sc_n, ss_b,
            ss_n, R=R, ROWS=ROWS, BLOCK_D=BLOCK_D,
        )  # fmt: skip
