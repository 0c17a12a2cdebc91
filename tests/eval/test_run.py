"""The evaluation harness end to end on a tiny random Qwen3.5 checkpoint (MTP head and tokenizer included), token
counting, and the oracle drafter."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from eval import metrics, run
from eval.data import DEFAULT_DATASETS, load_prompts
from eval.oracle import OracleDrafter
from hf_bole.models.mtp import Qwen3_5MTP, save_pretrained_with_mtp
from tests.models import tiny

PAD, EOS = 0, 1
CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
VOCAB = 2 + len(CHARS)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (unknown characters become a space), ids 0/1 pad/EOS."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {"<pad>": PAD, "<eos>": EOS, **{c: 2 + i for i, c in enumerate(CHARS)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=" "))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )


def bpe_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on the bundled prompts: prompts a few times shorter than one token per character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [p.text for d in DEFAULT_DATASETS for p in load_prompts(d, 2)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny dense Qwen3.5 with a random MTP head and a BPE tokenizer, saved as a checkpoint folder."""
    tokenizer = bpe_tokenizer()
    model = tiny.build_model("dense", vocab_size=len(tokenizer), eos_token_id=EOS)
    folder = tmp_path_factory.mktemp("tiny_checkpoint")
    save_pretrained_with_mtp(model, Qwen3_5MTP.for_model(model), folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_run_end_to_end(checkpoint, tmp_path):
    out = tmp_path / "out"
    rows = run.main([
        "--model", str(checkpoint), "--num-prompts", "2", "--max-new-tokens", "12", "--max-prompt-tokens", "160", "--shots", "1",
        "--modes", "ar", "chain", "tree-serial", "bole", "--batch-sizes", "1", "2", "--depth", "3", "--topk", "2",
        "--output-dir", str(out), "--device", "cpu",
    ])  # fmt: skip
    assert {(r["dataset"], r["mode"], r["batch_size"]) for r in rows} == {
        (d, m, b) for d in DEFAULT_DATASETS for m in ("ar", "chain", "tree-serial", "bole") for b in (1, 2)
    }
    for r in rows:
        assert r["num_prompts"] == 2 and r["output_tokens"] > 0 and r["output_tokens_per_s"] > 0
        assert r["ttft_ms"] > 0 and r["quality"] is not None
        # where each mode's budget came from: chain verifies every row's chain, the tree modes' "auto" falls back
        assert r["budget_source"] == {"ar": None, "chain": f"fixed {3 * r['batch_size']}"}.get(r["mode"], "fallback")
        if r["mode"] == "ar":
            assert r["exact_share"] is None and r["mean_accepted_tokens"] is None
        else:
            assert r["exact_share"] == 1.0 and r["divergences"] == []  # fp32 greedy: token for token
            assert r["mean_accepted_tokens"] >= 1 and r["speedup_over_ar"] > 0
            assert sum(r["accept_histogram"].values()) == r["rounds"]
            assert r["transient_bytes"]["snapshots" if r["mode"] == "tree-serial" else "factors"] > 0
    # Every mode counts the same tokens: greedy outputs are identical.
    per_run = {}
    for r in rows:
        per_run.setdefault((r["dataset"], r["batch_size"]), set()).add(r["output_tokens"])
    assert all(len(v) == 1 for v in per_run.values())

    assert not (out / "results.partial.jsonl").exists()  # kept only while a run is under way or was cut short
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(lines) == len(rows)
    assert lines[0]["machine"]["torch"] == torch.__version__ and lines[0]["settings"]["max_new_tokens"] == 12
    table = (out / "results.md").read_text()
    assert "| mbpp | bole | 2 |" in table
    # on a CPU the timings are given, no speed-up: tokens per round and exactness are what a CPU run shows
    assert "On a CPU the timings are no result" in table and "| speedup |" not in table
    assert "a greedy mode whose outputs all equal ar's (`exact` 100%) scores what ar scores" in table
    for png in ("throughput_vs_batch.png", "accept_histogram.png"):
        assert (out / png).stat().st_size > 0
    assert not (out / "speedup.png").exists()
    assert not (out / "budget_sweep.png").exists()  # no fixed budgets swept


def test_run_ar_static(checkpoint, tmp_path):
    """The static-cache form of the baseline decodes exactly what `ar` decodes."""
    rows = run.main([
        "--model", str(checkpoint), "--datasets", "gsm8k", "--num-prompts", "2", "--max-new-tokens", "8",
        "--max-prompt-tokens", "160", "--shots", "1", "--modes", "ar", "ar-static", "--output-dir", str(tmp_path),
        "--device", "cpu",
    ])  # fmt: skip
    ar, static = rows
    assert static["exact_share"] == 1.0 and static["mean_accepted_tokens"] is None
    assert static["speedup_over_ar"] > 0 and static["speedup_over_ar_static"] == 1.0
    assert ar["speedup_over_ar_static"] == pytest.approx(1 / static["speedup_over_ar"])
    from eval import report

    line = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[0])
    header = {"machine": line["machine"], "settings": line["settings"]}
    assert "| speedup | ÷ ar-static |" in report.markdown(rows, {**header, "devices": ["cuda:0"]})  # columns on a GPU
    assert "| speedup |" not in (tmp_path / "results.md").read_text()  # not on a CPU


