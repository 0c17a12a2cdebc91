"""The `k` largest entries of every row, optionally as log-probabilities (log-softmax over the row): the MTP drafter's
top-k over the vocabulary, one launch per split of the row and one merge.

Why: `torch.topk` with a small `k` over a row of thousands runs a radix select and then sorts what it found, two
kernels a call, a large share of a small model's drafting round, and the log-softmax before it is a third. Here each program holds `BLOCK` entries of a row in registers, takes their max and exp-sum and
picks its `k` best by `k` max-reductions; a merge program per row combines the splits' sums into the log-sum-exp
and picks the row's `k` best among the splits' `splits * k`. A row that fits one block is done in one launch.

Order: values descending; equal values by ascending index (`torch.topk` leaves ties unordered). NaN entries are
never picked (`torch.topk` ranks them first): a row with fewer than `k` other entries gets index -1 for the rest.
Values are float32 whatever the input's dtype, as `x.float().log_softmax(-1).topk(k)` gives them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_bole.kernels.utils import check_dtype, next_power_of_2, on_device, use_triton

BLOCK = 1024  # entries a program holds in registers (4 warps: 8 a thread)
MAX_K = 16  # the merge holds `splits * k` candidates in one block


def naive_row_topk(x: torch.Tensor, k: int, log_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification: `x [..., V]` -> values float32 and indices int64, each `[..., k]`, values descending."""
    x = x.float()
    return (x.log_softmax(-1) if log_softmax else x).topk(k, dim=-1)


