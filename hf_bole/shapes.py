"""The published Qwen3.5, Qwen3-Next, Kimi-Linear and Ling-3.0 shapes as random-weight models, for calibration and
benchmarks without checkpoints (`python -m hf_bole.calibrate --shape 9B`). A forward's cost depends on the shape, not
on the weights, so a budget table measured on a shape serves the published checkpoint of that shape
(`hf_bole.generation.budget.model_key`).

Every Qwen3.5 shape shares: vocab 248320, attention head_dim 256, GDN key/value head dims 128, conv kernel 4, layers
[lin, lin, lin, full] x N, partial rotary 0.25, one MTP layer (declared in the config; a random model has no MTP
weights, so it drafts with another drafter, e.g. the harness's oracle).

    model       hidden  layers  attn heads/kv  GDN k/v heads  FFN
    4B          2560    32      16/4           16/32          9216
    9B          4096    32      16/4           16/32          12288
    27B         5120    64      24/4           16/48          17408
    35B-A3B     2048    40      16/2           16/32          256 experts top-8, 512 (+512 shared)
    122B-A10B   3072    48      32/2           16/64          256 experts top-8, 1024 (+1024 shared)

Qwen3-Next-80B-A3B is transformers' `Qwen3NextConfig()` as it is (its docstring: the defaults yield a configuration
like Qwen3-Next-80B-A3B-Instruct's): vocab 151936, hidden 2048, 48 layers [lin, lin, lin, full] x 12, attention 16/2
heads of 256 (gated, partial rotary 0.25), GDN 16/32 heads of 128, 512 experts top-10 of 512 (+512 shared), 79.7B
parameters, 148 GiB in bf16: more than one H200 holds, so it runs spread over two GPUs (`eval/run.py --device-map
auto`). Qwen3-Next-80B-A3B-40L is the same with 40 of its 48 layers (124 GiB in bf16), every layer as the 80B-A3B's,
for one H200: per layer the forwards cost what the 80B-A3B's do, so ratios between decoding modes carry over (the LM
head and embedding, 1% of the weights, excepted).

The KDA families' shapes are transformers' config defaults too (their docstrings name the checkpoints):
Kimi-Linear-48B-A3B (`KimiLinearConfig()`: 27 layers, KDA and MLA 3:1, 49.1B parameters, 92 GiB in bf16: one H200)
and Ling-3.0-flash (`BailingHybridConfig()`, transformers 5.24 on: 42 layers, KDA and MLA 5:1, 124.4B parameters, 232
GiB). Cut to fewer layers as Qwen3-Next-80B-A3B-40L is, for one GPU: Kimi-Linear-48B-A3B-16L (53 GiB, one H100),
Ling-3.0-flash-12L (59 GiB, one H100) and -24L (128 GiB, one H200).

Example:

```python
>>> import torch
>>> from hf_bole.shapes import build_model, shape_config
>>> config = shape_config("9B", num_hidden_layers=4, hidden_size=256, vocab_size=1024)  # overrides shrink a shape
>>> model = build_model(config, "cpu", torch.float32)
>>> type(model).__name__, [layer.block_type for layer in model.model.layers]
('Qwen3_5ForCausalLM', ['linear_attention', 'linear_attention', 'linear_attention', 'full_attention'])
```
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
import transformers
from transformers import AutoConfig, PretrainedConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

EMBEDDING_SCALE = 10.0
# Weights that write a layer's output into the residual stream, scaled down so that the stream stays dominated by
# the token's embedding however wide and deep the shape (each layer adds ~1.6 per coordinate at the 9B width
# otherwise, against the embedding's 0.2). Compute is unchanged.
LAYER_OUTPUT_SCALE = 1e-3
_LAYER_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")

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
    # transformers' config defaults (see above); Qwen3-Next's MTP layer declared as in the published config
    "Qwen3-Next-80B-A3B": dict(model_type="qwen3_next", mtp_num_hidden_layers=1),
    "Qwen3-Next-80B-A3B-40L": dict(model_type="qwen3_next", mtp_num_hidden_layers=1, num_hidden_layers=40),
    "Kimi-Linear-48B-A3B": dict(model_type="kimi_linear"),
    "Kimi-Linear-48B-A3B-16L": dict(model_type="kimi_linear", num_hidden_layers=16),
    "Ling-3.0-flash-12L": dict(model_type="bailing_hybrid", num_hidden_layers=12),
    "Ling-3.0-flash-24L": dict(model_type="bailing_hybrid", num_hidden_layers=24),
}  # fmt: skip
# model_type -> (config class, model class), by their names in transformers (Lara-Mini's, Bailing-Hybrid's,
# GLM-5-Next's and Qwen4-Exp's from 5.24 on); eval/check_families.py builds every family's from its config defaults
# through them
CLASSES = {
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM"),
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM"),
    "glm5_next": ("Glm5NextConfig", "Glm5NextForConditionalGeneration"),  # the text path; no text-only class
    "qwen4_exp_text": ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM"),
}


def shape_config(shape: str, **overrides) -> PretrainedConfig:
    """The text config of a named shape (`SHAPES`) or of the checkpoint folder `shape` (its `config.json`);
    `overrides` replace fields (tests shrink a shape this way)."""
    if shape in SHAPES and "model_type" in SHAPES[shape]:
        fields = {k: v for k, v in SHAPES[shape].items() if k != "model_type"}
        return _transformers_class(SHAPES[shape]["model_type"], 0, shape)(**{**fields, **overrides})
    if shape in SHAPES:
        fields = {**COMMON, **SHAPES[shape], **overrides}
        moe = "num_experts" in fields
        if "layer_types" not in fields:
            fields["layer_types"] = [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(fields["num_hidden_layers"])
            ]
        return (Qwen3_5MoeTextConfig if moe else Qwen3_5TextConfig)(**fields)
    if not (Path(shape) / "config.json").is_file():
        raise ValueError(
            f"a shape must be one of {', '.join(SHAPES)} or a checkpoint folder with a config.json; got {shape!r}"
        )
    config = AutoConfig.from_pretrained(shape).get_text_config(decoder=True)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def available(shape: str) -> bool:
    """Whether this transformers has the classes of the named shape `shape` (Ling-3.0's from 5.24 on)."""
    model_type = SHAPES[shape].get("model_type")  # None: a Qwen3.5 shape, in every supported transformers
    return model_type is None or hasattr(transformers, CLASSES[model_type][0])


def model_class(config) -> type:
    return _transformers_class(config.model_type, 1, config.model_type)


def _transformers_class(model_type: str, which: int, what: str) -> type:
    """`CLASSES[model_type][which]` (0: the config class, 1: the model class) from transformers."""
    if model_type not in CLASSES:
        raise ValueError(f"shapes are configs of the model types {', '.join(CLASSES)}, got {model_type!r}")
    found = getattr(transformers, CLASSES[model_type][which], None)
    if found is None:
        raise ValueError(
            f"{what} needs transformers' {CLASSES[model_type][which]}, which transformers {transformers.__version__} "
            f"lacks: install a newer transformers"
        )
    return found


def parameter_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of the model's weights in `dtype`, counted on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = model_class(config)(config)
    return sum(p.numel() for p in model.parameters()) * torch.finfo(dtype).bits // 8


@torch.no_grad()
def build_model(config, device: torch.device | str, dtype: torch.dtype, seed: int = 0):
    """A random-weight model of `config`, built on `device` in `dtype` (no host copy, no checkpoint).

    transformers' own initialisation runs on the device (normal(0, 0.02) weights, centred norms), then
    `trained_like` makes the weights behave as a trained model's in the ways decoding notices.

    Raises a `ValueError` when the weights would not fit in the GPU's free memory.
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        needed = parameter_bytes(config, dtype)
        if needed > 0.9 * free:
            raise ValueError(
                f"the weights of this shape take {needed / 2**30:.1f} GiB in {dtype}, more than the "
                f"{free / 2**30:.1f} GiB free on {device}; pick a smaller shape or a larger GPU"
            )
    torch.manual_seed(seed)
    config.tie_word_embeddings = False  # the unembedding `trained_like` sets must not overwrite the embedding
    with torch.device(device):
        model = model_class(config)._from_config(config, dtype=dtype, attn_implementation="sdpa")
    trained_like(model)
    return model.eval()


def build_model_tensor_parallel(config, dtype: torch.dtype, seed: int = 0):
    """`build_model` sharded over the processes of `torchrun` by transformers' tensor parallelism: a random-weight
    model of `config` loaded with `from_pretrained(None, state_dict={}, tp_plan="auto")`, so that transformers makes
    and initialises each rank's shards on its GPU (no checkpoint, no host copy), then `trained_like`. The weights
    every rank holds whole (norms, GDN convs and decays) are rank 0's, so that the ranks run one model."""
    torch.manual_seed(seed)
    config.tie_word_embeddings = False  # the unembedding `trained_like` sets must not overwrite the embedding
    model = model_class(config).from_pretrained(
        None, config=config, state_dict={}, tp_plan="auto", dtype=dtype, attn_implementation="sdpa"
    )
    torch.manual_seed(seed)  # `trained_like` draws alike on every rank
    trained_like(model)
    with torch.no_grad():
        for param in model.parameters():
            if not isinstance(param, DTensor):
                dist.broadcast(param.data, src=0)
    return model.eval()


@torch.no_grad()
def trained_like(model) -> None:
    """Changes transformers' random initialisation of `model` in place, wherever its weights are (on several devices,
    or sharded by tensor parallelism: then the same on every rank where torch's generator is):
    - GDN decays are redrawn as Mamba-2 initialises them: upstream draws A up to 16 with dt_bias = 1, so every state
      forgets itself within a token, which no trained model does;
    - the unembedding is the embedding, permuted, the embedding is scaled up and every layer's output projections
      down: the residual stream then carries the current token to the end and its logits single out one successor
      by a wide margin, as a trained model's mostly do. With transformers' weights the top logits of 248k tokens
      sit within bf16 rounding of each other, so greedy decoding in bf16 follows rounding noise: plain and tree
      decoding part within a few tokens, and a drafter that knows plain decoding's continuation stops being
      accepted.
    """
    layers = model.get_decoder().layers  # a ConditionalGeneration model's: its language model's
    for gdn in layers.modules():
        if hasattr(gdn, "A_log") and hasattr(gdn, "dt_bias"):  # a GDN layer of any family, or KDA's forget gate
            A = torch.empty_like(gdn.A_log, dtype=torch.float32).uniform_(1.0, 16.0)
            # per head (GDN) or per head and key channel (KDA's dt_bias [H K], with A_log [1, 1, H, 1])
            dt = torch.empty_like(gdn.dt_bias, dtype=torch.float32).uniform_(math.log(1e-3), math.log(1e-1)).exp()
            gdn.A_log.copy_(A.log())
            gdn.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
    embedding, unembedding = model.get_input_embeddings().weight, model.get_output_embeddings().weight  # [V, hidden]
    full = embedding.full_tensor() if isinstance(embedding, DTensor) else embedding
    successor = torch.randperm(full.shape[0], device=full.device)
    # logit of v ~ <embedding[successor[v]], h>: largest where v is the current token's successor (under a device map
    # the LM head may sit on another GPU than the embedding: one copy).
    permuted = full[successor]
    if isinstance(unembedding, DTensor):  # tensor-parallel: this rank's rows of it, cut locally
        permuted = distribute_tensor(permuted, unembedding.device_mesh, unembedding.placements, src_data_rank=None)
    _local(unembedding).copy_(_local(permuted))
    _local(embedding).mul_(EMBEDDING_SCALE)
    for name, weight in layers.named_parameters():
        if name.endswith(_LAYER_OUTPUTS):
            _local(weight).mul_(LAYER_OUTPUT_SCALE)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel weight's shard on this rank (scaling it scales the whole); any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
