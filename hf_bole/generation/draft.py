"""Step 1 of a round, draft: the drafter's tree for every row, from what it has not seen yet (`Unseen`: the verify
forward's hidden states at the accepted path, or the prompt's at the first round). The drafter is made once per call
(the MTP drafter kept per model); a user's drafter gets its trees checked (`CheckedDraft`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from hf_bole.config import BoleConfig
from hf_bole.generation.drafters import DraftContext, NgramDrafter
from hf_bole.generation.tree import DraftTree


@dataclass
class Unseen:
    """What the drafter has not seen yet: per row `A` entries (the prompt at the first round, the accepted path
    later, `commit.RoundTail` carries the same four), right- or left-padded where `mask` is False."""

    hidden: torch.Tensor  # [B, A, hidden] the target's final hidden states there
    next_tokens: torch.Tensor  # [B, A] the token that followed each
    mask: torch.Tensor  # [B, A] bool
    positions: torch.Tensor  # [B, A] their position ids


@dataclass
class Drafted:
    """What step 1 hands to selection."""

    tree: DraftTree  # on the loop's device
    host_copy: DraftTree | None = None  # a custom drafter's tree on its way to the host, checked when its round is read
    safe: tuple[int, int] | None = None  # (vocab_size, max_depth): selection makes the tree safe to verify first


class Draft:
    """Step 1 with a built-in drafter: `draft(unseen, n_gen, longest) -> Drafted`.

    Args:
        drafter: what proposes (`propose(ctx) -> DraftTree`).
        writes (`writes.Writes`): the rows' sequences and counts on the device.
        columns (`list`, *optional*): where each row's prompt sits in them (`rows.prompt_columns`); None while rounds
            are pipelined, whose drafters read no host-side sequences.
        max_nodes (`int`): the most draft nodes one row's tree may hold.
        prompt_lengths (`torch.Tensor` of shape `(batch_size,)`): each row's prompt tokens, padding not counted.
        prompt_width (`int`): the prompts' columns, padding included (`P`).
        step (`int`): the most tokens one round commits per row.
        device (`torch.device`): where the loop runs (the LM head's device).
    """

    def __init__(self, drafter, writes, columns: list | None, max_nodes: int, prompt_lengths: torch.Tensor,
                 prompt_width: int, step: int, device: torch.device):  # fmt: skip
        self.drafter, self.writes, self.columns, self.max_nodes = drafter, writes, columns, max_nodes
        self.prompt_lengths, self.P, self.step, self.device = prompt_lengths, prompt_width, step, device

    def __call__(self, unseen: Unseen, n_gen: list[int], longest: int) -> Drafted:
        """The trees of a round in which the longest active row has generated at most `longest` tokens (`n_gen`: each
        row's count the host has read)."""
        return Drafted(self._on_device(self.drafter.propose(self.context(unseen, n_gen, longest))))

    def context(self, unseen: Unseen, n_gen: list[int], longest: int) -> DraftContext:
        P = self.P
        return DraftContext(
            sequences=None if self.columns is None else row_sequences(self.writes.seq, self.columns, P, n_gen),
            max_nodes=self.max_nodes,
            hidden_states=unseen.hidden,
            next_tokens=unseen.next_tokens,
            new_mask=unseen.mask,
            positions=unseen.positions,
            lengths=self.prompt_lengths + self.writes.generated,
            max_length=P + longest + self.step,
        )

    def _on_device(self, tree: DraftTree) -> DraftTree:
        return DraftTree(*(x.to(self.device) for x in (tree.tokens, tree.parents, tree.draft_logprobs)))


class CheckedDraft(Draft):
    """Step 1 with a user's drafter, whose trees are checked (`check_custom_tree`): at once, or, while rounds are
    pipelined, a round late on a host copy, the tree verified meanwhile in a form no kernel can trip over (`safe`)."""

    def __init__(self, *args, vocab_size: int, max_depth: int | None, pipelined: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.vocab_size, self.max_depth, self.pipelined = vocab_size, max_depth, pipelined

    def __call__(self, unseen: Unseen, n_gen: list[int], longest: int) -> Drafted:
        tree = self.drafter.propose(self.context(unseen, n_gen, longest))
        if not self.pipelined:
            self.check(tree)
            return Drafted(self._on_device(tree))
        check_custom_tree(tree, len(n_gen), self.vocab_size, self.drafter, self.max_depth, values=False)
        fields = (tree.tokens, tree.parents, tree.draft_logprobs)
        host_copy = DraftTree(*(x.to("cpu", non_blocking=True) for x in fields))
        return Drafted(self._on_device(tree), host_copy, (self.vocab_size, self.max_depth))

    def check(self, tree) -> None:
        """Raises a ValueError naming the drafter where `tree` is not a valid DraftTree (reads it on the host)."""
        check_custom_tree(tree, self.writes.seq.shape[0], self.vocab_size, self.drafter, self.max_depth)


# model -> {(depth, topk, cuda_graphs, compile, fuse_projections): its MTP drafter}, for the model's next calls.
_MTP_DRAFTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def drop_drafters(model) -> None:
    """Forgets the MTP drafters kept for `model` (`hf_bole.release`)."""
    _MTP_DRAFTERS.pop(model, None)


def make_drafter(model, config: BoleConfig, device: torch.device):
    """The call's drafter: the n-gram drafter, the model's MTP drafter (kept per model and tree shape across calls), a
    small model's (its own state per call), or the user's object as given."""
    if isinstance(config.drafter, PreTrainedModel):
        from hf_bole.generation.drafters.model import ModelDrafter

        return ModelDrafter(config.drafter, model, depth=config.depth, topk=config.topk)
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


def prompt_columns(mask: torch.Tensor) -> list[slice | torch.Tensor]:
    """Where each row's prompt tokens sit in `seq` (`mask`: `[B, P]` bool, True at them): after the row's left
    padding (a slice), or, with padding after its first token, the mask's columns (`[n]`). One host read."""
    B, P = mask.shape
    pad, left = torch.stack([P - mask.sum(-1), (mask[:, 1:] >= mask[:, :-1]).all(-1).long()]).tolist()
    return [slice(p, None) if l else mask[b].nonzero().flatten() for b, (p, l) in enumerate(zip(pad, left))]


def row_sequences(seq: torch.Tensor, prompt_columns: list, P: int, n_gen: list[int]) -> list[torch.Tensor]:
    """Each row's committed ids for the drafter (`DraftContext.sequences`) from `seq` (`[B, width]`): its prompt
    tokens (`prompt_columns`) and the `n_gen` it generated, from one copy of the columns in use, so that a drafter
    writing into them changes nothing of the output."""
    block = seq[:, : P + max(n_gen)].clone()
    return [
        block[b, columns.start : P + n]
        if isinstance(columns, slice)
        else torch.cat([block[b, columns], block[b, P : P + n]])
        for b, (columns, n) in enumerate(zip(prompt_columns, n_gen))
    ]
