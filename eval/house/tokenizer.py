"""The house model's tokenizer: a byte-level BPE trained with `tokenizers`, saved as a transformers fast tokenizer.

Pre-tokenization is Qwen2's split (digits one by one, so GSM8K arithmetic is spelled digit by digit; runs of spaces kept
whole, so Python indentation is a few tokens), then GPT-2's byte-to-unicode map, so every byte string round-trips.
The special tokens take ids 0-2: `<|endoftext|>` (end of document; bos, eos and pad), `<|im_start|>`, `<|im_end|>`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from eval.house.corpus import CHAT_TEMPLATE, EOS, IM_END, SPECIAL_TOKENS

# Qwen2's pre-tokenizer pattern (tokenizer.json of Qwen/Qwen2-7B).
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab_size` tokens (special tokens and the 256 byte tokens included), trained on `texts`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        padding_side="left",  # batched generation with a decoder-only model
        model_max_length=32768,
    )


def sample_texts(docs: dict[str, list[str]], chars_per_source: dict[str, int], seed: int = 0) -> list[str]:
    """Random whole documents of each source until it reaches its character budget: BPE merges follow the mix of
    sources rather than the size of each (ShareGPT alone is 3/4 of the corpus)."""
    rng = random.Random(seed)
    out = []
    for source, budget in chars_per_source.items():
        pool = list(docs.get(source, []))
        rng.shuffle(pool)
        total = 0
        for doc in pool:
            if total >= budget:
                break
            out.append(doc)
            total += len(doc)
    return out


def encode_documents(tokenizer: PreTrainedTokenizerFast, docs: list[str], batch: int = 4096) -> np.ndarray:
    """One token stream `[N]` (uint16) of `docs`, each followed by `<|endoftext|>`. Encodes on every core."""
    if len(tokenizer) > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"a vocabulary of {len(tokenizer)} does not fit uint16 token ids")
    backend, eos = tokenizer.backend_tokenizer, tokenizer.convert_tokens_to_ids(EOS)
    pieces = []
    for i in range(0, len(docs), batch):
        for enc in backend.encode_batch_fast(docs[i : i + batch], add_special_tokens=False):
            pieces.append(np.asarray(enc.ids, dtype=np.uint16))
            pieces.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def stop_token_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The generation stop tokens: end of document and end of a chat turn."""
    return [tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(IM_END)]
