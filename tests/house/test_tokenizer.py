"""The BPE tokenizer: byte-exact round trips, special tokens, the chat template the corpus writes."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from eval.house import corpus
from eval.house.tokenizer import encode_documents, stop_token_ids, train_tokenizer

TEXTS = [
    "def f(x):\n    return x + 12345\n\n\tif  y :  pass\r\n",
    "Question: Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72",
    "Übergrößenträger 🤖 日本語のテキスト — “quotes”",
    "<|im_start|>user\nhi<|im_end|>\n",
    " leading and trailing spaces   ",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    docs = [t * 20 for t in TEXTS] + ["The quick brown fox jumps over the lazy dog. " * 50]
    tok = train_tokenizer(docs, vocab_size=320)
    folder = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_round_trip(tokenizer):
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == text
    # digits one by one
    assert tokenizer.tokenize("12345") == ["1", "2", "3", "4", "5"]


def test_special_tokens(tokenizer):
    assert tokenizer.convert_tokens_to_ids(corpus.SPECIAL_TOKENS) == [0, 1, 2]
    assert tokenizer.eos_token == tokenizer.pad_token == tokenizer.bos_token == corpus.EOS
    assert tokenizer.padding_side == "left"
    assert tokenizer("<|im_end|>", add_special_tokens=False).input_ids == [2]
    assert stop_token_ids(tokenizer) == [0, 2]
    assert len(tokenizer) <= 320


def test_chat_template(tokenizer):
    conversation = [
        {"from": "human", "value": "How do I sort?  "},
        {"from": "gpt", "value": "Use sorted()."},
        {"from": "human", "value": "   "},  # empty turns are dropped
    ]
    messages = [{"role": "user", "content": "How do I sort?  "}, {"role": "assistant", "content": "Use sorted()."}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == corpus.format_chat(conversation)
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHow do I sort?  <|im_end|>\n<|im_start|>assistant\n"


def test_encode_documents(tokenizer):
    stream = encode_documents(tokenizer, ["ab", "", "cd ef"], batch=2)
    assert stream.dtype == np.uint16
    eos = tokenizer.eos_token_id
    assert (stream == eos).sum() == 3 and stream[-1] == eos
    assert tokenizer.decode(stream.tolist()) == "ab<|endoftext|><|endoftext|>cd ef<|endoftext|>"
