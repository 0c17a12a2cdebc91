"""What `generate` returns with `return_dict_in_generate=True`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

# The output's cache field: `cache` from transformers 5.25 (which still reads `past_key_values`, with a deprecation
# warning: given by that name, the output would warn in every call), `past_key_values` before.
CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


@dataclass
class BoleGenerateOutput(GenerateDecoderOnlyOutput):
    r"""
    `GenerateDecoderOnlyOutput` plus how well the tree drafts did (`return_dict_in_generate=True`).

    Args:
        accept_lengths (`torch.LongTensor` of shape `(batch_size, num_rounds)`):
            Tokens each verify round accepted per row, the bonus token included; 0 where the row sat the round out
            (finished). A row's last round may accept past `max_new_tokens` or a stop, where the output is cut; the
            first generated token comes from the prefill and is not counted.
        mean_accepted_tokens (`float`):
            Accepted tokens per verify round over all rows' rounds.
        peak_transient_bytes (`dict[str, int]`):
            The largest per-round tree state of the call (`TreeRound.transient_bytes` of its biggest round): GDN
            factors or per-node snapshots, pre-conv inputs, tree KV.
        round_time_ms (`dict[str, float]`, *optional*):
            With `bole_profile=True`: milliseconds spent in each phase of the rounds (draft, select, verify, accept,
            commit, host), summed over the rounds, and `rounds` (pipelined, one more than `accept_lengths` holds:
            the round launched before the last one was read); see `hf_bole.generation.phases.PhaseTimer`. Greedy
            decoding without logits processors under `bole_cuda_graphs` replays acceptance, commit and the drafter's
            next inputs from one graph (`commit.GreedyTail`): "commit" holds all of it and "accept" nothing.
        round_host_ms (`dict[str, float]`, *optional*):
            With `bole_profile=True`: the same phases' time on the host clock, in their Python code (on CUDA a phase
            whose host time exceeds its `round_time_ms` kept the GPU waiting once the host fell behind).
    """

    accept_lengths: torch.LongTensor | None = None
    mean_accepted_tokens: float | None = None
    peak_transient_bytes: dict[str, int] | None = None
    round_time_ms: dict[str, float] | None = None
    round_host_ms: dict[str, float] | None = None
