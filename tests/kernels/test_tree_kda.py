import importlib.util

import pytest
import torch

from hf_bole.kernels import tree_gdn_commit_serial, tree_kda_commit, tree_kda_verify
from hf_bole.kernels.tree_kda import closed_form_kernels as kernels
from hf_bole.kernels.tree_kda import tree_kda_verify_serial
from hf_bole.kernels.tree_kda.naive import naive_tree_kda_commit, naive_tree_kda_verify
from tests.kernels.test_commit import random_paths
from tests.kernels.trees import BACKENDS, backend_device, make_parents, rel_err


def kda_inputs(B, T, HK, H, K, V, dtype=torch.float32, device="cpu", seed=0, extreme=False):
    """Inputs shaped like a Kimi-Linear KDA layer's: raw q/k (normalised in the kernel), a log-decay per key channel
    as Kimi's gate makes it (-exp(A_log) softplus(x)). `extreme`: a third of the decays strong (g in [-1000, -10],
    alpha near 0) and a third weak (g in [-1e-3, 0], alpha near 1), mixed in every node, head and channel."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HK, K, generator=gen)
    k = torch.randn(B, T, HK, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    a = torch.empty(1, 1, H, 1).uniform_(1, 16, generator=gen)
    g = -a * torch.nn.functional.softplus(torch.randn(B, T, H, K, generator=gen) - 3.0)
    if extreme:
        pick = torch.rand(B, T, H, K, generator=gen)
        strong = -torch.empty(B, T, H, K).uniform_(10, 1000, generator=gen)
        weak = -torch.empty(B, T, H, K).uniform_(0, 1e-3, generator=gen)
        g = torch.where(pick < 1 / 3, strong, torch.where(pick < 2 / 3, weak, g))
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen) * 0.5
    cast = lambda x: x.to(dtype=dtype, device=device)  # noqa: E731
    return cast(q), cast(k), cast(v), g.to(device), beta.to(device), h0.to(device)


def gold(q, k, v, g, beta, parents, h0, **kw):
    f64 = [x.double().cpu() for x in (q, k, v, g, beta)]
    return naive_tree_kda_verify(*f64, parents.cpu(), None if h0 is None else h0.double().cpu(), **kw)


CASES = [
    pytest.param("chain", 1, 1, 1, 1, 16, 16, False, id="one-node"),
    pytest.param("chain", 2, 17, 2, 4, 32, 32, False, id="chain-T17-Hk2-H4"),
    pytest.param("star", 2, 40, 1, 3, 16, 32, False, id="star-T40-Hk1-H3"),
    pytest.param("deep", 1, 128, 1, 2, 16, 16, False, id="deep-T128-d16"),
    pytest.param("deep", 2, 128, 1, 2, 32, 16, True, id="deep-T128-d16-extreme"),
    pytest.param("bushy", 2, 63, 2, 4, 32, 16, True, id="bushy-T63-extreme"),
    pytest.param("mixed", 2, 100, 2, 4, 16, 32, False, id="mixed-T100-Hk2-H4"),
    pytest.param("mixed", 2, 45, 1, 2, 40, 80, True, id="mixed-T45-K40-V80-extreme"),  # no power of two
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,B,T,HK,H,K,V,extreme", CASES)
def test_tree_kda_verify_fp32(backend, kind, B, T, HK, H, K, V, extreme):
    """Float64 agreement of fp32 inputs on random trees up to depth 16; with `extreme` decays (alpha near 0 and near
    1 in every node) a difference of cumulative log-decays is 4.2e-5 off in o on the deep tree, a factorisation inf."""
    device = backend_device(backend)
    q, k, v, g, beta, h0 = kda_inputs(B, T, HK, H, K, V, device=device, seed=T, extreme=extreme)
    parents = make_parents(kind, T, B, seed=T).to(device)
    h0_before = h0.clone()
    o, u = tree_kda_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    ref_o, ref_u = gold(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.float32 and u.dtype == torch.float32
    assert rel_err(o, ref_o) <= 1e-5
    assert rel_err(u, ref_u) <= 1e-5
    assert torch.equal(h0, h0_before), "the committed state must not be modified"


@pytest.mark.interpreter
@pytest.mark.parametrize("kind,T", [("star", 16), ("mixed", 37), ("chain", 40)])
def test_tree_kda_kernels_at_every_tile(kind, T):
    """One half only (T <= 16), two halves, and a chain deeper than 16 crossing its halves (any depth is exact)."""
    device = backend_device("triton")
    q, k, v, g, beta, h0 = kda_inputs(1, T, 1, 2, 16, 16, device=device, seed=T, extreme=True)
    parents = make_parents(kind, T, 1, seed=T).to(device)
    o, u = kernels.tree_kda_verify_fwd(q, k, v, g, beta, parents, h0, 16**-0.5, True, "tf32x3")
    ref_o, ref_u = gold(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(u, ref_u) <= 1e-5


LAUNCH_CONFIGS = [pytest.param("solve", i, id=f"solve{i}") for i in range(len(kernels.SOLVE_CONFIGS))] + [
    pytest.param("apply", i, id=f"apply{i}") for i in range(len(kernels.APPLY_CONFIGS))
]


@pytest.mark.interpreter
@pytest.mark.parametrize("which,index", LAUNCH_CONFIGS)
def test_tree_kda_every_launch_config(which, index, monkeypatch):
    """Every launch config is exact on its own (the autotuner picks among them by time alone). K = 64 takes the walk
    over two chunks at BK = 32, and the tree of 70 nodes spans both halves of its 128-row tile."""
    tuner = kernels.tree_kda_verify_solve_kernel if which == "solve" else kernels.tree_kda_verify_apply_kernel.fn
    configs = kernels.SOLVE_CONFIGS if which == "solve" else kernels.APPLY_CONFIGS
    monkeypatch.setattr(tuner, "configs", [configs[index]])
    monkeypatch.setattr(tuner, "cache", {})
    device = backend_device("triton")
    q, k, v, g, beta, h0 = kda_inputs(1, 70, 1, 1, 64, 64, device=device, seed=index, extreme=True)
    parents = make_parents("mixed", 70, 1, seed=index).to(device)
    o, u = kernels.tree_kda_verify_fwd(q, k, v, g, beta, parents, h0, 64**-0.5, True, "tf32x3")
    ref_o, ref_u = gold(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(u, ref_u) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_kda_verify_bf16(backend):
    device = backend_device(backend)
    q, k, v, g, beta, h0 = kda_inputs(2, 50, 2, 4, 32, 32, dtype=torch.bfloat16, device=device, seed=1, extreme=True)
    g, beta = g.bfloat16(), beta.bfloat16()
    parents = make_parents("deep", 50, 2, seed=1).to(device)
    o, u = tree_kda_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    ref_o, ref_u = gold(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16
    assert rel_err(o, ref_o) <= 1e-2  # relative RMSE; rel_err also fails on NaN
    assert rel_err(u, ref_u) <= 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_kda_verify_without_l2norm_scale_or_state(backend):
    device = backend_device(backend)
    q, k, v, g, beta, _ = kda_inputs(2, 21, 1, 2, 16, 16, device=device, seed=2)
    q, k = q * 0.2, k * 0.2  # raw keys: keep the delta rule contractive
    parents = make_parents("mixed", 21, 2, seed=2).to(device)
    o, u = tree_kda_verify(q, k, v, g, beta, parents, None, scale=0.3)
    ref_o, ref_u = gold(q, k, v, g, beta, parents, None, scale=0.3)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(u, ref_u) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_kda_siblings_do_not_interact(backend):
    device = backend_device(backend)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 2, 3, 5]], device=device)  # 3 and 5 are cousins
    q, k, v, g, beta, h0 = kda_inputs(1, 9, 1, 2, 16, 16, device=device, seed=4)
    o, u = tree_kda_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    off = [2, 4, 5, 6, 8]  # everything off the path 0-1-3-7
    for x in (q, k, v):
        x[:, off] = torch.randn_like(x[:, off])
    g[:, off] = -torch.rand_like(g[:, off])
    o2, u2 = tree_kda_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    keep = [0, 1, 3, 7]
    torch.testing.assert_close(o2[:, keep], o[:, keep], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(u2[:, keep], u[:, keep], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "family",
    [
        "kimi_linear",
        "glm5_next",
        pytest.param(
            "bailing_hybrid",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("transformers.models.bailing_hybrid") is None,
                reason="Bailing-Hybrid is in transformers 5.24 on",
            ),
        ),
    ],
)
def test_tree_kda_chain_equals_transformers_recurrence(backend, family):
    """A chain is ordinary decoding: the outputs equal transformers' KDA recurrence of each family, and the commit
    of the whole chain its final state (the naive reference too)."""
    recurrence = importlib.import_module(f"transformers.models.{family}.modeling_{family}").recurrent_kimi_delta_attention
    device = backend_device(backend)
    B, T, H, K, V = 2, 12, 3, 32, 16
    q, k, v, g, beta, h0 = kda_inputs(B, T, H, H, K, V, device=device, seed=5, extreme=True)
    parents = make_parents("chain", T, B).to(device)
    o, u = tree_kda_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    path = torch.arange(T, device=device).expand(B, T).contiguous()
    state = tree_kda_commit(h0, k, g, u, path, use_qk_l2norm_in_kernel=True)
    # With fla-core installed, transformers routes this function to fla's kernel, which needs CUDA tensors.
    ref_device = "cuda" if torch.cuda.is_available() else "cpu"
    args = [x.to(ref_device) for x in (q, k, v, g, beta, h0)]
    ref_o, ref_state = recurrence(*args[:5], initial_state=args[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, ref_o) <= 1e-5
    assert rel_err(state, ref_state) <= 1e-5
    naive_o, _ = gold(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    assert rel_err(ref_o, naive_o) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kind,B,T,HK,H,K,V", [("mixed", 3, 40, 2, 4, 32, 32), ("deep", 2, 70, 1, 2, 16, 16), ("bushy", 2, 30, 1, 2, 40, 80)]
)
def test_tree_kda_commit_equals_sequential_state(backend, kind, B, T, HK, H, K, V):
    device = backend_device(backend)
    q, k, v, g, beta, h0 = kda_inputs(B, T, HK, H, K, V, device=device, seed=7, extreme=True)
    parents = make_parents(kind, T, B, seed=7)
    o, u = tree_kda_verify(q, k, v, g, beta, parents.to(device), h0, use_qk_l2norm_in_kernel=True)
    f64 = [x.double().cpu() for x in (q, k, v, g, beta)]
    *_, states = naive_tree_kda_verify(*f64, parents, h0.double().cpu(), use_qk_l2norm_in_kernel=True, output_states=True)
    h0_before = h0.clone()
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        path = random_paths(parents, gen, empty_rows=(1,))
        new = tree_kda_commit(h0, k, g, u, path.to(device), use_qk_l2norm_in_kernel=True)
        leaf = path.max(1).values
        ref = torch.stack([states[b, leaf[b]] if leaf[b] >= 0 else h0[b].double().cpu() for b in range(B)])
        assert rel_err(new, ref) <= 1e-5
        assert torch.equal(new[1], h0[1]), "an all -1 path keeps the state"
        # the naive replay of the factors is the same thing
        naive = naive_tree_kda_commit(h0.double().cpu(), k.cpu(), g.cpu(), u.cpu(), path, use_qk_l2norm_in_kernel=True)
        assert rel_err(naive, ref) <= 1e-5
    assert torch.equal(h0, h0_before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_kda_commit_stacked_layers_and_in_place(backend):
    device = backend_device(backend)
    NL, B, T, HK, H, K, V = 3, 2, 20, 2, 4, 16, 32
    parents = make_parents("mixed", T, B, seed=8)
    layers = [kda_inputs(B, T, HK, H, K, V, device=device, seed=10 + n) for n in range(NL)]
    us = [tree_kda_verify(*x[:5], parents.to(device), x[5], use_qk_l2norm_in_kernel=True)[1] for x in layers]
    path = random_paths(parents, torch.Generator().manual_seed(8)).to(device)
    per_layer = [tree_kda_commit(x[5], x[1], x[3], u, path, use_qk_l2norm_in_kernel=True) for x, u in zip(layers, us)]
    states = torch.stack([x[5] for x in layers])
    stacked = tree_kda_commit(
        states,
        torch.stack([x[1] for x in layers]),
        torch.stack([x[3] for x in layers]),
        torch.stack(us),
        path,
        use_qk_l2norm_in_kernel=True,
        out=states,  # in place
    )
    assert stacked.data_ptr() == states.data_ptr()
    for n in range(NL):
        torch.testing.assert_close(stacked[n], per_layer[n], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("K,V", [(32, 32), (40, 80)])
def test_tree_kda_verify_serial_equals_naive(backend, K, V):
    device = backend_device(backend)
    B, T, HK, H = 2, 30, 2, 4
    q, k, v, g, beta, h0 = kda_inputs(B, T, HK, H, K, V, device=device, seed=12, extreme=True)
    parents = make_parents("mixed", T, B, seed=12)
    o, states = tree_kda_verify_serial(q, k, v, g, beta, parents.to(device), h0, use_qk_l2norm_in_kernel=True)
    ref_o, _, ref_states = gold(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True, output_states=True)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(states, ref_states) <= 1e-5
    path = random_paths(parents, torch.Generator().manual_seed(12), empty_rows=(0,))
    new = tree_gdn_commit_serial(h0, states, path.to(device))
    assert torch.equal(new[0], h0[0])
    assert rel_err(new[1], ref_states[1, path[1].max()]) <= 1e-5


def test_tree_kda_rejects_bad_input():
    q, k, v, g, beta, h0 = kda_inputs(1, 4, 2, 4, 16, 16)
    parents = torch.tensor([[-1, 0, 1, 2]])
    with pytest.raises(ValueError, match=r"`g` must have shape \[B, T, H, K\]"):
        tree_kda_verify(q, k, v, g[..., 0], beta, parents, h0)  # GDN's per-head gate
    with pytest.raises(ValueError, match=r"parents\[0, 2\] = 3"):
        tree_kda_verify(q, k, v, g, beta, torch.tensor([[-1, 0, 3, 2]]), h0)
    with pytest.raises(ValueError, match="dtype"):
        tree_kda_verify(q, k, v, g, beta, parents.int(), h0)
    with pytest.raises(ValueError, match="multiple of the key heads"):
        tree_kda_verify(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3], parents, h0[:, :3])
    with pytest.raises(ValueError, match=r"`beta` must have shape"):
        tree_kda_verify(q, k, v, g, beta[..., None], parents, h0)
    with pytest.raises(ValueError, match=r"`initial_state` must have shape"):
        tree_kda_verify(q, k, v, g, beta, parents, h0[:, :, :8])
    with pytest.raises(ValueError, match="share a dtype"):
        tree_kda_verify(q.bfloat16(), k, v, g, beta, parents, h0)
    with pytest.raises(ValueError, match="dot_precision"):
        tree_kda_verify(q, k, v, g, beta, parents, h0, dot_precision="fp16")
    u = torch.randn(1, 4, 4, 16)
    with pytest.raises(ValueError, match=r"`g` must have shape"):
        tree_kda_commit(h0, k, g[..., 0], u, torch.tensor([[0]]))
    with pytest.raises(ValueError, match="right-padded"):
        tree_kda_commit(h0, k, g, u, torch.tensor([[0, -1, 2]]))
    with pytest.raises(ValueError, match="root-to-leaf chain"):
        tree_kda_commit(h0, k, g, u, torch.tensor([[0, 2, 1]]))
    with pytest.raises(ValueError, match="dtype"):
        tree_kda_commit(h0, k, g, u.double(), torch.tensor([[0]]))


@pytest.mark.interpreter
def test_tree_kda_triton_limits():
    device = backend_device("triton")
    q, k, v, g, beta, h0 = kda_inputs(1, 129, 1, 1, 16, 16, device=device)
    with pytest.raises(ValueError, match="at most 128 nodes"):
        tree_kda_verify(q, k, v, g, beta, make_parents("chain", 129, 1).to(device), h0)
    q, k, v, g, beta, h0 = kda_inputs(1, 4, 1, 1, 16, 272, device=device)
    with pytest.raises(ValueError, match="head dims K, V up to 256, got K = 16, V = 272"):
        tree_kda_verify(q, k, v, g, beta, make_parents("chain", 4, 1).to(device), h0)