def _fail_mode(monkeypatch, name: str, error: BaseException) -> None:
    """Every `generate` call of mode `name` raises `error`; the other modes run as usual."""
    run_batch = run.run_batch

    def failing(model, tokenizer, prompts, batch, mode, *args):
        if mode.name == name:
            raise error
        return run_batch(model, tokenizer, prompts, batch, mode, *args)

    monkeypatch.setattr(run, "run_batch", failing)


def test_mode_out_of_memory_is_a_row(checkpoint, tmp_path, monkeypatch):
    """A mode that runs out of memory (tree-serial's per-node states on large trees) gets a row that says so; the
    modes after it still run and are still checked against `ar`."""
    _fail_mode(monkeypatch, "tree-serial", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 800.00 MiB."))
    rows = run.main([
        "--model", str(checkpoint), "--datasets", "gsm8k", "--num-prompts", "2", "--max-new-tokens", "8",
        "--max-prompt-tokens", "160", "--shots", "1", "--modes", "ar", "tree-serial", "bole", "--depth", "3",
        "--topk", "2", "--output-dir", str(tmp_path), "--device", "cpu",
    ])  # fmt: skip
    ar, serial, bole = rows
    assert serial["error"] == "out of memory" and serial["output_tokens_per_s"] is None
    assert serial["speedup_over_ar"] is None and serial["num_prompts"] == 0
    assert ar["error"] is None and bole["error"] is None
    assert bole["exact_share"] == 1.0 and bole["speedup_over_ar"] > 0
    assert "| gsm8k | tree-serial | 1 | 0 | out of memory | – |" in (tmp_path / "results.md").read_text()


def test_failed_mode_is_a_row(checkpoint, tmp_path, monkeypatch, capsys):
    """A mode that fails otherwise (an error inside generate) gets a row naming the error, its traceback goes to
    stderr, and the modes after it still run."""
    _fail_mode(monkeypatch, "chain", RuntimeError("no kernel for this model"))
    rows = run.main([
        "--model", str(checkpoint), "--datasets", "gsm8k", "--num-prompts", "2", "--max-new-tokens", "4",
        "--max-prompt-tokens", "160", "--shots", "1", "--modes", "ar", "chain", "bole", "--depth", "2",
        "--topk", "2", "--output-dir", str(tmp_path), "--device", "cpu",
    ])  # fmt: skip
    ar, chain, bole = rows
    assert chain["error"] == "failed: RuntimeError" and chain["output_tokens_per_s"] is None
    assert ar["error"] is None and bole["error"] is None and bole["exact_share"] == 1.0
    assert "RuntimeError: no kernel for this model" in capsys.readouterr().err
    assert "| gsm8k | chain | 1 | 0 | failed: RuntimeError | – |" in (tmp_path / "results.md").read_text()


def test_run_cut_short_keeps_finished_modes(checkpoint, tmp_path, monkeypatch):
    """A run stopped inside a mode (a device time limit) leaves the rows of every mode that finished before it."""
    _fail_mode(monkeypatch, "bole", KeyboardInterrupt())  # what a time limit's signal ends a run with
    with pytest.raises(KeyboardInterrupt):
        run.main([
            "--model", str(checkpoint), "--datasets", "gsm8k", "--num-prompts", "2", "--max-new-tokens", "4",
            "--max-prompt-tokens", "160", "--shots", "1", "--modes", "ar", "chain", "bole", "--depth", "2",
            "--topk", "2", "--output-dir", str(tmp_path), "--device", "cpu",
        ])  # fmt: skip
    partial = [json.loads(line) for line in (tmp_path / "results.partial.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in partial if "mode" in r] == ["ar", "chain"]


def test_run_shape_oracle(checkpoint, tmp_path):
    """A random model of a checkpoint's shape, random prompts, the oracle drafter: high acceptance, exact."""
    rows = run.main([
        "--shape", str(checkpoint), "--num-prompts", "3", "--prompt-length", "9", "--max-new-tokens", "24",
        "--modes", "bole", "--batch-sizes", "3", "--depth", "6", "--topk", "2", "--oracle-accept", "1.0",
        "--budget", "64", "--output-dir", str(tmp_path), "--device", "cpu", "--profile", "--repeats", "2",
    ])  # fmt: skip
    (row,) = rows
    assert "timed 2× after an untimed warm-up, the median pass kept" in (tmp_path / "results.md").read_text()
    assert row["pass_spread"] >= 0
    assert "CUDA graphs off (a CPU has none)" in (tmp_path / "results.md").read_text()  # asked for by default
    assert set(row["round_phase_ms"]) == {"draft", "select", "verify", "accept", "commit", "host"}
    assert set(row["round_host_phase_ms"]) == set(row["round_phase_ms"])
    assert "Where a round's time goes" in (tmp_path / "results.md").read_text()
    assert "The same phases on the host clock" in (tmp_path / "results.md").read_text()
    assert row["dataset"] == "random" and row["drafter"] == "oracle" and row["quality"] is None
    assert row["exact_share"] == 1.0
    assert row["mean_accepted_tokens"] > 5  # 6 drafted + 1 bonus per round, but the last round is cut short
    assert "drafter `oracle`" in (tmp_path / "results.md").read_text()


def test_batch_sweep_on_a_random_shape(checkpoint, tmp_path):
    """`eval/gpu.sh batch-sweep-mtp` on a tiny shape: one batch per batch size (its first prompts), a random MTP head
    drafting (a random-weight shape has none of its own), bole by its budget and at budget 0, which decodes plainly;
    BENCHMARKS.md's table renders the rows."""
    from eval import render_benchmarks

    argv = [
        "--shape", str(checkpoint), "--drafter", "mtp", "--modes", "chain", "bole", "--budget", "auto", "0",
        "--batch-sizes", "1", "3", "--num-batches", "1", "--max-new-tokens", "5", "--prompt-length", "6", "--depth",
        "2", "--topk", "2", "--chain-depth", "2", "--output-dir", str(tmp_path), "--device", "cpu",
    ]  # fmt: skip
    rows = run.main(argv)
    assert [(r["mode"], r["batch_size"], r["num_prompts"]) for r in rows] == [
        (mode, b, b) for b in (1, 3) for mode in ("chain", "bole bauto", "bole b0")
    ]
    assert all(r["error"] is None and r["drafter"] == "mtp" for r in rows)
    plain = [r for r in rows if r["mode"] == "bole b0"]
    assert all(r["row_nodes"] == 0 and r["mean_accepted_tokens"] == 1.0 for r in plain)
    assert all(r["row_nodes"] > 0 for r in rows if r["mode"] != "bole b0")  # on a CPU: the fallback
    written = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    lines = render_benchmarks.batch_sweep([], written)
    assert any(line.startswith("| 3 | ") for line in lines) and "bole at budget 0" in "\n".join(lines)


def test_interleaved_passes_take_turns(checkpoint, tmp_path, monkeypatch):
    """--interleave: ar's outputs from an untimed pass, the warm-ups, then the modes' timed passes in turns, each turn
    starting one mode later; the rows are those of the same run without turns (outputs, exactness, the median)."""
    calls = []
    run_batch = run.run_batch

    def recording(model, tokenizer, prompts, batch, mode, args, generation, reference):
        calls.append((mode.label, tuple(batch), bool(reference)))
        return run_batch(model, tokenizer, prompts, batch, mode, args, generation, reference)

    monkeypatch.setattr(run, "run_batch", recording)
    argv = [
        "--model", str(checkpoint), "--datasets", "gsm8k", "--num-prompts", "2", "--max-new-tokens", "6",
        "--max-prompt-tokens", "160", "--shots", "1", "--modes", "ar", "chain", "bole", "--depth", "2", "--topk", "2",
        "--repeats", "2", "--device", "cpu",
    ]  # fmt: skip
    rows = run.main([*argv, "--interleave", "--output-dir", str(tmp_path / "turns")])
    timed = calls[-12:]  # 2 turns x 3 modes x 2 batches
    assert [label for label, _, _ in timed[::2]] == ["ar", "chain", "bole", "chain", "bole", "ar"]
    assert [batch for _, batch, _ in timed[:2]] == [(0,), (1,)]
    assert all(checked == (label != "ar") for label, _, checked in timed)  # ar is the reference, as without turns
    assert calls[0] == ("ar", (0,), False) and calls[1:3] == [("ar", (0,), False), ("ar", (1,), False)]  # warm, ref.
    plain = run.main([*argv, "--output-dir", str(tmp_path / "plain")])
    for turns, back_to_back in zip(rows, plain):
        assert turns["mode"] == back_to_back["mode"] and turns["outputs_sha256"] == back_to_back["outputs_sha256"]
        assert turns["exact_share"] == back_to_back["exact_share"] and turns["error"] is None
        assert turns["pass_spread"] >= 0  # two timed passes per batch
    assert all(r["exact_share"] == 1.0 for r in rows if r["mode"] != "ar")
    assert "the modes' passes taken in turns" in (tmp_path / "turns" / "results.md").read_text()


def test_mode_failing_in_turns_is_a_row(checkpoint, tmp_path, monkeypatch):
    """A mode that fails in its timed passes under --interleave gets a row naming the error and leaves the later
    turns; the other modes finish theirs."""
    chain_calls = []
    run_batch = run.run_batch

    def failing_after_warm_up(model, tokenizer, prompts, batch, mode, *args):
        if mode.name == "chain":
            chain_calls.append(batch)
            if len(chain_calls) > 1:  # the first call is its warm-up
                raise RuntimeError("out of luck")
        return run_batch(model, tokenizer, prompts, batch, mode, *args)

    monkeypatch.setattr(run, "run_batch", failing_after_warm_up)
    rows = run.main([
        "--model", str(checkpoint), "--datasets", "gsm8k", "--num-prompts", "2", "--max-new-tokens", "4",
        "--max-prompt-tokens", "160", "--shots", "1", "--modes", "ar", "chain", "bole", "--depth", "2", "--topk", "2",
        "--repeats", "2", "--interleave", "--output-dir", str(tmp_path), "--device", "cpu",
    ])  # fmt: skip
    ar, chain, bole = rows
    assert chain["error"] == "failed: RuntimeError" and chain["output_tokens_per_s"] is None
    assert len(chain_calls) == 2  # not tried again in the second turn
    assert ar["error"] is None and bole["error"] is None and bole["exact_share"] == 1.0


def test_warm_up_runs_every_batch_when_compiled_or_graphed(monkeypatch):
    """Off CUDA graphs one batch warms a mode up; a compiled mode meets each batch's sizes first in its warm-up, not
    in a timed pass (the MTP drafter's compiled round compiles again when a longer prompt grows its cache)."""
    from eval.modes import Mode

    warmed_batches = []
    monkeypatch.setattr(run, "run_batch", lambda model, tokenizer, prompts, batch, *a: warmed_batches.append(batch))
    monkeypatch.setattr(run.hf_bole, "warmup", lambda *a, **k: None)
    monkeypatch.setattr(run, "budget_for", lambda *a: argparse.Namespace(max_row_nodes=3))
    args = argparse.Namespace(cuda_graphs=True, compile_drafter=True, device_map=False)
    batches = [[0], [1], [2]]
    for compiled, expected in ((False, [[0]]), (True, batches)):
        warmed_batches.clear()
        run.warm_up(None, None, None, batches, 1, Mode("bole", compile=compiled), args, {}, [None] * 3, set(), set(),
                    torch.device("cpu"))  # fmt: skip
        assert warmed_batches == expected


def test_run_sweeps_tree_settings(checkpoint, tmp_path):
    """Several depths and budgets: one bole row per combination, labelled by what was swept."""
    rows = run.main([
        "--shape", str(checkpoint), "--num-prompts", "2", "--prompt-length", "9", "--max-new-tokens", "16",
        "--modes", "bole", "--batch-sizes", "2", "--depth", "1", "6", "--topk", "2", "--budget", "2", "64",
        "--oracle-accept", "1.0", "--output-dir", str(tmp_path), "--device", "cpu", "--no-cuda-graphs",
        "--no-compile-drafter",
    ])  # fmt: skip
    by_label = {r["mode"]: r for r in rows}
    assert "CUDA graphs off" in (tmp_path / "results.md").read_text()
    assert "the MTP drafter eager (--no-compile-drafter)" in (tmp_path / "results.md").read_text()
    assert set(by_label) == {"bole d1 b2", "bole d1 b64", "bole d6 b2", "bole d6 b64"}
    assert all(r["exact_share"] == 1.0 for r in rows)
    assert by_label["bole d6 b64"]["tree_depth"] == 6 and by_label["bole d6 b64"]["tree_budget"] == 64
    # a deeper tree and a budget that covers it accept more per round
    assert by_label["bole d6 b64"]["mean_accepted_tokens"] > by_label["bole d1 b2"]["mean_accepted_tokens"] + 2
    assert "swept over 1/6" in (tmp_path / "results.md").read_text()


def test_oracle_drafter_acceptance():
    """At accept p the oracle's rounds emit 1 + p + ... + p^depth tokens on average."""
    model = tiny.build_model("dense", vocab_size=VOCAB)
    ids = torch.tensor([[5, 9, 14, 3], [7, 7, 20, 11]])
    new = 40
    ref = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=PAD)
    drafter = OracleDrafter([4, 4], ref[:, 4:].tolist(), depth=6, topk=3, accept=0.8, vocab_size=VOCAB, seed=0)
    out = model.generate(
        ids, max_new_tokens=new, do_sample=False, pad_token_id=PAD, custom_generate="hf_bole",
        bole_drafter=drafter, bole_depth=6, bole_topk=3, bole_budget=64, return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    expected = sum(0.8**d for d in range(7))  # 3.95
    assert expected - 1.0 < out.mean_accepted_tokens < expected + 1.0


def test_oracle_tree_levels():
    """Each level: topk distinct tokens, the truth first while every level above held it, never a decoy equal to the
    truth; nothing true past the end of a continuation."""
    from hf_bole import DraftContext

    cont = [[3, 4, 5, 6, 7, 8, 9, 10], [11, 12]]
    prompts = [2, 3]
    sequences = [torch.zeros(2 + 3), torch.zeros(3 + 1)]  # row 0: 3 generated, row 1: 1 generated
    ctx = DraftContext(sequences=sequences, max_nodes=64)
    for accept in (1.0, 0.0, 0.5):
        oracle = OracleDrafter(prompts, cont, depth=4, topk=3, accept=accept, vocab_size=13, seed=1)
        for _ in range(20):
            tree = oracle.propose(ctx)
            levels = tree.tokens.view(2, 4, 3)  # [B, D, K]
            assert all(len(set(level.tolist())) == 3 for level in levels.flatten(0, 1))
            for b, done in enumerate((3, 1)):
                truth = cont[b][done : done + 4]
                alive = True
                for d, level in enumerate(levels[b].tolist()):
                    true = truth[d] if d < len(truth) else None
                    alive = alive and level[0] == true
                    assert level[1:].count(true) == 0 if alive else true not in level
                    if accept == 1.0:
                        assert alive == (true is not None)
                    if accept == 0.0:
                        assert not alive
    assert tree.parents[0].tolist() == [-1, -1, -1, 0, 0, 0, 3, 3, 3, 6, 6, 6]


def test_count_generated():
    """The one token count every mode's throughput uses: up to and including EOS, never padding."""
    eos, pad = {EOS}, PAD
    assert metrics.count_generated([5, 6, 7], eos, pad) == 3  # ran to max_new_tokens
    assert metrics.count_generated([5, EOS, PAD, PAD], eos, pad) == 2  # EOS counts, padding after it does not
    assert metrics.count_generated([5, EOS, 9, 9], eos, pad) == 2  # a row that kept going after EOS (no padding)
    assert metrics.count_generated([EOS, PAD], eos, pad) == 1
    assert metrics.count_generated([5, 6, PAD, PAD], eos, pad) == 2  # stopped by a criterion, then padded
    assert metrics.count_generated([5, 6, PAD], set(), pad) == 3  # without EOS nothing is padding
    assert metrics.count_generated([9, 9], {9}, 9) == 1  # pad == EOS
    tok = char_tokenizer()
    ids = tok("ab\n\nQ: x", add_special_tokens=False).input_ids
    assert metrics.count_generated(ids, eos, pad, ("\n\n",), tok) == 4  # through the stop string's last token
    assert metrics.count_generated(ids + [EOS], eos, pad, ("zz",), tok) == len(ids) + 1


def test_first_token_timer_and_acceptance():
    timer = metrics.FirstTokenTimer()
    timer.put(torch.tensor([[1, 2, 3]]))  # the prompt
    assert timer.first_token_at is None
    timer.put(torch.tensor([4]))
    first = timer.first_token_at
    timer.put(torch.tensor([5]))
    assert first is not None and timer.first_token_at == first
    assert metrics.Timing(seconds=1.0, ttft=0.1).tpot(10) == pytest.approx(0.1)

    stats = metrics.acceptance([1, 3, 4, 0, 4], depth=3)  # the 0 is a finished row that skipped a round
    assert stats["mean_accepted_tokens"] == 3.0 and stats["accept_histogram"] == {1: 1, 3: 1, 4: 2}
    assert stats["accepted_at_depth"] == [0.75, 0.75, 0.5]


def test_bad_arguments():
    with pytest.raises(SystemExit):
        run.parse_args(["--num-batches", "0"])
    with pytest.raises(SystemExit):
        run.parse_args(["--batch-sizes", "0"])
    with pytest.raises(SystemExit):
        run.parse_args(["--drafter", "oracle", "--temperature", "0.7"])
    with pytest.raises(SystemExit):
        run.parse_args(["--device-map", "auto", "--device", "cpu"])  # spreads over GPUs
    with pytest.raises(SystemExit):
        run.parse_args(["--tp"])  # shards over torchrun's processes: not launched by torchrun


@pytest.mark.parametrize("source", ["--shape", "--model"])
def test_device_map_loads_spread_models(checkpoint, source, monkeypatch):
    """--device-map auto: a --shape built across the devices of an even per-GPU budget, a --model loaded by
    from_pretrained(device_map="auto") under the same budget; both leave accelerate's map on the model. (On CPU
    the budget names the CPU only: the split over GPUs needs GPUs.)"""
    budgets = []

    def spread(weight_bytes, gpus, reserve):
        budgets.append((weight_bytes, reserve))
        return {"cpu": 2**31}

    loads = []
    from_pretrained = AutoModelForCausalLM.from_pretrained.__func__

    def recorded(cls, *args, **kwargs):
        loads.append(kwargs)
        return from_pretrained(cls, *args, **kwargs)

    monkeypatch.setattr(run, "spread_max_memory", spread)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recorded))
    args = run.parse_args([source, str(checkpoint), "--device-map", "auto", "--device", "cuda", "--gpu-reserve-gib", "2"])
    model, tokenizer, _ = run.load_target(args, torch.device("cpu"), torch.float32)
    assert budgets[0][0] == sum(p.numel() * 4 for p in model.parameters()) and budgets[0][1] == 2 * 2**30
    if source == "--shape":
        assert set(model.hf_device_map.values()) == {"cpu"} and tokenizer is None
    else:
        assert loads[0]["device_map"] == "auto" and loads[0]["max_memory"] == {"cpu": 2**31}


def test_missing_house_model(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "HOUSE_CHECKPOINT", tmp_path / "no_checkpoint")
    with pytest.raises(SystemExit, match="house model is not at"):
        run.main(["--device", "cpu", "--output-dir", str(tmp_path)])


@pytest.mark.skipif(not run.HOUSE_CHECKPOINT.is_dir(), reason="the house checkpoint is committed with the repository")
def test_run_house_model(tmp_path):
    """The README's main job, shortened: the committed house model, 2 bundled prompts per dataset, its MTP drafter."""
    rows = run.main([
        "--num-prompts", "2", "--max-new-tokens", "8", "--max-prompt-tokens", "256", "--shots", "1",
        "--output-dir", str(tmp_path), "--device", "cpu",
    ])  # fmt: skip
    assert {(r["dataset"], r["mode"]) for r in rows} == {(d, m) for d in DEFAULT_DATASETS for m in ("ar", "bole")}
    for r in rows:
        assert r["num_prompts"] == 2 and r["output_tokens"] > 0
        if r["mode"] == "bole":
            assert r["exact_share"] == 1.0 and r["mean_accepted_tokens"] >= 1
    assert "it solves no MBPP or GSM8K task" in (tmp_path / "results.md").read_text()


def test_divergence():
    """Where a greedy output leaves the reference, with the plain forward's logits there."""
    model = tiny.build_model("dense", vocab_size=VOCAB)
    prompt = [5, 9, 14, 3]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=PAD)[0, 4:].tolist()
    assert metrics.divergence(model, prompt, ref, ref) is None
    logits = model(torch.tensor([prompt + ref[:2]])).logits[0, -1]
    worst = int(logits.argmin())  # far below the argmax: no rounding explains it
    d = metrics.divergence(model, prompt, ref, ref[:2] + [worst, 7])
    assert (d["position"], d["reference_token"], d["output_token"]) == (2, ref[2], worst)
    assert d["top2_margin"] >= 0 and d["reference_logit"] > d["output_logit"]
    assert d["explanation"].startswith("NOT a tie")
    assert metrics.divergence(model, prompt, ref, ref[:3])["output_token"] is None  # stopped early


