"""Helpers shared by the Triton kernels: where they run, how they are tuned, how inputs are checked."""

from __future__ import annotations

import contextlib
import functools
import os
import weakref

import torch
import triton

# Nodes per tree, the root included, that a tree kernel holds in one program (the verify width of one row): the closed
# form keeps the tree as two halves of 64 rows with their blocks on chip; tree attention, the ancestor mask and greedy
# acceptance keep [128, 128] tiles in registers; the KV move takes a path of at most a tree's nodes. The widest verify
# width the decoding loop and the budget tables use (`hf_bole.generation.select.WIDTH_BUCKETS`).
MAX_TREE_NODES = 128


def is_interpreter() -> bool:
    """True when Triton kernels are simulated on the CPU (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` in plain Python (0 for 0): Triton's is a constexpr function, slow to call from the
    host, and the launchers size tiles a few times per kernel, hundreds of times a round of an eager forward."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA tensors, and on CPU tensors under the interpreter; otherwise the torch path."""
    return x.is_cuda or is_interpreter()


def on_device(x: torch.Tensor):
    """The context a kernel on `x` launches in: Triton launches on the current CUDA device's stream, not on the
    tensors' device, so the layers of a model spread over GPUs (accelerate's device_map) make theirs current. On
    the current device (every layer of a model on one GPU) nothing is switched."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


def autotune_configs(configs: list[triton.Config]) -> list[triton.Config]:
    """The configs to autotune over; only the first under the interpreter, whose autotuner asks a GPU
    driver for a benchmarker and fails on a CPU-only machine ("0 active drivers")."""
    return configs[:1] if is_interpreter() else configs


def is_capturing(x: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on the current stream: value checks that read tensors
    on the host would synchronise, so they are skipped then (shapes are still checked)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """L2-normalises the last dim with transformers' and fla's formula (eps inside the root), as the GDN kernels
    do to q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def use_pdl(x: torch.Tensor) -> bool:
    """True where a kernel on `x` may launch while the kernel before it still runs (programmatic dependent launch:
    CUDA tensors on an NVIDIA GPU of Hopper or later, not under the interpreter). The later kernel waits
    (`gdc_wait`) before it reads what the earlier one writes, so only its independent first part overlaps."""
    return x.is_cuda and not is_interpreter() and _launches_dependents(x.device.index)


@functools.cache
def _launches_dependents(device_index: int) -> bool:
    """Whether the GPU has programmatic dependent launch; asked once per device, not at every layer's launch."""
    # ROCm reports its own capability numbers, and has no such launch.
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9


def dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` itself where its last dim is contiguous (kernels that take every other stride read it in place), else a
    contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def token_major(x: torch.Tensor) -> torch.Tensor:
    """A `[B, T, heads, dim]` tensor whose (heads, dim) block is contiguous, as the q/k/v views that split one
    projection are, is read in place by the kernels through its (batch, token) strides; anything else is copied."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def check_dtype(name: str, x: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"`{name}` must have dtype in ({names}), got {str(x.dtype).removeprefix('torch.')}")


def check_shape(name: str, x: torch.Tensor, shape: tuple[int, ...], layout: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"`{name}` must have shape {layout} = {tuple(shape)}, got {tuple(x.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all inputs must be on one device, got {listing}")


# parents tensors whose values passed `check_parents`, with their version counter then: a model's forward hands
# one tree to every GDN layer, and reading it back on the host for each layer would stall the GPU every time.
# Inference tensors (made under `torch.inference_mode()`) have no version counter: they are checked at every call.
_CHECKED_PARENTS: dict[int, tuple[weakref.ref, int]] = {}


def _checked_before(parents: torch.Tensor) -> bool:
    ref, version = _CHECKED_PARENTS.get(id(parents), (None, None))
    return ref is not None and ref() is parents and not parents.is_inference() and version == parents._version


def _remember_checked(parents: torch.Tensor) -> None:
    if parents.is_inference():
        return
    key = id(parents)
    _CHECKED_PARENTS[key] = (weakref.ref(parents, lambda _: _CHECKED_PARENTS.pop(key, None)), parents._version)


def check_parents(parents: torch.Tensor, batch: int, num_nodes: int) -> None:
    """`parents [B, T]` int64 with `-1 <= parents[b, i] < i`: every node comes after its parent. The values are
    read (one host synchronisation) once per tensor and again only after it is modified in place."""
    check_dtype("parents", parents, (torch.int64,))
    check_shape("parents", parents, (batch, num_nodes), "[B, T]")
    check_parent_values(parents)


def check_parent_values(parents: torch.Tensor) -> None:
    """`check_parents` for a tensor whose dtype and shape were checked."""
    if _checked_before(parents) or parents.numel() == 0 or is_capturing(parents):
        return
    node = torch.arange(parents.shape[1], device=parents.device)
    bad = (parents < -1) | (parents >= node)
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"parents must satisfy -1 <= parents[b, i] < i (nodes in topological order, -1 = child of the "
            f"committed state), but parents[{b}, {i}] = {int(parents[b, i])}; reorder the nodes so that every "
            f"parent comes before its children"
        )
    _remember_checked(parents)


def check_path(path: torch.Tensor, batch: int, num_nodes: int, check_values: bool = True) -> None:
    """`path [B, L]` int64: node indices in root-to-leaf order, right-padded with -1. `check_values=False` checks
    the dtype and shape only (no host read)."""
    check_dtype("path", path, (torch.int64,))
    if path.dim() != 2 or path.shape[0] != batch:
        raise ValueError(f"`path` must have shape [B, L] with B = {batch}, got {tuple(path.shape)}")
    if not check_values or is_capturing(path) or path.numel() == 0:
        return
    valid = path >= 0
    if bool((path < -1).any() or (path >= num_nodes).any()):
        raise ValueError(f"`path` entries must be -1 (padding) or node indices in [0, {num_nodes}), got {path.tolist()}")
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError(f"`path` must be right-padded with -1 (no node after a -1), got {path.tolist()}")
    if bool((valid[:, 1:] & (path[:, 1:] <= path[:, :-1])).any()):
        raise ValueError(
            f"`path` must list a root-to-leaf chain, whose node indices increase since parents come before "
            f"their children, got {path.tolist()}"
        )
