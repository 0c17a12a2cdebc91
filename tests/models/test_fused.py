"""One GEMM per group of projections that read one input, in tree mode; the plain model as it was."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from hf_bole.cache import BoleCache
from hf_bole.models import fused, tree_forward
from tests.models import tiny_families
from tests.models.tiny import VOCAB, batch_trees, build_model, prefill, random_tree

pytestmark = pytest.mark.usefixtures("torch_gdn")

PROMPTS = [[5, 17, 33, 2, 41, 9, 60], [71, 3, 28, 44], [13]]


class _CountLinears(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is F.linear
        return func(*args, **(kwargs or {}))


def _tree(seed: int = 3):
    gen = torch.Generator(torch.get_default_device()).manual_seed(seed)
    parents = batch_trees([random_tree(n, max_depth=4, gen=gen) for n in (9, 6, 12)])
    return torch.randint(1, VOCAB, parents.shape, generator=gen), parents


def _tree_logits(model, tokens, parents, **kwargs):
    cache = BoleCache(model.config, batch_size=3)
    tokens = tokens.clone()
    tokens[:, 0] = prefill(model, cache, PROMPTS)
    with _CountLinears() as count:
        logits = tree_forward(model, cache, tokens, parents, **kwargs).logits
    return logits, count.calls


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tree_forward_runs_one_gemm_per_group(kind):
    """Fused, a GDN layer's four input projections, attention's q, k, v and every MLP's gate and up run as one
    F.linear each, with the logits of the projections one by one; the model's Linears are back afterwards."""
    model = build_model(kind)
    tokens, parents = _tree()
    apart, apart_calls = _tree_logits(model, tokens, parents, fuse_projections=False)
    together, calls = _tree_logits(model, tokens, parents)
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)
    config = model.config
    gdn = config.layer_types.count("linear_attention")
    full = config.num_hidden_layers - gdn
    mlps = config.num_hidden_layers  # dense MLPs, or the MoE's shared experts
    assert apart_calls - calls == 3 * gdn + 2 * full + mlps
    assert len(fused.fuse_projections(model.get_decoder())) == gdn + full + mlps
    for module in model.modules():
        assert not isinstance(module, fused._Part)


@pytest.mark.parametrize("name", tiny_families.params(["bailing_hybrid-moe"]))
def test_kda_and_mla_layers_run_one_gemm_per_group(name):
    """Bailing-Hybrid's KDA layer runs its q, k, v, beta and output-gate projections as one F.linear, its MLA layer
    its query, compressed-KV and head-gate projections (the forget gate's, in a module of its own, stays apart)."""
    model = tiny_families.build(name)
    tokens, parents = _tree()
    apart, apart_calls = _tree_logits(model, tokens, parents, fuse_projections=False)
    together, calls = _tree_logits(model, tokens, parents)
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)
    kda, mla, mlps = 3, 1, 4  # dense MLPs and the MoE's shared experts
    assert apart_calls - calls == 4 * kda + 2 * mla + mlps


@pytest.mark.parametrize("name", tiny_families.params(["glm5_next"]))
def test_glm5_next_layers_run_one_gemm_per_group(name):
    """GLM-5-Next's KDA layer runs its q, k, v, beta and output-gate (first) projections as one F.linear, its MLA layer
    its low-rank query and compressed-KV projections (the forget gate's and the indexer's stay apart)."""
    model = tiny_families.build(name)
    tokens, parents = _tree()
    apart, apart_calls = _tree_logits(model, tokens, parents, fuse_projections=False)
    together, calls = _tree_logits(model, tokens, parents)
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)
    kda, mla, mlps = 2, 2, 4  # a dense MLP and the MoE's shared experts
    assert apart_calls - calls == 4 * kda + mla + mlps


def test_plain_model_is_unchanged_by_fusing(tmp_path):
    """The weights become views of one buffer per group: same values, no new memory, the plain forward's logits
    bit for bit, and save_pretrained / from_pretrained round-trip them."""
    model = build_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([PROMPTS[0]])
    plain = model(ids).logits
    storage = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    groups = fused.fuse_projections(model.get_decoder())
    attention = model.get_decoder().layers[0].linear_attn
    buffer = groups[0].weight
    assert groups[0].module is attention
    assert attention.in_proj_qkv.weight.data_ptr() == buffer.data_ptr()
    assert attention.in_proj_a.weight.data_ptr() == buffer[-attention.in_proj_a.out_features].data_ptr()
    after = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(after.values()) == sum(storage.values())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    torch.testing.assert_close(model(ids).logits, plain, rtol=0, atol=0)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_weights_given_new_storage_are_fused_again():
    """After `model.to(...)` (new storage for every weight) the next tree forward fuses again, from the new
    weights: the logits follow a weight changed since."""
    model = build_model()
    tokens, parents = _tree()
    first = fused.fuse_projections(model.get_decoder())
    model.to(torch.float64).to(torch.float32)
    with torch.no_grad():
        model.get_decoder().layers[0].linear_attn.in_proj_z.weight.mul_(2)
    together, _ = _tree_logits(model, tokens, parents)
    apart, _ = _tree_logits(model, tokens, parents, fuse_projections=False)
    assert fused.fuse_projections(model.get_decoder())[0] is not first[0]
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)


def test_group_that_cannot_share_a_buffer_stays_apart_and_says_so(caplog):
    """A projection with a bias keeps its group one GEMM per projection, named in one warning."""
    model = build_model()
    mlp = model.get_decoder().layers[1].mlp
    up = nn.Linear(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=True)
    up.load_state_dict({"weight": mlp.up_proj.weight, "bias": torch.zeros(up.out_features)})
    mlp.up_proj = up
    tokens, parents = _tree()
    apart, apart_calls = _tree_logits(model, tokens, parents, fuse_projections=False)
    with caplog.at_level(logging.WARNING):
        together, calls = _tree_logits(model, tokens, parents)
        _tree_logits(model, tokens, parents)
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-5)
    assert apart_calls - calls == 3 * 3 + 2 + 4 - 1
    assert caplog.text.count("layers.1.mlp (a projection has a bias)") == 1


def test_parts_called_on_different_inputs_raise():
    """Should a transformers version feed a group's projections different inputs, the fused parts say so."""
    model = build_model()
    group = fused.fuse_projections(model.get_decoder())[0]
    x = torch.randn(1, 2, group.weight.shape[1])
    group.parts[0](x)
    with pytest.raises(RuntimeError, match="bole_fuse_projections=False"):
        group.parts[1](x.clone())
