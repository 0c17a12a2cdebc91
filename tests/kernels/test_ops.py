"""The custom ops a compiled verify forward calls (`hf_bole.kernels.ops`, and the cache's `write_tree_kv`): their
fakes give what the kernels return (inductor asserts sizes and strides against them at run time), their schemas
hold, on the torch path and on the Triton kernels under the interpreter."""

import pytest
import torch

import hf_bole.kernels.ops  # noqa: F401  (registers the ops)
import hf_bole.cache.bole_cache  # noqa: F401  (registers write_tree_kv)
from hf_bole.kernels import tree_ancestor_mask
from tests.kernels.test_attention import attention_inputs, masked_inputs
from tests.kernels.trees import BACKENDS, backend_device, gdn_inputs, make_parents

CHECKS = ("test_schema", "test_faketensor")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gdn_ops(backend):
    device = backend_device(backend)
    q, k, v, g, beta, h0 = gdn_inputs(2, 9, 1, 2, 16, 16, device=device)
    parents = make_parents("mixed", 9, 2).to(device)
    ops = torch.ops.hf_bole
    torch.library.opcheck(
        ops.tree_gdn_verify.default, (q, k, v, g, beta, parents, h0, tree_ancestor_mask(parents), None, True),
        test_utils=CHECKS,
    )  # fmt: skip
    torch.library.opcheck(
        ops.tree_gdn_verify_serial.default, (q, k, v, g, beta, parents, h0, None, True), test_utils=CHECKS
    )
    x, weight, window = torch.randn(2, 9, 8), torch.randn(8, 4), torch.randn(2, 8, 3)
    torch.library.opcheck(
        ops.tree_causal_conv1d.default, (x.to(device), weight.to(device), None, parents, window.to(device), "silu"),
        test_utils=CHECKS,
    )  # fmt: skip


def test_write_tree_kv_op():
    keys, values = torch.zeros(2, 2, 1, 12, 4), torch.zeros(2, 2, 1, 12, 4)  # two attention layers' stack
    slots = torch.tensor([[3, 4, 5], [7, 8, 9]])
    new = (torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4))
    torch.library.opcheck(torch.ops.hf_bole.write_tree_kv.default, (keys, values, 1, slots, *new), test_utils=CHECKS)
    keys.zero_(), values.zero_()
    torch.ops.hf_bole.write_tree_kv(keys, values, 1, slots, *new)
    assert torch.equal(keys[1, 0, :, 3:6], new[0][0]) and torch.equal(values[1, 1, :, 7:10], new[1][1])
    assert not keys[0].any() and not keys[1, 0, :, 6:].any()  # the other layer's and the other slots untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_attention_op(backend):
    """Its torch path returned a transposed view once, where the fake says contiguous: inductor's assert failed."""
    q, k, v, lengths, valid, anc, _ = attention_inputs("mixed", 2, 4, 2, 9, 40, 16, device=backend_device(backend))
    k, v = k.nan_to_num(), v.nan_to_num()  # opcheck compares two runs: NaN never equals itself
    torch.library.opcheck(
        torch.ops.hf_bole.tree_attention.default, (q, k, v, lengths, valid, anc, 0.25), test_utils=CHECKS
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_topk_op(backend):
    x = torch.randn(2, 3, 2000, device=backend_device(backend))
    for log_softmax in (False, True):
        torch.library.opcheck(torch.ops.hf_bole.row_topk.default, (x, 4, log_softmax), test_utils=CHECKS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_attention_op(backend):
    q, k, v, mask = masked_inputs(2, 4, 2, 3, 50, 16, device=backend_device(backend))
    op = torch.ops.hf_bole.masked_attention.default
    torch.library.opcheck(op, (q, k, v, mask, 0.25, None), test_utils=CHECKS)
    torch.library.opcheck(op, (q, k, v, mask, 0.25, torch.tensor([7, 50], device=q.device)), test_utils=CHECKS)
