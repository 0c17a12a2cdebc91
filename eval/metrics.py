"""What one generate call is measured by, the same way for every mode: generated tokens, time to first token,
acceptance statistics, and exactness against plain `generate`.

Token counting (`count_generated`) is the one place that decides how many tokens a row produced; every mode's
throughput, TPOT and completions go through it (STYLE.md §6: EAGLE counts its two arms differently).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch


def count_generated(
    tokens: list[int],
    eos_token_ids: set[int],
    pad_token_id: int | None,
    stop_strings: tuple[str, ...] = (),
    tokenizer=None,
) -> int:
    """How many of a row's generated `tokens` (the output after the prompt) count: up to and including the first
    EOS; without one, up to and including the token that completes a stop string, or everything but the trailing
    padding that follows a row that stopped before the others (`generate` pads finished rows only when it knows an
    EOS token; without one, a stopped row keeps producing real tokens until all rows stop).

    Args:
        tokens (`list[int]`): the row's generated token ids, padding included.
        eos_token_ids (`set[int]`): the ids that end a sequence.
        pad_token_id (`int`, *optional*): the id finished rows are padded with (may equal an EOS id).
        stop_strings (`tuple[str, ...]`): strings that end a completion (needs `tokenizer` to decode).
        tokenizer: decodes prefixes to find where a stop string completes.
    """
    n = next((i + 1 for i, t in enumerate(tokens) if t in eos_token_ids), None)
    if n is None:
        n = len(tokens)
        while eos_token_ids and n > 0 and tokens[n - 1] == pad_token_id:
            n -= 1
    if stop_strings and tokenizer is not None:
        has_stop = lambda k: any(s in tokenizer.decode(tokens[:k]) for s in stop_strings)  # noqa: E731
        if has_stop(n):
            # The shortest prefix that contains a stop string: containment only grows with the prefix.
            lo, hi = 1, n
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if has_stop(mid) else (mid + 1, hi)
            n = lo
    return n


class FirstTokenTimer:
    """A streamer that timestamps the first generated token. `generate` first `put`s the prompt, then each step's
    tokens (hf_bole streams the same way), and `.cpu()`s them, so the time includes the device work before it."""

    def __init__(self):
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class Timing:
    """Wall time of one generate call (prefill included) and its time to first token, in seconds."""

    seconds: float
    ttft: float | None

    def tpot(self, steps: int) -> float | None:
        """Time per output token after the first, for a row of `steps` tokens (the batch's longest)."""
        if self.ttft is None or steps < 2:
            return None
        return (self.seconds - self.ttft) / (steps - 1)


def acceptance(accept_lengths: list[int], depth: int) -> dict:
    """Statistics of tokens emitted per verify round (bonus included), over all rows' played rounds.

    Returns:
        `mean_accepted_tokens`; `accept_histogram` {tokens per round: rounds}; `accepted_at_depth[d-1]`, the
        share of rounds whose draft was accepted at least d deep (d = 1..depth).
    """
    rounds = [n for n in accept_lengths if n > 0]
    if not rounds:
        return {"rounds": 0, "mean_accepted_tokens": None, "accept_histogram": {}, "accepted_at_depth": []}
    hist = Counter(rounds)
    return {
        "rounds": len(rounds),
        "mean_accepted_tokens": sum(rounds) / len(rounds),
        "accept_histogram": {n: hist[n] for n in sorted(hist)},
        "accepted_at_depth": [sum(n > d for n in rounds) / len(rounds) for d in range(1, depth + 1)],
    }


# A logit gap this many units of the dtype's rounding (relative to the top logit) is a tie that rounding decides.
_TIE_ULPS = 16


@torch.no_grad()
def divergence(model, prompt: list[int], reference: list[int], output: list[int], tokenizer=None) -> dict | None:
    """Where a greedy `output` first leaves the `reference` (plain `generate`) of the same prompt, and why.

    Runs one plain forward over the prompt and the common prefix and reports the logits there: when the two
    tokens' logits are within rounding of each other the divergence is a near tie that batched or tree-shaped
    arithmetic in low precision can flip; otherwise it is a real mismatch.

    Returns:
        None when identical; else `position` (index in the generated tokens), `reference_token`,
        `output_token` (None where one sequence ended), their logits, `top2_margin`, `tolerance` and `explanation`.
    """
    if output == reference:
        return None
    i = next((j for j, (a, b) in enumerate(zip(reference, output)) if a != b), min(len(reference), len(output)))
    ref_token = reference[i] if i < len(reference) else None
    out_token = output[i] if i < len(output) else None
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([prompt + reference[:i]], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()  # [V]
    top = logits.topk(2).values
    tolerance = _TIE_ULPS * torch.finfo(model.dtype).eps * max(1.0, float(top[0].abs()))
    record = {
        "position": i,
        "reference_token": ref_token,
        "output_token": out_token,
        "reference_logit": float(logits[ref_token]) if ref_token is not None else None,
        "output_logit": float(logits[out_token]) if out_token is not None else None,
        "top2_margin": float(top[0] - top[1]),
        "tolerance": tolerance,
    }
    if tokenizer is not None:
        record["text"] = {
            "reference": tokenizer.decode([ref_token]) if ref_token is not None else None,
            "output": tokenizer.decode([out_token]) if out_token is not None else None,
        }
    if ref_token is None or out_token is None:
        record["explanation"] = (
            "one output ends where the other continues: compare where each stopped (EOS, stop string)"
        )
    elif abs(record["reference_logit"] - record["output_logit"]) <= tolerance:
        record["explanation"] = (
            f"near tie: the two tokens' logits differ by {abs(record['reference_logit'] - record['output_logit']):.3g}, "
            f"within {model.dtype} rounding ({tolerance:.3g}); batched/tree arithmetic rounds the other way"
        )
    else:
        record["explanation"] = (
            f"NOT a tie: the reference token leads by {record['reference_logit'] - record['output_logit']:.3g} "
            f"(> {tolerance:.3g}, {model.dtype} rounding); a real mismatch to investigate"
        )
    return record
