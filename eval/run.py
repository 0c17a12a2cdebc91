"""The evaluation harness: datasets x modes x batch sizes, speed, acceptance, exactness and task quality.

    python eval/run.py                                    # house model, bundled prompts, ar vs bole (CPU: minutes)
    python eval/run.py --datasets mbpp gsm8k --modes ar chain tree-serial bole --batch-sizes 1 8 --device cuda
    python eval/run.py --shape 9B --modes ar bole --batch-sizes 1 8 --max-new-tokens 256   # random 9B, oracle drafter
    accelerate launch --multi_gpu --num_processes 2 eval/run.py ...   # prompts sharded over processes (GPUs or CPU)
    python eval/run.py --shape 122B-A10B --device-map auto --modes ar bole --batch-sizes 1 8   # one model, all GPUs
    torchrun --nproc-per-node 2 eval/run.py --tp --shape 122B-A10B --modes ar bole   # one model, its weights sharded

Modes (eval/modes.py): `ar` plain `generate`; `ar-static` its static cache, compiled; `chain` hf_bole with topk 1,
depth 3 (--chain-depth); `tree-serial` bole's trees verified node by node with state snapshots; `bole` the closed
form. Every run is greedy unless --temperature > 0. Writes results.jsonl, results.md and PNG plots to --output-dir
(default runs/eval, git-ignored) and prints the table; on a CPU the table gives no speed-up (its timings move with
the machine's load). See eval/README.md.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import gc
import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_bole  # noqa: E402  (also registers custom_generate="hf_bole")
from eval import metrics, report  # noqa: E402
from eval.data import DATASETS, DEFAULT_DATASETS, Prompt, load_prompts  # noqa: E402
from eval.modes import CHAIN_DEPTH, MODES, Mode, make_modes  # noqa: E402
from eval.oracle import OracleDrafter  # noqa: E402
from eval.shapes import (  # noqa: E402
    HOUSE_CHECKPOINT,
    SHAPES,
    build_model,
    build_model_across,
    build_model_tensor_parallel,
    parameter_bytes,
    shape_config,
    spread_max_memory,
    with_random_mtp,
)
from hf_bole import BoleConfig  # noqa: E402
from hf_bole.generation.budget import BudgetResolver  # noqa: E402
from hf_bole.generation.verify import drop_verify_graphs  # noqa: E402

FEW_SHOT = ("mbpp", "gsm8k")  # the datasets eval.data prompts with exemplars (the others are zero-shot)
DTYPES = {"auto": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = BoleConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=str(HOUSE_CHECKPOINT), help="checkpoint folder or Hub id (default: the house model)"
    )
    ap.add_argument("--shape", help=f"a random-weight model instead of --model: {', '.join(SHAPES)}, 'house' or a "
                    "folder with a config.json; prompts are random token ids, the drafter is the oracle (or a random "
                    "MTP head with --drafter mtp, for its cost)")  # fmt: skip
    ap.add_argument("--datasets", nargs="+", default=list(DEFAULT_DATASETS), choices=DATASETS)
    ap.add_argument("--modes", nargs="+", default=["ar", "bole"], choices=MODES)
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    ap.add_argument("--num-prompts", type=int, help="prompts per dataset (all processes together; default 4, or "
                    "--num-batches times the largest batch size)")  # fmt: skip
    ap.add_argument("--num-batches", type=int, help="batches per batch size: each batch size runs its first "
                    "N x batch size prompts (a sweep over batch sizes at one batch each)")  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=None, help="passed to eval.data.load_prompts")
    ap.add_argument("--shots", type=int, default=None, help="few-shot exemplars (MBPP, GSM8K); default: the dataset's")
    ap.add_argument("--prompt-length", type=int, default=128, help="tokens per random prompt (--shape)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (exactness is checked)")
    ap.add_argument("--depth", type=int, nargs="+", default=[defaults.depth], help="several: a sweep")
    ap.add_argument("--topk", type=int, default=defaults.topk)
    ap.add_argument(
        "--chain-depth", type=int, nargs="+", default=[CHAIN_DEPTH], help="tokens a chain drafts (chain mode; default "
        f"{CHAIN_DEPTH}, the SGLang/vLLM MTP default); several: a sweep, each labelled `chain d<depth>`",
    )  # fmt: skip
    ap.add_argument(
        "--budget",
        type=_budget,
        nargs="+",
        default=[defaults.budget],
        help="draft nodes verified per round across the batch, or 'auto' (hf_bole's calibrated table); several: a "
        "sweep",
    )
    ap.add_argument(
        "--epsilon",
        type=float,
        nargs="+",
        default=[defaults.epsilon],
        help="the slack of --budget auto; several: a sweep",
    )
    ap.add_argument("--drafter", choices=["mtp", "ngram", "oracle"], help="default: mtp (--model), oracle (--shape)")
    ap.add_argument(
        "--oracle-accept",
        type=float,
        default=0.8,
        help="oracle: chance a tree level holds the true token (0.8: ~3.7 tokens/round at depth 5, ~4 at 6)",
    )
    ap.add_argument("--sort-by-length", action="store_true", help="batch prompts of similar length together")
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed passes per batch, the one of median wall time kept "
        "(default: 3 on CUDA, 1 on CPU)",
    )  # fmt: skip
    ap.add_argument(
        "--interleave", action="store_true", help="time the modes' passes in turns (every mode's first pass over all "
        "batches, then every mode's second, each turn starting one mode later) instead of each mode's passes back to "
        "back: a drift of the machine over the run then falls on every mode alike; ar's outputs come from an untimed "
        "pass first",
    )  # fmt: skip
    ap.add_argument(
        "--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="hf_bole modes launch every kernel from "
        "Python (bole_cuda_graphs=False; by default they replay verify forwards and MTP drafting from CUDA graphs)",
    )  # fmt: skip
    ap.add_argument(
        "--no-compile-drafter", dest="compile_drafter", action="store_false", help="hf_bole modes draft eagerly "
        "(bole_compile_drafter=False; by default the MTP drafter's rounds run through torch.compile on CUDA)",
    )  # fmt: skip
    ap.add_argument(
        "--compile", nargs="*", choices=["off", "on"], default=["off"], help="hf_bole modes run the verify forward "
        "through torch.compile (bole_compile); bare: on; `off on`: a sweep, each hf_bole mode both ways",
    )  # fmt: skip
    ap.add_argument(
        "--attention", choices=hf_bole.config.ATTENTION_MODES, help="how hf_bole modes' full-attention layers "
        "attend in the verify forward (bole_attention; default: hf_bole's, \"auto\": its tree attention kernel on "
        "CUDA)",
    )  # fmt: skip
    ap.add_argument(
        "--profile", action="store_true",
        help="time the phases of hf_bole's rounds (bole_profile): where a round's time goes",
    )
    ap.add_argument("--output-dir", default="runs/eval", help="where the tables and plots go (runs/ is git-ignored)")
    ap.add_argument("--data-dir", default=None, help="passed to eval.data.load_prompts")
    ap.add_argument("--dtype", default="auto", choices=list(DTYPES), help="auto: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--device-map", choices=["auto"], help="spread one model over all visible GPUs with accelerate (a checkpoint "
        "through from_pretrained(device_map='auto'), a --shape built across them); every mode runs on that placement",
    )  # fmt: skip
    ap.add_argument(
        "--tp", action="store_true", help="under `torchrun --nproc-per-node N`: one model sharded over the N processes "
        "by transformers' tensor parallelism (a checkpoint through from_pretrained(tp_plan='auto'), a --shape built so: "
        "eval.shapes.build_model_tensor_parallel); every process runs every prompt, the first one reports",
    )  # fmt: skip
    ap.add_argument(
        "--gpu-reserve-gib", type=float, default=8.0, help="--device-map: GiB each GPU keeps free of weights "
        "(activations, tree cache); the weights are shared evenly over the GPUs (eval.shapes.spread_max_memory)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cudnn-sdpa", action="store_true", help="leave SDPA's cuDNN backend on for every mode (default: off for "
        "every mode, as hf_bole's generate turns it off: it re-plans for every key length, 45 vs 15 ms per "
        "house-model step)",
    )  # fmt: skip
    args = ap.parse_args(argv)

    args.drafter = args.drafter or ("oracle" if args.shape else "mtp")
    if args.drafter == "oracle" and args.temperature > 0:
        ap.error("the oracle drafter knows greedy continuations only: use --temperature 0 with it")
    args.compile = [c == "on" for c in dict.fromkeys(args.compile or ["on"])]
    if args.device_map and not args.device.startswith("cuda"):
        ap.error("--device-map spreads the model over GPUs: it needs --device cuda")
    if args.tp and (args.device_map or int(os.environ.get("WORLD_SIZE", "1")) < 2):
        ap.error("--tp shards the model over the processes of `torchrun --nproc-per-node N` (N >= 2), without --device-map")
    if args.repeats is None:
        args.repeats = 3 if args.device.startswith("cuda") else 1
    if args.num_prompts is None:
        args.num_prompts = 4 if args.num_batches is None else args.num_batches * max(args.batch_sizes)
    for name in (
        "batch_sizes", "num_prompts", "max_new_tokens", "prompt_length", "depth", "chain_depth", "topk", "repeats",
        *(["num_batches"] if args.num_batches is not None else []),
    ):
        values = getattr(args, name)
        if any(v < 1 for v in (values if isinstance(values, list) else [values])):
            ap.error(f"--{name.replace('_', '-')} must be positive, got {values}")
    if args.temperature < 0:
        ap.error(f"--temperature must be >= 0, got {args.temperature}")
    args.modes = sorted(set(args.modes), key=MODES.index)  # ar first: the others are compared with it
    return args


def _budget(value: str) -> int | str:
    if value == "auto":
        return value
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"an int >= 0 (0: the roots alone, plain decoding) or 'auto', got {value!r}")
    return int(value)


def main(argv: list[str] | None = None) -> list[dict]:
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    args = parse_args(argv)
    accelerator = Accelerator(cpu=args.device == "cpu")
    # Processes that run prompts apart (data parallel): all of them, or one model's ranks as one under --tp.
    data_parallel = 1 if args.tp else accelerator.num_processes
    if args.device_map and accelerator.num_processes > 1:
        raise SystemExit(
            "--device-map spreads one model over all GPUs; `accelerate launch` runs one process per GPU: use one or "
            "the other"
        )
    device = accelerator.device if accelerator.num_processes > 1 else torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # one device for loading, memory stats and sync
    dtype = DTYPES[args.dtype] or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    set_backends(args)
    torch.manual_seed(args.seed)
    model, tokenizer, model_label = load_target(args, device, dtype)
    prompt_sets = load_prompt_sets(args, model, tokenizer)
    generation = generation_kwargs(args, model, tokenizer)

    launcher = (
        ["torchrun", f"--nproc-per-node={accelerator.num_processes}"] if args.tp
        else ["python"] if accelerator.num_processes == 1
        else ["accelerate", "launch", f"--num_processes={accelerator.num_processes}"]
    )  # fmt: skip
    command = shlex.join([*launcher, "eval/run.py", *(sys.argv[1:] if argv is None else argv)])
    place = hf_bole.placement.placement(model)
    header = {
        "machine": report.machine(),
        "settings": settings(args, model_label, dtype, data_parallel, command),
        "devices": [str(d) for d in place.devices],  # several under --device-map
    }
    header["settings"]["tensor_parallel"] = accelerator.num_processes if args.tp else 1
    # the attention hf_bole's modes run with, "auto" settled as generate settles it (for the report's header)
    header["settings"]["attention"] = hf_bole.config.resolve_attention(
        args.attention or BoleConfig().attention, place.layer_devices[0]
    )
    out = Path(args.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)

    rows = []

    def finish(dataset, prompts, batch_size: int, mode, records: list[dict], error: str | None, reference_only: bool):
        """A mode's row from every process's records, written at once: a run cut short (a time limit) still leaves
        every finished mode's row behind."""
        # which process timed each batch: processes run side by side, so their times do not add up (under --tp
        # every rank ran every batch together: the first one's records)
        gathered = [{**r, "process": 0} for r in records] if args.tp else (
            gather_object([{**r, "process": accelerator.process_index} for r in records])
        )  # fmt: skip
        errors = [e for e in gather_object([error]) if e is not None]  # from every process
        if accelerator.is_main_process and not reference_only:
            row = summarize(dataset, prompts, mode, batch_size, gathered, args, data_parallel)
            row["budget_source"] = budget_source(model, mode, args, batch_size)
            # the most draft nodes a row gets at this batch size (0: every round decodes plainly)
            row["row_nodes"] = budget_for(model, mode, args, batch_size).max_row_nodes if mode.drafts else None
            rows.append({**row, "error": errors[0] if errors else None})
            report.write_jsonl(rows, header, out / "results.partial.jsonl")

    # ar runs whenever another mode needs its greedy outputs: the oracle drafts from them.
    drafting = any(m not in ("ar", "ar-static") for m in args.modes)
    run_modes = ["ar"] * ("ar" not in args.modes and args.drafter == "oracle" and drafting) + args.modes
    warmed: set[tuple[str, int]] = set()  # (mode label, batch size)
    compiled: set[tuple[str, int, bool, str]] = set()  # (verify, rows, compile, attention) through hf_bole.warmup
    for dataset, all_prompts in prompt_sets.items():
        for batch_size in args.batch_sizes:
            prompts = all_prompts[: args.num_batches * batch_size] if args.num_batches else all_prompts
            with accelerator.split_between_processes(list(range(len(prompts)))) as mine:
                mine = list(range(len(prompts))) if args.tp else mine
                batches = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
            reference: list[dict] = []
            modes = [m for name in run_modes for m in make_modes(name, batch_size, args)]
            outcomes: list[tuple[list[dict], str | None]] = []  # --interleave: (records, error) of every mode
            for mode in modes:
                reference_only = is_reference_only(mode, args)
                label = f"{dataset} {mode.label} batch {batch_size}"
                records, error = [], None
                if not reference_only:
                    start = time.perf_counter()
                    _, error = attempt(
                        warm_up, model, tokenizer, prompts, batches, batch_size, mode, args, generation, reference,
                        warmed, compiled, device, label=label,
                    )  # fmt: skip
                    # compiles and captures take most of a short run: a run cut short says where its time went
                    print(f"{label}: warmed up in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
                # Every process times its batches while the others time theirs, not beside another's warm-up
                # (compilation and graph capture load the host that the timed passes also need).
                accelerator.wait_for_everyone()
                if error is None and (reference_only or (args.interleave and mode.name == "ar")):
                    # one untimed pass: the oracle's continuations, and the outputs the other modes are checked against
                    passes, error = attempt(
                        lambda: [run_batch(model, tokenizer, prompts, b, mode, args, generation, []) for b in batches],
                        label=label,
                    )
                    reference = passes
                elif error is None and not args.interleave:
                    records, error = attempt(
                        timed_runs, model, tokenizer, prompts, batches, mode, args, generation, reference, label,
                        accelerator.is_main_process, label=label,
                    )  # fmt: skip
                    if mode.name == "ar":
                        reference = records
                if error is not None:
                    free(model)
                if args.interleave:  # timed below, in turns; the row once they are done
                    outcomes.append((records, error))
                else:
                    finish(dataset, prompts, batch_size, mode, records, error, reference_only)
            if args.interleave:
                accelerator.wait_for_everyone()
                timed = [i for i, m in enumerate(modes) if outcomes[i][1] is None and not is_reference_only(m, args)]
                for i, result in interleaved_runs(
                    model, tokenizer, prompts, batches, [modes[i] for i in timed], args, generation, reference,
                    f"{dataset} batch {batch_size}", accelerator.is_main_process,
                ).items():  # fmt: skip
                    outcomes[timed[i]] = result
                for mode, (records, error) in zip(modes, outcomes):
                    finish(dataset, prompts, batch_size, mode, records, error, is_reference_only(mode, args))
            # hf_bole keeps a tree cache and its graphs per batch size for later calls (at batch 256 on the 9B shape,
            # 16 GiB): none has this one. The drafters stay, compiled.
            drop_verify_graphs(model)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    if accelerator.is_main_process:
        report.add_speedups(rows)
        report.write_jsonl(rows, header, out / "results.jsonl")
        (out / "results.partial.jsonl").unlink(missing_ok=True)
        table = report.markdown(rows, header)
        (out / "results.md").write_text(table)
        report.plots(rows, out, comparisons=any(d.type == "cuda" for d in place.devices))
        print(table)
        print(f"wrote {out / 'results.jsonl'}, {out / 'results.md'} and plots")
    # Processes leave together, their process group torn down: with gloo's threads still running at interpreter
    # exit, a process aborts ("terminate called without an active exception"; 2 of 6 two-process CPU runs).
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return rows


def budget_for(model, mode: Mode, args, batch_size: int) -> BudgetResolver:
    """A drafting mode's budgets at `batch_size` rows, looked up as `generate` looks them up."""
    looked_up = ("budget", "epsilon", "verify", "attention")
    fields = {k: v for k, v in mode.settings().items() if k in looked_up and v is not None}
    config = BoleConfig(**fields, compile=mode.compile, cuda_graphs=args.cuda_graphs)
    return BudgetResolver.for_model(model, config, batch_size)


def budget_source(model, mode: Mode, args, batch_size: int) -> str | None:
    """Where a drafting mode's budget comes from: "fixed N", "table <file> at epsilon e" or "fallback"."""
    return budget_for(model, mode, args, batch_size).source if mode.drafts else None


def is_reference_only(mode, args) -> bool:
    """ar run only for the oracle's continuations (ar not asked for): untimed, no row."""
    return mode.name == "ar" and "ar" not in args.modes


def free(model) -> None:
    """After a mode failed: what it held goes (freed here, not inside the except block, whose traceback still holds
    the tensors)."""
    hf_bole.release(model)
    gc.collect()
    torch.cuda.empty_cache()


def attempt(fn, *args, label: str) -> tuple[list[dict] | None, str | None]:
    """`(fn(*args), None)`, or `([], error)` with the error that goes on the mode's row. Running out of memory is a
    result (tree-serial's per-node states on large trees), not a crash; any other failure of one mode (say, a
    compile that does not support the model) prints its traceback. Either way the other modes still run."""
    try:
        return fn(*args), None
    except torch.OutOfMemoryError as oom:
        print(f"{label}: {str(oom).splitlines()[0]}", file=sys.stderr)
        return [], "out of memory"
    except Exception as failure:
        print(f"{label} failed:", file=sys.stderr)
        traceback.print_exc()
        return [], f"failed: {type(failure).__name__}"


def warm_up(
    model, tokenizer, prompts, batches, batch_size, mode, args, generation, reference, warmed, compiled, device
) -> None:
    """A mode's untimed warm-up over `batches`, once per mode and batch size."""
    if (mode.label, batch_size) in warmed or not batches:
        return
    # Untimed, for every mode of a sweep: first calls pay for kernel compilation, autotuning and allocator
    # growth, and each budget meets tree widths (graphs) of its own; every tree width a later round may reach
    # gets its kernels compiled here too (hf_bole.warmup).
    for n_rows in sorted({len(b) for b in batches} if mode.drafts else ()):
        # up to the widest tree the mode's calls verify: at a large batch a width of 128 would not fit in memory
        widest = 1 + budget_for(model, mode, args, n_rows).max_row_nodes
        key = (mode.verify or "closed_form", n_rows, mode.compile, mode.attention or "auto", widest)
        if key not in compiled:
            hf_bole.warmup(model, n_rows, max_nodes=widest, verify=key[0], compile=mode.compile, attention=key[3])
            compiled.add(key)
    # With CUDA graphs every batch runs once untimed: each tree width it meets is captured then. Compiled (or with
    # compiled drafting, on CUDA), each batch too: a longer prompt grows the MTP drafter's cache, and its compiled
    # round compiles again for the new size (seconds inside a timed pass otherwise, as seen on the CPU).
    cuda = device.type == "cuda" and not args.device_map
    graphed = mode.drafts and args.cuda_graphs and cuda
    drafting_compiled = mode.compile or (mode.drafts and args.compile_drafter and cuda)
    for k, batch in enumerate(batches if graphed or drafting_compiled else batches[:1]):
        run_batch(model, tokenizer, prompts, batch, mode, args, generation, reference[k : k + 1])
    warmed.add((mode.label, batch_size))


def timed_runs(
    model, tokenizer, prompts, batches, mode, args, generation, reference, label: str, show_progress: bool
) -> list[dict]:
    """One mode's records over `batches` (warmed)."""
    from tqdm.auto import tqdm

    bar = tqdm(batches, desc=label, disable=not show_progress)
    return [
        median_run(model, tokenizer, prompts, batch, mode, args, generation, reference[k : k + 1])
        for k, batch in enumerate(bar)
    ]


def set_backends(args) -> None:
    """Every mode runs with the attention backends hf_bole's generate picks (`hf_bole.models.attention_backends`),
    so that `ar` is not slowed by cuDNN's per-shape planning; `--cudnn-sdpa` leaves torch's default."""
    if not args.cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)


