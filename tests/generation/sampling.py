"""The statistical test of lossless sampling the generation tests share: hf_bole's samples against plain ones."""

from __future__ import annotations

import torch

SAMPLES = 4000  # per arm
PROMPT = [1, 2, 3, 4]  # for models of a 6-token vocabulary: 216 joint outcomes of three tokens


def samples(model, prompt: list[int], n: int, **kwargs) -> torch.Tensor:
    """`[n, 3]`: the first three tokens of `n` sampled continuations of `prompt` (`kwargs` go to `generate`)."""
    out = model.generate(
        torch.tensor([prompt] * n), max_new_tokens=3, do_sample=True, top_k=0, pad_token_id=0, **kwargs
    )
    return out[:, -3:]


def sampling_p_value(model, **kwargs) -> float:
    """Chi-square p-value of the hypothesis that hf_bole's samples (`generate(**kwargs)` with `custom_generate=
    "hf_bole"` and a wide budget) of the first three tokens after `PROMPT` follow plain sampling's law, `SAMPLES`
    each; `model` has a vocabulary of 6 tokens."""
    from scipy.stats import chi2_contingency  # imported here: GPU images without scipy still run the other tests

    ref = samples(model, PROMPT, SAMPLES)
    ours = samples(model, PROMPT, SAMPLES, custom_generate="hf_bole", bole_budget=SAMPLES * 12, **kwargs)
    codes = [(x[:, 0] * 36 + x[:, 1] * 6 + x[:, 2]).bincount(minlength=216) for x in (ref, ours)]
    table = torch.stack(codes)
    frequent = table.sum(0) >= 20  # pool rare outcomes so that every cell's expected count is large
    table = torch.cat([table[:, frequent], table[:, ~frequent].sum(1, keepdim=True)], dim=1)
    return chi2_contingency(table.cpu().numpy()).pvalue
