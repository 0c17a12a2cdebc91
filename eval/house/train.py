"""Train the house model: a small Qwen3.5 (`Qwen3_5ForCausalLM`) with one MTP layer and its own BPE tokenizer.

    python -m eval.house.train --data ../shared/data --out eval/house/checkpoint --minutes 8   # one H200
    python -m eval.house.train --data DIR --out DIR --tiny --max-steps 3                       # CPU smoke run

One run does everything, inside a wall-clock budget: corpus (`corpus.py`), tokenizer (`tokenizer.py`), training until
`--reserve-s` seconds before the budget ends, then the checkpoint (bf16, `save_pretrained` + `mtp.*` tensors, the
tokenizer, a model card) and the measurements the card reports (`evaluate.py`), each written as soon as it exists.
SIGINT stops training early and still saves.

The loss is the next-token loss plus the MTP head unrolled over `--depth` recursive steps (`mtp_unroll.py`), step s
weighted `depth_decay**(s-1)`: each step's loss mixes the true token's cross-entropy with the cross-entropy against
the target's own (detached) next-token distribution at that position, since drafts are accepted when they match the
target, not the text. The learning rate warms up over steps and then follows a cosine over the training time budget,
so that it reaches its floor when time runs out however fast the machine is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from eval.data import load_prompts
from eval.house import card, corpus, evaluate
from eval.house import tokenizer as house_tokenizer
from eval.house.data import TrainWindows, valid_windows
from eval.house.mtp_unroll import forward_unrolled
from hf_bole.models.mtp import Qwen3_5MTP, save_pretrained_with_mtp

# The real shape: 15.1M parameters with the MTP layer (29 MiB in bf16), GDN heads of 128 as in Qwen3.5. As many GDN
# key heads as value heads (Qwen3.5 has twice as many value heads): transformers 5.17 repeats the key heads inside
# the GDN layer and 5.23 inside the kernel, and hf_bole's tree verification does not yet follow 5.17 there (the
# device image's version), so this shape behaves the same under both.
SHAPE = dict(
    hidden_size=384,
    intermediate_size=576,
    num_hidden_layers=8,  # [lin, lin, lin, full] x 2
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=3,
    linear_num_value_heads=3,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)
# A CPU smoke-test shape of the same structure.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
TINY_DEFAULTS = dict(
    vocab_size=384,
    batch_size=4,
    seq_len=64,
    depth=3,
    warmup_steps=2,
    eval_windows=2,
    eval_prompts=2,
    eval_new_tokens=12,
)
# How often each source's tokens are repeated in the training stream: the harness prompts with MBPP and GSM8K.
REPEATS = {"sharegpt": 1, "python": 1, "gsm8k": 3, "mbpp": 6}
# Characters of each source the BPE is trained on.
TOKENIZER_CHARS = {"sharegpt": 20_000_000, "python": 8_000_000, "gsm8k": 4_000_000, "mbpp": 300_000}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="folder with gsm8k/{train,test}.jsonl and mbpp/mbpp.jsonl")
    ap.add_argument("--out", required=True, help="checkpoint folder to write")
    ap.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget of the whole run, from its start")
    ap.add_argument(
        "--deadline", type=float, default=None, help="when the run must end (Unix time); overrides --minutes"
    )
    ap.add_argument("--reserve-s", type=float, default=90.0, help="seconds of the budget kept for saving and measuring")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps even if time is left")
    ap.add_argument("--tiny", action="store_true", help="tiny shape, vocabulary and batch (CPU smoke runs)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=1536, help="window length: eval prompts are 700-1100 tokens")
    ap.add_argument("--depth", type=int, default=5, help="unrolled MTP steps (hf_bole drafts 5 deep by default)")
    ap.add_argument("--depth-decay", type=float, default=0.8, help="step s of the MTP loss weighs decay**(s-1)")
    ap.add_argument("--mtp-weight", type=float, default=0.5, help="weight of the MTP loss (mean over steps)")
    ap.add_argument("--distill", type=float, default=0.5, help="share of the MTP loss taken against the target")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--sharegpt-holdout", type=int, default=1000, help="first conversations never trained on")
    ap.add_argument("--sharegpt-file", default=None, help="a ShareGPT JSON array instead of the packaged one")
    ap.add_argument("--python-root", default=None, help="Python sources instead of the interpreter's stdlib")
    ap.add_argument("--eval-windows", type=int, default=48, help="held-out windows per source")
    ap.add_argument("--eval-prompts", type=int, default=32, help="MBPP and GSM8K prompts each for acceptance")
    ap.add_argument("--eval-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    if args.tiny:  # other defaults, still overridden by what the command line says
        ap.set_defaults(**TINY_DEFAULTS)
        args = ap.parse_args(argv)
    return args


def check_torch_gdn_path() -> None:
    """transformers binds Qwen3.5's GDN kernels to fla-core when it imports (`use_kernel_func_from_hub_with_fallback`
    in 5.17 through 5.24), and fla-core 0.6's chunk backward refuses Triton < 3.7.1 on Hopper: train only where it is
    absent, so the PyTorch chunk path runs."""
    if importlib.util.find_spec("fla") is not None:
        raise RuntimeError(
            "fla-core is importable here, so transformers would route Qwen3.5's GDN layers to it; its chunk backward "
            "fails on Hopper with Triton < 3.7.1. Train in an environment without fla-core."
        )


def house_config(vocab_size: int, tiny: bool, eos_id: int) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attn_implementation="sdpa",
        **(TINY_SHAPE if tiny else SHAPE),
    )


def mtp_losses(
    logits: torch.Tensor, mtp_logits: list[torch.Tensor], window: torch.Tensor, distill: float
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The next-token loss; one loss per MTP step, `(1 - distill) * CE(true token) + distill * CE(the target's
    distribution)`; and each step's true-token CE (detached, for the log)."""
    labels = window[:, 1:]  # [B, T]
    main = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    teacher = logits.detach().float().softmax(-1)  # [B, T, V]
    step_losses, step_ce = [], []
    for s, step_logits in enumerate(mtp_logits, start=1):
        length = step_logits.shape[1]
        logp = step_logits.float().log_softmax(-1)  # [B, T-D, V]
        hard = F.nll_loss(logp.flatten(0, 1), window[:, s + 1 : s + 1 + length].flatten())
        soft = -(teacher[:, s : s + length] * logp).sum(-1).mean()
        step_losses.append((1 - distill) * hard + distill * soft)
        step_ce.append(hard.detach())
    return main, step_losses, step_ce