def test_budget_sweep_table():
    """The budget comparison of a sweep: the best fixed budget per batch size against auto, and each fixed
    budget's worst shortfall."""
    from eval import report

    def row(batch, budget, tps, mode="bole", epsilon=0.1, compiled=False):
        return {"dataset": "mbpp", "mode": mode, "batch_size": batch, "tree_depth": 5, "tree_budget": budget,
                "tree_epsilon": epsilon, "output_tokens_per_s": tps, "compiled": compiled}  # fmt: skip

    rows = [
        row(1, 16, 100.0), row(1, 64, 120.0), row(1, "auto", 118.0),
        row(8, 16, 400.0), row(8, 64, 300.0), row(8, "auto", 390.0),
        row(1, 3, 90.0, mode="chain"), row(8, 24, 200.0, mode="chain"),  # chain: one budget per batch, not a sweep
    ]  # fmt: skip
    lines = report.budget_sweep(rows)
    assert "| mbpp | bole | 5 | 1 | 64 | 120.0 | auto ε=0.1 | 118.0 | 0.98 |" in lines
    assert "| mbpp | bole | 5 | 8 | 16 | 400.0 | auto ε=0.1 | 390.0 | 0.97 |" in lines
    assert "- mbpp / bole / depth 5: 16: 17% at batch 1, 64: 25% at batch 8" in lines
    assert not any("chain" in line for line in lines)
    assert report.budget_sweep([row(1, 16, 100.0), row(1, "auto", 90.0)]) == []  # one fixed budget: no sweep
    # a sweep run eager and compiled compares the budgets of each form on its own
    compiled = [row(1, 16, 200.0, compiled=True), row(1, 64, 150.0, compiled=True), row(1, "auto", 190.0, compiled=True)]
    lines = report.budget_sweep(rows + compiled)
    assert "| mbpp | bole compiled | 5 | 1 | 16 | 200.0 | auto ε=0.1 | 190.0 | 0.95 |" in lines
    assert "| mbpp | bole | 5 | 1 | 64 | 120.0 | auto ε=0.1 | 118.0 | 0.98 |" in lines


