"""The statistical test of lossless sampling the generation tests share: hf_bole's samples against the law plain
sampling draws from, computed exactly from the model's logits."""

from __future__ import annotations

import torch

SAMPLES = 4000
VOCAB = 6
PROMPT = [1, 2, 3, 4]  # for models of a 6-token vocabulary: 216 joint outcomes of three tokens
PAD = 0


def samples(model, prompt: list[int], n: int, **kwargs) -> torch.Tensor:
    """`[n, 3]`: the first three tokens of `n` sampled continuations of `prompt` (`kwargs` go to `generate`)."""
    out = model.generate(
        torch.tensor([prompt] * n), max_new_tokens=3, do_sample=True, top_k=0, pad_token_id=PAD, **kwargs
    )
    return out[:, -3:]


@torch.no_grad()
def plain_law(model, prompt: list[int]) -> torch.Tensor:
    """`[216]`: the probability that plain sampling (`samples` without hf_bole) gives each outcome of the first three
    tokens after `prompt`, `36 a + 6 b + c`: the softmax of the model's logits after `prompt`, `prompt + [a]` and
    `prompt + [a, b]`, from one forward of the 36 two-token continuations; after an EOS a row holds padding, as
    `generate` pads a finished row."""
    P = len(prompt)
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [36, 2]: row 6 a + b holds (a, b)
    ids = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], dim=1)
    probs = model(ids).logits.double().softmax(-1)  # [36, P + 2, V]
    first, second, third = probs[0, P - 1], probs[::VOCAB, P], probs[:, P + 1].view(VOCAB, VOCAB, VOCAB)
    eos = model.generation_config.eos_token_id
    padding = torch.nn.functional.one_hot(torch.tensor(PAD), VOCAB).to(probs)
    for token in [] if eos is None else [eos] if isinstance(eos, int) else eos:
        second[token] = padding  # a row that sampled EOS first pads the next two
        third[token] = padding
        third[:, token] = padding
    return (first[:, None, None] * second[:, :, None] * third).flatten()


def sampling_p_value(model, **kwargs) -> float:
    """Chi-square p-value of the hypothesis that hf_bole's samples (`generate(**kwargs)` with `custom_generate=
    "hf_bole"` and a wide budget) of the first three tokens after `PROMPT` follow plain sampling's law (`plain_law`),
    `SAMPLES` of them; `model` has a vocabulary of 6 tokens."""
    from scipy.stats import chisquare  # imported here: GPU images without scipy still run the other tests

    ours = samples(model, PROMPT, SAMPLES, custom_generate="hf_bole", bole_budget=SAMPLES * 12, **kwargs)
    observed = (ours[:, 0] * 36 + ours[:, 1] * 6 + ours[:, 2]).bincount(minlength=216).double().cpu()
    expected = plain_law(model, PROMPT).cpu() * SAMPLES
    frequent = expected >= 20  # pool rare outcomes so that every cell's expected count is large
    observed = torch.cat([observed[frequent], observed[~frequent].sum(0, keepdim=True)])
    expected = torch.cat([expected[frequent], expected[~frequent].sum(0, keepdim=True).clamp(min=1e-12)])
    return chisquare(observed.numpy(), expected.numpy() * (SAMPLES / expected.sum().item())).pvalue
