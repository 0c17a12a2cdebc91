"""The published Qwen3.5 shapes (DESIGN.md §8) as random-weight models built directly on the device, for speed
and memory runs without checkpoints (`eval/run.py --shape 9B`).

Every shape shares: vocab 248320, attention head_dim 256, GDN key/value head dims 128, conv kernel 4, layers
[lin, lin, lin, full] x N, partial rotary 0.25, one MTP layer (declared in the config; the random model has no
MTP weights, so runs on shapes draft with the oracle of `eval/oracle.py`).

    model       hidden  layers  attn heads/kv  GDN k/v heads  FFN
    4B          2560    32      16/4           16/32          9216
    9B          4096    32      16/4           16/32          12288
    27B         5120    64      24/4           16/48          17408
    35B-A3B     2048    40      16/2           16/32          256 experts top-8, 512 (+512 shared)
    122B-A10B   3072    48      32/2           16/64          256 experts top-8, 1024 (+1024 shared)

`"house"` (or any folder with a config.json) gives a random model of that checkpoint's shape.

A shape larger than one GPU (122B-A10B: 227 GiB in bf16) is built across the GPUs by `build_model_across`: on the meta
device first, placed by accelerate's `infer_auto_device_map` under a per-GPU budget (`spread_max_memory`), each
weight then made on its GPU and initialised as `build_model` initialises it, and accelerate's hooks attached
(`dispatch_model`), as `from_pretrained(..., device_map="auto")` leaves a checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

EMBEDDING_SCALE = 10.0
# Weights that write a layer's output into the residual stream, scaled down so that the stream stays dominated by
# the token's embedding however wide and deep the shape (each layer adds ~1.6 per coordinate at the 9B width
# otherwise, against the embedding's 0.2). Compute is unchanged.
LAYER_OUTPUT_SCALE = 1e-3
_LAYER_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")
HOUSE_CHECKPOINT = Path(__file__).resolve().parent / "house" / "checkpoint"

COMMON = dict(
    vocab_size=248320,
    head_dim=256,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    mtp_num_hidden_layers=1,
    tie_word_embeddings=False,
)

SHAPES: dict[str, dict] = {
    "4B": dict(
        hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
        linear_num_key_heads=16, linear_num_value_heads=32, intermediate_size=9216,
    ),
    "9B": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
        linear_num_key_heads=16, linear_num_value_heads=32, intermediate_size=12288,
    ),
    "27B": dict(
        hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
        linear_num_key_heads=16, linear_num_value_heads=48, intermediate_size=17408,
    ),
    "35B-A3B": dict(
        hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=512, shared_expert_intermediate_size=512,
    ),
    "122B-A10B": dict(
        hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2,
        linear_num_key_heads=16, linear_num_value_heads=64, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
    ),
}  # fmt: skip


def shape_config(shape: str, **overrides) -> Qwen3_5TextConfig | Qwen3_5MoeTextConfig:
    """The text config of a named shape (`SHAPES`), of the house model (`"house"`), or of the checkpoint folder
    `shape`; `overrides` replace fields (tests shrink a shape this way)."""
    if shape in SHAPES:
        fields = {**COMMON, **SHAPES[shape], **overrides}
        moe = "num_experts" in fields
        if "layer_types" not in fields:
            fields["layer_types"] = [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(fields["num_hidden_layers"])
            ]
        return (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(**fields)
    folder = HOUSE_CHECKPOINT if shape == "house" else Path(shape)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"--shape must be one of {', '.join(SHAPES)}, 'house' or a checkpoint folder with a config.json; "
            f"got {shape!r}" + (f" (the house checkpoint is not at {HOUSE_CHECKPOINT} yet)" if shape == "house" else "")
        )
    config = AutoConfig.from_pretrained(folder).get_text_config(decoder=True)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def model_class(config) -> type:
    if config.model_type == "qwen3_5_moe_text":
        return Qwen3_5MoeForCausalLM
    if config.model_type == "qwen3_5_text":
        return Qwen3_5ForCausalLM
    raise ValueError(f"shapes are Qwen3.5 text configs (qwen3_5_text, qwen3_5_moe_text), got {config.model_type!r}")


def parameter_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of the model's weights in `dtype`, counted on the meta device (nothing is allocated)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = model_class(config)(config)
    return sum(p.numel() for p in model.parameters()) * torch.finfo(dtype).bits // 8


@torch.no_grad()
def build_model(config, device: torch.device | str, dtype: torch.dtype, seed: int = 0):
    """A random-weight model of `config`, built on `device` in `dtype` (no host copy, no checkpoint).

    transformers' own initialisation runs on the device (normal(0, 0.02) weights, centred norms), with two changes:
    - GDN decays are redrawn as Mamba-2 initialises them: upstream draws A up to 16 with dt_bias = 1, so every state
      forgets itself within a token, which no trained model does;
    - the unembedding is the embedding, permuted, the embedding is scaled up and every layer's output projections
      down: the residual stream then carries the current token to the end and its logits single out one successor
      by a wide margin, as a trained model's mostly do. With transformers' weights the top logits of 248k tokens
      sit within bf16 rounding of each other, so greedy decoding in bf16 follows rounding noise: plain and tree
      decoding part within a few tokens (seen at the 9B shape on an H200), and the oracle, which knows plain
      decoding's continuation, stops being accepted.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        needed = parameter_bytes(config, dtype)
        if needed > 0.9 * free:
            raise ValueError(
                f"the weights of this shape take {needed / 2**30:.1f} GiB in {dtype}, more than the "
                f"{free / 2**30:.1f} GiB free on {device}; pick a smaller shape, or spread it over the GPUs "
                f"(eval/run.py --device-map auto)"
            )
    torch.manual_seed(seed)
    config.tie_word_embeddings = False  # the unembedding below must not overwrite the embedding
    with torch.device(device):
        model = model_class(config)._from_config(config, dtype=dtype, attn_implementation="sdpa")
    _trained_like(model)
    return model.eval()


def _trained_like(model) -> None:
    """`build_model`'s changes to transformers' initialisation (see there), in place, wherever the weights are."""
    for layer in model.model.layers:
        if layer.block_type == "linear_attention":
            gdn = layer.linear_attn
            A = torch.empty_like(gdn.A_log, dtype=torch.float32).uniform_(1.0, 16.0)
            dt = torch.empty_like(A).uniform_(math.log(1e-3), math.log(1e-1)).exp()
            gdn.A_log.copy_(A.log())
            gdn.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
    embedding = model.get_input_embeddings().weight  # [V, hidden]
    successor = torch.randperm(embedding.shape[0], device=embedding.device)
    # logit of v ~ <embedding[successor[v]], h>: largest where v is the current token's successor (under a device map
    # the LM head may sit on another GPU than the embedding: one copy).
    model.get_output_embeddings().weight.copy_(embedding[successor])
    embedding.mul_(EMBEDDING_SCALE)
    for name, weight in model.model.layers.named_parameters():
        if name.endswith(_LAYER_OUTPUTS):
            weight.mul_(LAYER_OUTPUT_SCALE)


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
    does: transformers' initialisation, then `build_model`'s changes. Raises a `ValueError` when the map would
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
    _trained_like(model)
    return dispatch_model(model, device_map).eval()
