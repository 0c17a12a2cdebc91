import pytest
import torch

from hf_bole.kernels import tree_causal_conv1d, tree_conv_state_commit, tree_path_window
from hf_bole.kernels.tree_gdn.naive import naive_tree_causal_conv1d, naive_tree_conv_state_commit
from tests.kernels.test_closed_form import BACKENDS, backend_device
from tests.kernels.test_commit import random_paths
from tests.kernels.trees import make_parents, rel_err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kind,B,T,D,W,S,bias,dtype",
    [
        ("mixed", 2, 37, 48, 4, 4, True, torch.float32),
        ("star", 1, 9, 200, 4, 3, False, torch.float32),
        ("chain", 3, 5, 64, 2, 2, True, torch.float32),
        ("deep", 2, 50, 32, 4, 4, False, torch.bfloat16),
    ],
)
def test_tree_causal_conv1d(backend, kind, B, T, D, W, S, bias, dtype):
    device = backend_device(backend)
    x = torch.randn(B, T, D, device=device, dtype=dtype)
    weight = torch.randn(D, W, device=device, dtype=dtype)
    b = torch.randn(D, device=device, dtype=dtype) if bias else None
    state = torch.randn(B, D, S, device=device, dtype=dtype)
    parents = make_parents(kind, T, B, seed=9).to(device)
    out = tree_causal_conv1d(x, weight, b, parents, state, activation="silu")
    ref = naive_tree_causal_conv1d(
        x.double(), weight.double(), None if b is None else b.double(), parents.cpu(), state.double(), "silu"
    )
    assert out.dtype == dtype and out.shape == (B, T, D)
    assert rel_err(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_causal_conv1d_chain_equals_transformers_conv(backend):
    """On a chain the tree conv is transformers' causal conv over (window, tokens)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    device = backend_device(backend)
    B, T, D, W = 2, 11, 40, 4
    x, weight, state = torch.randn(B, T, D), torch.randn(D, W), torch.randn(B, D, W)
    out = tree_causal_conv1d(x.to(device), weight.to(device), None, make_parents("chain", T, B).to(device), state.to(device))
    full = torch.cat([state, x.transpose(1, 2)], dim=-1)  # [B, D, W + T]
    ref = causal_conv1d_fn(full, weight, None, activation="silu")[:, :, W:].transpose(1, 2)
    assert rel_err(out, ref) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_causal_conv1d_reads_one_token_major_buffer(backend):
    """BoleCache hands the conv [B, D, S + T] views of one token-major buffer (the window, then the nodes): the
    window and the nodes are read through their strides and give what contiguous copies give."""
    device = backend_device(backend)
    B, T, D, W = 2, 13, 48, 4
    io = torch.randn(B, W + T, D, device=device)  # [B, S + T, D]
    window, x = io.transpose(1, 2)[..., :W], io[:, W:]  # [B, D, S] strided, [B, T, D]
    assert not window.is_contiguous()
    weight, parents = torch.randn(D, W, device=device), make_parents("bushy", T, B, seed=4).to(device)
    out = tree_causal_conv1d(x, weight, None, parents, window)
    assert torch.equal(out, tree_causal_conv1d(x.contiguous(), weight, None, parents, window.contiguous()))
    ref = naive_tree_causal_conv1d(x.double(), weight.double(), None, parents.cpu(), window.double(), "silu")
    assert rel_err(out, ref) <= 1e-6


def test_tree_path_window():
    """Each node's last `width` inputs along its own path, oldest first and the node last, the committed window above
    the root (the taps a causal conv reads; Qwen4-Exp's n-gram hash reads its tokens so)."""
    B, T, S, width = 2, 20, 5, 4
    x = torch.arange(B * T).view(B, T, 1)
    state = -1 - torch.arange(B * S).view(B, 1, S)
    parents = make_parents("mixed", T, B, seed=3)
    out = tree_path_window(x, parents, state, width)  # [B, T, width, 1]
    for b in range(B):
        for i in range(T):
            path, j = [], i
            while j >= 0:
                path.insert(0, int(x[b, j, 0]))
                j = int(parents[b, j])
            assert out[b, i, :, 0].tolist() == (state[b, 0].tolist() + path)[-width:]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("S, dtype", [(4, torch.float32), (3, torch.float32), (2, torch.int64)])
def test_tree_conv_state_commit(backend, S, dtype):
    """The window after each accepted path; int64: the tokens Qwen4-Exp's n-gram hash keeps (one channel)."""
    device = backend_device(backend)
    B, T, D = 4, 12, 40 if dtype == torch.float32 else 1
    if dtype == torch.float32:
        x, state = torch.randn(B, T, D, device=device), torch.randn(B, D, S, device=device)
    else:
        x, state = torch.randint(0, 1000, (B, T, D), device=device), torch.randint(0, 1000, (B, D, S), device=device)
    parents = make_parents("mixed", T, B, seed=11)
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        path = random_paths(parents, gen, empty_rows=(2,))
        path[3, 1:] = -1  # a one-node path
        new = tree_conv_state_commit(state, x, path.to(device))
        assert torch.equal(new.cpu(), naive_tree_conv_state_commit(state.cpu(), x.cpu(), path))
        in_place = state.clone()
        tree_conv_state_commit(in_place, x, path.to(device), out=in_place)
        assert torch.equal(in_place, new)


def test_tree_conv_rejects_bad_input():
    x, weight = torch.randn(1, 3, 8), torch.randn(8, 4)
    parents = torch.tensor([[-1, 0, 0]])
    with pytest.raises(ValueError, match="at least W - 1 = 3"):
        tree_causal_conv1d(x, weight, None, parents, torch.zeros(1, 8, 2))
    with pytest.raises(ValueError, match="activation"):
        tree_causal_conv1d(x, weight, None, parents, torch.zeros(1, 8, 4), activation="gelu")
    with pytest.raises(ValueError, match=r"`weight` must be \[D, W\]"):
        tree_causal_conv1d(x, weight[:4], None, parents, torch.zeros(1, 8, 4))
    with pytest.raises(ValueError, match="parents"):
        tree_causal_conv1d(x, weight, None, torch.tensor([[0, 0, 0]]), torch.zeros(1, 8, 4))
