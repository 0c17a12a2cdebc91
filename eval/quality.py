"""Task quality of generated completions, so a sampling run can be checked against `ar` on the same prompts.

MBPP and HumanEval: pass@1 by running each program against its tests in a sandboxed subprocess; GSM8K: answer
accuracy; CNN/DailyMail: ROUGE-1/2/L; ShareGPT has no reference. The metrics are `evaluate` modules kept in
`eval/metric_modules/` and loaded by path, which works offline (`evaluate.load("rouge")` needs the Hub).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import evaluate

if TYPE_CHECKING:
    from eval.data import Prompt

METRICS_DIR = Path(__file__).parent / "metric_modules"


@functools.cache
def load_metric(name: str) -> evaluate.EvaluationModule:
    """One of our metric modules (`rouge`, `pass_at_1`, `gsm8k_accuracy`), loaded from `eval/metric_modules/<name>`."""
    return evaluate.load(str(METRICS_DIR / name))


def cut_at_stop(completion: str, stop: list[str]) -> str:
    """The completion up to its first stop string.

    `generate` keeps the matched stop string, and in a batch a row may run on past it until the others finish.
    """
    ends = [i for s in stop if (i := completion.find(s)) >= 0]
    return completion[: min(ends)] if ends else completion


def score(dataset: str, prompts: list[Prompt], completions: list[str]) -> dict[str, float]:
    """Score completions (the generated text only, prompt excluded) against the prompts' references.

    Args:
        dataset: the dataset every prompt comes from.
        prompts: from `eval.data.load_prompts(dataset, ...)`.
        completions: one generated text per prompt, in the same order.

    Returns:
        mbpp/humaneval `{"pass@1"}`; gsm8k `{"accuracy"}`; cnn_dailymail `{"rouge1", "rouge2", "rougeL"}`
        (F-measures); sharegpt `{}`. Every value is in [0, 1].

    Example:
        >>> from eval.data import load_prompts
        >>> prompts = load_prompts("gsm8k", 1)
        >>> score("gsm8k", prompts, [" 16 - 3 - 4 = 9 eggs, 9 * 2 = 18\\n#### 18\\n\\nQuestion: ..."])
        {'accuracy': 1.0}
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if not prompts or any(p.dataset != dataset for p in prompts):
        raise ValueError(f"score needs a non-empty list of {dataset} prompts")
    # Thinking chat templates (Qwen3.5's) put reasoning before the answer; only the answer is scored.
    completions = [cut_at_stop(c.split("</think>")[-1], p.stop) for p, c in zip(prompts, completions)]
    if dataset == "mbpp":
        tests = ["\n".join([p.reference["test_setup_code"], *p.reference["test_list"]]) for p in prompts]
        return {"pass@1": load_metric("pass_at_1").compute(predictions=completions, references=tests)["pass@1"]}
    if dataset == "humaneval":
        programs = [p.reference["prompt"] + c for p, c in zip(prompts, completions)]
        tests = [f"{p.reference['test']}\ncheck({p.reference['entry_point']})" for p in prompts]
        return {"pass@1": load_metric("pass_at_1").compute(predictions=programs, references=tests)["pass@1"]}
    if dataset == "gsm8k":
        answers = [p.reference["answer"] for p in prompts]
        accuracy = load_metric("gsm8k_accuracy").compute(predictions=completions, references=answers)["accuracy"]
        return {"accuracy": accuracy}
    if dataset == "cnn_dailymail":
        highlights = [p.reference["highlights"] for p in prompts]
        return load_metric("rouge").compute(predictions=completions, references=highlights)
    if dataset == "sharegpt":
        return {}
    raise ValueError(f"no quality metric for dataset {dataset!r}")
