"""The prompt's prefill as chains through the verify forward (`bole_prefill`).

A prompt is a tree too: a chain, each token the child of the one before. Fed through the verify forward in chains of
at most `MAX_TREE_NODES` tokens, each committed whole, it leaves the cache exactly where transformers' own forward over
the prompt leaves it (the same recurrence, computed in closed form). What differs is what launches it. The eager
forward launches its kernels one by one from Python; a chain of a bucketed width replays the verify forward's CUDA
graph. Each chain reads every weight once more, so on a large model past a few chains the one eager forward is
faster, while a small model's long prompts gain from the graphs whatever their length. So "auto" bounds the weights
the chains re-read, not the prompt's length (`CHAIN_PREFILL_READ_BYTES`). A chain is a verify round, too: it holds the
GDN factors, the pre-conv inputs and the logits of every node of every row, where the plain forward computes the last
token's logits alone, so "auto" also bounds what a chain holds for the whole batch (`CHAIN_PREFILL_ROUND_BYTES`).
"""

from __future__ import annotations

import functools
import weakref

import torch

from hf_bole.generation.acceptance import sample_tokens
from hf_bole.generation.select import width_bucket
from hf_bole.kernels.utils import MAX_TREE_NODES
from hf_bole.models import cache_argument

# The most weight bytes "auto"'s chains may read in all: 4 chains of the 9B shape's 18 GB (bf16), where 4 chains
# (512 tokens) beat the eager forward and 8 lost to it (measured above).
CHAIN_PREFILL_READ_BYTES = 4 * 18 * 10**9


# The most a chain's verify round may hold for the whole batch under "auto" (`verify.round_bytes`, summed over the
# rows): on the 9B shape a chain of 128 nodes holds 1.4 MB a node, 47 GB at batch 256, more than an 80 GB GPU holds
# beside the model's 18 GB; 4 GiB lets batches of up to 23 such prompts prefill as chains.
CHAIN_PREFILL_ROUND_BYTES = 4 * 2**30


def chain_limit(weight_bytes: int) -> int:
    """The longest prompt "auto" prefills as chains for a model of `weight_bytes`: as many chains of `MAX_TREE_NODES` as
    read `CHAIN_PREFILL_READ_BYTES` of weights, and at least 4 (512 tokens, the 9B shape's)."""
    return MAX_TREE_NODES * max(4, CHAIN_PREFILL_READ_BYTES // max(weight_bytes, 1))


# model -> its weights' bytes. Summing them walks every parameter, 0.2-1.1 ms of host a `generate` call (the house model
# to the 35B-A3B shape). A model changed in place later keeps its first figure: it only picks between two exact
# prefills, and from the 9B shape up the limit is the floor of 4 chains at any dtype.
_WEIGHT_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weight_bytes(model: torch.nn.Module) -> int:
    """What each prefill chain re-reads: the bytes of every parameter of `model`, summed at its first call."""
    if model not in _WEIGHT_BYTES:
        _WEIGHT_BYTES[model] = sum(p.numel() * p.element_size() for p in model.parameters())
    return _WEIGHT_BYTES[model]


def use_chains(
    mode: str, graphed: bool, prompt_length: int, verify: str, weight_bytes: int, round_bytes: int
) -> bool:
    """Whether `generate` may prefill as chains: asked for ("chains"), or "auto" with the verify forward replayed
    from CUDA graphs, a prompt of at most `chain_limit(weight_bytes)` tokens and a chain whose round holds at most
    `CHAIN_PREFILL_ROUND_BYTES` (`round_bytes`, the whole batch's); never with `verify="serial"`, whose forward would
    keep a state snapshot per prompt token. (The batch must suit them too: `unchainable`.)"""
    if mode == "plain" or verify != "closed_form":
        return False
    fits = prompt_length <= chain_limit(weight_bytes) and round_bytes <= CHAIN_PREFILL_ROUND_BYTES
    return mode == "chains" or (graphed and fits)


def unchainable(mask: torch.Tensor, position_ids: torch.Tensor, run: torch.Tensor | None = None) -> str | None:
    """Why chains would not prefill this batch as transformers' forward does, or None (one host read).

    A chain holds a row's tokens only, each at the position the cache gives it (the tokens before it in its row). The
    plain forward runs the padding too: at the left, before any token, it leaves the GDN state and conv window zero, so
    only left padding may be skipped; padding after a row's first token (right padding, a hole in the mask) goes
    through its GDN layers and changes their state. So: every row left-padded, with a token to run, numbered from 0 as
    `generate` numbers them.

    Args:
        mask: `[B, P]` bool, True at the prompt's tokens.
        position_ids: `[B, P']` (or `[..., B, P']`, mRoPE) the forward's position ids of the last `P'` columns.
        run: `[B, P']` bool, the tokens the chains run, in the last `P'` columns (a call continuing from a cache runs
            those after the cached ones); all of `mask` by default.
    """
    run = mask if run is None else run
    counted = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, mask.shape[1] - run.shape[1] :]  # [B, P'] each token's place
    checks = [(mask[:, 1:] >= mask[:, :-1]).all(), run.any(-1).all(), ((position_ids == counted) | ~run).all()]
    left_padded, tokens, counts = torch.stack(checks).tolist()
    if not left_padded:
        return "the attention mask has padding after a row's first token (right padding, or a hole), which chains skip"
    if not tokens:
        return "a row of the attention mask is all padding"
    if not counts:
        return "the position ids do not number each row's tokens from 0, as the cache does"
    return None


