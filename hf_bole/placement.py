"""Where a model's parts run: one device, or several under accelerate's `device_map` (e.g. `device_map="auto"`).

accelerate places each module of the map on its device and hooks it (`AlignDevicesHook`): the hook moves the
module's inputs to its execution device, and for an offloaded module (`"cpu"` or `"disk"` in the map) loads the
weights there for each call, leaving the parameters on the meta device in between. So a module runs where its
nearest hooked ancestor-or-self says (`execution_device`), or, without hooks, where its parameters are.

hf_bole keeps every layer's tree state on the device that layer runs on (`BoleCache(layer_devices=...)`), takes
its inputs to the embedding's device and reads the logits on the LM head's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Placement:
    """Devices of a model's parts.

    Args:
        input_device: where the input embedding runs (token ids go there).
        output_device: where the LM head runs (the logits come out there; the MTP drafter sits there).
        layer_devices: per decoder layer, where it runs (its cache state lives there).
    """

    input_device: torch.device
    output_device: torch.device
    layer_devices: tuple[torch.device, ...]

    @property
    def devices(self) -> list[torch.device]:
        """The distinct devices, in the order the forward meets them."""
        return list(dict.fromkeys([self.input_device, *self.layer_devices, self.output_device]))

    @property
    def spans_devices(self) -> bool:
        return len(self.devices) > 1


def _as_device(device) -> torch.device:
    # accelerate records GPUs as ints in device maps and hooks.
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _hook_device(module: nn.Module) -> torch.device | None:
    hook = getattr(module, "_hf_hook", None)
    # A SequentialHook holds several hooks; the device one is an AlignDevicesHook among them.
    for h in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        device = getattr(h, "execution_device", None)
        if device is not None:
            return _as_device(device)
    return None


def _run_devices(module: nn.Module, inherited: torch.device | None) -> set[torch.device]:
    """The devices the parameters of `module` (and its children) are used on."""
    here = _hook_device(module) or inherited
    devices = set()
    for p in module.parameters(recurse=False):
        if here is not None:
            devices.add(here)
        elif p.device.type != "meta":
            devices.add(p.device)
    for child in module.children():
        devices |= _run_devices(child, here)
    return devices


def execution_device(root: nn.Module, name: str) -> torch.device:
    """The one device the submodule `name` of `root` (dotted path, "" for `root`) runs on.

    Raises a `ValueError` when its parameters run on several devices (a device map that splits it) or nowhere (all
    on the meta device without a hook to load them)."""
    module, inherited = root, _hook_device(root)
    for part in name.split(".") if name else []:
        module = getattr(module, part)
        inherited = _hook_device(module) or inherited
    devices = _run_devices(module, inherited)
    if len(devices) != 1:
        where = "nowhere (its weights are on the meta device and no accelerate hook loads them)" if not devices else (
            f"on {sorted(map(str, devices))}"
        )
        raise ValueError(
            f"hf_bole needs every decoder layer, the embedding and the LM head each on one device, but {name or 'the model'} "
            f"runs {where}; load the model with device_map='auto' (which keeps each decoder layer whole: "
            f"no_split_module_classes) or on one device"
        )
    return devices.pop()


# model -> (what `_moved` read, its Placement): reading the placement walks every module (2-3 ms on a 9B model, on
# a CPU), and a generate call asks for it several times (the loop, the budget table's key, CUDA graphs, the cache).
_PLACEMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _moved(model: nn.Module) -> tuple:
    """What changes when a model is placed again: accelerate's map (set anew by every dispatch) and where its
    embedding and LM head weights are (`.to(device)` moves both)."""
    device_map = getattr(model, "hf_device_map", None)
    return (
        None if device_map is None else tuple(device_map.items()),
        model.get_input_embeddings().weight.device,
        model.get_output_embeddings().weight.device,
    )


def placement(model: nn.Module) -> Placement:
    """The `Placement` of a Qwen3.5 model (`...ForCausalLM` or `...ForConditionalGeneration`), read once per
    placement of the model: again only after it is moved or dispatched anew."""
    moved = _moved(model)
    held = _PLACEMENTS.get(model)
    if held is None or held[0] != moved:
        held = _PLACEMENTS[model] = (moved, _read_placement(model))
    return held[1]


def _read_placement(model: nn.Module) -> Placement:
    names = {module: name for name, module in model.named_modules()}
    decoder = model.get_decoder()
    input_device = execution_device(model, names[model.get_input_embeddings()])
    output_device = execution_device(model, names[model.get_output_embeddings()])
    layers = tuple(execution_device(model, names[layer]) for layer in decoder.layers)
    return Placement(input_device, output_device, layers)