def load_target(args, device: torch.device, dtype: torch.dtype):
    """`(model, tokenizer or None, label)`: the checkpoint of --model, or a random model of --shape; with
    --device-map spread over all visible GPUs, each holding an even share of the weights; with --tp sharded over the
    processes."""
    config = shape_config(args.shape) if args.shape else None
    max_memory = None
    if args.device_map:
        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(args.model).get_text_config(decoder=True)
        reserve = int(args.gpu_reserve_gib * 2**30)
        max_memory = spread_max_memory(parameter_bytes(config, dtype), list(range(torch.cuda.device_count())), reserve)
    if args.shape:
        label = f"random {args.shape} shape"
        if args.tp:
            return build_model_tensor_parallel(config, dtype, seed=args.seed), None, label
        if max_memory is not None:
            model = build_model_across(config, dtype, max_memory, seed=args.seed)
        else:
            model = build_model(config, device, dtype, seed=args.seed)
        if args.drafter == "mtp":
            folder = Path(tempfile.mkdtemp(prefix="hf_bole_random_mtp_"))
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            with_random_mtp(model, folder)
        return model, None, label
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model == str(HOUSE_CHECKPOINT) and not HOUSE_CHECKPOINT.is_dir():
        raise SystemExit(
            f"The house model is not at {HOUSE_CHECKPOINT} yet (it is trained by eval/house/ and committed there). "
            f"Pass --model <checkpoint folder or Hub id> or --shape <{'|'.join(SHAPES)}>."
        )
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    placed = dict(device_map={"": device})
    if max_memory is not None:
        placed = dict(device_map="auto", max_memory=max_memory)
    elif args.tp:
        placed = dict(tp_plan="auto")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa", **placed)
    return model.eval(), tokenizer, args.model