@torch.no_grad()
def chain_prefill(
    verify_forward, cache, input_ids: torch.Tensor, mask: torch.Tensor, pad_token: int, commit=None
) -> torch.Tensor:
    """Appends each row's tokens to `cache` as chains through `verify_forward(ids, parents)` (a `VerifyGraphs` or
    `tree_forward`), each committed whole by `commit(tree_round, path)` (`VerifyGraphs.commit`, replayed; defaults to
    `cache.commit` without its reads): the prompts into an empty cache, the uncached tokens of a call continuing from a
    cache, the tokens a returned cache lacks (`continuation.settle`).

    Args:
        input_ids: `[B, P]` int64 tokens, each row's right-aligned (left-padded).
        mask: `[B, P]` bool, True at the tokens to append (a row may have none).

    Returns:
        `[B, P, hidden]` the final-norm hidden states of the prompt's tokens, in `input_ids`' columns (zero at left
        padding), as the decoder's forward over the prompt gives them.
    """
    if commit is None:
        commit = functools.partial(cache.commit, check_values=False)
    B, P = input_ids.shape
    device = input_ids.device
    lengths = mask.sum(-1)  # [B]
    longest = int(lengths.max())  # one host read, before the first chain is launched
    # Every chain's inputs at once, [B, chains * MAX_TREE_NODES], chain c in columns [c * MAX_TREE_NODES,
    # (c + 1) * MAX_TREE_NODES): on a small model the prefill's time is its launches from Python, and these were a
    # dozen a chain.
    index = torch.arange(-(-longest // MAX_TREE_NODES) * MAX_TREE_NODES, device=device)  # place in each row's prompt
    real = index[None] < lengths[:, None]
    columns = torch.where(real, (P - lengths)[:, None] + index[None], P)  # P: a spare column
    ids = torch.where(real, input_ids.gather(1, columns.clamp(max=P - 1)), pad_token)
    # A chain: node i the child of node i - 1, the first a child of the cache; past a row's prompt, nodes of parent
    # -1 that are never committed. A chain's path is the whole chain, or nothing.
    in_chain = index % MAX_TREE_NODES
    parents = torch.where(real, in_chain - 1, -1).to(cache.device)
    path = torch.where(real, in_chain, -1).to(cache.device)
    hidden = None
    for start in range(0, longest, MAX_TREE_NODES):
        chain = slice(start, start + width_bucket(min(MAX_TREE_NODES, longest - start), MAX_TREE_NODES))
        out = verify_forward(ids[:, chain], parents[:, chain])
        if hidden is None:
            hidden = out.hidden_states.new_zeros(B, P + 1, out.hidden_states.shape[-1])
        # The outputs may be a graph's buffers, which the next chain overwrites: taken out now.
        into = columns[:, chain].to(hidden.device)[..., None].expand(-1, -1, hidden.shape[-1])
        hidden.scatter_(1, into, out.hidden_states)
        commit(out.tree_round, path[:, chain])
    return hidden[:, :P]


def plain_prefill(
    model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor, in_device
) -> torch.Tensor:
    """Appends `input_ids` (`[B, Q]`) to `cache` through transformers' forward of `model`'s decoder, as plain
    `generate`'s prefill runs it, with the attention mask `[B, past + Q]` (or None) and position ids `[B, Q]` (or
    `[4, B, Q]`, mRoPE), all put on `in_device` (the embedding's). Returns `[B, Q, hidden]` the final hidden states."""
    decoder = model.get_decoder()
    out = decoder(
        input_ids=input_ids.to(in_device),
        attention_mask=None if attention_mask is None else attention_mask.to(in_device),
        position_ids=position_ids.to(in_device),
        use_cache=True,
        **{cache_argument(type(decoder).forward): cache},
    )
    return out.last_hidden_state


def prefill_prompt(model, plan, cache, verify_forward, commit=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Puts the prompts of `plan` (`CallPlan`) into `cache`, empty or holding their first `plan.tail` columns (a call
    continuing from a cache): as chains through `verify_forward` (committed by `commit`, see `chain_prefill`) where
    `plan.chains`, else through transformers' forward over the columns from `plan.tail` on.

    Returns:
        `([B, P - tail, hidden], [B])`: the final hidden states of the columns prefilled, and each row's first
        generated token, sampled or the argmax of the last position's processed logits, as plain decoding takes it.
    """
    input_ids, device, tail = plan.input_ids, plan.device, plan.tail
    if plan.chains:
        # Chains skip padding: its slots go first, so that every row ends at the last column as after the plain forward.
        cache.pad(input_ids.shape[1] - cache.lengths - plan.run.sum(-1).to(cache.device))
        hidden = chain_prefill(verify_forward, cache, input_ids[:, tail:], plan.run, plan.pad_token, commit)
        hidden = hidden.to(device)
    else:
        # the attention mask of all columns: those of the cached tokens too
        hidden = plain_prefill(model, cache, input_ids[:, tail:], plan.attention_mask, plan.position_ids[..., tail:],
                               plan.in_device).to(device)  # fmt: skip
    logits = model.get_output_embeddings()(hidden[:, -1]).float()  # [B, V]
    scores = plan.logits_processor(input_ids, logits) if plan.logits_processor else logits
    first = sample_tokens(scores) if plan.do_sample else scores.argmax(-1)  # [B]
    return hidden, first
