import os

import pytest
import torch

from hf_bole.kernels import tree_ancestor_mask
from hf_bole.kernels import attention
from hf_bole.kernels.attention import masked_attention, naive_masked_attention, naive_tree_attention, tree_attention
from hf_bole.kernels.tree_gdn.ancestors import tree_attention_mask
from tests.kernels.trees import BACKENDS, backend_device, make_parents, path_to, rel_err

def attention_inputs(kind, B, H, HKV, N, C, D, dtype=torch.float32, device="cpu", seed=0):
    """A layer's queries and KV storage after the tree's KV was written: committed slots below `lengths` (some of
    them padding), the tree's N slots after them, and above them NaN for the kernel (which never reads them), large
    finite values for the torch path (which reads every slot, as SDPA does)."""
    gen = torch.Generator().manual_seed(seed)
    parents = make_parents(kind, N, B, seed=seed)
    if B > 1 and N > 3:  # a ragged row: its last nodes are padding, children of the committed state
        parents[1, -2:] = -1
    lengths = torch.randint(0, C - N + 1, (B,), generator=gen)
    lengths[0] = C - N  # one row whose tree ends at the last slot
    valid = torch.rand(B, C, generator=gen) > 0.2
    q = torch.randn(B, H, N, D, generator=gen)
    k = torch.randn(B, HKV, C, D, generator=gen)
    v = torch.randn(B, HKV, C, D, generator=gen)
    unread = float("nan") if device != "cpu" or os.environ.get("TRITON_INTERPRET") == "1" else 1e4
    for b in range(B):
        k[b, :, lengths[b] + N :] = unread
        v[b, :, lengths[b] + N :] = unread
    cast = lambda x: x.to(dtype=dtype, device=device)  # noqa: E731
    ancestors = tree_ancestor_mask(parents).to(device)
    return cast(q), cast(k), cast(v), lengths.to(device), valid.to(device), ancestors, parents


