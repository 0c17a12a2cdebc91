"""A small stand-in for the house model's data: GSM8K and MBPP files in the shared-data layout, a ShareGPT JSON array
cut off mid-conversation like the packaged one, and a folder of Python sources."""

from __future__ import annotations

import json

import pytest

NUM_CONVERSATIONS, HOLDOUT = 12, 4


def conversation(i: int) -> dict:
    turns = [
        {"from": "human", "value": f"Question {i}: how do I sort a list of {i} numbers in Python? " * 3},
        {"from": "gpt", "value": f"Answer {i}: call sorted(xs) or xs.sort(); both take key= and reverse=. " * 4},
    ]
    return {"id": f"conv{i}", "conversations": turns}


@pytest.fixture(scope="session")
def house_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("house_data")
    (root / "gsm8k").mkdir()
    for name, n in (("train", 30), ("test", 12)):
        rows = [
            {"question": f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?",
             "answer": f"He has {i} + {i + 3} = <<{i}+{i + 3}={2 * i + 3}>>{2 * i + 3} apples.\n#### {2 * i + 3}"}
            for i in range(n)
        ]  # fmt: skip
        (root / "gsm8k" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "mbpp").mkdir()
    mbpp = [
        {"text": f"Write a function to add {t} to a number.", "code": f"def add_{t}(x):\r\n  return x + {t}",
         "task_id": t, "test_setup_code": "", "test_list": [f"assert add_{t}(1) == {t + 1}"], "challenge_test_list": []}
        for t in [*range(1, 21), *range(511, 521)]
    ]  # fmt: skip
    (root / "mbpp" / "mbpp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mbpp))
    array = json.dumps([conversation(i) for i in range(NUM_CONVERSATIONS + 1)], indent=2)
    (root / "sharegpt.json").write_text(array[: array.rindex('"from"')])  # the last conversation is cut off
    (root / "python").mkdir()
    for i in range(3):
        (root / "python" / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
    (root / "python" / "site-packages").mkdir()
    (root / "python" / "site-packages" / "skipped.py").write_text("SKIPPED = True\n")
    return root