def test_budget_sweep_plot(tmp_path):
    """A sweep of fixed budgets adds `budget_sweep.png`: one panel per (dataset, mode, depth), a line per batch size
    over the fixed budgets, auto dashed at its share of the best."""
    from eval import report

    def row(batch, budget, tps, mode="bole"):
        return {"dataset": "mbpp", "mode": f"{mode} b{budget}", "batch_size": batch, "tree_depth": 5,
                "tree_budget": budget, "tree_epsilon": 0.3, "output_tokens_per_s": tps, "compiled": False,
                "accept_histogram": {"3": 2}, "speedup_over_ar": None}  # fmt: skip

    rows = [row(1, 16, 100.0), row(1, 64, 120.0), row(1, "auto", 118.0), row(8, 16, 400.0), row(8, 64, 300.0),
            row(8, 16, 200.0, mode="tree-serial"), row(8, 64, 250.0, mode="tree-serial")]  # fmt: skip
    written = report.plots(rows, tmp_path)
    assert tmp_path / "budget_sweep.png" in written and (tmp_path / "budget_sweep.png").stat().st_size > 0
    assert report.budget_cells(rows).keys() == {("mbpp", "bole", 5, 1), ("mbpp", "bole", 5, 8),
                                                 ("mbpp", "tree-serial", 5, 8)}  # fmt: skip


