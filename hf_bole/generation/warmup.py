"""Compiling hf_bole's kernels before the first timed round: `hf_bole.warmup(model, batch_size)`.

Triton compiles a kernel the first time it meets a new specialisation: a new power-of-two tile of the tree width
(the verify, conv and commit kernels), a width of 1, a multiple of 16 or neither (Triton specialises integer
arguments that way), and for the verify kernels a new batch size, where the autotuner benchmarks its configs. A
round whose verify width reaches such a case for the first time pays seconds of compilation inside `generate`;
benchmarks and latency-sensitive servers run this once per batch size instead.
"""

from __future__ import annotations

import torch

from hf_bole.cache import BoleCache
from hf_bole.kernels.utils import MAX_TREE_NODES
from hf_bole.models import attention_backends, cache_argument, tree_forward
from hf_bole.placement import placement

# One width per specialisation of each power-of-two tile up to MAX_TREE_NODES: 1, then per tile one width that is
# not a multiple of 16 and one that is (the tile itself).
WIDTHS = (1, 2, 16, 17, 32, 33, 64, 65, 128)


@torch.no_grad()
@attention_backends()  # the attention kernels generate uses
def warmup(
    model,
    batch_size: int,
    max_nodes: int = MAX_TREE_NODES,
    verify: str = "closed_form",
    compile: bool = False,
    fuse_projections: bool = True,
    attention: str = "auto",
) -> list[int]:
    r"""
    Runs one tree round (verify forward and commit) at every verify width that needs its own compiled kernels,
    up to `max_nodes`, on a scratch cache of `batch_size` rows, so that later `generate` calls of that batch size
    compile nothing.

    Args:
        model: a Qwen3.5 model hf_bole supports, on its device and in its dtype.
        batch_size (`int`): the rows of the `generate` calls to prepare (the verify kernels autotune per batch size).
        max_nodes (`int`): the widest tree a round verifies, root included (at most `MAX_TREE_NODES`): at a large
            batch, the width its budget gives a row (`BudgetResolver.max_row_nodes + 1`), or the widest forwards
            take the memory of the batch times 128 nodes (at batch 256 on the 9B shape, 16 GiB of logits alone).
        verify (`str`): "closed_form" or "serial", as `bole_verify`.
        compile (`bool`): as `bole_compile`: the compiled forward is compiled here too (the MTP drafter's
            compiled rounds are not: they compile in the first `generate` call's rounds, in seconds).
        fuse_projections (`bool`): as `bole_fuse_projections` (the compiled forward differs with it).
        attention (`str`): as `bole_attention` (so does its Triton kernel).

    Returns:
        `list[int]`: the widths that were run.

    Example:
        >>> hf_bole.warmup(model, batch_size=8)
        >>> model.generate(input_ids, custom_generate="hf_bole")  # no compilation inside the timed call
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if not 1 <= max_nodes <= MAX_TREE_NODES:
        raise ValueError(f"max_nodes must be in [1, {MAX_TREE_NODES}] (the kernels' largest tree), got {max_nodes}")
    # Width 1 too: a round of budget 0 (plain decoding) verifies the roots alone, from CUDA graphs as any other (and
    # torch.compile specialises size 1: compiled, it is a compile of its own).
    widths = sorted({w for w in WIDTHS if w < max_nodes} | {max_nodes})
    # The cache's device: the first layer's (under a device_map the embedding's weight may be offloaded to meta).
    place = placement(model)
    device, vocab = place.layer_devices[0], model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(1, vocab, (batch_size, 4), device=device)
    # Capacity: the prompt, every round's committed path (at most a binary tree's depth), the widest tree.
    paths = [_binary_path(w) for w in widths]
    capacity = prompt.shape[1] + sum(len(p) for p in paths) + max_nodes + 2
    cache = BoleCache.for_model(model, batch_size, max_cache_len=capacity)
    decoder = model.get_decoder()
    decoder(input_ids=prompt[:, :-1], use_cache=True, **{cache_argument(type(decoder).forward): cache})
    root = prompt[:, -1:]
    for width, path in zip(widths, paths):
        # Node i's parent is (i - 1) // 2: a binary tree, as wide as asked and log-deep.
        parents = ((torch.arange(width, device=device) - 1).div(2, rounding_mode="floor")).expand(batch_size, -1)
        ids = torch.cat([root, torch.randint(1, vocab, (batch_size, width - 1), device=device)], dim=1)
        out = tree_forward(model, cache, ids, parents, verify, compile, fuse_projections, attention)
        padded = path + [-1] * (width - len(path))  # as the acceptance walk gives it: [B, width], -1 after the leaf
        cache.commit(out.tree_round, torch.tensor([padded] * batch_size, device=device))
        root = ids[:, path[-1] : path[-1] + 1]
    for d in place.devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
    return widths


def _binary_path(width: int) -> list[int]:
    """Root-to-leaf node indices to the last node of a `width`-node binary tree (parent of i: (i - 1) // 2)."""
    path, node = [], width - 1
    while node >= 0:
        path.append(node)
        node = (node - 1) // 2 if node > 0 else -1
    return path[::-1]
