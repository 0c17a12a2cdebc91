import pytest
import torch

from hf_bole.kernels import tree_ancestor_mask, tree_gdn_verify
from hf_bole.kernels.tree_gdn import closed_form_kernels as kernels
from hf_bole.kernels.tree_gdn.closed_form_kernels import tree_gdn_verify_fwd
from hf_bole.kernels.tree_gdn.naive import naive_tree_gdn_verify
from tests.kernels.trees import BACKENDS, backend_device, gdn_inputs, make_parents, rel_err

def gold(q, k, v, g, beta, parents, h0, **kw):
    f64 = [x.double().cpu() for x in (q, k, v, g, beta)]
    return naive_tree_gdn_verify(*f64, parents.cpu(), h0.double().cpu(), **kw)


CASES = [
    pytest.param("chain", 1, 1, 1, 1, 16, 16, id="one-node"),
    pytest.param("chain", 2, 33, 2, 4, 32, 32, id="chain-T33-Hk2-H4"),
    pytest.param("star", 2, 40, 1, 3, 16, 32, id="star-T40-Hk1-H3"),
    pytest.param("deep", 1, 128, 1, 2, 16, 16, id="deep-T128-d16"),
    pytest.param("bushy", 2, 63, 2, 4, 32, 16, id="bushy-T63"),
    pytest.param("mixed", 3, 100, 2, 6, 16, 32, id="mixed-T100-Hk2-H6"),
    pytest.param("chain", 1, 128, 1, 1, 16, 16, id="chain-T128"),
    pytest.param("mixed", 2, 45, 1, 2, 40, 80, id="mixed-T45-K40-V80"),  # no power of two (OLMo-Hybrid's 96, 192)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,B,T,HK,H,K,V", CASES)
def test_closed_form_fp32(backend, kind, B, T, HK, H, K, V):
    device = backend_device(backend)
    q, k, v, g, beta, h0 = gdn_inputs(B, T, HK, H, K, V, device=device)
    parents = make_parents(kind, T, B).to(device)
    h0_before = h0.clone()
    o, u, log_decay = tree_gdn_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    ref_o, ref_u, ref_lp = gold(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.float32 and u.dtype == torch.float32 and log_decay.dtype == torch.float32
    assert rel_err(o, ref_o) <= 1e-5
    assert rel_err(u, ref_u) <= 1e-5
    assert rel_err(log_decay, ref_lp) <= 1e-5
    assert torch.equal(h0, h0_before), "the committed state must not be modified"


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "kind,T,one_block",
    [("star", 16, True), ("mixed", 29, False), ("mixed", 37, False), ("mixed", 37, True), ("chain", 64, False),
     ("chain", 64, True), ("deep", 128, False)],
)  # fmt: skip
def test_kernels_at_every_tile(kind, T, one_block, monkeypatch):
    """The kernels hold a tree as one block (up to 16 nodes, and up to 64 over many (request, value head) pairs, here
    forced) or as two halves of a power-of-two tile, a chain crossing them: exact in each."""
    monkeypatch.setattr(kernels, "ONE_BLOCK_MIN_PAIRS", 1 if one_block else 2**31)
    assert kernels.verify_tile(T, 2)[1] == (T <= 16 or one_block)
    device = backend_device("triton")
    q, k, v, g, beta, h0 = gdn_inputs(1, T, 1, 2, 16, 16, device=device, seed=T)
    parents = make_parents(kind, T, 1, seed=T).to(device)
    o, u, lp = tree_gdn_verify_fwd(q, k, v, g, beta, tree_ancestor_mask(parents), h0, 16**-0.5, True, "tf32x3")
    ref_o, ref_u, ref_lp = gold(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(u, ref_u) <= 1e-5 and rel_err(lp, ref_lp) <= 1e-5


@pytest.mark.interpreter
def test_closed_form_called_again():
    """Later calls of a shape launch the kernels compiled at the first (on a GPU, `CachedLaunch`): new values, an
    initial state or none, and inputs whose addresses are not 16-byte aligned (Triton compiles those apart) are each
    exact."""
    device = backend_device("triton")
    parents = make_parents("mixed", 37, 2, seed=5).to(device)
    for seed, offset, with_state in ((1, 0, True), (2, 0, True), (3, 0, False), (4, 1, True), (5, 0, True)):
        inputs = list(gdn_inputs(2, 37, 2, 4, 16, 16, device=device, seed=seed))
        if offset:  # each input one element into a larger buffer
            inputs = [torch.cat([x.new_zeros(offset), x.flatten()])[offset:].view(x.shape) for x in inputs]
            assert inputs[0].data_ptr() % 16 != 0
        q, k, v, g, beta, h0 = inputs
        o, u, lp = tree_gdn_verify(q, k, v, g, beta, parents, h0 if with_state else None, use_qk_l2norm_in_kernel=True)
        ref = gold(q, k, v, g, beta, parents, h0 if with_state else torch.zeros_like(h0), use_qk_l2norm_in_kernel=True)
        assert rel_err(o, ref[0]) <= 1e-5 and rel_err(u, ref[1]) <= 1e-5 and rel_err(lp, ref[2]) <= 1e-5


LAUNCH_CONFIGS = [pytest.param("solve", i, id=f"solve{i}") for i in range(len(kernels.SOLVE_CONFIGS))] + [
    pytest.param("apply", i, id=f"apply{i}") for i in range(len(kernels.APPLY_CONFIGS))
]


@pytest.mark.interpreter
@pytest.mark.parametrize("T", [100, 50])
@pytest.mark.parametrize("which,index", LAUNCH_CONFIGS)
def test_every_launch_config(which, index, T, monkeypatch):
    """Every committed launch config is exact on its own: the autotuner picks among them by time alone (on an
    H200, two stages made the solve kernel stray and the apply kernel fault). K = 64 takes the K loop two steps at
    BK = 32; the mixed tree of 100 nodes spans both halves of its 128-row tile, that of 50 is one block of 64 rows
    (forced here: the pairs of a large batch)."""
    tuner = kernels.tree_gdn_verify_solve_kernel if which == "solve" else kernels.tree_gdn_verify_apply_kernel.fn
    configs = kernels.SOLVE_CONFIGS if which == "solve" else kernels.APPLY_CONFIGS
    monkeypatch.setattr(tuner, "configs", [configs[index]])  # the kernels compiled earlier are chosen again
    monkeypatch.setattr(tuner, "cache", {})
    monkeypatch.setattr(kernels, "ONE_BLOCK_MIN_PAIRS", 1)
    device = backend_device("triton")
    q, k, v, g, beta, h0 = gdn_inputs(1, T, 1, 2, 64, 64, device=device, seed=index)
    parents = make_parents("mixed", T, 1, seed=index).to(device)
    o, u, lp = tree_gdn_verify_fwd(q, k, v, g, beta, tree_ancestor_mask(parents), h0, 64**-0.5, True, "tf32x3")
    ref_o, ref_u, ref_lp = gold(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(u, ref_u) <= 1e-5 and rel_err(lp, ref_lp) <= 1e-5


def test_full_tile_prune_narrows_only_the_full_tile():
    """For two halves of 64 rows the autotuners choose among the configs the H200's sweeps found best there; at
    smaller tiles and for one block among all; a lone config (a test or the tuning script pinning one) is kept
    whatever it is."""
    prune = kernels.tree_gdn_verify_apply_kernel.fn.early_config_prune  # the apply kernel's own
    configs = kernels.APPLY_CONFIGS
    kept = prune(configs, {}, BT=128, ONE_HALF=False)
    assert kept and all(c.kwargs["BK"] == 32 and c.num_warps == 4 for c in kept)
    assert {c.kwargs["BV"] for c in kept} == {32, 64}  # the batch decides between them
    assert prune(configs, {}, BT=64, ONE_HALF=False) == configs
    assert prune(configs, {}, BT=128, ONE_HALF=True) == configs
    assert prune(configs[-1:], {}, BT=128, ONE_HALF=False) == configs[-1:]


def test_verify_tile():
    """One block of 16 rows up to 16 nodes, two halves of 16 up to 32; up to 64 one block of 64 rows from
    ONE_BLOCK_MIN_PAIRS (request, value head) pairs on, two halves of 32 below; two halves of 64 up to 128. The
    workspace holds the blocks each needs, then the rows' norms."""
    many = kernels.ONE_BLOCK_MIN_PAIRS
    tiles = [kernels.verify_tile(T, many) for T in (1, 16, 17, 32, 33, 64, 65, 128)]
    assert tiles == [(32, True)] * 2 + [(32, False)] * 2 + [(128, True)] * 2 + [(128, False)] * 2
    assert kernels.verify_tile(33, many - 1) == kernels.verify_tile(64, many - 1) == (64, False)
    assert kernels.workspace_bytes(8, 64, 32, 16) == (8 * 32 * 2 * 64 * 64 + 8 * 64 * 16 * 2) * 4  # 256 pairs
    assert kernels.workspace_bytes(1, 64, 32, 16) == (32 * 6 * 32 * 32 + 64 * 16 * 2) * 4
    assert kernels.workspace_bytes(1, 16, 1, 1) == (2 * 16 * 16 + 16 * 2) * 4


# The interpreter computes float32 products whatever the precision: there this checks only the argument's way in.
@pytest.mark.parametrize(
    "backend,precision",
    [("torch", "tf32x3"), pytest.param("triton", "tf32x3", marks=pytest.mark.interpreter),
     pytest.param("triton", "ieee", marks=pytest.mark.interpreter)],
)  # fmt: skip
@pytest.mark.parametrize("kind,B,T,HK,H,K,V", [CASES[1], CASES[4]])
def test_closed_form_bf16(backend, precision, kind, B, T, HK, H, K, V):
    device = backend_device(backend)
    q, k, v, g, beta, h0 = gdn_inputs(B, T, HK, H, K, V, dtype=torch.bfloat16, device=device, seed=1)
    g, beta = g.bfloat16(), beta.bfloat16()
    parents = make_parents(kind, T, B, seed=1).to(device)
    o, u, log_decay = tree_gdn_verify(
        q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True, dot_precision=precision
    )
    ref_o, ref_u, _ = gold(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16
    assert rel_err(o, ref_o) <= 1e-2
    assert rel_err(u, ref_u) <= 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_form_without_l2norm_scale_or_state(backend):
    device = backend_device(backend)
    q, k, v, g, beta, _ = gdn_inputs(2, 21, 1, 2, 16, 16, device=device, seed=2)
    q, k = q * 0.2, k * 0.2  # raw keys: keep the delta rule contractive
    parents = make_parents("mixed", 21, 2, seed=2).to(device)
    o, u, lp = tree_gdn_verify(q, k, v, g, beta, parents, None, scale=0.3)
    ref_o, ref_u, ref_lp = gold(q, k, v, g, beta, parents, torch.zeros(2, 2, 16, 16), scale=0.3)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(u, ref_u) <= 1e-5 and rel_err(lp, ref_lp) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_form_precomputed_ancestors(backend):
    device = backend_device(backend)
    q, k, v, g, beta, h0 = gdn_inputs(2, 30, 1, 2, 16, 16, device=device, seed=6)
    parents = make_parents("bushy", 30, 2, seed=6).to(device)
    out = tree_gdn_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    ancestors = tree_ancestor_mask(parents)
    out_anc = tree_gdn_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True, ancestors=ancestors)
    for x, y in zip(out, out_anc):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="ancestors"):
        tree_gdn_verify(q, k, v, g, beta, parents, h0, ancestors=tree_ancestor_mask(parents).int())


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_form_reads_strided_key_heads_in_place(backend, monkeypatch):
    # transformers 5.17 repeats q and k to the value heads; the layer keeps every group-th head, a view whose heads
    # are 2 K apart: the kernels read it through its strides (nothing copied) and give what contiguous inputs give
    device = backend_device(backend)
    q, k, v, g, beta, h0 = gdn_inputs(2, 37, 2, 4, 16, 16, device=device, seed=9)
    parents = make_parents("mixed", 37, 2, seed=9).to(device)
    q_rep, k_rep = (x.repeat_interleave(2, dim=2) for x in (q, k))  # [B, T, 4, K]
    q_view, k_view = q_rep[:, :, ::2], k_rep[:, :, ::2]
    assert q_view.stride(2) == 2 * q.shape[-1] and torch.equal(q_view, q)
    copies, contiguous = [], torch.Tensor.contiguous

    def counted(x, *args, **kwargs):
        copies.append(tuple(x.shape))
        return contiguous(x, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", counted)
    out = tree_gdn_verify(q_view, k_view, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    if backend == "triton":
        assert tuple(q.shape) not in copies, "q or k was copied"
    monkeypatch.undo()
    ref = tree_gdn_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    for x, y in zip(out, ref):
        assert rel_err(x, y) <= 1e-6


def random_topological_order(parents: list[int], gen: torch.Generator) -> list[int]:
    """A uniformly shuffled order in which every node still comes after its parent."""
    children = {i: [] for i in range(-1, len(parents))}
    for i, p in enumerate(parents):
        children[p].append(i)
    order, ready = [], list(children[-1])
    while ready:
        i = ready.pop(int(torch.randint(len(ready), (1,), generator=gen)))
        order.append(i)
        ready.extend(children[i])
    return order


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_form_reordering_permutes_outputs(backend):
    device = backend_device(backend)
    B, T = 2, 37
    q, k, v, g, beta, h0 = gdn_inputs(B, T, 2, 4, 16, 16, device=device, seed=3)
    parents = make_parents("mixed", T, B, seed=3)
    gen = torch.Generator().manual_seed(3)
    perm = torch.stack([torch.tensor(random_topological_order(parents[b].tolist(), gen)) for b in range(B)])
    inv = perm.argsort(dim=1)  # old index -> new index
    new_parents = torch.stack(
        [torch.where(parents[b, perm[b]] >= 0, inv[b][parents[b, perm[b]].clamp(min=0)], -1) for b in range(B)]
    )
    rows = torch.arange(B)[:, None]
    permuted = [x[rows, perm.to(device)] for x in (q, k, v, g, beta)]
    out = tree_gdn_verify(q, k, v, g, beta, parents.to(device), h0, use_qk_l2norm_in_kernel=True)
    out_p = tree_gdn_verify(*permuted, new_parents.to(device), h0, use_qk_l2norm_in_kernel=True)
    for x, y in zip(out, out_p):
        torch.testing.assert_close(x[rows, perm.to(device)], y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_form_siblings_do_not_interact(backend):
    device = backend_device(backend)
    T = 9
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 2, 3, 5]], device=device)  # 3 and 5 are cousins
    q, k, v, g, beta, h0 = gdn_inputs(1, T, 1, 2, 16, 16, device=device, seed=4)
    o, u, _ = tree_gdn_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    for x in (q, k, v):
        x[:, [2, 4, 5, 6, 8]] = torch.randn_like(x[:, [2, 4, 5, 6, 8]])  # everything off the path 0-1-3-7
    o2, u2, _ = tree_gdn_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    keep = [0, 1, 3, 7]
    torch.testing.assert_close(o2[:, keep], o[:, keep], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(u2[:, keep], u[:, keep], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_form_chain_equals_linear_recurrence(backend):
    """A chain is ordinary decoding: compare with transformers' recurrence (and fla's where installed)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    device = backend_device(backend)
    B, T, HK, H, K, V = 2, 24, 2, 4, 32, 32
    q, k, v, g, beta, h0 = gdn_inputs(B, T, HK, H, K, V, device=device, seed=5)
    parents = make_parents("chain", T, B).to(device)
    o, _, _ = tree_gdn_verify(q, k, v, g, beta, parents, h0, use_qk_l2norm_in_kernel=True)
    # With fla-core installed, transformers routes this function to fla's kernel, which needs CUDA tensors.
    ref_device = "cuda" if torch.cuda.is_available() else device
    q, k, v, g, beta, h0 = (x.to(ref_device) for x in (q, k, v, g, beta, h0))
    # transformers 5.17's recurrence takes q and k repeated to the value heads (later versions group them).
    qr, kr = (x.repeat_interleave(H // HK, dim=2) for x in (q, k))
    ref, _ = torch_recurrent_gated_delta_rule(qr, kr, v, g=g, beta=beta, initial_state=h0, use_qk_l2norm_in_kernel=True)
    assert rel_err(o.to(ref_device), ref) <= 1e-5
    if device == "cuda":
        fla = pytest.importorskip("fla.ops.gated_delta_rule")
        ref_fla, _ = fla.fused_recurrent_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=h0, use_qk_l2norm_in_kernel=True
        )
        assert rel_err(o, ref_fla) <= 1e-5


def test_closed_form_rejects_bad_input():
    q, k, v, g, beta, h0 = gdn_inputs(1, 4, 2, 4, 16, 16)
    parents = torch.tensor([[-1, 0, 1, 2]])
    with pytest.raises(ValueError, match=r"parents\[0, 2\] = 3"):
        tree_gdn_verify(q, k, v, g, beta, torch.tensor([[-1, 0, 3, 2]]), h0)
    with pytest.raises(ValueError, match="parents must satisfy"):
        tree_gdn_verify(q, k, v, g, beta, torch.tensor([[-1, -2, 0, 1]]), h0)
    with pytest.raises(ValueError, match="dtype"):
        tree_gdn_verify(q, k, v, g, beta, parents.int(), h0)
    with pytest.raises(ValueError, match="multiple of the key heads"):
        tree_gdn_verify(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3], parents, h0[:, :3])
    with pytest.raises(ValueError, match=r"`g` must have shape"):
        tree_gdn_verify(q, k, v, g[:, :3], beta, parents, h0)
    with pytest.raises(ValueError, match=r"`initial_state` must have shape"):
        tree_gdn_verify(q, k, v, g, beta, parents, h0[:, :, :8])
    with pytest.raises(ValueError, match="dot_precision"):
        tree_gdn_verify(q, k, v, g, beta, parents, h0, dot_precision="fp16")


@pytest.mark.interpreter
def test_closed_form_triton_limits():
    device = backend_device("triton")
    q, k, v, g, beta, h0 = gdn_inputs(1, 129, 1, 1, 16, 16, device=device)
    with pytest.raises(ValueError, match="at most 128 nodes"):
        tree_gdn_verify(q, k, v, g, beta, make_parents("chain", 129, 1).to(device), h0)
    q, k, v, g, beta, h0 = gdn_inputs(1, 4, 1, 1, 272, 16, device=device)
    with pytest.raises(ValueError, match="head dims K, V up to 256, got K = 272"):
        tree_gdn_verify(q, k, v, g, beta, make_parents("chain", 4, 1).to(device), h0)
    q, k, v, g, beta, h0 = gdn_inputs(1, 2, 1, 65536, 16, 16, device=device)  # one request of 65536 value heads
    with pytest.raises(ValueError, match="at most 65535 .request, value head. pairs"):
        tree_gdn_verify(q, k, v, g, beta, make_parents("chain", 2, 1).to(device), h0)
