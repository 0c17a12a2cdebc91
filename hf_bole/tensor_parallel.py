"""A model split over processes by transformers' tensor parallelism (`from_pretrained(..., tp_plan="auto")` under
`torchrun --nproc-per-node N`): what a rank holds of it.

transformers shards the weights named in the model's TP plan as DTensors over a device mesh and hooks those modules'
forwards with the collectives around them. Qwen3.5's plan splits the full-attention layers by heads (q, k, v column-
wise, o row-wise: each rank attends with its share of the query and KV heads and one all-reduce sums the output) and
the MLPs by columns, and gathers the GDN layers' projections (`colwise_gather_output`), so every rank runs every GDN
head. Every rank runs the whole decoding round on the same inputs: the logits come out gathered (the LM head is
`colwise_gather_output`), identical on every rank, so drafts, selection and greedy acceptance agree without any
exchange; sampling agrees where every rank's generator is seeded alike (`check_same_generator`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class TensorParallel:
    """What one rank of a tensor-parallel model holds.

    Args:
        size: the TP degree: how many ranks share the model's weights (1: not tensor-parallel).
        group: the process group of those ranks (None at size 1).
        key_value_heads: the KV heads each full-attention layer of this rank holds; None at size 1, where the cache
            holds the layout's own (`cache/layout.py`: MLA's one compressed head included).
    """

    size: int
    group: dist.ProcessGroup | None
    key_value_heads: int | None


def _local_rows(weight: torch.Tensor) -> int:
    return (weight.to_local() if isinstance(weight, DTensor) else weight).shape[0]


def tensor_parallel(model: nn.Module) -> TensorParallel:
    """The `TensorParallel` of a Qwen3.5 model: read from its DTensor weights, so that it holds whichever transformers
    version sharded them.

    Reads Qwen3.5's layout (its attention's `k_proj` split by heads; `generate` refuses other families under tensor
    parallelism: `generation.requests.tensor_parallel_settings`). Raises a `ValueError` for a plan that splits a GDN
    layer's heads (its projections not gathered), or a mesh of more than one dimension (data or pipeline parallelism
    besides TP)."""
    if not dist.is_available() or not dist.is_initialized():
        # DTensor weights need a process group: without one, no parameter scan (a walk of every module, paid on the
        # host in every call)
        return TensorParallel(1, None, None)
    config = model.config.get_text_config(decoder=True)
    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    if not meshes:
        return TensorParallel(1, None, None)
    if len(meshes) > 1 or next(iter(meshes)).ndim != 1:
        raise ValueError(
            "hf_bole runs tensor parallelism over one mesh dimension (DistributedConfig(tp_size=N) or tp_plan='auto' "
            "alone); this model's weights sit on several meshes or dimensions (data, pipeline or expert parallelism "
            "besides): load it with tensor parallelism only"
        )
    mesh = meshes.pop()
    layers = model.get_decoder().layers
    attention = next(layer.self_attn for layer in layers if layer.block_type == "full_attention")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for i, layer in enumerate(layers):
        if layer.block_type != "linear_attention":
            continue
        gdn = layer.linear_attn
        # The GDN kernels run on the heads the layer's conv and decays hold: all of them, where the projections are
        # gathered (transformers' plan); a plan that shards them leaves `A_log` or `conv1d` split.
        if isinstance(gdn.A_log, DTensor) or isinstance(gdn.conv1d.weight, DTensor):
            raise ValueError(
                f"hf_bole runs every GDN head on every tensor-parallel rank, but this model's plan splits layer {i}'s "
                f"(model.layers.{i}.linear_attn): keep its projections 'colwise_gather_output', as transformers' "
                f"Qwen3.5 plan has them"
            )
    return TensorParallel(mesh.size(), mesh.get_group(), _local_rows(attention.k_proj.weight) // head_dim)


def check_same_generator(tp: TensorParallel, device: torch.device) -> None:
    """Raises a `ValueError` unless torch's generator of `device` is in the same state on every rank: sampled tokens
    (acceptance, the bonus token) must be drawn alike on every rank, as plain `generate` under TP needs too. One
    all-gather of a checksum of the state, once per call."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    digest = torch.tensor([int(state.long().mul(torch.arange(1, state.numel() + 1)).sum())], device=device)
    digests = [torch.empty_like(digest) for _ in range(tp.size)]
    dist.all_gather(digests, digest, group=tp.group)
    if any(not torch.equal(d, digest) for d in digests):
        raise ValueError(
            f"hf_bole samples on every tensor-parallel rank, and the {tp.size} ranks' random generators differ: their "
            f"tokens would too. Seed every rank alike before generate (torch.manual_seed(seed) on each), as plain "
            f"sampling under tensor parallelism needs too"
        )
