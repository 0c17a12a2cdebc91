"""The harness's random-weight models: the published Qwen3.5 and Qwen3-Next shapes of `hf_bole.shapes`, the house model's
shape (`"house"`), a shape larger than one GPU built across the GPUs, and a random MTP head for any of them
(`with_random_mtp`: what the MTP drafter costs).

A shape larger than one GPU (122B-A10B: 227 GiB in bf16) is built across the GPUs by `build_model_across`: on the meta
device first, placed by accelerate's `infer_auto_device_map` under a per-GPU budget (`spread_max_memory`), each
weight then made on its GPU and initialised as `hf_bole.shapes.build_model` initialises it, and accelerate's hooks
attached (`dispatch_model`), as `from_pretrained(..., device_map="auto")` leaves a checkpoint. Under `torchrun`,
`hf_bole.shapes.build_model_tensor_parallel` shards it over the processes' GPUs instead, as
`from_pretrained(..., tp_plan="auto")` does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hf_bole import shapes
from hf_bole.models.mtp import MTP_PREFIX, Qwen3_5MTP
from hf_bole.shapes import (
    SHAPES,
    build_model,
    build_model_tensor_parallel,
    model_class,
    parameter_bytes,
    trained_like,
)

HOUSE_CHECKPOINT = Path(__file__).resolve().parent / "house" / "checkpoint"

__all__ = [
    "HOUSE_CHECKPOINT", "SHAPES", "build_model", "build_model_across", "build_model_tensor_parallel", "parameter_bytes",
    "shape_config", "spread_max_memory", "with_random_mtp",
]  # fmt: skip


def shape_config(shape: str, **overrides):
    """`hf_bole.shapes.shape_config`, with `"house"` for the house checkpoint's shape."""
    if shape == "house" and not (HOUSE_CHECKPOINT / "config.json").is_file():
        raise ValueError(f"the house checkpoint is not at {HOUSE_CHECKPOINT}")
    return shapes.shape_config(str(HOUSE_CHECKPOINT) if shape == "house" else shape, **overrides)


# Each GPU's weight budget over an even share: the map places whole decoder layers (4.7 GiB each at 122B-A10B), so
# the first GPU stops short of its budget by up to one layer and the last must take that much more.
SPREAD_SLACK = 0.08


def spread_max_memory(weight_bytes: int, gpus: list[int], reserve_bytes: int = 8 * 2**30) -> dict[int, int]:
    """`max_memory` for accelerate's `infer_auto_device_map`: each of `gpus` takes an even share of `weight_bytes`
    plus `SPREAD_SLACK`, so that every GPU keeps the rest of its memory for activations and the tree cache (the
    default `"auto"` fills the first GPUs to 90% and leaves the last one the remainder).

    Raises a `ValueError` when a share does not fit in a GPU's free memory less `reserve_bytes`."""
    share = int(weight_bytes / len(gpus) * (1 + SPREAD_SLACK))
    for gpu in gpus:
        free, _ = torch.cuda.mem_get_info(gpu)
        if share > free - reserve_bytes:
            raise ValueError(
                f"the weights take {weight_bytes / 2**30:.1f} GiB: {share / 2**30:.1f} GiB on each of {len(gpus)} GPUs, "
                f"but GPU {gpu} has {free / 2**30:.1f} GiB free and keeps {reserve_bytes / 2**30:.0f} GiB for "
                f"activations and the cache; use more GPUs or a smaller shape"
            )
    return {gpu: share for gpu in gpus}


def _mapped_device(device_map: dict[str, int | str], name: str) -> torch.device:
    """The device of parameter `name` under `device_map` (module name -> device): its closest mapped ancestor's."""
    module = name
    while module not in device_map:
        module = module.rpartition(".")[0] if "." in module else ""
    device = device_map[module]
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


@torch.no_grad()
def build_model_across(config, dtype: torch.dtype, max_memory: dict, seed: int = 0):
    """`build_model` spread over devices: a random-weight model of `config` placed by accelerate's
    `infer_auto_device_map` under `max_memory` (device -> bytes, e.g. `spread_max_memory`), whole decoder layers per
    device, with accelerate's hooks attached (`dispatch_model`) and `hf_device_map` set.

    Built on the meta device, then every weight made on its device (no host copy) and initialised as `build_model`
    does: transformers' initialisation, then `hf_bole.shapes.trained_like`. Raises a `ValueError` when the map would
    offload weights to the CPU or disk (they do not fit in `max_memory`)."""
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights

    torch.manual_seed(seed)
    config.tie_word_embeddings = False  # the unembedding must not overwrite the embedding
    with init_empty_weights():
        model = model_class(config)._from_config(config, dtype=dtype, attn_implementation="sdpa")
    device_map = infer_auto_device_map(
        model, max_memory=max_memory, no_split_module_classes=model._no_split_modules, dtype=dtype
    )
    on_gpus = any(isinstance(device, int) for device in device_map.values())
    offloaded = sorted(n for n, device in device_map.items() if device == "disk" or (on_gpus and device == "cpu"))
    if offloaded:
        raise ValueError(
            f"the weights do not fit in max_memory={max_memory}: {len(offloaded)} modules would be offloaded to the CPU "
            f"or disk ({offloaded[:3]}...); give the GPUs more memory or use more GPUs"
        )
    for name, param in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        module._parameters[leaf] = nn.Parameter(
            torch.empty(param.shape, dtype=param.dtype, device=_mapped_device(device_map, name)), requires_grad=False
        )
    # The meta build marked every module initialised; transformers' initialisation now runs on the real weights.
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
    model.initialize_weights()
    trained_like(model)
    return dispatch_model(model, device_map).eval()


@torch.no_grad()
def with_random_mtp(model, folder: Path) -> None:
    """Gives a random-weight model an MTP head of random weights where `bole_drafter="mtp"` looks for a checkpoint's
    (`Qwen3_5MTP.from_pretrained`): its `mtp.*` tensors in `folder/model.safetensors`, and `model.name_or_path` set to
    `folder`. Its drafts are next to never accepted: it measures what the MTP drafter costs, not what it brings."""
    from safetensors.torch import save_file
    from transformers.utils import SAFE_WEIGHTS_NAME

    mtp = Qwen3_5MTP.for_model(model)  # transformers' initialisation, on the LM head's device
    tensors = {MTP_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in mtp.state_dict().items()}
    Path(folder).mkdir(parents=True, exist_ok=True)
    save_file(tensors, Path(folder) / SAFE_WEIGHTS_NAME, metadata={"format": "pt"})
    model.name_or_path = str(folder)
