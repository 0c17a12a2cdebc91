"""The accepted path's keys and values moved to the committed slots, for every full-attention layer in one launch.

Why: `BoleCache.commit` moved them with a gather and a scatter per storage, over index tensors as large as the moved
entries (int64 per element), and a few small kernels before them for the slots: far more time than moving the
entries themselves takes.

One program per (layer, row, KV head) moves the path's `L` rows of its keys and values, `BLOCK_L <= 16` at a time
in registers (`[BLOCK_L, BLOCK_D]` tiles; a prefill chain's path is 128 long): it loads a chunk, waits for every
thread of the program, then stores it. The targets overlap the sources (path node `path[j] >= j` moves down to slot
`j`), but never those of a later chunk: a later entry `j' > j` reads slot `path[j'] >= j' > j`. Entries after the path
(-1) move their own slot onto itself. The moved values are copies, so the result equals `kv_commit_torch` bit for
bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_bole.kernels.utils import (
    MAX_TREE_NODES,
    check_dtype,
    check_same_device,
    check_shape,
    next_power_of_2,
    on_device,
    use_triton,
)


def kv_commit_torch(keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, path: torch.Tensor) -> None:
    """The specification: slot `lengths[b] + j` of every layer and head takes slot `lengths[b] + path[b, j]` where
    `path[b, j] >= 0`, in place. keys `[NA, B, H, C, Dk]`, values `[NA, B, H, C, Dv]`, lengths `[B]`, path `[B, L]`."""
    commit_slots_torch(lengths, path, keys, values)


def commit_slots_torch(lengths: torch.Tensor, path: torch.Tensor, *stacks: torch.Tensor) -> None:
    """`kv_commit_torch`'s move for any stacks of per-slot entries `[N, B, H, C, D]` (slots on dim 3), in place: what
    a cache keeps per slot beside the KV moves with it."""
    L = path.shape[1]
    steps = torch.arange(L, device=path.device)
    dst = lengths[:, None] + steps  # [B, L]
    src = lengths[:, None] + torch.where(path >= 0, path, steps)  # padding entries move their own slot
    for buf in stacks:
        N, B, H = buf.shape[:3]
        dst_i, src_i = (x[None, :, None, :, None].expand(N, B, H, L, buf.shape[-1]) for x in (dst, src))
        buf.scatter_(3, dst_i, buf.gather(3, src_i))


def kv_commit(keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, path: torch.Tensor) -> None:
    """Moves the accepted path's KV of a tree round to the committed slots, in place: slot `lengths[b] + j` of every
    layer and head of `keys [NA, B, H, C, Dk]` and `values [NA, B, H, C, Dv]` (stacked layers, last dim contiguous;
    Dv differs from Dk in MLA's compressed cache: the latent and the shared rotary key) takes slot
    `lengths[b] + path[b, j]` where `path[b, j] >= 0` (`path [B, L]`, root-to-leaf, right-padded with -1, increasing;
    `lengths [B]` int64, `lengths[b] + L <= C`). One Triton launch on CUDA (and under the interpreter),
    `kv_commit_torch` otherwise; no host synchronisation."""
    if keys.dim() != 5:
        raise ValueError(f"`keys` must be [NA, B, H, C, Dk], got {tuple(keys.shape)}")
    NA, B, H, C, D = keys.shape
    if values.dim() != 5:
        raise ValueError(f"`values` must be [NA, B, H, C, Dv], got {tuple(values.shape)}")
    DV = values.shape[-1]
    check_shape("values", values, (NA, B, H, C, DV), "[NA, B, H, C, Dv]")
    check_dtype("values", values, (keys.dtype,))
    check_dtype("lengths", lengths, (torch.int64,))
    check_shape("lengths", lengths, (B,), "[B]")
    check_dtype("path", path, (torch.int64,))
    if path.dim() != 2 or path.shape[0] != B or path.shape[1] > min(MAX_TREE_NODES, C):
        raise ValueError(
            f"`path` must be [B, L] with B = {B} and L <= {min(MAX_TREE_NODES, C)}, got {tuple(path.shape)}"
        )
    check_same_device(keys=keys, values=values, lengths=lengths, path=path)
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("`keys` and `values` must have a contiguous last dim (the cache's storage has)")
    if NA == 0 or B == 0 or path.shape[1] == 0:
        return
    if not use_triton(keys):
        return kv_commit_torch(keys, values, lengths, path)
    L = path.shape[1]
    with on_device(keys):
        kv_commit_fwd_kernel[(NA * B * H,)](
            keys, values, lengths, path,
            *keys.stride()[:4], *values.stride()[:4], lengths.stride(0), *path.stride(),
            B, H, L,
            D=D, DV=DV, BLOCK_L=min(16, max(2, next_power_of_2(L))),
            BLOCK_D=max(1, next_power_of_2(D)), BLOCK_DV=max(1, next_power_of_2(DV)),  # Dv = 0: no rotary key
        )  # fmt: skip


@triton.jit(do_not_specialize=["B", "L"])
def kv_commit_fwd_kernel(
    keys,
    values,
    lengths,
    path,
    stride_ka,
    stride_kb,
    stride_kh,
    stride_kc,
    stride_va,
    stride_vb,
    stride_vh,
    stride_vc,
    stride_lb,
    stride_pb,
    stride_pl,
    B,
    H: tl.constexpr,
    L,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)  # the storage's offsets can pass 2**31
    i_a, i_b, i_h = i // (B * H), (i // H) % B, i % H
    length = tl.load(lengths + i_b * stride_lb)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    o_dv = tl.arange(0, BLOCK_DV)
    m_dv = o_dv < DV
    p_k = keys + i_a * stride_ka + i_b * stride_kb + i_h * stride_kh
    p_v = values + i_a * stride_va + i_b * stride_vb + i_h * stride_vh
    for j0 in range(0, L, BLOCK_L):
        o_j = j0 + tl.arange(0, BLOCK_L)
        m_jd = (o_j < L)[:, None] & m_d[None, :]
        m_jdv = (o_j < L)[:, None] & m_dv[None, :]
        b_path = tl.load(path + i_b * stride_pb + o_j * stride_pl, mask=o_j < L, other=-1)
        src = length + tl.where(b_path >= 0, b_path, o_j)  # [BLOCK_L] slots read
        dst = length + o_j  # [BLOCK_L] slots written
        b_k = tl.load(p_k + src[:, None] * stride_kc + o_d[None, :], mask=m_jd)
        b_v = tl.load(p_v + src[:, None] * stride_vc + o_dv[None, :], mask=m_jdv)
        tl.debug_barrier()  # the chunk's sources read before its targets, which may be other entries' sources, change
        tl.store(p_k + dst[:, None] * stride_kc + o_d[None, :], b_k, mask=m_jd)
        tl.store(p_v + dst[:, None] * stride_vc + o_dv[None, :], b_v, mask=m_jdv)
