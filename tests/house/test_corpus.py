"""The corpus builder: every source parsed, the eval prompts and eval tasks never in the training text."""

from __future__ import annotations

from eval.house import corpus
from tests.house.conftest import HOLDOUT, NUM_CONVERSATIONS


def test_sharegpt_conversations(house_data):
    with open(house_data / "sharegpt.json", encoding="utf-8") as f:
        conversations = list(corpus.sharegpt_conversations(f))
    # the cut-off last conversation is dropped, every whole one kept in file order
    assert len(conversations) == NUM_CONVERSATIONS
    assert conversations[3][0]["value"].startswith("Question 3:")


def test_build_corpus(house_data):
    text = corpus.build_corpus(
        house_data,
        sharegpt_holdout=HOLDOUT,
        sharegpt_valid=2,
        sharegpt_file=house_data / "sharegpt.json",
        python_root=house_data / "python",
    )
    train = "\n".join(text.train["sharegpt"])
    assert all(f"Question {i}:" not in train for i in range(HOLDOUT))  # the harness's prompts
    assert all(f"Question {i}:" in train for i in range(HOLDOUT, NUM_CONVERSATIONS))
    assert [doc.count("Question ") > 0 for doc in text.valid["sharegpt"]] == [True, True]
    assert text.train["sharegpt"][0].startswith("<|im_start|>user\nQuestion 4:")
    assert text.train["sharegpt"][0].endswith("<|im_end|>\n")

    # few-shot groups, "Question: ...\nAnswer: ..." examples separated by a blank line
    gsm8k = text.train["gsm8k"]
    assert len(gsm8k) == 5 and all(doc.count("Question: ") == corpus.GSM8K_PER_DOC for doc in gsm8k)
    assert gsm8k[0].startswith("Question: Tom has 0 apples and buys 3 more. How many apples does he have?\nAnswer: He")
    assert "#### 3\n\nQuestion: Tom has 1 apples" in gsm8k[0]
    assert sum(doc.count("Question: ") for doc in text.valid["gsm8k"]) == 12

    mbpp_train, mbpp_valid = "\n".join(text.train["mbpp"]), "\n".join(text.valid["mbpp"])
    train_ids = {t for t in [*range(1, 21), *range(511, 521)] if f"def add_{t}(" in mbpp_train}
    valid_ids = {t for t in [*range(1, 21), *range(511, 521)] if f"def add_{t}(" in mbpp_valid}
    assert train_ids == {*range(1, 11), *range(511, 521)} and valid_ids == set(range(11, 21))
    assert text.train["mbpp"][0].startswith(
        "You are an expert Python programmer, and here is your task: Write a function to add 1 to a number. Your code "
        "should pass these tests:\n\nassert add_1(1) == 2\n[BEGIN]\ndef add_1(x):\n  return x + 1\n[DONE]\n\n"
    )
    assert "\r" not in mbpp_train

    assert len(text.train["python"]) == 3 and not any("SKIPPED" in doc for doc in text.train["python"])
    assert text.stats()["train"]["python"]["docs"] == 3