def gold(q, k, v, lengths, valid, ancestors, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    f64 = [x.double().cpu().nan_to_num(0.0) for x in (q, k, v)]  # the unread slots, zero
    return naive_tree_attention(*f64, lengths.cpu(), valid.cpu(), ancestors.cpu(), scale)


CASES = [
    pytest.param("chain", 1, 1, 1, 1, 8, 16, id="one-node"),
    pytest.param("mixed", 2, 2, 1, 6, 20, 8, id="D8-below-the-dot-tile"),
    pytest.param("mixed", 2, 4, 1, 9, 40, 32, id="mixed-N9-rep4"),
    pytest.param("star", 2, 6, 2, 17, 70, 64, id="star-N17-rep3-D64"),
    pytest.param("deep", 1, 2, 2, 33, 96, 16, id="deep-N33-rep1"),
    pytest.param("bushy", 3, 4, 2, 12, 50, 48, id="bushy-N12-D48"),
    pytest.param("mixed", 1, 8, 2, 32, 160, 256, id="mixed-N32-rep4-D256"),
    pytest.param("bushy", 1, 6, 1, 10, 40, 256, id="bushy-N10-rep6-D256"),  # the 27B shape's grouping
    pytest.param("mixed", 1, 16, 1, 7, 30, 256, id="mixed-N7-rep16-D256"),  # 122B-A10B's
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,B,H,HKV,N,C,D", CASES)
def test_tree_attention_fp32(backend, kind, B, H, HKV, N, C, D):
    q, k, v, lengths, valid, anc, _ = attention_inputs(kind, B, H, HKV, N, C, D, device=backend_device(backend))
    out = tree_attention(q, k, v, lengths, valid, anc)
    assert out.shape == (B, N, H, D) and out.dtype == torch.float32
    assert rel_err(out, gold(q, k, v, lengths, valid, anc)) <= 1e-5


@pytest.mark.interpreter
@pytest.mark.parametrize("split", [64, 128, 192])
def test_tree_attention_every_split_is_the_same_attention(split):
    """One program's slots (one launch) and many splits merged by the second launch, against float64."""
    q, k, v, lengths, valid, anc, _ = attention_inputs("mixed", 2, 4, 2, 20, 150, 32, device=backend_device("triton"))
    out = tree_attention(q, k, v, lengths, valid, anc, split=split)
    assert rel_err(out, gold(q, k, v, lengths, valid, anc)) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_attention_half_precision(backend, dtype):
    q, k, v, lengths, valid, anc, _ = attention_inputs(
        "mixed", 2, 8, 2, 24, 120, 64, dtype=dtype, device=backend_device(backend)
    )
    out = tree_attention(q, k, v, lengths, valid, anc, scale=0.1, split=64)
    assert out.dtype == dtype
    assert rel_err(out, gold(q, k, v, lengths, valid, anc, scale=0.1)) <= 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_attention_reads_queries_in_transformers_layout(backend):
    """transformers hands attention `[B, N, H, D]` projections transposed to `[B, H, N, D]` (not contiguous)."""
    q, k, v, lengths, valid, anc, _ = attention_inputs("bushy", 2, 4, 2, 10, 40, 16, device=backend_device(backend))
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not transposed.is_contiguous()
    assert torch.equal(
        tree_attention(transposed, k, v, lengths, valid, anc), tree_attention(q, k, v, lengths, valid, anc)
    )


def test_tree_attention_mask_is_the_rule():
    """Node i sees the committed non-padding slots and the slots of its root-to-node path, nothing else."""
    _, _, _, lengths, valid, anc, parents = attention_inputs("mixed", 3, 1, 1, 11, 30, 4)
    mask = tree_attention_mask(lengths, valid, anc)
    for b in range(3):
        L = int(lengths[b])
        for i in range(11):
            expected = torch.zeros(30, dtype=torch.bool)
            expected[:L] = valid[b, :L]
            expected[[L + j for j in path_to(parents, b, i)]] = True
            assert torch.equal(mask[b, i], expected)


def test_tree_attention_bad_input():
    q, k, v, lengths, valid, anc, _ = attention_inputs("chain", 1, 4, 2, 4, 16, 8)
    with pytest.raises(ValueError, match="multiple of the key heads"):
        tree_attention(q[:, :3], k, v, lengths, valid, anc)
    with pytest.raises(ValueError, match="`v` must have shape"):
        tree_attention(q, k, v[:, :, :8], lengths, valid, anc)
    with pytest.raises(ValueError, match="`k` must have dtype"):
        tree_attention(q, k.half(), v, lengths, valid, anc)
    with pytest.raises(ValueError, match="`ancestors` must have dtype"):
        tree_attention(q, k, v, lengths, valid, anc.long())
    with pytest.raises(ValueError, match="head dims up to 256"):
        tree_attention(*(torch.zeros(*x.shape[:-1], 512) for x in (q, k, v)), lengths, valid, anc)
    with pytest.raises(ValueError, match="split must be a positive multiple"):
        tree_attention(q, k, v, lengths, valid, anc, split=20)


def masked_inputs(B, H, HKV, Q, L, D, dtype=torch.float32, device="cpu", seed=0):
    """A few queries a row over L slots, each under its own random mask; query 0 of row 0 sees one slot, query 1
    (where there is one) every slot, the last query of the last row none. The mask is a `[B, 1, Q, L]` tensor's view,
    as the MTP head's attention gets it."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Q, D, generator=gen)
    k, v = torch.randn(2, B, HKV, L, D, generator=gen)
    mask = torch.rand(B, 1, Q, L, generator=gen) < 0.3
    mask[0, 0, 0] = False
    mask[0, 0, 0, L // 2] = True
    if Q > 1:
        mask[0, 0, 1] = True
    mask[-1, 0, -1] = False
    cast = lambda x: x.to(dtype=dtype, device=device)  # noqa: E731
    return cast(q), cast(k), cast(v), mask.to(device)[:, 0]


MASKED_CASES = [
    pytest.param(2, 4, 2, 4, 40, 16, id="house-drafter-step"),
    pytest.param(3, 4, 2, 6, 100, 64, id="house-drafter-extension"),
    pytest.param(1, 16, 4, 4, 300, 256, id="9B-drafter-step"),
    pytest.param(2, 6, 2, 1, 33, 8, id="one-query-D8"),
    pytest.param(1, 3, 3, 50, 20, 32, id="many-queries-rep1"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,H,HKV,Q,L,D", MASKED_CASES)
def test_masked_attention_fp32(backend, B, H, HKV, Q, L, D):
    q, k, v, mask = masked_inputs(B, H, HKV, Q, L, D, device=backend_device(backend))
    out = masked_attention(q, k, v, mask)
    assert out.shape == (B, Q, H, D) and out.dtype == torch.float32
    gold_out = naive_masked_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask.cpu(), D**-0.5)
    assert rel_err(out, gold_out) <= 1e-5
    assert not out[-1, -1].any()  # the query that sees nothing


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masked_attention_half_precision_and_transposed_queries(backend, dtype):
    q, k, v, mask = masked_inputs(4, 4, 2, 5, 700, 64, dtype=dtype, device=backend_device(backend))
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)  # transformers' layout: [B, Q, H, D] transposed
    out = masked_attention(transposed, k, v, mask, scale=0.1)
    assert out.dtype == dtype
    gold_out = naive_masked_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask.cpu(), 0.1)
    assert rel_err(out, gold_out) <= 1e-2


@pytest.mark.interpreter
@pytest.mark.parametrize("rows_and_splits", [1, 2, 8, 32], ids=lambda c: f"{c}-splits-a-step")
def test_merge_takes_splits_in_chunks(monkeypatch, rows_and_splits):
    """The merge's chunks of splits, a last one partly past the splits that ran, against float64: masked attention
    over 21 splits of 2 query rows, tree attention over up to 3 splits (a row's own count) of 16-row blocks."""
    monkeypatch.setattr(attention, "MERGE_ELEMENTS", rows_and_splits * 2 * 16)  # [splits, 2 rows, D = 16]
    q, k, v, mask = masked_inputs(3, 4, 2, 1, 700, 16, device=backend_device("triton"))
    assert attention._merge_tiles(2, 16, 21) == (2, rows_and_splits)
    gold_out = naive_masked_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask.cpu(), 16**-0.5)
    assert rel_err(masked_attention(q, k, v, mask), gold_out) <= 1e-5

    monkeypatch.setattr(attention, "MERGE_ELEMENTS", rows_and_splits * 16 * 32)  # [splits, 16 rows, D = 32]
    q, k, v, lengths, valid, anc, _ = attention_inputs("mixed", 2, 4, 2, 20, 150, 32, device=backend_device("triton"))
    out = tree_attention(q, k, v, lengths, valid, anc, split=64)
    assert rel_err(out, gold(q, k, v, lengths, valid, anc)) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,H,HKV,Q,L,D", [(4, 4, 2, 4, 700, 16), (4, 4, 2, 1, 1300, 64), (4, 16, 4, 4, 300, 256)])
def test_masked_attention_reads_each_row_up_to_its_length(backend, B, H, HKV, Q, L, D):
    """`lengths`: a row's slots at or past its length are not seen whatever the mask, and not read (NaN there for the
    kernel): one row empty (zeros out), one inside a split, one at a split's end, one at L, against float64."""
    q, k, v, mask = masked_inputs(B, H, HKV, Q, L, D, device=backend_device(backend))
    lengths = torch.tensor([0, L // 3 + 5, 64, L], device=q.device)
    gold_out = naive_masked_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask.cpu(), D**-0.5,
                                      lengths.cpu())  # fmt: skip
    if backend == "triton":
        for b, n in enumerate(lengths.tolist()):
            k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
    out = masked_attention(q, k, v, mask, lengths=lengths)
    assert rel_err(out, gold_out) <= 1e-5
    assert not out[0].any()
    unbounded = naive_masked_attention(*(x.double().cpu().nan_to_num(0) for x in (q, k, v)), mask.cpu(), D**-0.5)
    assert rel_err(out[1], unbounded[1]) > 1e-2  # the mask alone would have seen more


def test_merge_takes_large_tiles_one_split_a_step():
    """Chunks only where they were measured faster on an H200 (`_merge_tiles`): the house drafter's 2 and 8 query
    rows at head dim 64 in chunks, the 9B drafter's 16 rows at head dim 256 and the verify's trees a split a step."""
    assert attention._merge_tiles(2, 64, 64) == (2, 64)
    assert attention._merge_tiles(8, 64, 64) == (8, 16)
    assert attention._merge_tiles(8, 64, 8) == (8, 8)
    assert attention._merge_tiles(16, 256, 32) == (attention.MERGE_BLOCK_M, 1)
    assert attention._merge_tiles(64, 64, 32) == (attention.MERGE_BLOCK_M, 1)


def test_masked_attention_equals_sdpa_over_repeated_keys():
    """The specification is SDPA's attention with a boolean mask, each query head reading key head h // REP."""
    q, k, v, mask = masked_inputs(2, 6, 2, 3, 11, 8, dtype=torch.float64)
    mask[-1, -1, 0] = True  # SDPA's softmax over no slot is NaN
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask[:, None], scale=0.3
    )
    torch.testing.assert_close(naive_masked_attention(q, k, v, mask, 0.3), expected.transpose(1, 2))


def test_masked_attention_bad_input():
    q, k, v, mask = masked_inputs(1, 4, 2, 3, 16, 8)
    with pytest.raises(ValueError, match="multiple of the key heads"):
        masked_attention(q[:, :3], k, v, mask)
    with pytest.raises(ValueError, match="`mask` must have shape"):
        masked_attention(q, k, v, mask[:, :2])
    with pytest.raises(ValueError, match="`mask` must have dtype"):
        masked_attention(q, k, v, mask.float())
    with pytest.raises(ValueError, match="`lengths` must have dtype"):
        masked_attention(q, k, v, mask, lengths=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="up to 128 query rows"):
        masked_attention(q[:, :, :1].expand(-1, -1, 70, -1), k, v, mask[:, :1].expand(-1, 70, -1))
