"""Step 1 of a round, draft: the drafter (built once per call, the MTP drafter kept per model) and the checks of a
drafter's trees."""

from __future__ import annotations

import weakref

import torch

from hf_bole.config import BoleConfig
from hf_bole.generation.drafters import NgramDrafter
from hf_bole.generation.tree import DraftTree


_MTP_DRAFTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def drop_drafters(model) -> None:
    """Forgets the MTP drafters kept for `model` (`hf_bole.release`)."""
    _MTP_DRAFTERS.pop(model, None)


def make_drafter(model, config: BoleConfig, device: torch.device):
    if config.drafter == "ngram":
        return NgramDrafter(config)
    if config.drafter == "mtp":
        # Loading the head reads the checkpoint: keep one per model (and tree shape) across generate calls.
        from hf_bole.generation.drafters.mtp import MTPDrafter

        # Compiled drafting proposes what eager drafting does up to rounding, and the verify forward decides.
        compiled = config.compile or (config.compile_drafter and device.type == "cuda")
        # Settings it cannot run are named as such, not as the missing weights below.
        MTPDrafter.check_settings(
            model.config.get_text_config(decoder=True), config.depth, config.topk,
            model.get_output_embeddings().weight.shape[0],
        )  # fmt: skip
        per_model = _MTP_DRAFTERS.setdefault(model, {})
        key = (config.depth, config.topk, config.cuda_graphs, compiled, config.fuse_projections)
        if key not in per_model:
            try:
                per_model[key] = MTPDrafter.from_model(
                    model, depth=config.depth, topk=config.topk, cuda_graphs=config.cuda_graphs, compile=compiled,
                    fuse_projections=config.fuse_projections,
                )
            except ValueError as e:
                raise ValueError(
                    f"the default drafter runs the checkpoint's MTP head (`mtp.*` weights), which this model lacks: "
                    f"{e} Pass bole_drafter='ngram' (needs no weights) or a drafter object instead."
                ) from e
        return per_model[key]
    return config.drafter


def drafter_max_depth(drafter) -> int | None:
    """The drafter's `max_depth` (see `Drafter`), or None when it declares none."""
    depth = getattr(drafter, "max_depth", None)
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 1):
        raise ValueError(
            f"{type(drafter).__name__}.max_depth must be a positive int (the most levels its trees hold below the "
            f"root) or absent, got {depth!r}"
        )
    return depth


def check_custom_tree(tree, batch_size: int, vocab_size: int, drafter, max_depth: int | None, values=True) -> None:
    """Raises a ValueError naming the drafter when `tree` is not a valid DraftTree; with `values=False` only what
    needs no read of the tree's values (its type, dtypes, shapes and devices)."""
    if not isinstance(tree, DraftTree):
        raise ValueError(f"{type(drafter).__name__}.propose must return a hf_bole.DraftTree, got {type(tree).__name__}")
    try:
        if values:
            tree.validate(batch_size, vocab_size, max_depth)
        else:
            tree.check_layout(batch_size)
    except ValueError as e:
        raise ValueError(f"{type(drafter).__name__}.propose returned an invalid DraftTree: {e}") from e