def test_header_says_graphs_are_off_for_a_spread_model():
    """generate runs a model spread over devices without CUDA graphs (and warns), and a CPU has none: the table's
    header says so, with the devices, instead of the flag's "on"."""
    from eval import report

    machine = {"gpu": "NVIDIA H200", "cpu_threads": 16, "torch": "2", "transformers": "5", "triton": "3",
               "commit": "abc", "dirty": False}  # fmt: skip
    settings = {"model": "m", "dtype": "bfloat16", "temperature": 0.0, "max_new_tokens": 8, "drafter": "oracle",
                "depth": [6], "topk": 4, "budget": ["auto"], "epsilon": [0.25], "cuda_graphs": True, "command": "c"}  # fmt: skip
    one = report.markdown([], {"machine": machine, "settings": settings, "devices": ["cuda:0"]})
    two = report.markdown([], {"machine": machine, "settings": settings, "devices": ["cuda:0", "cuda:1"]})
    assert "hf_bole's CUDA graphs on" in one and "tree attention" not in one
    assert "hf_bole's CUDA graphs off (the model spans cuda:0, cuda:1)" in two
    cpu = report.markdown([], {"machine": {**machine, "gpu": None}, "settings": settings, "devices": ["cpu"]})
    assert "CPU (16 threads)" in cpu and "hf_bole's CUDA graphs off (a CPU has none)" in cpu
    tp = report.markdown([], {"machine": machine, "settings": {**settings, "tensor_parallel": 2}, "devices": ["cuda:0"]})
    assert "NVIDIA H200 ×2, the model sharded over 2 processes" in tp and "CUDA graphs off (tensor parallelism)" in tp
    for attention, said in (("triton", "hf_bole's kernel"), ("model", "the model's own attention")):
        header = {"machine": machine, "settings": {**settings, "attention": attention}, "devices": []}
        text = report.markdown([], header)
        assert f"tree attention by {said}" in text and f'(bole_attention="{attention}")' in text


