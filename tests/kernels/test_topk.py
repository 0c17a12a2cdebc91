"""`row_topk` against float64 `log_softmax` + `topk`: one-launch rows, split rows, ties, -inf and NaN entries."""

import pytest
import torch

from hf_bole.kernels.topk import MAX_K, row_topk
from tests.kernels.trees import BACKENDS, backend_device

SHAPES = [  # (leading dims, row length): one block, a ragged last split, many splits
    ((3,), 16),
    ((2, 4), 1000),
    ((5,), 1024 * 3 + 17),
    ((4,), 40000),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("log_softmax", [False, True])
@pytest.mark.parametrize("lead,V", SHAPES)
def test_matches_float64(backend, dtype, log_softmax, lead, V):
    gen = torch.Generator().manual_seed(V)
    x = (torch.randn(*lead, V, generator=gen) * 3).to(dtype)
    k = 4
    values, indices = row_topk(x.to(backend_device(backend)), k, log_softmax=log_softmax)
    assert values.shape == (*lead, k) and indices.shape == (*lead, k)
    assert values.dtype == torch.float32 and indices.dtype == torch.int64
    gold_v, gold_i = (x.double().log_softmax(-1) if log_softmax else x.double()).topk(k, dim=-1)
    values, indices = values.cpu(), indices.cpu()
    if dtype == torch.float32:  # bf16 rows tie often: their indices are checked by value below
        assert torch.equal(indices, gold_i)
    # the picked entries are the row's best, in order: their values are the gold values
    picked = x.double().gather(-1, indices)
    if log_softmax:
        picked = picked - x.double().logsumexp(-1, keepdim=True)
    torch.testing.assert_close(picked, gold_v, rtol=0, atol=1e-6)
    torch.testing.assert_close(values.double(), gold_v, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_and_minus_infinity(backend):
    x = torch.zeros(2, 3000)
    x[0, [5, 2900, 1500]] = 1.0  # one value in three splits
    x[1] = float("-inf")
    x[1, 2999] = 2.0
    device = backend_device(backend)
    values, indices = row_topk(x.to(device), 4)
    if backend == "triton":  # the kernel's order; torch.topk leaves ties unordered
        assert indices[0].tolist() == [5, 1500, 2900, 0]
        assert indices[1].tolist() == [2999, 0, 1, 2]
    assert values[0].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert values[1].tolist() == [2.0] + [float("-inf")] * 3
    logp, _ = row_topk(x[1:].to(device), 2, log_softmax=True)
    assert logp.tolist() == [[0.0, float("-inf")]]


@pytest.mark.interpreter
def test_kernel_never_picks_nan():
    x = torch.zeros(2, 3000, device=backend_device("triton"))
    x[0, [7, 2000]] = float("nan")
    x[0, 2999] = 1.0
    x[1, :2] = float("nan")
    x[1, 2:] = float("nan")
    x[1, 1500] = 3.0
    values, indices = row_topk(x, 2)
    assert indices.tolist() == [[2999, 0], [1500, -1]]
    assert values[0].tolist() == [1.0, 0.0] and values[1, 0] == 3.0


@pytest.mark.parametrize("k", [0, MAX_K + 1, 9])
def test_rejects_k_out_of_range(k):
    with pytest.raises(ValueError, match="row_topk takes 1 <= k"):
        row_topk(torch.randn(2, 8), k)