def load_prompt_sets(args, model, tokenizer) -> dict[str, list[tuple[Prompt, list[int]]]]:
    """Per dataset, the prompts and their token ids; random ids under a single "random" dataset with --shape."""
    if args.shape:
        vocab = model.get_input_embeddings().weight.shape[0]
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, vocab, (args.num_prompts, args.prompt_length), generator=gen).tolist()
        return {"random": [(Prompt("random", str(i), "", {}, []), row) for i, row in enumerate(ids)]}
    sets = {}
    for dataset in args.datasets:
        prompts = load_prompts(
            dataset, args.num_prompts, data_dir=args.data_dir, tokenizer=tokenizer,
            max_prompt_tokens=args.max_prompt_tokens, shots=args.shots if dataset in FEW_SHOT else None,
        )  # fmt: skip
        if not prompts:
            raise SystemExit(f"eval.data.load_prompts({dataset!r}) returned no prompts")
        pairs = [(p, tokenizer(p.text, add_special_tokens=False).input_ids) for p in prompts]
        if args.sort_by_length:
            pairs.sort(key=lambda pair: len(pair[1]))
        sets[dataset] = pairs
    return sets


def generation_kwargs(args, model, tokenizer) -> dict:
    """What every mode's `generate` call shares: length, sampling, EOS and padding, stated explicitly so that
    the checkpoint's generation config cannot make the modes differ."""
    eos = model.generation_config.eos_token_id
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    kwargs = dict(max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    if args.temperature > 0:
        kwargs.update(do_sample=True, temperature=args.temperature)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    return kwargs


def median_run(model, tokenizer, prompts, batch: list[int], mode: Mode, args, generation: dict, reference: list[dict]):
    """`run_batch` `args.repeats` times; the record of median wall time, with every pass's time in `seconds_all`."""
    return median_record(
        [run_batch(model, tokenizer, prompts, batch, mode, args, generation, reference) for _ in range(args.repeats)]
    )


def median_record(runs: list[dict]) -> dict:
    """The record of median wall time among one batch's passes, with every pass's time in `seconds_all`."""
    runs = sorted(runs, key=lambda r: r["seconds"])
    return {**runs[(len(runs) - 1) // 2], "seconds_all": [r["seconds"] for r in runs]}


def one_pass(model, tokenizer, prompts, batches, mode, args, generation, reference, into: list[list[dict]]) -> None:
    """One timed pass of `mode` over all batches, batch k's record appended to `into[k]`."""
    for k, batch in enumerate(batches):
        into[k].append(run_batch(model, tokenizer, prompts, batch, mode, args, generation, reference[k : k + 1]))


def interleaved_runs(
    model, tokenizer, prompts, batches, modes: list[Mode], args, generation, reference, label: str, show_progress: bool
) -> dict[int, tuple[list[dict], str | None]]:
    """`--interleave`: `{index in modes: (records, error)}` for modes warmed already, their `args.repeats` timed
    passes taken in turns. Turn r runs every mode's pass over all batches, starting with mode r (mod the number of
    modes), so no mode always runs first or right after a given other. A mode that fails leaves the later turns."""
    from tqdm.auto import tqdm

    passes = {i: [[] for _ in batches] for i in range(len(modes))}  # mode -> batch -> records
    errors: dict[int, str] = {}
    bar = tqdm(total=args.repeats * len(modes), desc=f"{label}, passes in turns", disable=not show_progress)
    for turn in range(args.repeats):
        for i in [(turn + j) % len(modes) for j in range(len(modes))]:
            if i in errors:
                continue
            mode = modes[i]
            checked_against = [] if mode.name == "ar" else reference  # ar is the reference, as without turns
            _, error = attempt(
                one_pass, model, tokenizer, prompts, batches, mode, args, generation, checked_against, passes[i],
                label=f"{label} {mode.label}",
            )  # fmt: skip
            if error is not None:
                errors[i] = error
                free(model)
            bar.update()
    bar.close()
    return {i: ([], errors[i]) if i in errors else ([median_record(p) for p in passes[i]], None) for i in passes}


@functools.cache
def _stop_criterion(tokenizer, stops: tuple[str, ...]) -> StopStringCriteria:
    """The criterion of `stops`, built once per process (the cache holds the tokenizer). transformers 5.17's
    StopStringCriteria keys its own cache by the vocabulary in the tokenizer's dict order, which changes from call to
    call (5.24 sorts it): built inside each generate call it scans the vocabulary again every time, as long as a
    whole bole call on the house model. A server builds it once; every mode gets the same criterion, through `stopping_criteria`."""
    return StopStringCriteria(tokenizer, list(stops))


def run_batch(model, tokenizer, prompts, batch: list[int], mode: Mode, args, generation: dict, reference: list[dict]):
    """One timed generate call over `prompts[batch]` (left-padded), measured and checked against `reference`
    (the `ar` record of the same batch, when there is one)."""
    pad = generation["pad_token_id"]
    rows = [prompts[i][1] for i in batch]
    P = max(len(r) for r in rows)
    place = hf_bole.placement.placement(model)
    device = place.input_device
    gpus = [d for d in place.devices if d.type == "cuda"]  # one, or all of them under --device-map
    input_ids = torch.tensor([[pad] * (P - len(r)) + r for r in rows], device=device)  # [B, P]
    attention_mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows], device=device)  # [B, P]
    stops = tuple(dict.fromkeys(s for i in batch for s in prompts[i][0].stop)) if tokenizer is not None else ()
    extra = dict(stopping_criteria=StoppingCriteriaList([_stop_criterion(tokenizer, stops)])) if stops else {}

    drafter = args.drafter
    if mode.drafts and args.drafter == "oracle":
        drafter = OracleDrafter(
            [len(r) for r in rows], reference[0]["tokens"], depth=mode.depth, topk=mode.topk,
            accept=args.oracle_accept, vocab_size=model.get_output_embeddings().weight.shape[0], seed=args.seed,
        )  # fmt: skip

    profiled = mode.drafts and args.profile
    graphs = {"bole_cuda_graphs": args.cuda_graphs, "bole_compile_drafter": args.compile_drafter} if mode.drafts else {}
    if generation["do_sample"]:
        torch.manual_seed(args.seed + batch[0])  # each batch samples the same way in every mode and run
    timer = metrics.FirstTokenTimer()
    for gpu in gpus:
        torch.cuda.reset_peak_memory_stats(gpu)
        torch.cuda.synchronize(gpu)
    start = time.perf_counter()
    # `generation` comes last: a caller's settings there override the mode's.
    kwargs = {**mode.generate_kwargs(drafter), **graphs, **({"bole_profile": True} if profiled else {}), **generation}
    out = model.generate(
        input_ids, attention_mask=attention_mask, streamer=timer, return_dict_in_generate=True, **extra, **kwargs
    )
    for gpu in gpus:
        torch.cuda.synchronize(gpu)
    seconds = time.perf_counter() - start

    eos = generation["eos_token_id"]
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    generated = out.sequences[:, P:].tolist()
    counts = [metrics.count_generated(g, eos, pad, stops, tokenizer) for g in generated]
    tokens = [g[:n] for g, n in zip(generated, counts)]
    timing = metrics.Timing(seconds, timer.first_token_at - start if timer.first_token_at else None)
    completions = None
    if tokenizer is not None:
        # Scoring cuts each completion at its stop strings (eval.quality).
        completions = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    divergences = None
    if reference and args.temperature == 0:
        divergences = [
            metrics.divergence(model, r, ref, t, tokenizer) for r, ref, t in zip(rows, reference[0]["tokens"], tokens)
        ]
    accept = getattr(out, "accept_lengths", None)
    return {
        "prompts": batch,
        "tokens": tokens,
        "completions": completions,
        "seconds": seconds,
        "ttft": timing.ttft,
        "tpot": timing.tpot(max(counts)),
        "accept_lengths": accept.flatten().tolist() if accept is not None else [],
        "transient_bytes": out.peak_transient_bytes if mode.drafts else None,
        "round_time_ms": out.round_time_ms if profiled else None,
        "round_host_ms": out.round_host_ms if profiled else None,
        # summed over the model's GPUs (one, or all under --device-map or --tp)
        "peak_memory_bytes": _peak_memory(gpus, args.tp),
        "divergences": divergences,
    }


def _peak_memory(gpus: list[torch.device], tp: bool) -> int | None:
    """Peak bytes allocated on `gpus` since their last reset, summed; under `tp` over every rank's GPU."""
    if not gpus:
        return None
    peak = sum(torch.cuda.max_memory_allocated(gpu) for gpu in gpus)
    if tp:
        total = torch.tensor([peak], device=gpus[0])
        torch.distributed.all_reduce(total)
        peak = int(total)
    return peak


def summarize(
    dataset: str, prompts, mode: Mode, batch_size: int, records: list[dict], args, num_processes: int
) -> dict:
    """One row: every batch of (dataset, mode, batch size), from all processes."""
    order = sorted((i, k, r) for r in records for k, i in enumerate(r["prompts"]))  # by prompt index
    n_tokens = sum(len(t) for r in records for t in r["tokens"])
    seconds = sum(r["seconds"] for r in records)
    busiest = {}  # process -> its generate seconds: the processes run at once, the busiest one sets the pace
    for r in records:
        busiest[r["process"]] = busiest.get(r["process"], 0.0) + r["seconds"]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    ttfts = [r["ttft"] for r in records if r["ttft"] is not None]
    tpots = [r["tpot"] for r in records if r["tpot"] is not None]
    checked = [(i, r["divergences"][k]) for i, k, r in order if r["divergences"] is not None]
    peaks = [r["peak_memory_bytes"] for r in records if r["peak_memory_bytes"] is not None]
    transient = [r["transient_bytes"] for r in records if r["transient_bytes"]]
    phases = [r["round_time_ms"] for r in records if r["round_time_ms"]]
    host_phases = [r["round_host_ms"] for r in records if r["round_host_ms"]]
    rounds = sum(p["rounds"] for p in phases)
    per_round = lambda totals: (  # noqa: E731
        {k: sum(p[k] for p in totals) / rounds for k in totals[0] if k != "rounds"} if rounds else None
    )
    quality = None
    if dataset != "random" and records and records[0]["completions"] is not None:
        try:
            from eval.quality import score
        except ImportError as e:  # the eval extra is missing (a bare GPU image): speed and exactness still count
            print(f"task quality not scored: {e} (pip install -e '.[eval]')", file=sys.stderr)
        else:
            quality = score(dataset, [prompts[i][0] for i, _, _ in order], [r["completions"][k] for _, k, r in order])
    return {
        "dataset": dataset,
        "mode": mode.label,
        "batch_size": batch_size,
        "drafter": args.drafter if mode.drafts else None,
        **{f"tree_{k}": v for k, v in mode.settings().items()},
        "compiled": mode.compile if mode.drafts else None,
        "num_prompts": len(order),
        "num_processes": num_processes,
        "output_tokens": n_tokens,
        # the generated tokens of every prompt in prompt order: equal digests are equal outputs (across runs, or one
        # process against several)
        "outputs_sha256": hashlib.sha256(json.dumps([r["tokens"][k] for _, k, r in order]).encode()).hexdigest(),
        "seconds": seconds,
        "output_tokens_per_s": n_tokens / seconds if seconds > 0 else None,
        # all processes together (data-parallel throughput): prompts over the busiest process's generate time
        "prompts_per_s": len(order) / max(busiest.values()) if busiest and max(busiest.values()) > 0 else None,
        # how far apart the timed passes of one batch were, at the worst batch: max / min - 1
        "pass_spread": max((max(r["seconds_all"]) / min(r["seconds_all"]) - 1 for r in records), default=None),
        "ttft_ms": 1e3 * mean(ttfts) if ttfts else None,
        "tpot_ms": 1e3 * mean(tpots) if tpots else None,
        **metrics.acceptance([n for r in records for n in r["accept_lengths"]], mode.depth or 0),
        "peak_memory_bytes": max(peaks) if peaks else None,
        "transient_bytes": max(transient, key=lambda t: sum(t.values())) if transient else None,
        # ms per round in each phase, over all batches (--profile): on the device timeline, and in the phase's code
        # on the host clock
        "round_phase_ms": per_round(phases),
        "round_host_phase_ms": per_round(host_phases),
        "exact_share": sum(d is None for _, d in checked) / len(checked) if checked and mode.name != "ar" else None,
        "divergences": [{"prompt_id": prompts[i][0].id, **d} for i, d in checked if d is not None],
        "quality": quality,
    }


def settings(args, model_label: str, dtype: torch.dtype, num_processes: int, command: str) -> dict:
    return {
        **vars(args),
        "model": model_label,
        "dtype": str(dtype).removeprefix("torch."),
        "num_processes": num_processes,
        "command": command,
    }


if __name__ == "__main__":
    # A mode that failed fails the run, once every table is written (running out of memory is a result, not a failure).
    sys.exit(int(any(r["error"] not in (None, "out of memory") for r in main())))
