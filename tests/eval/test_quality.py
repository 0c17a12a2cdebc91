"""eval.quality and the metric modules in eval/metric_modules: code execution, GSM8K extraction, ROUGE, offline loading."""

from __future__ import annotations

import json
import socket

import evaluate
import pytest

from eval.data import PROMPTS_DIR, load_prompts
from eval.quality import METRICS_DIR, cut_at_stop, load_metric, score


def bundled_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (PROMPTS_DIR / name).read_text().splitlines()]


def test_cut_at_stop():
    assert cut_at_stop("a = 1\n[DONE]\n\nYou are [DONE]", ["[DONE]"]) == "a = 1\n"
    assert cut_at_stop("    return x\nprint(f(1))\ndef g():", ["\ndef", "\nprint"]) == "    return x"
    assert cut_at_stop("no stop here", ["\n\n"]) == "no stop here"
    assert cut_at_stop("anything", []) == "anything"


def test_score_mbpp():
    prompts = load_prompts("mbpp", 2)
    code = {row["task_id"]: row["code"] for row in bundled_rows("mbpp/mbpp.jsonl")}
    # What a model continues after "[BEGIN]\n": the solution, "[DONE]", then the start of another task.
    right = [f"{code[p.reference['task_id']]}\n[DONE]\n\nYou are an expert" for p in prompts]
    assert score("mbpp", prompts, right) == {"pass@1": 1.0}
    assert score("mbpp", prompts, [right[0], "def remove_Occ(s, ch):\n    return s\n[DONE]"]) == {"pass@1": 0.5}


def test_pass_at_1_sandbox():
    tests = "assert add(2, 3) == 5"
    programs = [
        "def add(a, b):\n    return a + b",  # passes
        "def add(a, b):\n    return a - b",  # a failing assert
        "def add(a, b):\n    while True:\n        pass",  # runs past the timeout
        "import os\nos.system('true')\ndef add(a, b):\n    return a + b",  # the guard disables os.system
    ]
    out = load_metric("pass_at_1").compute(predictions=programs, references=[tests] * 4, timeout=2.0)
    assert out["results"][:3] == ["passed", "failed: AssertionError()", "timed out"]
    assert out["results"][3].startswith("failed: TypeError") and out["pass@1"] == 0.25


def test_score_humaneval():
    prompts = load_prompts("humaneval", 3, data_dir=PROMPTS_DIR)
    solutions = [row["canonical_solution"] for row in bundled_rows("humaneval/HumanEval.jsonl")[:3]]
    # The stop strings cut the test-style code a model often writes after the function.
    completions = [f"{s}\n\nprint({p.reference['entry_point']}(None))\n" for s, p in zip(solutions, prompts)]
    assert score("humaneval", prompts, completions) == {"pass@1": 1.0}
    assert score("humaneval", prompts, ["    return None\n"] * 3) == {"pass@1": 0.0}


def test_score_gsm8k():
    prompts = load_prompts("gsm8k", 4)
    assert [p.reference["answer"] for p in prompts] == ["18", "3", "70000", "540"]
    completions = [
        " 16 - 3 - 4 = 9 and 9 * 2 = $18.\n#### 18\n\nQuestion: 5 + 5 = 10\n#### 10",  # marked; cut at Question:
        " It takes 2 + 1 = 3 bolts.",  # no "####": the last number
        " The profit is $70,000\n#### 70,000",  # separators dropped
        " 3 * 60 * 3 = 520\n#### 520",  # wrong
    ]
    assert score("gsm8k", prompts, completions) == {"accuracy": 0.75}
    out = load_metric("gsm8k_accuracy").compute(predictions=["#### -1,234.5 apples, 7", "none"], references=["1", "2"])
    assert out["extracted"] == ["-1,234.5", None] and out["accuracy"] == 0.0


def test_score_cnn_dailymail():
    prompts = load_prompts("cnn_dailymail", 2)
    highlights = [p.reference["highlights"] for p in prompts]
    assert score("cnn_dailymail", prompts, highlights) == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    # Case and a reasoning block before the summary do not count.
    thinking = [f"<think>\nA summary.\n\nThree sentences.\n</think>\n{h.upper()}" for h in highlights]
    assert score("cnn_dailymail", prompts, thinking) == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    partial = score("cnn_dailymail", prompts, ["president barack obama", "the pharmacists association"])
    assert all(0.0 < v < 0.5 for v in partial.values())


def test_score_errors():
    prompts = load_prompts("gsm8k", 2)
    assert score("sharegpt", load_prompts("sharegpt", 1, data_dir=PROMPTS_DIR), ["hi"]) == {}
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        score("gsm8k", prompts, ["1"])
    with pytest.raises(ValueError, match="non-empty list of mbpp prompts"):
        score("mbpp", prompts, ["1", "2"])


def test_metrics_load_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)

    def no_network(*args, **kwargs):
        raise AssertionError("a metric module reached for the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    for name in ("rouge", "pass_at_1", "gsm8k_accuracy"):
        metric = evaluate.load(str(METRICS_DIR / name))
        assert metric.compute(predictions=["x = 1"], references=["assert x == 1"])
    rouge = evaluate.load(str(METRICS_DIR / "rouge"))
    assert rouge.compute(predictions=["the same text"], references=["the same text"])["rougeL"] == 1.0