def mtp_length(args) -> int:
    """Indices the head trains at: T - D rounded down to a multiple of 16, so that the bool-masked attention's key
    lengths (multiples of it) suit the memory-efficient SDPA kernel without padding."""
    n = args.seq_len - args.depth
    return n // 16 * 16 if n >= 16 else n


def learning_rate(args, step: int, progress: float) -> float:
    warmup = min(1.0, (step + 1) / args.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * warmup * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def make_optimizer(modules: list[torch.nn.Module], args, device: torch.device) -> torch.optim.AdamW:
    params = {id(p): p for m in modules for p in m.parameters()}.values()  # the tied embedding once
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]  # norms, GDN's A_log and dt_bias
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def main(argv: list[str] | None = None) -> dict:
    start = time.time()
    args = parse_args(argv)
    deadline = args.deadline if args.deadline is not None else start + 60 * args.minutes
    check_torch_gdn_path()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = {
        "command": os.environ.get("HOUSE_COMMAND")
        or " ".join([Path(sys.executable).name, "-m", "eval.house.train", *sys.argv[1:]]),
        "commit": os.environ.get("HOUSE_COMMIT"),
        "args": vars(args),
        "environment": environment(device),
        "timings_s": {},
        "steps": [],
    }

    def mark(name: str) -> None:
        log["timings_s"][name] = round(time.time() - start, 1)
        print(f"[{log['timings_s'][name]:7.1f}s] {name}", flush=True)

    # Data and tokenizer
    text = corpus.build_corpus(
        args.data,
        sharegpt_holdout=args.sharegpt_holdout,
        sharegpt_valid=min(200, args.sharegpt_holdout),
        sharegpt_file=args.sharegpt_file,
        python_root=args.python_root,
    )
    log["corpus"] = text.stats()
    mark("corpus")
    tok = house_tokenizer.train_tokenizer(
        house_tokenizer.sample_texts(text.train, TOKENIZER_CHARS, seed=args.seed), vocab_size=args.vocab_size
    )
    mark("tokenizer")
    train_streams = {src: house_tokenizer.encode_documents(tok, docs) for src, docs in text.train.items()}
    valid_streams = {src: house_tokenizer.encode_documents(tok, docs) for src, docs in text.valid.items()}
    log["tokens"] = {
        "train": {src: len(s) for src, s in train_streams.items()},
        "valid": {src: len(s) for src, s in valid_streams.items()},
        "repeats": REPEATS,
    }
    windows = TrainWindows(train_streams, REPEATS, args.seq_len, device, seed=args.seed)
    heldout = {src: valid_windows(s, args.seq_len, args.eval_windows) for src, s in valid_streams.items()}
    log["tokens"]["train_stream"] = len(windows)
    mark("encode")
    print(json.dumps(log["tokens"]), flush=True)

    # Model
    eos_id = tok.convert_tokens_to_ids(corpus.EOS)
    vocab_size = -(-len(tok) // 64) * 64
    model = Qwen3_5ForCausalLM(house_config(vocab_size, args.tiny, eos_id)).to(device)
    mtp = Qwen3_5MTP.for_model(model)
    model.train()
    mtp.train()
    n_model = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    log["parameters"] = {"model": n_model, "mtp": n_mtp, "total": n_model + n_mtp}
    log["shape"] = TINY_SHAPE if args.tiny else SHAPE
    print(f"parameters: model {n_model / 1e6:.2f}M + MTP {n_mtp / 1e6:.2f}M, vocab {vocab_size}", flush=True)
    log["environment"]["autocast"] = str(autocast_dtype).removeprefix("torch.") if autocast_dtype else None
    print(
        f"weights on {next(model.parameters()).device} and {next(mtp.parameters()).device}, autocast "
        f"{log['environment']['autocast']}, GDN: transformers' PyTorch chunk path (fla-core not importable)",
        flush=True,
    )
    optimizer = make_optimizer([model, mtp], args, device)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    weights = [args.depth_decay**s for s in range(args.depth)]
    mark("model")

    # Training
    train_start = time.time()
    train_end = deadline - args.reserve_s
    step, tokens_seen = 0, 0
    interrupted = False
    window_tokens = args.batch_size * args.seq_len
    try:
        with _sigint_as_keyboard_interrupt():
            while time.time() < train_end and (args.max_steps is None or step < args.max_steps):
                progress = (time.time() - train_start) / max(train_end - train_start, 1e-6)
                if args.max_steps:
                    progress = max(progress, step / args.max_steps)
                lr = learning_rate(args, step, progress)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                step += 1
                tokens_seen += window_tokens
                logged = step % args.log_every == 0 or step == 1
                entry = train_step(model, mtp, optimizer, params, windows.sample(args.batch_size), args, weights,
                                   autocast_dtype, logged)  # fmt: skip
                if logged:
                    log["steps"].append(report(entry, step, time.time() - train_start, lr, tokens_seen))
    except KeyboardInterrupt:
        interrupted = True
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_seconds = time.time() - train_start
    log["training"] = {
        "steps": step,
        "tokens": tokens_seen,
        "seconds": round(train_seconds, 1),
        "tokens_per_s": round(tokens_seen / max(train_seconds, 1e-6)),
        "epochs_of_stream": round(tokens_seen / len(windows), 2),
        "interrupted": interrupted,
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if device.type == "cuda" else None,
    }
    mark("train")
    del optimizer, params

    # Checkpoint: bf16, the Qwen3.5 layout with mtp.* tensors, tokenizer, stop tokens
    model.to(torch.bfloat16).eval()
    mtp.to(torch.bfloat16).eval()
    stop_ids = house_tokenizer.stop_token_ids(tok)
    model.generation_config.eos_token_id = stop_ids
    model.generation_config.pad_token_id = eos_id
    model.generation_config.bos_token_id = eos_id
    save_pretrained_with_mtp(model, mtp, out)
    tok.save_pretrained(out)
    del model, mtp
    mark("save")

    # Measurements, on the checkpoint as loaded back (the path hf_bole takes)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).to(device).eval()
    mtp = Qwen3_5MTP.from_pretrained(model)
    log["heldout"] = {
        src: evaluate.heldout_metrics(model, mtp, w, args.depth, max(1, args.batch_size // 2))
        for src, w in heldout.items()
    }
    mark("heldout eval")
    write_card(out, log)

    if args.eval_prompts > 0:
        try:
            with _sigint_as_keyboard_interrupt():
                measure_acceptance(model, mtp, tok, args, log, deadline)
        except KeyboardInterrupt:
            log["acceptance_interrupted"] = True
        mark("acceptance")
        write_card(out, log)
    return log


def measure_acceptance(model, mtp, tok, args, log: dict, deadline: float) -> None:
    """Accepted tokens on MBPP and GSM8K prompts: replayed on the model's own greedy text, then hf_bole's real number
    while time is left. A failure here must not cost the saved checkpoint, so it is logged instead."""
    prompts = eval_prompts(args.data, args.eval_prompts)
    stop_ids = house_tokenizer.stop_token_ids(tok)
    log["own_text"], log["hf_bole"], references = {}, {}, {}
    try:
        for name, batch in prompts.items():
            generated, prompt_len = evaluate.greedy_generate(model, tok, batch, args.eval_new_tokens)
            references[name] = generated
            log["own_text"][name] = evaluate.self_generated_metrics(
                model, mtp, tok, batch, generated, prompt_len, stop_ids, args.depth
            )
            print(name, json.dumps(log["own_text"][name]), flush=True)
        for name, batch in prompts.items():
            if time.time() > deadline - 10:
                log["hf_bole"][name] = "skipped: out of time"
                continue
            # 32 draft nodes per row, what hf_bole verifies at batch 1 without a calibration table (its budget is
            # shared by the batch)
            budget = 32 * len(batch)
            settings = {
                "tree": {"bole_topk": 4, "bole_depth": 5, "bole_budget": budget},
                "chain": {"bole_topk": 1, "bole_depth": 3, "bole_budget": budget},
            }
            log["hf_bole"][name] = evaluate.bole_acceptance(
                model, tok, batch, references[name], args.eval_new_tokens, settings
            )
            print(name, json.dumps(log["hf_bole"][name]), flush=True)
    except Exception as error:  # noqa: BLE001  (reported in the log and the card)
        traceback.print_exc()
        log["acceptance_error"] = repr(error)


def train_step(model, mtp, optimizer, params, window, args, weights, autocast_dtype, logged: bool) -> dict | None:
    """One optimizer step on `window [B, T + 1]`; when `logged`, the step's losses and MTP agreement (host syncs)."""
    device = window.device
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits, mtp_logits = forward_unrolled(model, mtp, window[:, :-1], args.depth, mtp_length(args))
        main_loss, step_losses, step_ce = mtp_losses(logits, mtp_logits, window, args.distill)
        mtp_loss = sum(w * x for w, x in zip(weights, step_losses, strict=True)) / sum(weights)
        loss = main_loss + args.mtp_weight * mtp_loss
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if not logged:
        return None
    with torch.no_grad():
        agree = [
            (m.argmax(-1) == logits[:, s : s + m.shape[1]].argmax(-1)).float().mean().item()
            for s, m in enumerate(mtp_logits, start=1)
        ]
    return {
        "loss": round(main_loss.item(), 4),
        "mtp_ce": [round(c.item(), 3) for c in step_ce],
        "mtp_agree": [round(a, 3) for a in agree],
        "grad_norm": round(grad_norm.item(), 3),
    }


def report(entry: dict, step: int, seconds: float, lr: float, tokens: int) -> dict:
    entry = {"step": step, "seconds": round(seconds, 1), "lr": lr, "tokens": tokens, **entry,
             "tokens_per_s": round(tokens / max(seconds, 1e-6))}  # fmt: skip
    print(
        f"step {step:5d} | {seconds:6.1f}s | lr {lr:.2e} | loss {entry['loss']:.3f} | mtp ce "
        + " ".join(f"{c:.2f}" for c in entry["mtp_ce"])
        + " | agree "
        + " ".join(f"{a:.2f}" for a in entry["mtp_agree"])
        + f" | gnorm {entry['grad_norm']:.2f} | {entry['tokens_per_s'] / 1e3:.0f}k tok/s",
        flush=True,
    )
    return entry


def eval_prompts(data_dir: str, n: int) -> dict[str, list[str]]:
    """The first `n` MBPP eval-split and GSM8K test prompts, few-shot, exactly as the harness builds them."""
    return {dataset: [p.text for p in load_prompts(dataset, n, data_dir=data_dir)] for dataset in ("mbpp", "gsm8k")}


def environment(device: torch.device) -> dict:
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def write_card(out: Path, log: dict) -> None:
    """The model card and the training log, each replaced whole (a run stopped mid-write keeps the previous one)."""
    for name, text in (("README.md", card.model_card(log)), ("training_log.json", json.dumps(log, indent=1) + "\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


class _sigint_as_keyboard_interrupt:
    """Makes sure SIGINT (what `timeout -s INT` sends) raises KeyboardInterrupt in the block, whatever handler the
    process had installed."""

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)
        return False


if __name__ == "__main__":
    main()