def test_epsilon_sweep_runs_fixed_budgets_once():
    """Epsilon only shapes the "auto" budget: a fixed budget is one mode, labelled without an epsilon."""
    from types import SimpleNamespace

    from eval.modes import make_modes

    args = SimpleNamespace(depth=[5], topk=4, budget=[16, "auto"], epsilon=[0.05, 0.1], compile=[False])
    labels = [m.label for m in make_modes("bole", 4, args)]
    assert labels == ["bole b16", "bole bauto e0.05", "bole bauto e0.1"]


def test_compile_sweep_modes():
    """`--compile off on`: every hf_bole mode once eager and once compiled, the compiled one labelled and passing
    bole_compile; without a sweep the label stays the mode's name."""
    from types import SimpleNamespace

    from eval.modes import make_modes

    args = run.parse_args(["--compile", "off", "on", "--budget", "16", "auto"])
    assert args.compile == [False, True]
    modes = make_modes("bole", 1, args) + make_modes("chain", 1, args)
    assert [m.label for m in modes] == [
        "bole b16", "bole bauto", "bole b16 compiled", "bole bauto compiled", "chain", "chain compiled"
    ]
    assert [m.generate_kwargs("mtp")["bole_compile"] for m in modes] == [False, False, True, True, False, True]
    assert all(m.generate_kwargs("mtp")["use_cache"] is False for m in modes)  # no cache handed back: no per-round cuts
    assert run.parse_args(["--compile"]).compile == [True] and run.parse_args([]).compile == [False]
    one = SimpleNamespace(depth=[5], topk=4, budget=[16], epsilon=[0.1], compile=[True])
    assert [m.label for m in make_modes("bole", 1, one)] == ["bole"]


