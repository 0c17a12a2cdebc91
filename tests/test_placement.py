"""Where a model's parts run: one device, accelerate hooks (real, on CPU), and the logic for several GPUs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate import dispatch_model

from hf_bole.placement import execution_device, placement
from tests.models import tiny


def _hook(device) -> SimpleNamespace:
    """What `placement` reads of accelerate's `AlignDevicesHook`: its execution device (GPUs as ints)."""
    return SimpleNamespace(execution_device=device)


def test_one_device():
    model = tiny.build_model()
    device = torch.empty(0).device  # the tests' device (HF_BOLE_TEST_DEVICE)
    place = placement(model)
    assert place.input_device == place.output_device == device
    assert place.layer_devices == (device,) * 4
    assert not place.spans_devices


@pytest.mark.skipif(torch.empty(0).device.type != "cpu", reason="accelerate offload hooks on CPU")
def test_accelerate_offload_hooks(tmp_path):
    """Offloaded modules keep their weights on the meta device; their hooks say where they run."""
    model = tiny.build_model(num_hidden_layers=8)
    device_map = {
        "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "disk", "lm_head": "disk",
        **{f"model.layers.{i}": "cpu" if i < 5 else "disk" for i in range(8)},
    }  # fmt: skip
    model = dispatch_model(model, device_map, offload_dir=tmp_path)
    assert model.lm_head.weight.device.type == "meta"
    place = placement(model)
    assert place.devices == [torch.device("cpu")]
    assert place.output_device == torch.device("cpu")


def test_layers_on_two_gpus():
    """The map `device_map="auto"` makes over two GPUs: hooks on the embedding, each layer and the LM head (GPUs as
    ints); a layer runs where its hook says, its submodules inherit it."""
    model = tiny.build_model(num_hidden_layers=8)
    devices = [0] * 5 + [1] * 3
    for layer, device in zip(model.model.layers, devices):
        layer._hf_hook = _hook(device)
    model.model.embed_tokens._hf_hook = _hook(0)
    model.lm_head._hf_hook = _hook(1)
    place = placement(model)
    cuda = lambda i: torch.device("cuda", i)  # noqa: E731
    assert place.input_device == cuda(0) and place.output_device == cuda(1)
    assert place.layer_devices == tuple(cuda(d) for d in devices)
    assert place.devices == [cuda(0), cuda(1)] and place.spans_devices
    assert execution_device(model, "model.layers.6.linear_attn.in_proj_qkv") == cuda(1)  # inherited
    # A SequentialHook (several hooks on one module) holds the device hook among others.
    model.lm_head._hf_hook = SimpleNamespace(hooks=[SimpleNamespace(), _hook(0)])
    model.hf_device_map = {"lm_head": 0}  # as a new dispatch sets it: the placement is read again
    assert placement(model).output_device == cuda(0)


def test_refusals():
    model = tiny.build_model()
    model.model.layers[1].mlp._hf_hook = _hook(7)  # a map that splits layer 1
    with pytest.raises(ValueError, match=r"model.layers.1 runs on \[.*'cuda:7'\].*device_map='auto'"):
        placement(model)
    model = tiny.build_model()
    model.lm_head.to("meta")  # weights nowhere, and no hook to load them
    with pytest.raises(ValueError, match="lm_head runs nowhere"):
        placement(model)


def test_placement_is_read_again_only_when_the_model_moves():
    """A generate call asks for the placement several times: it is read once, and again after a new device map."""
    model = tiny.build_model(num_hidden_layers=8)
    for layer in model.model.layers:
        layer._hf_hook = _hook(0)
    model.hf_device_map = {"model": 0}
    first = placement(model)
    assert placement(model) is first and first.layer_devices == (torch.device("cuda", 0),) * 8
    for layer in model.model.layers[5:]:
        layer._hf_hook = _hook(1)
    model.hf_device_map = {"model.layers.0": 0, "model.layers.5": 1}  # what a new dispatch sets
    again = placement(model)
    assert again is not first and again.layer_devices[5:] == (torch.device("cuda", 1),) * 3
