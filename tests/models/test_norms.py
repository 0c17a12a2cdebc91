"""Each RMSNorm of an eager verify forward as one kernel; the model's own modules outside tree mode."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_bole.models import norms
from hf_bole.models import adapter, family_of
from hf_bole.models.twin import tree_twin
from tests.models.tiny import build_model, random_tree_logits

pytestmark = pytest.mark.usefixtures("torch_gdn")


def _model(kind: str = "dense"):
    """A tiny model whose norm weights are not their initial zeros and ones, so that a weight read wrong shows."""
    model = build_model(kind)
    with torch.no_grad():
        for module in model.modules():
            if type(module) in sum(family_of(model.config).norm_classes(), ()):
                module.weight.add_(torch.randn_like(module.weight) * 0.3)
    return model


class _Count:
    """Counts calls of a function of `hf_bole.models.norms` and passes them on."""

    def __init__(self, monkeypatch, name: str):
        self.calls, original = 0, getattr(norms, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(norms, name, counted)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tree_forward_runs_every_norm_through_the_kernels(monkeypatch, kind):
    """Every layer's two norms, the attention's q and k norms, the final norm (zero-centred) and each GDN layer's
    gated norm go through `rms_norm` / `gated_rms_norm`; afterwards the model holds its own modules again and its
    state dict is as it was."""
    model = _model(kind)
    keys = list(model.state_dict())
    modules = dict(model.named_modules())
    plain, gated = _Count(monkeypatch, "rms_norm"), _Count(monkeypatch, "gated_rms_norm")
    random_tree_logits(model)
    config = model.config
    gdn = config.layer_types.count("linear_attention")
    full = config.num_hidden_layers - gdn
    assert (plain.calls, gated.calls) == (2 * config.num_hidden_layers + 2 * full + 1, gdn)
    assert dict(model.named_modules()) == modules and list(model.state_dict()) == keys


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_kernels_give_the_model_norms_logits(monkeypatch, kind):
    """Through the Triton kernels (the interpreter on the CPU), the tree's logits are the ones transformers' own
    norm modules give."""
    model = _model(kind)
    fused = random_tree_logits(model)
    twin = adapter.tree_twin
    monkeypatch.setattr(adapter, "tree_twin", lambda decoder, projections, norms: twin(decoder, projections, False))
    # fp32 sums in another order, layer after layer: about 1e-5 apart on logits near 0.05 (triton 3.9's interpreter).
    torch.testing.assert_close(fused, random_tree_logits(model), rtol=1e-4, atol=5e-5)


def test_module_that_is_hooked_keeps_its_forward_and_says_so(monkeypatch, caplog):
    """A norm that accelerate hooks keeps transformers' forward, named once in a warning; the others still swap."""
    model = _model()
    layer_norm = model.get_decoder().layers[1].input_layernorm
    layer_norm._hf_hook = object()  # what accelerate's add_hook_to_module leaves on a module
    plain = _Count(monkeypatch, "rms_norm")
    with caplog.at_level(logging.WARNING):
        random_tree_logits(model)
        random_tree_logits(model)
    config = model.config
    full = config.layer_types.count("full_attention")
    assert plain.calls == 2 * (2 * config.num_hidden_layers + 2 * full + 1 - 1)
    assert caplog.text.count("layers.1.input_layernorm (accelerate hooks it)") == 1


def test_norm_replaced_since_is_swapped_next_time():
    """A norm module replaced after a tree forward is the one the next tree forward stands in for, not the old one."""
    model = _model()
    random_tree_logits(model)
    decoder = model.get_decoder()
    old = decoder.norm
    decoder.norm = type(old)(old.weight.shape[0], eps=old.eps)
    stand_in = tree_twin(decoder, projections=True, norms=True).module.norm
    assert stand_in.norm is decoder.norm