def test_chain_depth_sweep_modes():
    """`--chain-depth 3 6`: chain once per depth, labelled by it, each verifying every row's whole chain (budget
    depth x batch); without a sweep, one chain of 3 under the mode's name; the header names the depths."""
    from eval import report
    from eval.modes import make_modes

    args = run.parse_args(["--chain-depth", "3", "6"])
    modes = make_modes("chain", 2, args)
    assert [(m.label, m.depth, m.topk, m.budget) for m in modes] == [("chain d3", 3, 1, 6), ("chain d6", 6, 1, 12)]
    assert [m.generate_kwargs("mtp")["bole_depth"] for m in modes] == [3, 6]
    assert [(m.label, m.depth) for m in make_modes("chain", 2, run.parse_args([]))] == [("chain", 3)]
    with pytest.raises(SystemExit):
        run.parse_args(["--chain-depth", "0"])
    machine = {"gpu": None, "cpu_threads": 2, "torch": "2", "transformers": "5", "triton": "3", "commit": "abc",
               "dirty": False}  # fmt: skip
    settings = {**vars(args), "model": "m", "dtype": "float32", "drafter": "mtp", "command": "c"}
    assert "(chain: depth swept over 3/6, topk 1)" in report.markdown([], {"machine": machine, "settings": settings})


