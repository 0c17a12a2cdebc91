"""GSM8K answer accuracy: the number after "####" in a completion, else its last number, against the gold answer.

A local `evaluate` module, loaded by path (`evaluate.load("<repo>/eval/metric_modules/gsm8k_accuracy")`). The two
extraction rules are lm-evaluation-harness's "strict-match" and "flexible-extract" filters for gsm8k, applied
as one fallback chain so a model that forgets the "####" line is still read.
"""

from __future__ import annotations

import re

import datasets
import evaluate

_MARKED = re.compile(r"####\s*(-?[$0-9.,]*[0-9])")
_NUMBER = re.compile(r"-?[$0-9.,]*[0-9]")

_DESCRIPTION = """\
Fraction of completions whose extracted final number equals the gold answer. The number is the one after
"####" when the completion has one, else the last number in it; "$" and thousands separators are dropped.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): completions, already cut at the next "Question:".
    references (`list[str]`): gold final answers, e.g. "72" (the text after "####" in the GSM8K answer).
Returns:
    `dict` with `accuracy` (`float` in [0, 1]) and `extracted` (`list[str | None]`, the number read from each
    completion, `None` when it has none).
Example:
    >>> acc = evaluate.load("eval/metric_modules/gsm8k_accuracy")
    >>> acc.compute(predictions=["48 + 24 = 72\\n#### 72"], references=["72"])["accuracy"]
    1.0
"""

_CITATION = """\
@article{cobbe2021gsm8k,
    title = {Training Verifiers to Solve Math Word Problems},
    author = {Cobbe, Karl and Kosaraju, Vineet and others},
    journal = {arXiv preprint arXiv:2110.14168},
    year = {2021},
}
"""


def _extract(text: str) -> str | None:
    marked = _MARKED.search(text)
    if marked:
        return marked.group(1)
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _value(number: str | None) -> float | None:
    if number is None:
        return None
    try:
        return float(number.replace(",", "").replace("$", "").rstrip("."))
    except ValueError:  # e.g. "1.2.3"
        return None


class Gsm8kAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        extracted = [_extract(p) for p in predictions]
        correct = [
            (v := _value(e)) is not None and v == _value(r) for e, r in zip(extracted, references)
        ]
        return {"accuracy": sum(correct) / len(correct), "extracted": extracted}