def row_topk(x: torch.Tensor, k: int, log_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest entries of every row of `x [..., V]` (float32, bfloat16 or float16): values `[..., k]`
    float32 (with `log_softmax`, of `x.float().log_softmax(-1)`) in descending order, equal values by ascending
    index, and their indices `[..., k]` int64. `1 <= k <= min(V, MAX_K)`.

    Triton on CUDA tensors and under `TRITON_INTERPRET=1`; `naive_row_topk` on CPU tensors otherwise (whose ties
    and NaN entries are `torch.topk`'s)."""
    check_dtype("x", x, (torch.float32, torch.float16, torch.bfloat16))
    V = x.shape[-1] if x.dim() else 0
    if not 1 <= k <= min(V, MAX_K):
        raise ValueError(f"row_topk takes 1 <= k <= min(row length, {MAX_K}), got k = {k} for rows of {V}")
    if not use_triton(x):
        return naive_row_topk(x, k, log_softmax)
    lead = x.shape[:-1]
    rows = x.reshape(-1, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R = rows.shape[0]
    values = torch.empty(R, k, dtype=torch.float32, device=x.device)
    indices = torch.empty(R, k, dtype=torch.int64, device=x.device)
    block = max(16, min(BLOCK, next_power_of_2(V)))
    splits = triton.cdiv(V, block)
    if R == 0:
        return values.view(*lead, k), indices.view(*lead, k)
    with on_device(x):
        if splits == 1:
            row_topk_split_kernel[(R, 1)](
                rows, values, indices, values, rows.stride(0), V,
                K=k, BLOCK=block, LOG_SOFTMAX=log_softmax, FINAL=True, num_warps=4,
            )  # fmt: skip
        else:
            # per split: its k best (values, indices: -1 where the split has fewer), and its max and exp-sum
            part_v = torch.empty(R, splits, k, dtype=torch.float32, device=x.device)
            part_i = torch.empty(R, splits, k, dtype=torch.int64, device=x.device)
            part_ms = torch.empty(R, splits, 2, dtype=torch.float32, device=x.device)
            row_topk_split_kernel[(R, splits)](
                rows, part_v, part_i, part_ms, rows.stride(0), V,
                K=k, BLOCK=block, LOG_SOFTMAX=log_softmax, FINAL=False, num_warps=4,
            )  # fmt: skip
            row_topk_merge_kernel[(R,)](
                part_v, part_i, part_ms, values, indices, splits,
                K=k, BLOCK=max(16, next_power_of_2(splits * k)),
                SPLIT_BLOCK=max(16, next_power_of_2(splits)), LOG_SOFTMAX=log_softmax, num_warps=4,
            )  # fmt: skip
    return values.view(*lead, k), indices.view(*lead, k)


@triton.jit
def _pick(b_x, b_idx, b_ok, BIG: tl.constexpr):
    """The best entry of the block still in the running: `b_x` values, `b_idx` their indices, `b_ok` the entries
    in the running. Returns (value, index, b_ok without it); index BIG where none is left."""
    b_cand = tl.where(b_ok, b_x, float("-inf"))
    best = tl.max(b_cand, axis=0)
    at = tl.min(tl.where(b_ok & (b_cand == best), b_idx, BIG), axis=0)
    return best, at, b_ok & (b_idx != at)


@triton.jit(do_not_specialize=["V"])
def row_topk_split_kernel(
    x, out_v, out_i, part_ms, stride_x, V,
    K: tl.constexpr, BLOCK: tl.constexpr, LOG_SOFTMAX: tl.constexpr, FINAL: tl.constexpr,
):  # fmt: skip
    """One (row, split of BLOCK entries): its k best into `out_v`/`out_i` (`[R, splits, K]`; index -1 where the
    split has fewer than k entries that are not NaN) and with LOG_SOFTMAX its max and exp-sum into `part_ms`
    (`[R, splits, 2]`), or, with FINAL (one split a row), the row's answer into `out_v`/`out_i` (`[R, K]`)."""
    i_r, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    splits = tl.num_programs(1)
    o = i_s * BLOCK + tl.arange(0, BLOCK)
    b_in = o < V
    b_x = tl.load(x + i_r * stride_x + o, mask=b_in, other=float("-inf")).to(tl.float32)
    b_ok = b_in & (b_x == b_x)  # NaN never equals itself: never picked
    if LOG_SOFTMAX:
        b_m = tl.max(tl.where(b_ok, b_x, float("-inf")), axis=0)
        b_ref = tl.where(b_m == float("-inf"), 0.0, b_m)  # a split of -inf only: its sum is 0, not NaN
        b_s = tl.sum(tl.where(b_ok, tl.exp(b_x - b_ref), 0.0), axis=0)
    base = (i_r * splits + i_s) * K
    for j in tl.static_range(K):
        best, at, b_ok = _pick(b_x, o, b_ok, 2147483647)
        at = tl.where(at < V, at, -1).to(tl.int64)
        if FINAL:
            if LOG_SOFTMAX:
                best = best - (b_ref + tl.log(b_s))
            tl.store(out_v + i_r * K + j, best)
            tl.store(out_i + i_r * K + j, at)
        else:
            tl.store(out_v + base + j, best)
            tl.store(out_i + base + j, at)
    if not FINAL:
        if LOG_SOFTMAX:
            tl.store(part_ms + (i_r * splits + i_s) * 2, b_m)
            tl.store(part_ms + (i_r * splits + i_s) * 2 + 1, b_s)


@triton.jit
def row_topk_merge_kernel(
    part_v, part_i, part_ms, out_v, out_i, splits,
    K: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr, LOG_SOFTMAX: tl.constexpr,
):  # fmt: skip
    """One row: the k best of its splits' `splits * K` candidates (ties by index, as within a split), their values
    less the row's log-sum-exp (merged from the splits' max and exp-sum) with LOG_SOFTMAX."""
    i_r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    b_in = o < splits * K
    b_idx = tl.load(part_i + i_r * splits * K + o, mask=b_in, other=-1)
    b_x = tl.load(part_v + i_r * splits * K + o, mask=b_in, other=float("-inf"))
    b_ok = b_idx >= 0
    lse = 0.0
    if LOG_SOFTMAX:
        o_s = tl.arange(0, SPLIT_BLOCK)
        m_s = o_s < splits
        b_m = tl.load(part_ms + (i_r * splits + o_s) * 2, mask=m_s, other=float("-inf"))
        b_s = tl.load(part_ms + (i_r * splits + o_s) * 2 + 1, mask=m_s, other=0.0)
        m = tl.max(b_m, axis=0)
        ref = tl.where(m == float("-inf"), 0.0, m)
        lse = ref + tl.log(tl.sum(b_s * tl.exp(b_m - ref), axis=0))
    for j in tl.static_range(K):
        best, at, b_ok = _pick(b_x, b_idx, b_ok, 9223372036854775807)
        tl.store(out_v + i_r * K + j, best - lse)
        tl.store(out_i + i_r * K + j, tl.where(at < 9223372036854775807, at, -1))
