"""What the house model card reports: held-out accuracy, MTP agreement, and accepted tokens per round.

Three measurements, from cheap to real:

- `heldout_metrics`: teacher-forced on held-out text. Next-token accuracy against the text; MTP agreement at depth s
  = the step-s argmax (recursing on the head's own hidden state) equals the target's own argmax at that position,
  top-1 and within the top 4.
- `self_generated_metrics`: the target writes greedy continuations of eval-style prompts; the head is then run over
  that text, so a depth-s draft is accepted exactly when steps 1..s all equal what the target wrote, and decoding is
  replayed round by round (each round emits its accepted drafts plus the bonus token and the next one starts there).
  For the chain drafter (top 1, depth 3) that is its mean accepted tokens per round, up to rounding; for the top-4
  tree it is an optimistic estimate: a depth counts while the target's token is among the head's top 4 at every
  depth so far, whereas the real tree expands only the best `topk` nodes per level and keeps the best `budget`.
- `bole_acceptance`: hf_bole's own `generate` with the MTP drafter: mean accepted tokens per verify round, and
  whether its greedy output equals plain `generate`'s.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from eval.house.mtp_unroll import forward_unrolled


@torch.no_grad()
def heldout_metrics(model, mtp, windows: torch.Tensor, depth: int, batch_size: int) -> dict:
    """Teacher-forced metrics over held-out windows `[n, T + 1]`, in the model's own dtype."""
    device = model.get_output_embeddings().weight.device
    tokens = loss = correct = 0
    agree, agree_top4, mtp_correct = [0] * depth, [0] * depth, [0] * depth
    mtp_tokens = 0
    for i in range(0, len(windows), batch_size):
        window = windows[i : i + batch_size].to(device)
        inputs, labels = window[:, :-1], window[:, 1:]
        logits, mtp_logits = forward_unrolled(model, mtp, inputs, depth)
        predicted = logits.argmax(-1)  # [B, T]
        loss += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum").item()
        correct += (predicted == labels).sum().item()
        tokens += labels.numel()
        length = inputs.shape[1] - depth
        mtp_tokens += window.shape[0] * length
        for s, step_logits in enumerate(mtp_logits, start=1):
            target = predicted[:, s : s + length]  # the target's own next token at position t+s
            top4 = step_logits.topk(4, dim=-1).indices  # [B, T-D, 4]
            agree[s - 1] += (top4[..., 0] == target).sum().item()
            agree_top4[s - 1] += (top4 == target[..., None]).any(-1).sum().item()
            mtp_correct[s - 1] += (top4[..., 0] == window[:, s + 1 : s + 1 + length]).sum().item()
    return {
        "tokens": tokens,
        "loss": loss / tokens,
        "next_token_acc": correct / tokens,
        "mtp_agree": [a / mtp_tokens for a in agree],
        "mtp_agree_top4": [a / mtp_tokens for a in agree_top4],
        "mtp_acc": [a / mtp_tokens for a in mtp_correct],
    }


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: list[str], max_new_tokens: int, **kwargs):
    """Left-padded batch greedy generation: the `generate` output and the padded prompt length."""
    device = model.get_output_embeddings().weight.device
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    out = model.generate(
        **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id, **kwargs
    )
    return out, batch.input_ids.shape[1]


@torch.no_grad()
def self_generated_metrics(
    model, mtp, tokenizer, prompts: list[str], sequences: torch.Tensor, prompt_len: int, stop_ids: list[int],
    depth: int, chain_depth: int = 3, topk: int = 4,
) -> dict:  # fmt: skip
    """Accepted tokens per round, replayed over the target's own greedy continuations `sequences [B, prompt_len +
    new]`: each round starts at the root the previous one ended on and emits 1 + its run of accepted drafts."""
    device = sequences.device
    positions = 0
    emitted = {"chain": [0, 0], "tree": [0, 0]}  # tokens, rounds
    agree = [0] * depth
    for b, prompt in enumerate(prompts):
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        generated = sequences[b, prompt_len:].tolist()
        stops = [i for i, t in enumerate(generated) if t in stop_ids]
        generated = generated[: stops[0] + 1] if stops else generated
        if len(generated) < 2:
            continue
        text = prompt_ids + generated
        n = len(text)
        # D + 1 filler tokens so that every step has an input and an output at every root; their drafts never count
        filler = [stop_ids[0]] * (depth + 1)
        inputs = torch.tensor([text + filler], device=device)
        _, mtp_logits = forward_unrolled(model, mtp, inputs, depth)
        first = len(prompt_ids) - 1  # the first round's root entry: its token is the first generated one
        roots = torch.arange(first, n - 1, device=device)  # entry t drafts text[t + 2], text[t + 3], ...
        target = torch.tensor(text + filler, device=device)
        hit, hit_topk = [], []
        for s, step_logits in enumerate(mtp_logits, start=1):
            top = step_logits[0, roots].topk(topk, dim=-1).indices  # [R, topk]
            want = target[roots + s + 1]
            valid = roots + s + 1 < n
            hit.append((top[:, 0] == want) & valid)
            hit_topk.append((top == want[:, None]).any(-1) & valid)
            agree[s - 1] += hit[-1].sum().item()
        positions += len(roots)
        for name, hits in (("chain", hit[:chain_depth]), ("tree", hit_topk)):
            accepted = torch.stack(hits).long().cumprod(0).sum(0).tolist()  # [R] drafts accepted at each root
            tokens, played = _replay(accepted)
            emitted[name][0] += tokens
            emitted[name][1] += played
    return {
        "positions": positions,
        "chain_accepted": emitted["chain"][0] / max(emitted["chain"][1], 1),
        f"tree_top{topk}_accepted_estimate": emitted["tree"][0] / max(emitted["tree"][1], 1),
        "mtp_agree_own_text": [a / max(positions, 1) for a in agree],
    }


def _replay(accepted: list[int]) -> tuple[int, int]:
    """(tokens emitted, rounds) of decoding that accepts `accepted[r]` drafts at root r, emits them and the bonus
    token, and continues from root r + 1 + accepted[r]."""
    r = tokens = rounds = 0
    while r < len(accepted):
        tokens += 1 + accepted[r]
        rounds += 1
        r += 1 + accepted[r]
    return tokens, rounds


@torch.no_grad()
def bole_acceptance(
    model, tokenizer, prompts: list[str], reference: torch.Tensor, max_new_tokens: int, settings: dict[str, dict]
) -> dict:
    """hf_bole's mean accepted tokens per round for each named setting of `bole_*` arguments, and whether its greedy
    output equals plain `generate`'s `reference` (row by row)."""
    import hf_bole  # noqa: F401  (registers custom_generate="hf_bole")

    results = {}
    for name, kwargs in settings.items():
        start = time.perf_counter()
        out, _ = greedy_generate(
            model, tokenizer, prompts, max_new_tokens, custom_generate="hf_bole", return_dict_in_generate=True,
            **kwargs,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        width = min(out.sequences.shape[1], reference.shape[1])
        same = (out.sequences[:, :width] == reference[:, :width]).all(-1)
        results[name] = {
            **kwargs,
            "mean_accepted_tokens": round(out.mean_accepted_tokens, 4),
            "rows_equal_to_plain_greedy": f"{int(same.sum())}/{len(same)}",
            "seconds": round(seconds, 2),
        }
    return results
