"""ROUGE-1/2/L F-measure averaged over examples, computed by Google's `rouge-score`.

A local `evaluate` module, loaded by path (`evaluate.load("<repo>/eval/metric_modules/rouge")`), because
`evaluate.load("rouge")` fetches its script from the Hub and fails offline.
"""

from __future__ import annotations

import datasets
import evaluate
from rouge_score import rouge_scorer

_KEYS = ("rouge1", "rouge2", "rougeL")

_DESCRIPTION = """\
ROUGE-1, ROUGE-2 and ROUGE-L F-measures between each prediction and its reference, averaged over the
examples. rouge-score's tokenizer lowercases and keeps only [a-z0-9] runs, so cased model output scores
fairly against the lowercased, PTB-tokenized CNN/DailyMail references of the local copy.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): generated summaries.
    references (`list[str]`): reference summaries (CNN/DailyMail highlights, one sentence a line).
    use_stemmer (`bool`, defaults to `True`): Porter-stem tokens before matching, as summarisation papers do.
Returns:
    `dict[str, float]` with keys `rouge1`, `rouge2`, `rougeL`, each in [0, 1].
Example:
    >>> rouge = evaluate.load("eval/metric_modules/rouge")
    >>> rouge.compute(predictions=["the cat sat"], references=["the cat sat"])["rouge1"]
    1.0
"""

_CITATION = """\
@inproceedings{lin-2004-rouge,
    title = "{ROUGE}: A Package for Automatic Evaluation of Summaries",
    author = "Lin, Chin-Yew",
    booktitle = "Text Summarization Branches Out",
    year = "2004",
}
"""


class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, use_stemmer=True):
        scorer = rouge_scorer.RougeScorer(list(_KEYS), use_stemmer=use_stemmer)
        scores = [scorer.score(ref, pred) for pred, ref in zip(predictions, references)]
        return {key: sum(s[key].fmeasure for s in scores) / len(scores) for key in _KEYS}
