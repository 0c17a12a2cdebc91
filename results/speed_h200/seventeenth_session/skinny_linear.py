"""`x @ weight.T` for a few rows: the verify forward's projections at batch 1, where a tree's 4-64 nodes are the rows.

Such a product reads the whole weight for almost no arithmetic, so it is bound by memory bandwidth alone. cuBLAS
picks tiles for it that left bandwidth unused on an H200 (thirteenth session's kernel log, 9B shape, 32 nodes: 2.2
TB/s for a 4096x4096 projection, 3.0 for 4096x8192, 3.5 for 4096x12288, against a 4.3 TB/s copy), and splits K
with a second kernel to sum the splits.

This kernel streams the weight in `[BN, BK]` tiles against the rows held whole (`BM` = the rows rounded up to a
power of two, at least 16), products on the tensor cores with the weight as the left operand (its `BN` is the
tile's long side; the rows its short one). Where N alone gives too few programs to keep the GPU's memory busy, K is
split over `SPLIT_K` programs per column tile, and the last of them to finish sums the splits in order from a
float32 workspace (a counter per tile says which is last; it resets the counter for the next launch). So one
launch, and the sum is the same whichever split finishes last.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hf_bole.kernels.utils import autotune_configs, check_dtype, check_same_device, is_interpreter, on_device

# Up to this many rows the skinny kernel runs; above it the product has arithmetic enough for cuBLAS's tiles.
SKINNY_MAX_ROWS = 64
# The counters of one device's launches: one per column tile, enough for a 248320-wide LM head at BN = 64.
_MAX_TILES = 8192

SKINNY_CONFIGS = [
    triton.Config({"BN": BN, "BK": BK, "SPLIT_K": split}, num_warps=4, num_stages=stages)
    for BN, BK, split, stages in [
        (64, 128, 1, 4),
        (64, 256, 1, 3),
        (128, 128, 1, 4),
        (32, 256, 1, 4),
        (64, 128, 2, 4),
        (64, 128, 4, 4),
        (64, 256, 2, 3),
        (64, 256, 4, 3),
        (32, 256, 2, 4),
        (128, 128, 2, 4),
        (128, 128, 4, 4),
        (64, 128, 8, 4),
    ]
]


def _max_split(N: int) -> int:
    """The most K splits worth trying at N columns: none where the column tiles alone outnumber an H200's 132
    multiprocessors twice over (at BN = 64), which also keeps the workspace small for an LM head."""
    return 1 if N >= 16384 else 8


def _prune(configs, named_args, **kwargs):
    """The configs whose K split divides K into whole `BK` steps (no tail masking in K), within `_max_split`."""
    K, N = named_args["K"], named_args["N"]
    kept = [
        c for c in configs if c.kwargs["SPLIT_K"] <= _max_split(N) and K % (c.kwargs["BK"] * c.kwargs["SPLIT_K"]) == 0
    ]
    return kept or configs[:1]


def _bench(fn, quantiles):
    # Short timings: the verify forward's warm-up tunes every (projection shape, row bucket) once.
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


@triton.autotune(
    configs=autotune_configs(SKINNY_CONFIGS),
    key=["BM", "N", "K"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=None if is_interpreter() else _bench,
)
@triton.jit
def skinny_linear_kernel(
    x,  # [M, K] rows, last dim contiguous
    w,  # [N, K] weight, last dim contiguous
    out,  # [M, N]
    workspace,  # [SPLIT_K, M, N] float32 partial sums (unused at SPLIT_K = 1)
    counters,  # [>= N / BN] int32, zero between launches
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # Triton's interpreter multiplies bf16 tiles wrongly (3.9): fp32 there
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    mask_n = offs_n < N
    mask_m = offs_m < M
    k_split = K // SPLIT_K
    k0 = pid_k * k_split
    w_ptrs = w + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]  # [BN, BK]
    x_ptrs = x + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None]  # [BK, BM]: the rows transposed
    acc = tl.zeros((BN, BM), dtype=tl.float32)  # out.T's tile
    for _ in range(0, k_split, BK):
        w_tile = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        x_tile = tl.load(x_ptrs, mask=mask_m[None, :], other=0.0)
        if UPCAST_DOT:
            w_tile, x_tile = w_tile.to(tl.float32), x_tile.to(tl.float32)
        acc = tl.dot(w_tile, x_tile, acc)
        w_ptrs += BK
        x_ptrs += BK
    mask = mask_n[:, None] & mask_m[None, :]
    out_ptrs = out + offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=mask)
    else:
        tile = offs_m[None, :] * N + offs_n[:, None]
        tl.store(workspace + pid_k * M * N + tile, acc, mask=mask)
        # Every thread's partial sums are written before the counter says so (the barrier), and the last program
        # reads the others' only after its increment has seen theirs (acquire-release at GPU scope).
        tl.debug_barrier()
        arrived = tl.atomic_add(counters + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BN, BM), dtype=tl.float32)
            for s in range(SPLIT_K):  # in split order, whichever finished last: the same sum every launch
                total += tl.load(workspace + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counters + pid_n, 0)


@functools.cache
def _counters(device: torch.device, stream: int) -> torch.Tensor:
    """The split-K counters of launches on one device's stream (launches on one stream never overlap)."""
    return torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` (`torch.nn.functional.linear` without bias) through `skinny_linear_kernel`.

    Args:
        x: `[..., K]` bf16 or fp16, at most `SKINNY_MAX_ROWS` rows in all.
        weight: `[N, K]` of x's dtype.

    Returns:
        `[..., N]` of x's dtype, accumulated in float32.
    """
    check_dtype("x", x, (torch.bfloat16, torch.float16))
    check_dtype("weight", weight, (x.dtype,))
    check_same_device(x=x, weight=weight)
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"`weight` must have shape [N, K] with K = {K} (x's last dim), got {tuple(weight.shape)}")
    rows = x.reshape(-1, K)
    M, N = rows.shape[0], weight.shape[0]
    if not 0 < M <= SKINNY_MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1 to {SKINNY_MAX_ROWS} rows, got {M}; use torch.nn.functional.linear")
    if K % 128:
        raise ValueError(f"skinny_linear needs K a multiple of 128, got {K}")
    if triton.cdiv(N, 32) > _MAX_TILES:
        raise ValueError(f"skinny_linear takes at most {_MAX_TILES * 32} output columns, got {N}")
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    BM = max(16, triton.next_power_of_2(M))
    with on_device(x):
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
        counters = _counters(x.device, stream)
        # Sized for the largest split tried: the autotuner runs every config with one set of arguments.
        workspace = torch.empty(_max_split(N), M, N, dtype=torch.float32, device=x.device)

        def grid(meta):
            return (triton.cdiv(N, meta["BN"]), meta["SPLIT_K"])

        skinny_linear_kernel[grid](
            rows, weight, out, workspace, counters, M, N, K, rows.stride(0), weight.stride(0), out.stride(0), BM=BM,
            UPCAST_DOT=is_interpreter(),
        )
    return out.view(*x.shape[:-1], N)
