"""The decoder's tree twin: shares the model's parameters, leaves its modules alone, follows changes to the model."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from hf_bole.models import fused
from hf_bole.models.twin import tree_twin
from tests.models.tiny import build_model, random_tree_logits

pytestmark = pytest.mark.usefixtures("torch_gdn")


def test_tree_forward_leaves_the_model_modules_alone():
    """During a tree forward the model holds its own modules (a hook on a layer sees them), and the twin shares every
    module it does not stand in for, and every parameter."""
    model = build_model()
    decoder = model.get_decoder()
    modules = dict(model.named_modules())
    during = []
    hook = decoder.layers[1].register_forward_pre_hook(lambda *_: during.append(dict(model.named_modules())))
    random_tree_logits(model)
    hook.remove()
    assert during == [modules] * 2  # the hook (shared with the twin's copy of the layer): the prefill, the tree
    twin = tree_twin(decoder, projections=True, norms=True).module
    assert twin is not decoder and twin.layers[1] is not decoder.layers[1]
    assert twin.embed_tokens is decoder.embed_tokens
    assert twin.layers[1].linear_attn.conv1d is decoder.layers[1].linear_attn.conv1d
    assert isinstance(twin.layers[1].linear_attn.in_proj_qkv, fused._Part)
    assert twin.layers[1].linear_attn.A_log is decoder.layers[1].linear_attn.A_log
    assert tree_twin(decoder, projections=False, norms=False).module is decoder


def test_twin_is_made_again_when_the_model_changes():
    """Kept while the model is as it was; made again after `train()`, a replaced module or a new attribute, and then
    runs what the model holds."""
    model = build_model()
    decoder = model.get_decoder()
    twin = tree_twin(decoder, projections=True, norms=True)
    assert tree_twin(decoder, projections=True, norms=True) is twin
    model.train()
    trained = tree_twin(decoder, projections=True, norms=True)
    assert trained is not twin and trained.module.layers[0].training
    model.eval()
    mlp = decoder.layers[2].mlp
    decoder.layers[2].mlp = type(mlp)(mlp.config, mlp.intermediate_size)
    replaced = tree_twin(decoder, projections=True, norms=True)
    assert replaced.module.layers[2].mlp.down_proj is decoder.layers[2].mlp.down_proj
    decoder.layers[3].self_attn.scaling = 0.5
    assert tree_twin(decoder, projections=True, norms=True).module.layers[3].self_attn.scaling == 0.5


def test_a_forward_that_raised_leaves_no_partial_product():
    """A tree forward that raises between a group's projections leaves nothing behind for the next one."""
    model = build_model()
    twin = tree_twin(model.get_decoder(), projections=True, norms=False)
    part = twin.module.layers[0].linear_attn.in_proj_qkv
    with pytest.raises(KeyError), twin.entered():
        part(torch.randn(1, 2, 64))
        raise KeyError("a forward failing inside the group")
    part(torch.randn(1, 2, 64))  # a new input: no "called on different ones" error


def test_threads_keep_their_own_products():
    """Two threads through one group at once each get the columns of their own input's product."""
    model = build_model()
    group = fused.fuse_projections(model.get_decoder())[0]
    xs = [torch.randn(1, 2, group.weight.shape[1]) for _ in range(2)]
    first, second = threading.Event(), threading.Event()
    got = {}

    def run(i: int, wait: threading.Event, signal: threading.Event) -> None:
        if i == 1:
            wait.wait(timeout=30)
        got[i, 0] = group.parts[0](xs[i])
        signal.set()
        if i == 0:
            wait.wait(timeout=30)
        got[i, 1] = group.parts[1](xs[i])
        for part in group.parts[2:]:
            part(xs[i])

    threads = [threading.Thread(target=run, args=args) for args in ((0, second, first), (1, first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for i in range(2):
        for j in range(2):
            torch.testing.assert_close(got[i, j], nn.functional.linear(xs[i], group.linears[j].weight))
