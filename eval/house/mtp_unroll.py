"""The MTP head unrolled over D recursive steps for training, attending exactly as hf_bole's tree drafter lets it.

At draft time (`hf_bole/generation/drafters/mtp.py`) the head first runs over the committed entries (h_j, x_{j+1}) at
positions j, h_j the target's final normed hidden state; then a depth-d tree node is the entry (o_parent, token) at
position root + d, o_parent the head's own output (after its final norm) at the parent, and it attends to the
committed entries and its own ancestors. Unrolled over a training sequence with teacher forcing, step s at index t is

    step 1:  o¹_t = MTP(x_{t+1}, h_t)          position t        predicts x_{t+2}
    step s:  oˢ_t = MTP(x_{t+s}, oˢ⁻¹_t)       position t+s-1    predicts x_{t+s+1}

and step s at index t attends to the step-1 keys at indices <= t (the committed entries up to the root t) plus the
keys of steps 2..s at index t itself (its ancestors in the tree, and itself). The keys of all steps are concatenated
`[step 1 | step 2 | ... | step s]`, each block T long, under the boolean mask

    [T, s*T] = [ tril(T) | eye(T) | ... | eye(T) ]

(step 1 alone is plain causal attention). Gradients flow through the whole recursion and into the target's hidden
states, as in joint MTP training.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_bole.models.mtp import Qwen3_5MTP

# Not cuDNN: the bool-masked steps go to the memory-efficient kernel, whose backward takes a broadcast mask.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class _StepKeys:
    """The keys/values of the steps run so far; `update` (the one `Cache` method attention calls) appends the current
    step's `[B, kv_heads, T, head_dim]` and returns all of them."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys.append(key_states)
        self.values.append(value_states)
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)


def unrolled_mask(length: int, step: int, device: torch.device) -> torch.Tensor:
    """`[1, 1, T, step*T]`, True where step `step`'s query at index t may attend (see the module docstring)."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (step - 1), dim=1)[None, None]


def mtp_unroll(
    mtp: Qwen3_5MTP,
    embed_tokens: nn.Module,
    rotary_emb: nn.Module,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    depth: int,
) -> list[torch.Tensor]:
    r"""
    The head's outputs at every unrolled step, teacher-forced.

    Args:
        mtp: the MTP head.
        embed_tokens, rotary_emb: the target's input embedding and rotary embedding (shared, as at draft time).
        hidden (`torch.FloatTensor` of shape `(batch_size, T, hidden)`): the target's final normed hidden states h_t.
        tokens (`torch.LongTensor` of shape `(batch_size, T + depth)`): the sequence; step s reads `tokens[:, s:s+T]`
            (x_{t+s}), so the step-s output at index t is to predict `tokens[:, t+s+1]`, which the caller holds.
        depth: the number of steps D.

    Returns:
        `list[torch.FloatTensor]`: D outputs `[batch_size, T, hidden]` (the `lm_head` inputs), step 1 first.
    """
    batch_size, length, _ = hidden.shape
    if tokens.shape[1] < length + depth:
        raise ValueError(
            f"mtp_unroll needs {length + depth} tokens per row for T={length}, D={depth}, got {tokens.shape[1]}"
        )
    keys = _StepKeys()
    positions = torch.arange(length, device=hidden.device).expand(batch_size, -1)  # [B, T]
    outputs = []
    with sdpa_kernel(SDPA_BACKENDS):
        for step in range(1, depth + 1):
            embeds = embed_tokens(tokens[:, step : step + length])  # [B, T, hidden]
            step_positions = positions + (step - 1)
            # Qwen3.5's rotary embedding takes (3, B, T) position ids: one text position on all three axes
            rope = rotary_emb(embeds, step_positions.expand(3, -1, -1))
            mask = None if step == 1 else unrolled_mask(length, step, hidden.device)
            hidden = mtp(embeds, hidden, rope, attention_mask=mask, past_key_values=keys)
            outputs.append(hidden)
    return outputs


def forward_unrolled(
    model: nn.Module, mtp: Qwen3_5MTP, inputs: torch.Tensor, depth: int, length: int | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    r"""
    The target's logits and the unrolled head's logits over one batch of token windows.

    Args:
        model: a `Qwen3_5ForCausalLM`.
        mtp: its MTP head.
        inputs (`torch.LongTensor` of shape `(batch_size, T)`): the tokens x_0 .. x_{T-1}.
        depth: the number of MTP steps D (< T).
        length: how many indices t the head runs at, at most (and by default) T - D.

    Returns:
        logits `[batch_size, T, vocab]` (position t predicts x_{t+1}) and D MTP logits `[batch_size, length, vocab]`
        (step s at index t predicts x_{t+s+1}, the token the target predicts at position t+s).
    """
    length = inputs.shape[1] - depth if length is None else length
    if not 0 < length <= inputs.shape[1] - depth:
        raise ValueError(f"length must be in [1, T - depth] = [1, {inputs.shape[1] - depth}], got {length}")
    decoder = model.get_decoder()
    hidden = decoder(input_ids=inputs, use_cache=False).last_hidden_state  # [B, T, hidden], after the final norm
    lm_head = model.get_output_embeddings()
    outputs = mtp_unroll(mtp, model.get_input_embeddings(), decoder.rotary_emb, hidden[:, :length], inputs, depth)
    return lm_head(hidden), [lm_head(o) for o in outputs]
