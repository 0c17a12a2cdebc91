"""`naive_tree_select_nodes` as one Triton launch: the whole batch in one program (DESIGN.md §3 step 2).

`naive_tree_select_nodes` (naive.py, the reference and the specification) runs about 80 small kernels per decoding
round on a GPU; this kernel does the same in one launch, and the decoding loop selects with it
(`hf_bole.generation.select`) wherever the batch's draft nodes fit one program.

One program holds all `B * N` draft nodes, one per lane of a block of `BLOCK = next_power_of_2(B * N)` lanes:

1. depth and `log rho` by pointer jumping over the parents (ceil(log2 N) rounds, each a gather through a scratch
   buffer in global memory between two barriers), the sum in float64; then the running minimum of `log rho` along
   the path, `select_nodes`' ranking key, by a second pointer jump;
2. the within-row order by one `tl.sort` of int64 keys `(row, key descending, depth, index)` (the float key mapped
   to an order-preserving integer); a node's row rank is its sorted position minus `row * N`;
3. the batch order by a second sort, of `(floor first, other eligible nodes next, key descending, depth, b * N + i)`:
   the selected nodes are the floors and eligible nodes at sorted positions below `max(budget, floors)`;
4. compaction by a cumulative sum (per-row offsets through scratch), then the verify trees' fields.

Rounding: `naive_tree_select_nodes` sums `log rho` in the dtype of the log-probabilities in torch's reduction order,
this kernel in float64 rounded once, so the two agree exactly where the float32 path sums are exact (they are on the
trees of the tests) and otherwise to rounding, which can reorder nodes whose `log rho` differ by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_bole.kernels.tree_select.naive import SelectedNodes, check_selection, naive_tree_select_nodes
from hf_bole.kernels.utils import check_dtype, check_same_device, next_power_of_2, on_device, use_triton

# Draft nodes of a whole round (all rows together) the one program holds in registers and sorts there: 8192 int64 keys
# is the most we allow (register pressure at 16 warps; the sort's bit fields also need B * N <= 2**13, see the key
# layouts in the kernel).
MAX_ROUND_NODES = 8192

# The order-preserving descending code of -inf: codes below it are real nodes (see `_desc_code`).
_NEG_INF_DESC = tl.constexpr(0xFFFFFFFF - 0x7FFFFF)


@triton.jit
def _desc_code(x):
    """`[BLOCK]` float32 -> int64 in [0, 2**32), decreasing in x (-0.0 and +0.0 share a code; no NaN here)."""
    b_bits = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True).to(tl.int64)
    b_asc = tl.where(b_bits >= 0, b_bits + (1 << 31), -1 - b_bits)  # the float order on [0, 2**32)
    return 0xFFFFFFFF - b_asc


@triton.jit(do_not_specialize=["B", "N", "N_IN", "T", "budget", "cap"])
def select_nodes_fwd_kernel(
    tokens,
    parents,
    logprobs,
    root_tokens,
    input_ids,
    out_parents,
    depths,
    draft_index,
    node_mask,
    num_nodes,
    draft_log_rho,
    ws_f,
    ws_i,
    stride_tb,
    stride_tn,
    stride_pb,
    stride_pn,
    stride_lb,
    stride_ln,
    B,
    N,
    N_IN,
    T,
    budget,
    cap,
    BLOCK: tl.constexpr,
    LOG_N: tl.constexpr,
    WI: tl.constexpr,
    WF: tl.constexpr,
):
    # Lane o is draft node (b, i) = (o // N, o % N) while o < B * N (N >= 1 here; N_IN = 0 leaves one padding node).
    o_n = tl.arange(0, BLOCK).to(tl.int64)
    m_n = o_n < B * N
    o_b = o_n // N
    o_i = o_n % N
    m_in = m_n & (o_i < N_IN)
    # Scratch: ws_f [BLOCK] float64; ws_i [4 * BLOCK] int64, four regions.
    p_r0, p_r1, p_r2, p_r3 = ws_i, ws_i + BLOCK, ws_i + 2 * BLOCK, ws_i + 3 * BLOCK

    # draft_index is -1 wherever no node lands; its scatter below comes after several barriers.
    for q0 in range(0, B * T, BLOCK):
        tl.store(draft_index + q0 + o_n, tl.full([BLOCK], -1, tl.int64), mask=q0 + o_n < B * T)

    b_lp = tl.load(logprobs + o_b * stride_lb + o_i * stride_ln, mask=m_in, other=float("-inf"))
    b_par = tl.load(parents + o_b * stride_pb + o_i * stride_pn, mask=m_in, other=-1)
    b_up0 = tl.where(b_par >= 0, o_b * N + b_par, -1)  # the parent's lane

    # Pointer jumping: after round k, b_s and b_cnt cover the node and its 2^k - 1 nearest ancestors, b_up is the
    # 2^k-th ancestor (-1 past the root).
    b_s = b_lp.to(tl.float64)
    b_cnt = tl.full([BLOCK], 1, tl.int64)
    b_up = b_up0
    for _ in range(LOG_N):
        tl.store(ws_f + o_n, b_s)
        tl.store(p_r0 + o_n, b_cnt)
        tl.store(p_r1 + o_n, b_up)
        tl.debug_barrier()
        m_up = b_up >= 0
        b_src = tl.where(m_up, b_up, 0)
        b_s = tl.where(m_up, b_s + tl.load(ws_f + b_src, mask=m_up, other=0.0, volatile=True), b_s)
        b_cnt += tl.load(p_r0 + b_src, mask=m_up, other=0, volatile=True)
        b_up = tl.load(p_r1 + b_src, mask=m_up, other=-1, volatile=True)
        tl.debug_barrier()
    b_depth = b_cnt - 1
    # log rho in the dtype select_nodes computes it in; NaN (a NaN or +inf - inf on the path) is not real.
    b_rho = b_s.to(tl.float32).to(draft_log_rho.dtype.element_ty).to(tl.float32)
    b_key = tl.where(b_rho == b_rho, b_rho, float("-inf"))

    # The key is the minimum of log rho over the path; a NaN ancestor makes the node NaN too, so none is left here.
    b_up = b_up0
    for _ in range(LOG_N):
        tl.store(ws_f + o_n, b_key.to(tl.float64))
        tl.store(p_r1 + o_n, b_up)
        tl.debug_barrier()
        m_up = b_up >= 0
        b_src = tl.where(m_up, b_up, 0)
        b_key = tl.minimum(b_key, tl.load(ws_f + b_src, mask=m_up, other=float("inf"), volatile=True).to(tl.float32))
        b_up = tl.load(p_r1 + b_src, mask=m_up, other=-1, volatile=True)
        tl.debug_barrier()
    tl.store(draft_log_rho + o_n, b_key.to(draft_log_rho.dtype.element_ty), mask=m_n)
    tl.store(p_r3 + o_n, b_depth)

    # Row order: (row, key descending, depth, index) in [WB | 32 | WI | WI] bits; lanes past B * N get row B and
    # sort last. Every row has N lanes, so row b's sorted positions are [b * N, b * N + N).
    b_desc = _desc_code(b_key)
    b_row = tl.where(m_n, o_b, B)
    k_row = (b_row << (32 + 2 * WI)) | (b_desc << (2 * WI)) | (b_depth << WI) | o_i
    s_row = tl.sort(k_row)
    r_b = s_row >> (32 + 2 * WI)
    r_desc = (s_row >> (2 * WI)) & 0xFFFFFFFF
    r_depth = (s_row >> WI) & ((1 << WI) - 1)
    r_i = s_row & ((1 << WI) - 1)
    r_rank = o_n - r_b * N
    r_real = (r_b < B) & (r_desc < _NEG_INF_DESC)
    r_floor = r_real & (r_rank == 0)  # a row's best node is a root child: nothing outranks its best root child
    r_elig = r_real & (r_rank > 0) & (r_rank < cap)
    n_floor = tl.sum(r_floor.to(tl.int64), axis=0)

    # Batch order: (floor, eligible, rest) then key descending, depth, lane in [2 | 32 | WI | WF] bits. Within a
    # row it is the row order, so a prefix keeps each row's selection a prefix of its order (prefix-connected).
    # Lanes past B * N take their sorted position, so the lane field is a permutation of [0, BLOCK).
    r_cls = tl.where(r_floor, 0, tl.where(r_elig, 1, 2)).to(tl.int64)
    r_lane = tl.where(r_b < B, r_b * N + r_i, o_n)
    k_bat = (r_cls << (32 + WI + WF)) | (r_desc << (WI + WF)) | (r_depth << WF) | r_lane
    s_bat = tl.sort(k_bat)
    # floors at positions [0, F), eligible nodes from F on: taking max(budget, F) gives the floors plus
    # max(budget - F, 0) eligible nodes, as select_nodes' `extra`
    q_sel = ((s_bat >> (32 + WI + WF)) < 2) & (o_n < tl.maximum(budget, n_floor))
    tl.store(p_r0 + (s_bat & ((1 << WF) - 1)), q_sel.to(tl.int64))
    tl.debug_barrier()

    # Compaction: a kept node goes to verify slot 1 + (kept nodes before it in its row).
    b_sel = tl.load(p_r0 + o_n, volatile=True) > 0
    b_cum = tl.cumsum(b_sel.to(tl.int64), axis=0)  # [BLOCK], inclusive, across rows
    tl.store(p_r1 + o_n, b_cum)
    tl.debug_barrier()
    m_prev = m_n & (o_b > 0)
    b_slot = b_cum - tl.load(p_r1 + tl.where(m_prev, o_b * N - 1, 0), mask=m_prev, other=0, volatile=True)
    tl.store(p_r2 + o_n, b_slot)
    tl.store(draft_index + o_b * T + b_slot, o_i, mask=m_n & b_sel)
    tl.store(num_nodes + o_b, 1 + b_slot, mask=m_n & (o_i == N - 1))
    tl.debug_barrier()

    # The verify trees, one lane per (b, t).
    for q0 in range(0, B * T, BLOCK):
        o_q = q0 + o_n
        m_q = o_q < B * T
        q_b = o_q // T
        q_t = o_q % T
        q_di = tl.load(draft_index + o_q, mask=m_q, other=-1, volatile=True)
        m_node = m_q & (q_di >= 0)
        q_src = tl.where(m_node, q_di, 0)
        q_tok = tl.load(tokens + q_b * stride_tb + q_src * stride_tn, mask=m_node, other=0)
        q_root = tl.load(root_tokens + q_b, mask=m_q & (q_t == 0), other=0).to(tl.int64)
        q_dpar = tl.load(parents + q_b * stride_pb + q_src * stride_pn, mask=m_node, other=-1)
        m_dpar = m_node & (q_dpar >= 0)
        q_vpar = tl.load(p_r2 + q_b * N + tl.where(m_dpar, q_dpar, 0), mask=m_dpar, other=0, volatile=True)
        q_depth = tl.load(p_r3 + q_b * N + q_src, mask=m_node, other=0, volatile=True)
        tl.store(input_ids + o_q, tl.where(q_t == 0, q_root, q_tok), mask=m_q)
        tl.store(out_parents + o_q, tl.where(m_node, q_vpar, -1), mask=m_q)
        tl.store(depths + o_q, tl.where(m_node, q_depth + 1, 0), mask=m_q)
        tl.store(node_mask + o_q, m_node | (q_t == 0), mask=m_q)


def _select_nodes_fwd(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_logprobs: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int,
    max_nodes_per_row: int,
    M: int,
) -> SelectedNodes:
    B, N_in = tokens.shape
    N, T = max(N_in, 1), M + 1  # N = 0 becomes one padding node, as in naive_tree_select_nodes
    device = tokens.device
    BLOCK = max(16, next_power_of_2(B * N))
    WI = max(1, (N - 1).bit_length())  # depth and index < N
    WF = (BLOCK - 1).bit_length()  # a lane < BLOCK
    assert B.bit_length() + 32 + 2 * WI <= 63 and 2 + 32 + WI + WF <= 63, "sort keys must fit an int64"
    out = {name: torch.empty(B, T, dtype=torch.long, device=device) for name in ("ids", "parents", "depths", "index")}
    node_mask = torch.empty(B, T, dtype=torch.bool, device=device)
    num_nodes = torch.empty(B, dtype=torch.long, device=device)
    draft_log_rho = torch.empty(B, N, dtype=draft_logprobs.dtype, device=device)
    ws_f = torch.empty(BLOCK, dtype=torch.float64, device=device)
    ws_i = torch.empty(4 * BLOCK, dtype=torch.long, device=device)
    with on_device(tokens):
        select_nodes_fwd_kernel[(1,)](
            tokens, parents, draft_logprobs, root_tokens,
            out["ids"], out["parents"], out["depths"], out["index"], node_mask, num_nodes, draft_log_rho,
            ws_f, ws_i,
            *tokens.stride(), *parents.stride(), *draft_logprobs.stride(),
            B, N, N_in, T, min(budget, B * N), min(max_nodes_per_row, N),
            BLOCK=BLOCK, LOG_N=(N - 1).bit_length(), WI=WI, WF=WF,
            num_warps=4 if BLOCK <= 512 else 8 if BLOCK <= 2048 else 16,
        )  # fmt: skip
    return SelectedNodes(out["ids"], out["parents"], out["depths"], out["index"], node_mask, num_nodes, draft_log_rho)


def tree_select_nodes(
    tokens: torch.LongTensor,
    parents: torch.LongTensor,
    draft_logprobs: torch.Tensor,
    root_tokens: torch.LongTensor,
    budget: int,
    max_nodes_per_row: int,
) -> SelectedNodes:
    r"""
    `naive_tree_select_nodes` in one Triton launch (one program for the whole batch): the same rules, arguments and
    outputs, with no host synchronisation and shapes fixed by the arguments, so it can be captured in a CUDA graph.
    On CPU tensors without `TRITON_INTERPRET=1` it calls `naive_tree_select_nodes`.

    `log rho` is summed in float64 and rounded once, where the reference sums in the log-probabilities' dtype: the
    two agree exactly where those sums are exact, otherwise to rounding (see the module docstring).

    Args:
        tokens, parents (`torch.LongTensor` of shape `(batch_size, N)`): the draft trees, `B * N <= 8192`
            (`MAX_ROUND_NODES`).
        draft_logprobs (`torch.Tensor` of shape `(batch_size, N)`): float32, bfloat16 or float16; -inf on padding.
        root_tokens (`torch.LongTensor` of shape `(batch_size,)`): the last committed token of every row.
        budget (`int`): total draft nodes to verify across the batch (the roots not counted).
        max_nodes_per_row (`int`): the most draft nodes one row may keep.

    Returns:
        `SelectedNodes` of width `T = 1 + M`, `M = min(max_nodes_per_row, max(budget, 1), N)`, as the reference.
    """
    check_selection(tokens, root_tokens, budget, max_nodes_per_row)
    B, N = tokens.shape
    if parents.shape != (B, N) or draft_logprobs.shape != (B, N):
        raise ValueError(
            f"tokens, parents and draft_logprobs must share one shape [B, N] = {[B, N]}, got parents "
            f"{list(parents.shape)} and draft_logprobs {list(draft_logprobs.shape)}"
        )
    check_dtype("tokens", tokens, (torch.int64,))
    check_dtype("parents", parents, (torch.int64,))
    check_dtype("draft_logprobs", draft_logprobs, (torch.float32, torch.bfloat16, torch.float16))
    if root_tokens.dtype.is_floating_point or root_tokens.dtype == torch.bool:
        raise ValueError(f"`root_tokens` must have an integer dtype, got {root_tokens.dtype}")
    check_same_device(tokens=tokens, parents=parents, draft_logprobs=draft_logprobs, roots=root_tokens)
    if B * max(N, 1) > MAX_ROUND_NODES:
        raise ValueError(
            f"tree_select_nodes holds the whole batch in one program: B * N = {B} * {N} = {B * N} nodes exceeds "
            f"its limit of {MAX_ROUND_NODES}; use naive_tree_select_nodes"
        )
    M = min(max_nodes_per_row, max(budget, 1), N)
    if not use_triton(tokens) or B == 0:
        return naive_tree_select_nodes(tokens, parents, draft_logprobs, root_tokens, budget, max_nodes_per_row)
    return _select_nodes_fwd(tokens, parents, draft_logprobs, root_tokens, budget, max_nodes_per_row, M)
