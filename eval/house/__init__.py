"""The house model: a small Qwen3.5 with an MTP head and its own tokenizer, trained by `python -m eval.house.train`."""