# Everything a row says about the decoded content, which sharding the prompts across processes must not change.
CONTENT = ("dataset", "mode", "batch_size", "num_prompts", "output_tokens", "outputs_sha256", "mean_accepted_tokens",
           "accept_histogram", "exact_share", "divergences", "quality")  # fmt: skip


def test_data_parallel_matches_one_process(checkpoint, tmp_path):
    """eval/README's CPU recipe, `accelerate launch --multi_gpu --num_processes 2 eval/run.py` (gloo on the CPU): two
    processes, each decoding half of the prompts, gather rows whose content equals one process's, as the same command
    does across GPUs."""
    import subprocess
    import sys

    args = ["--model", str(checkpoint), "--datasets", "gsm8k", "--num-prompts", "4", "--max-new-tokens", "8",
            "--max-prompt-tokens", "160", "--shots", "1", "--modes", "ar", "bole", "--batch-sizes", "1", "2",
            "--device", "cpu"]  # fmt: skip
    run.main([*args, "--output-dir", str(tmp_path / "one")])
    subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "eval/run.py",
         *args, "--output-dir", str(tmp_path / "two")],
        cwd=run.HOUSE_CHECKPOINT.parents[2], check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    one, two = (
        [json.loads(line) for line in (tmp_path / d / "results.jsonl").read_text().splitlines()] for d in ("one", "two")
    )
    assert [r["num_processes"] for r in two] == [2] * len(one) and len(one) == 4
    # prompts/s of both processes together: over the busier one's time, not the sum of both
    for a, b in zip(one, two):
        assert a["prompts_per_s"] == pytest.approx(4 / a["seconds"])
        assert b["prompts_per_s"] > 4 / b["seconds"]
    assert "Prompts/s: all 2 processes together" in (tmp_path / "two" / "results.md").read_text()
    assert "prompts/s" not in (tmp_path / "one" / "results.md").read_text()
    assert [{k: r[k] for k in CONTENT} for r in two] == [{k: r[k] for k in CONTENT} for r in one]
    ar = {(r["dataset"], r["batch_size"]): r["outputs_sha256"] for r in one if r["mode"] == "ar"}
    for r in one:  # the digest is of the outputs: an exact mode's equals ar's
        if r["exact_share"] == 1.0:
            assert r["outputs_sha256"] == ar[r["dataset"], r["batch_size"]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU recipe; on GPUs eval/gpu.sh's tp parts run --tp")
def test_tensor_parallel_run(tmp_path):
    """`torchrun --nproc-per-node 2 eval/run.py --tp` (gloo on the CPU): one random-weight model sharded over both
    processes (`build_model_tensor_parallel`), every prompt run by both, one table: hf_bole exact against plain
    `generate` under the same sharding."""
    import os
    import subprocess
    import sys

    from tests.models import tiny

    tiny.text_config("moe", vocab_size=96, num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # the torch paths on the CPU, as outside `interpreter` tests
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "eval/run.py", "--tp",
         "--shape", str(tmp_path), "--modes", "ar", "bole", "--batch-sizes", "1", "2", "--num-prompts", "2",
         "--prompt-length", "12", "--max-new-tokens", "12", "--device", "cpu", "--output-dir", str(tmp_path / "out")],
        cwd=run.HOUSE_CHECKPOINT.parents[2], env=env, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    settings = rows[0]["settings"]  # every row carries the header
    assert settings["tensor_parallel"] == 2 and settings["command"].startswith("torchrun --nproc-per-node=2")
    assert sorted((r["mode"], r["batch_size"], r["num_prompts"], r["num_processes"]) for r in rows) == [
        ("ar", 1, 2, 1), ("ar", 2, 2, 1), ("bole", 1, 2, 1), ("bole", 2, 2, 1)
    ]  # fmt: skip
    assert all(r["exact_share"] == 1.0 and r["mean_accepted_tokens"] > 2 for r in rows if r["mode"] == "bole")
