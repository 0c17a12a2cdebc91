"""The projections of a layer that read one input, run as one GEMM in the verify forward.

A verify forward multiplies a few dozen tree nodes by every weight of the model, so each GEMM is bound by reading
its weight, and a small one by its launch and split-K reduction besides. Qwen3.5's layers run several projections
of one input one after the other: a GDN layer four (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), an attention
layer three (q, k, v), an MLP two (gate, up). On a 9B model a GDN layer's four input projections take far longer
than one GEMM over as many bytes of weights, in_proj_b and in_proj_a (32 outputs each) a large share of it.

`fuse_projections(decoder)` copies each such group's weights into one buffer `[sum of out_features, in_features]`
and makes the Linears' weights views of it, once per model. The plain forward then computes exactly what it did
(each Linear still runs its own GEMM on the same weights), the model takes no more memory, and `save_pretrained`
still writes the weights one by one (it clones weights that share a buffer without overlapping). The tree forward
runs a twin of the decoder (`models/twin.py`) in which each group's Linears are parts of one GEMM
(`projection_stand_ins`): the first part called multiplies its input by the whole buffer, and every part returns its
columns of the product. The model's own modules are never swapped. A group stays as it is, and a log line says which
and why, when its Linears are not plain bias-free `nn.Linear`s on one device in one dtype (quantized, offloaded by
accelerate, hooked one by one, sharded by tensor parallelism).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.utils import logging

from hf_bole.models.family import family_of

logger = logging.get_logger(__name__)



@dataclass(eq=False)
class _Group:
    """One module's Linears of one input, their weights views of `weight`."""

    name: str  # the module's qualified name, for messages
    module: nn.Module
    names: tuple[str, ...]
    linears: tuple[nn.Linear, ...]
    weight: torch.Tensor  # [sum of out_features, in_features]
    pointers: tuple[int, ...] = ()  # where each Linear's weight starts in `weight`
    parts: tuple[_Part, ...] = ()
    product: _Product = field(default_factory=lambda: _Product(), repr=False)

    def intact(self) -> bool:
        """Whether the module still holds these Linears with their weights in this buffer (`model.to(...)` or
        `load_state_dict(..., assign=True)` give them new storage). Runs every eager tree forward: pointers only."""
        modules = self.module._modules
        return all(
            modules.get(name) is linear and linear.weight.data_ptr() == ptr
            for name, linear, ptr in zip(self.names, self.linears, self.pointers)
        )

    def reset(self) -> None:
        """Forgets this thread's product (a forward that raised between the group's calls leaves one behind)."""
        self.product.__init__()


class _Product(threading.local):
    """The product of a group's forward under way in this thread: its input and outputs, and how many parts have not
    taken theirs. Per thread: two threads' tree forwards of one model run the same parts."""

    def __init__(self):
        self.input: torch.Tensor | None = None
        self.outputs: tuple[torch.Tensor, ...] | None = None
        self.pending = 0


class _Part(nn.Module):
    """Stands in for one Linear of a group in tree mode: its columns of the group's one GEMM."""

    def __init__(self, group: _Group, index: int):
        super().__init__()
        self.group, self.index = group, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, product = self.group, self.group.product
        if product.outputs is None:
            sizes = [linear.out_features for linear in group.linears]
            product.input, product.outputs = x, F.linear(x, group.weight).split(sizes, dim=-1)
            product.pending = len(sizes)
        elif x is not product.input:
            raise RuntimeError(
                f"hf_bole fused {group.name}'s projections {', '.join(group.names)} as they read one input, but this "
                f"transformers version calls them on different ones; pass bole_fuse_projections=False "
                f"(tree_forward(..., fuse_projections=False))"
            )
        out = product.outputs[self.index]
        product.pending -= 1
        if product.pending == 0:
            product.input = product.outputs = None
        return out


def _why_not(linears: list[nn.Module]) -> str | None:
    """Why these Linears cannot share one buffer, or None."""
    for linear in linears:
        if type(linear) is not nn.Linear:
            return f"{type(linear).__name__} is not a plain nn.Linear"
        if linear.bias is not None:
            return "a projection has a bias"
        if hasattr(linear, "_hf_hook"):
            return "accelerate hooks the projections one by one"
        if linear.weight.device.type == "meta":
            return "its weights are offloaded (meta device)"
        if isinstance(linear.weight, DTensor):
            return "tensor-parallel: DTensor weights"
    first = linears[0].weight
    if any(l.weight.dtype != first.dtype or l.weight.device != first.device for l in linears):
        return "its projections differ in dtype or device"
    if any(l.in_features != linears[0].in_features for l in linears):
        return "its projections differ in input size"
    return None


@torch.inference_mode(False)  # see `fuse_projections`
@torch.no_grad()
def _fuse(name: str, module: nn.Module, names: tuple[str, ...]) -> _Group:
    linears = tuple(getattr(module, n) for n in names)
    weight = torch.cat([linear.weight for linear in linears])  # [sum out, in]; the old weights go below
    offset = 0
    for linear in linears:
        rows = linear.out_features
        linear.weight = nn.Parameter(weight[offset : offset + rows], requires_grad=linear.weight.requires_grad)
        offset += rows
    group = _Group(name, module, names, linears, weight, tuple(linear.weight.data_ptr() for linear in linears))
    group.parts = tuple(_Part(group, i) for i in range(len(names)))
    return group


# decoder -> its fused groups (the values hold the decoder's modules, never the decoder itself)
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fuse_projections(decoder: nn.Module) -> list[_Group]:
    """Makes the weights of `decoder`'s projection groups (its family's `projection_groups`, the first a module holds;
    `decoder.config` names the family) views of one buffer per group, once (again for a group whose weights moved
    since); returns the groups. Says once, in a log line, which groups stay apart.

    The buffer is made outside inference mode, also when called inside it: the Linears' weights become views of it,
    and a weight made an inference tensor would fail the model's next forward outside inference mode with grad."""
    held = _FUSED.get(decoder)
    if held is not None and all(group.intact() for group in held):
        return held
    groups, apart = [], []
    projection_groups = family_of(decoder.config).projection_groups
    for name, module in decoder.named_modules():
        for names in projection_groups:
            if not all(isinstance(getattr(module, n, None), nn.Module) for n in names):
                continue
            reason = _why_not([getattr(module, n) for n in names])
            if reason is None:
                groups.append(_fuse(name, module, names))
            else:
                apart.append(f"{name} ({reason})")
            break
    if apart and held is None:
        logger.warning(
            f"hf_bole: {len(apart)} of {len(apart) + len(groups)} projection groups run one GEMM per projection in the "
            f"verify forward: {', '.join(apart[:3])}{', ...' if len(apart) > 3 else ''}"
        )
    _FUSED[decoder] = groups
    return groups


def projection_stand_ins(decoder: nn.Module) -> tuple[dict[tuple[nn.Module, str], nn.Module], list[_Group]]:
    """What a tree twin of `decoder` (`models/twin.py`) holds in place of its grouped projections: `{(module, name):
    part}` for every Linear of every group `fuse_projections` fused, and the groups."""
    groups = fuse_projections(decoder)
    return {(group.module, name): part for group in groups for name, part in zip(group.names, group.parts)}, groups
