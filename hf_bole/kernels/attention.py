"""Tree attention for the full-attention layers of a verify forward: split over the keys, grouped heads, the mask
computed in the kernel.

Why: with an arbitrary mask transformers' SDPA path takes the memory-efficient kernel, which runs one program per
(row, head, 32 queries) and walks every key slot of the storage in it: 16 programs on a 132-SM GPU for a 9B model at
batch 1. Before it, `repeat_kv` copies the layer's keys and values to every query head, and SDPA turns the boolean
mask into an additive one.

This kernel reads the keys once per key head, in place in the cache's storage, and spreads them over programs:
- the `H / Hkv` query heads that share a key head are one block of `REP * N` query rows (row `r`: head
  `kv_head * REP + r // N`, node `r % N`), so a key tile is loaded once for all of them;
- the key slots are split into `SPLIT` slots a program, each program keeps a flash-attention running max and sum
  over its slots, and a second launch merges the splits by their log-sum-exp (one launch when one split covers the
  storage);
- only slots below `lengths[b] + N` are read: a program above them returns at once, so the storage's capacity costs
  nothing but idle programs;
- slot `c` of row `b` is visible to node `i` iff it is committed and not padding (`c < lengths[b]` and
  `valid[b, c]`) or it is the slot of one of `i`'s ancestors or `i` itself (`0 <= c - lengths[b] < N` and
  `ancestors[b, i, c - lengths[b]]`): exactly `BoleCache.tree_mode`'s attention mask, which is never built for it.

`masked_attention` runs the same split and merge with the mask given instead, `[B, Q, L]`, for a few queries a row:
the MTP drafter's steps, whose tree sits in scratch slots before the committed entries. Its batched matmuls before
(`torch.baddbmm`, masked softmax, `torch.bmm`) spent most of a step in cuBLAS's kernel for the second product, which
walks every slot in one program per (row, key head).

Numerics: scores and sums in float32, the probabilities rounded to the value dtype for the second product (as
flash attention does); within 1e-5 (float32) and 1e-2 (bf16, fp16) of float64 in tests/kernels/test_attention.py, and
eval/bench_attention.py reports its error beside SDPA's on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_bole.kernels.tree_gdn.ancestors import tree_attention_mask
from hf_bole.kernels.utils import (
    MAX_TREE_NODES,
    check_dtype,
    check_same_device,
    check_shape,
    is_interpreter,
    next_power_of_2,
    on_device,
    use_triton,
)

# Query rows per key head a program holds: a row's tree in `tree_attention`, grouped heads x queries in
# `masked_attention` (the MTP drafter's cache extension).
MAX_QUERY_ROWS = MAX_TREE_NODES
MAX_HEAD_DIM = 256  # one [BLOCK_M, head_dim] query tile in registers
TARGET_PROGRAMS = 128  # the split is chosen to launch about this many programs (an H200 has 132 SMs)
MERGE_BLOCK_M = 16  # query rows a merge program takes, one split a step, when a split's partial tile is large
# A split's partial [query rows, head dim] of at most this many floats is merged in chunks of splits, MERGE_ELEMENTS
# floats a step (64 registers a thread at 4 warps); see `_merge_tiles`.
MERGE_SMALL_TILE = 512
MERGE_ELEMENTS = 8192


def naive_tree_attention(q, k, v, lengths, valid, ancestors, scale: float) -> torch.Tensor:
    """The specification, in the inputs' dtype (float64 in the tests): softmax over the visible slots of every
    query head and node. q `[B, H, N, D]`, k and v `[B, Hkv, C, D]` -> `[B, N, H, D]`."""
    H, Hkv = q.shape[1], k.shape[1]
    mask = tree_attention_mask(lengths, valid, ancestors)[:, None]  # [B, 1, N, C]
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)  # query head h reads h // REP
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, H, N, C]
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs @ v).transpose(1, 2)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    valid: torch.Tensor,
    ancestors: torch.Tensor,
    *,
    scale: float | None = None,
    split: int | None = None,
) -> torch.Tensor:
    """Attention of every tree node over a full-attention layer's KV storage.

    Args:
        q: `[B, H, N, D]` queries of the tree's nodes (any strides with the last dim contiguous, as transformers'
            transposed view is).
        k, v: `[B, Hkv, C, D]` the layer's KV storage (the tree's keys already at slots `lengths[b] + i`), `H` a
            multiple of `Hkv`; read in place.
        lengths: `[B]` int64 committed slots of every row (`lengths[b] + N <= C`).
        valid: `[B, C]` bool, False at padding slots.
        ancestors: `[B, N, N]` bool ancestor-or-self mask of the trees (`tree_ancestor_mask`).
        scale: defaults to `D ** -0.5`.
        split: key slots per program (a multiple of the kernel's key tile); by default chosen from the grid so that
            about `TARGET_PROGRAMS` programs run.

    Returns:
        `[B, N, H, D]` in q's dtype (the layout of transformers' attention functions' output).

    Triton on CUDA tensors and under `TRITON_INTERPRET=1`; `naive_tree_attention` on CPU tensors otherwise.
    """
    B, H, N, D = q.shape
    Hkv, C = k.shape[1], k.shape[2]
    _check_qkv(q, k, v, "[B, Hkv, C, D]")
    check_dtype("lengths", lengths, (torch.int64,))
    check_shape("lengths", lengths, (B,), "[B]")
    check_dtype("valid", valid, (torch.bool,))
    check_shape("valid", valid, (B, C), "[B, C]")
    check_dtype("ancestors", ancestors, (torch.bool,))
    check_shape("ancestors", ancestors, (B, N, N), "[B, N, N]")
    check_same_device(q=q, k=k, v=v, lengths=lengths, valid=valid, ancestors=ancestors)
    if N > MAX_TREE_NODES or N > C:
        raise ValueError(f"tree_attention takes trees of 1 to {min(MAX_TREE_NODES, C)} nodes here, got N = {N}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"tree_attention takes head dims up to {MAX_HEAD_DIM}, got {D}")
    BLOCK_D = max(16, next_power_of_2(D))  # tl.dot takes no dimension below 16
    BLOCK_M, BLOCK_N, num_warps = _tiles(BLOCK_D)
    if split is not None and (split <= 0 or split % BLOCK_N):
        raise ValueError(f"split must be a positive multiple of {BLOCK_N} (the key tile at D = {D}), got {split}")
    scale = D**-0.5 if scale is None else scale
    if not use_triton(q):
        return naive_tree_attention(q, k, v, lengths, valid, ancestors, scale).to(q.dtype).contiguous()

    M = (H // Hkv) * N  # query rows per key head
    row_blocks = triton.cdiv(M, BLOCK_M)
    if split is None:
        per_program = triton.cdiv(C, max(1, TARGET_PROGRAMS // (B * Hkv * row_blocks)))
        split = triton.cdiv(per_program, BLOCK_N) * BLOCK_N
    num_splits = triton.cdiv(C, split)
    q, k, v, valid = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, valid))
    anc = ancestors.contiguous().view(torch.uint8)
    out = torch.empty(B, N, H, D, dtype=q.dtype, device=q.device)
    partial, lse = _split_outputs(out, B * Hkv, num_splits, M)  # only the splits below lengths + N are written
    dtype_args = _dot_args(q)
    with on_device(q):
        tree_attention_split_kernel[(row_blocks, num_splits, B * Hkv)](
            q, k, v, lengths, valid.view(torch.uint8), anc, out, partial, lse,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], valid.stride(0), *out.stride()[:3],
            N, scale * 1.4426950408889634,  # log2(e): the kernel's exponentials are exp2
            REP=H // Hkv, HKV=Hkv, D=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SPLIT=split,
            NUM_SPLITS=num_splits, **dtype_args, num_warps=num_warps,
        )  # fmt: skip
        if num_splits > 1:
            merge_m, chunk = _merge_tiles(M, BLOCK_D, num_splits)
            tree_attention_merge_kernel[(triton.cdiv(M, merge_m), B * Hkv)](
                lengths, partial, lse, out, *out.stride()[:3], N, N, C,
                REP=H // Hkv, HKV=Hkv, D=D, BLOCK_D=BLOCK_D, BLOCK_M=merge_m, SPLIT=split,
                NUM_SPLITS=num_splits, CHUNK=chunk, HAS_LENGTHS=True, num_warps=4,
            )  # fmt: skip
    return out


def naive_masked_attention(q, k, v, mask, scale: float, lengths=None) -> torch.Tensor:
    """The specification of `masked_attention`, in the inputs' dtype: q `[B, H, Q, D]`, k and v `[B, Hkv, L, D]`,
    mask `[B, Q, L]`, lengths `[B]` or None -> `[B, Q, H, D]`; a query that sees no slot gets zeros."""
    H, Hkv = q.shape[1], k.shape[1]
    if lengths is not None:  # slots at or past a row's length are not seen, whatever the mask says
        mask = mask & (torch.arange(k.shape[2], device=mask.device) < lengths[:, None, None])
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, H, Q, L]
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1).nan_to_num(0.0)
    return (probs @ v).transpose(1, 2)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a few queries a row over a KV storage, each query over the slots its mask row allows.

    Args:
        q: `[B, H, Q, D]` queries (any strides with the last dim contiguous).
        k, v: `[B, Hkv, L, D]` keys and values, read in place; `H` a multiple of `Hkv`.
        mask: `[B, Q, L]` bool, True where a query sees a slot (any strides with the last dim contiguous).
        scale: defaults to `D ** -0.5`.
        lengths: `[B]` int64, optional: row b's slots at or past `lengths[b]` are neither seen (whatever the mask
            says) nor read. Why: a CUDA graph fixes `L` at the storage's capacity, while a row's entries end sooner;
            the programs past a row's length return at once and the merge skips their splits.

    Returns:
        `[B, Q, H, D]` in q's dtype; zeros for a query that sees no slot.

    Triton on CUDA tensors and under `TRITON_INTERPRET=1`; `naive_masked_attention` on CPU tensors otherwise.
    """
    B, H, Q, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    _check_qkv(q, k, v, "[B, Hkv, L, D]")
    check_dtype("mask", mask, (torch.bool,))
    check_shape("mask", mask, (B, Q, L), "[B, Q, L]")
    check_same_device(q=q, k=k, v=v, mask=mask)
    if lengths is not None:
        check_dtype("lengths", lengths, (torch.int64,))
        check_shape("lengths", lengths, (B,), "[B]")
        check_same_device(q=q, lengths=lengths)
    if (H // Hkv) * Q > MAX_QUERY_ROWS or D > MAX_HEAD_DIM:
        raise ValueError(
            f"masked_attention takes up to {MAX_QUERY_ROWS} query rows a key head and head dims up to {MAX_HEAD_DIM}, "
            f"got {H // Hkv} x {Q} rows and D = {D}"
        )
    scale = D**-0.5 if scale is None else scale
    if not use_triton(q):
        return naive_masked_attention(q, k, v, mask, scale, lengths).to(q.dtype).contiguous()
    BLOCK_D = max(16, next_power_of_2(D))
    BLOCK_M, BLOCK_N, num_warps = _tiles(BLOCK_D)
    M = (H // Hkv) * Q
    BLOCK_M = min(BLOCK_M, max(16, next_power_of_2(M)))  # a few queries: one small block of rows
    row_blocks = triton.cdiv(M, BLOCK_M)
    # The drafter's key length changes with every call outside CUDA graphs: the splits (compile-time constants) do
    # not follow it but the grid, and a split's length only at powers of two, so a run compiles a handful of
    # variants. A split at or past L (or the row's length) returns at once, and the merge takes the splits below.
    num_splits = max(1, TARGET_PROGRAMS // (B * Hkv * row_blocks))
    split = BLOCK_N * next_power_of_2(triton.cdiv(L, num_splits * BLOCK_N))
    q, k, v, mask = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, mask))
    out = torch.empty(B, Q, H, D, dtype=q.dtype, device=q.device)
    partial, lse = _split_outputs(out, B * Hkv, num_splits, M)
    dtype_args = _dot_args(q)
    has_lengths = lengths is not None
    lengths = lengths if has_lengths else out  # not read without lengths
    with on_device(q):
        masked_attention_split_kernel[(row_blocks, num_splits, B * Hkv)](
            q, k, v, mask.view(torch.uint8), lengths, out, partial, lse,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *mask.stride()[:2], *out.stride()[:3],
            Q, L, scale * 1.4426950408889634,
            REP=H // Hkv, HKV=Hkv, D=D, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SPLIT=split,
            NUM_SPLITS=num_splits, HAS_LENGTHS=has_lengths, **dtype_args, num_warps=num_warps,
        )  # fmt: skip
        if num_splits > 1:
            merge_m, chunk = _merge_tiles(M, BLOCK_D, num_splits)
            tree_attention_merge_kernel[(triton.cdiv(M, merge_m), B * Hkv)](
                lengths, partial, lse, out, *out.stride()[:3], Q, 0, L,
                REP=H // Hkv, HKV=Hkv, D=D, BLOCK_D=BLOCK_D, BLOCK_M=merge_m, SPLIT=split,
                NUM_SPLITS=num_splits, CHUNK=chunk, HAS_LENGTHS=has_lengths, num_warps=4,
            )  # fmt: skip
    return out


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str) -> None:
    """q `[B, H, ..., D]` in a float dtype, k and v `[B, Hkv, slots, D]` in the same, `H` a multiple of `Hkv`."""
    B, H, D = q.shape[0], q.shape[1], q.shape[-1]
    Hkv, slots = k.shape[1], k.shape[2]
    check_dtype("q", q, (torch.float32, torch.float16, torch.bfloat16))
    for name, x in (("k", k), ("v", v)):
        check_dtype(name, x, (q.dtype,))
        check_shape(name, x, (B, Hkv, slots, D), kv_layout)
    if H % Hkv:
        raise ValueError(f"the query heads ({H}) must be a multiple of the key heads ({Hkv})")


def _split_outputs(out: torch.Tensor, programs: int, num_splits: int, M: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a split kernel writes besides `out [B, rows, H, D]`: one split writes the output itself; several write
    float32 partials `[programs, splits, M, D]` (programs: B * Hkv) and their log2-sum-exp `[programs, splits, M]`
    for the merge."""
    if num_splits == 1:
        return out, out
    D = out.shape[-1]
    return (
        torch.empty(programs, num_splits, M, D, dtype=torch.float32, device=out.device),
        torch.empty(programs, num_splits, M, dtype=torch.float32, device=out.device),
    )


def _merge_tiles(M: int, block_d: int, num_splits: int) -> tuple[int, int]:
    """(query rows, splits) a merge program takes a step, for `M` query rows a key head over `num_splits` splits.

    Why chunks of splits for small tiles only: a merge that takes one split a step waits on each step's loads in
    turn. On an H200 a small model's drafter step (a few query rows over many splits) ran about three times faster
    with its splits merged in chunks, while larger tiles (a 9B model's head dim of 256, 32-node verify trees) ran
    slower in chunks; those keep one split a step.
    """
    rows = max(2, min(MERGE_BLOCK_M, next_power_of_2(M)))
    if rows * block_d > MERGE_SMALL_TILE:
        return MERGE_BLOCK_M, 1
    return rows, min(next_power_of_2(num_splits), MERGE_ELEMENTS // (rows * block_d))


def _dot_args(q: torch.Tensor) -> dict:
    return dict(
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=is_interpreter(),  # the interpreter's half-precision dot rounds wrongly
    )


def _tiles(block_d: int) -> tuple[int, int, int]:
    """(query rows, key slots a step, warps) of a split program at head dim `block_d`: tiles whose program compiles
    for sm_90a without spilling registers in bf16 (`eval/kernel_registers.py --kernels attention`; ptxas of Triton
    3.9: 252, 219 and 171 registers a thread at 256, 128 and 64), where the [rows, head dim] float32 accumulator,
    the query tile and a key and a value tile are all held in registers. Larger tiles spilled."""
    if block_d > 128:
        return 32, 16, 8
    if block_d > 64:
        return 32, 32, 8
    return 64, 32, 8


@triton.jit(do_not_specialize=["N"])
def tree_attention_split_kernel(
    q,
    k,
    v,
    lengths,
    valid,
    ancestors,
    out,
    partial,
    lse,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kc,
    stride_vb,
    stride_vh,
    stride_vc,
    stride_valid,
    stride_ob,
    stride_on,
    stride_oh,
    N,
    scale_log2,
    REP: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One (query-row block, key split, row x key head): a flash-attention pass over the split's visible slots, the
    committed ones first (visible where valid), then the tree's (visible on the node's ancestor mask)."""
    i_m, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_kh = (i_bh // HKV).to(tl.int64), i_bh % HKV  # the row's base offsets in int64, offsets inside it in int32
    length = tl.load(lengths + i_b).to(tl.int32)
    lo = i_s * SPLIT
    hi = tl.minimum(lo + SPLIT, length + N)  # no slot at or above lengths + N is visible
    if lo >= hi:
        return

    o_r, m_r, node, head, o_d, m_rd, b_q = _query_block(
        q, i_m, i_b, i_kh, stride_qb, stride_qh, stride_qn, N, REP, D, BLOCK_D, BLOCK_M, UPCAST_DOT
    )
    p_k = k + i_b * stride_kb + i_kh * stride_kh
    p_v = v + i_b * stride_vb + i_kh * stride_vh

    b_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    committed_end = tl.minimum(hi, length)
    for start in range(lo, committed_end, BLOCK_N):
        o_c = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key slots
        m_c = o_c < committed_end
        seen = tl.load(valid + i_b * stride_valid + o_c, mask=m_c, other=0) != 0  # [BLOCK_N]
        b_max, b_sum, b_acc = _attend(
            b_q, p_k, p_v, o_c, m_c, o_d, seen[None, :], b_max, b_sum, b_acc, stride_kc, stride_vc, scale_log2, D,
            DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    p_anc = ancestors + i_b * N * N
    for start in range(tl.maximum(lo, length), hi, BLOCK_N):
        o_c = start + tl.arange(0, BLOCK_N)
        m_c = o_c < hi
        rel = o_c - length  # [BLOCK_N] tree nodes of the slots
        seen = tl.load(p_anc + node[:, None] * N + rel[None, :], mask=m_r[:, None] & m_c[None, :], other=0) != 0
        b_max, b_sum, b_acc = _attend(
            b_q, p_k, p_v, o_c, m_c, o_d, seen, b_max, b_sum, b_acc, stride_kc, stride_vc, scale_log2, D,
            DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip

    _store_split(
        out, partial, lse, b_max, b_sum, b_acc, i_b, i_bh, i_s, o_r, m_r, node, head, o_d, m_rd,
        stride_ob, stride_on, stride_oh, REP * N, D, NUM_SPLITS,
    )  # fmt: skip


@triton.jit(do_not_specialize=["stride_mb", "stride_mq", "Q", "L"])
def masked_attention_split_kernel(
    q,
    k,
    v,
    mask,
    lengths,
    out,
    partial,
    lse,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kc,
    stride_vb,
    stride_vh,
    stride_vc,
    stride_mb,
    stride_mq,
    stride_ob,
    stride_on,
    stride_oh,
    Q,
    L,
    scale_log2,
    REP: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One (query-row block, key split, row x key head) of `masked_attention`: a flash-attention pass over the
    split's slots below L and the row's length, each query row over those its mask row allows. A split with no such
    slot returns at once, except the first, which writes the zero output of a row that sees nothing."""
    i_m, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_kh = (i_bh // HKV).to(tl.int64), i_bh % HKV
    end = L
    if HAS_LENGTHS:
        end = tl.minimum(end, tl.load(lengths + i_b).to(tl.int32))
    lo = i_s * SPLIT
    hi = tl.minimum(lo + SPLIT, end)
    if lo >= hi and i_s > 0:  # the merge takes only the splits below `end`, and always the first
        return

    o_r, m_r, node, head, o_d, m_rd, b_q = _query_block(
        q, i_m, i_b, i_kh, stride_qb, stride_qh, stride_qn, Q, REP, D, BLOCK_D, BLOCK_M, UPCAST_DOT
    )
    p_k = k + i_b * stride_kb + i_kh * stride_kh
    p_v = v + i_b * stride_vb + i_kh * stride_vh
    p_mask = mask + i_b * stride_mb + node[:, None] * stride_mq

    b_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        o_c = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key slots
        m_c = o_c < hi
        seen = tl.load(p_mask + o_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0) != 0
        b_max, b_sum, b_acc = _attend(
            b_q, p_k, p_v, o_c, m_c, o_d, seen, b_max, b_sum, b_acc, stride_kc, stride_vc, scale_log2, D,
            DOT_PRECISION, UPCAST_DOT,
        )  # fmt: skip
    _store_split(
        out, partial, lse, b_max, b_sum, b_acc, i_b, i_bh, i_s, o_r, m_r, node, head, o_d, m_rd,
        stride_ob, stride_on, stride_oh, REP * Q, D, NUM_SPLITS,
    )  # fmt: skip


@triton.jit
def _query_block(
    q, i_m, i_b, i_kh, stride_qb, stride_qh, stride_qn, N, REP: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """Block `i_m` of the `REP * N` query rows of key head `i_kh` (row `r`: head `i_kh * REP + r // N`, node or
    query `r % N`): the rows, which are real, their nodes and heads, the head-dim offsets, the rows x dims mask, and
    the queries `[BLOCK_M, BLOCK_D]`."""
    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_r = o_r < REP * N
    node = o_r % N
    head = i_kh * REP + o_r // N
    o_d = tl.arange(0, BLOCK_D)
    m_rd = m_r[:, None] & (o_d < D)[None, :]
    b_q = tl.load(
        q + i_b * stride_qb + (head * stride_qh + node * stride_qn)[:, None] + o_d[None, :], mask=m_rd, other=0
    )
    if UPCAST_DOT:
        b_q = b_q.to(tl.float32)
    return o_r, m_r, node, head, o_d, m_rd, b_q


@triton.jit
def _store_split(
    out, partial, lse, b_max, b_sum, b_acc, i_b, i_bh, i_s, o_r, m_r, node, head, o_d, m_rd,
    stride_ob, stride_on, stride_oh, M, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """A split program's rows: the output itself when one split covers the storage, else its float32 partial
    output and log2-sum-exp for the merge (`M` query rows a key head)."""
    b_o = b_acc / tl.where(b_sum > 0, b_sum, 1.0)[:, None]  # a split may hold no slot a row sees: its sum is 0
    if NUM_SPLITS == 1:
        p_o = out + i_b * stride_ob + (node * stride_on + head * stride_oh)[:, None] + o_d[None, :]
        tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_rd)
    else:
        base = (i_bh * NUM_SPLITS + i_s).to(tl.int64) * M  # this split's first row
        tl.store(partial + base * D + o_r[:, None] * D + o_d[None, :], b_o, mask=m_rd)
        b_lse = tl.where(b_sum > 0, b_max + tl.log2(tl.where(b_sum > 0, b_sum, 1.0)), float("-inf"))
        tl.store(lse + base + o_r, b_lse, mask=m_r)


@triton.jit
def _attend(
    b_q, p_k, p_v, o_c, m_c, o_d, seen, b_max, b_sum, b_acc, stride_kc, stride_vc, scale_log2, D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):  # fmt: skip
    """One key tile into the running max, sum and output of the rows: `o_c [BLOCK_N]` slots (`m_c` in range),
    `seen` what each row sees of them (`[BLOCK_M, BLOCK_N]` or `[1, BLOCK_N]`)."""
    m_cd = m_c[:, None] & (o_d < D)[None, :]
    b_k = tl.load(p_k + o_c[:, None] * stride_kc + o_d[None, :], mask=m_cd, other=0)  # [BLOCK_N, BLOCK_D]
    b_v = tl.load(p_v + o_c[:, None] * stride_vc + o_d[None, :], mask=m_cd, other=0)
    if UPCAST_DOT:
        b_k = b_k.to(tl.float32)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    b_s = tl.where(seen & m_c[None, :], b_s, float("-inf"))
    b_new = tl.maximum(b_max, tl.max(b_s, axis=1))
    b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)  # rows that have seen nothing yet stay at 0
    b_p = tl.exp2(b_s - b_ref[:, None])
    b_alpha = tl.exp2(b_max - b_ref)
    if UPCAST_DOT:
        b_pv = tl.dot(b_p, b_v.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        b_pv = tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
    return b_new, b_sum * b_alpha + tl.sum(b_p, axis=1), b_acc * b_alpha[:, None] + b_pv


@triton.jit(do_not_specialize=["N", "extra", "limit"])
def tree_attention_merge_kernel(
    lengths,
    partial,
    lse,
    out,
    stride_ob,
    stride_on,
    stride_oh,
    N,
    extra,
    limit,
    REP: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
):
    """One (query-row block, row x key head): the splits' outputs weighted by their sums, `CHUNK` splits a step,
    over the splits that ran: those below `min(lengths[b] + extra, limit)` (`limit` alone without lengths), and the
    first always. `tree_attention`'s: extra N, limit C; `masked_attention`'s: extra 0, limit L (`N` its queries)."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_kh = (i_bh // HKV).to(tl.int64), i_bh % HKV
    end = limit
    if HAS_LENGTHS:
        end = tl.minimum(end, tl.load(lengths + i_b).to(tl.int32) + extra)
    used = tl.maximum(tl.minimum(tl.cdiv(end, SPLIT), NUM_SPLITS), 1)

    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_r = o_r < REP * N
    o_d = tl.arange(0, BLOCK_D)
    m_rd = m_r[:, None] & (o_d < D)[None, :]
    b_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Large tiles (`_merge_tiles`) keep the loop that ran before chunks, line for line: the chunked loop below at
    # chunks of 1 computes the same, but it was never timed against this one on a GPU (the 9B verify runs here).
    if CHUNK == 1:
        for i_s in range(0, used):
            base = (i_bh * NUM_SPLITS + i_s).to(tl.int64) * (REP * N)
            b_lse = tl.load(lse + base + o_r, mask=m_r, other=float("-inf"))
            b_o = tl.load(partial + base * D + o_r[:, None] * D + o_d[None, :], mask=m_rd, other=0)
            b_new = tl.maximum(b_max, b_lse)
            b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
            b_alpha, b_w = tl.exp2(b_max - b_ref), tl.exp2(b_lse - b_ref)
            b_sum = b_sum * b_alpha + b_w
            b_acc = b_acc * b_alpha[:, None] + b_w[:, None] * b_o
            b_max = b_new
    else:
        o_c = tl.arange(0, CHUNK)
        for i_s in range(0, used, CHUNK):
            m_s = (i_s + o_c) < used  # [CHUNK]
            base = (i_bh * NUM_SPLITS + i_s + o_c).to(tl.int64) * (REP * N)  # [CHUNK] each split's first row
            m_sr = m_s[:, None] & m_r[None, :]
            b_lse = tl.load(lse + base[:, None] + o_r[None, :], mask=m_sr, other=float("-inf"))  # [CHUNK, BLOCK_M]
            p_o = partial + (base[:, None, None] + o_r[None, :, None]) * D + o_d[None, None, :]
            b_o = tl.load(p_o, mask=m_sr[:, :, None] & (o_d < D)[None, None, :], other=0)  # [CHUNK, BLOCK_M, BLOCK_D]
            b_new = tl.maximum(b_max, tl.max(b_lse, axis=0))
            b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
            b_alpha, b_w = tl.exp2(b_max - b_ref), tl.exp2(b_lse - b_ref[None, :])  # [BLOCK_M], [CHUNK, BLOCK_M]
            b_sum = b_sum * b_alpha + tl.sum(b_w, axis=0)
            b_acc = b_acc * b_alpha[:, None] + tl.sum(b_w[:, :, None] * b_o, axis=0)
            b_max = b_new

    node, head = o_r % N, i_kh * REP + o_r // N
    b_o = b_acc / tl.where(b_sum > 0, b_sum, 1.0)[:, None]
    p_o = out + i_b * stride_ob + (node * stride_on + head * stride_oh)[:, None] + o_d[None, :]
    tl.store(p_o, b_o.to(out.dtype.element_ty), mask=m_rd)
