"""The decoding loop end to end on tiny random Qwen3.5 models: equal to plain `generate`, through every entry point."""

from __future__ import annotations

import logging
import os
import threading
import traceback
import warnings
from pathlib import Path

import pytest
import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    PreTrainedTokenizerFast,
)

import hf_bole
from hf_bole.config import BoleConfig
from hf_bole.generation import DraftContext, DraftTree, draft, graphs, loop, plan, requests, select
from hf_bole.generation import prefill as prefill_module
from hf_bole.generation import commit as commit_module
from hf_bole.generation import writes as writes_module
from hf_bole.generation.requests import spread_settings
from hf_bole.placement import Placement
from hf_bole.models.mtp import Qwen3_5MTP, save_pretrained_with_mtp
from hf_bole.models.twin import tree_twin
from tests.generation import sampling
from tests.models import tiny

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 33, 2, 41, 9, 60], [71, 3, 28, 44], [13], [8, 8, 90, 4, 4]]
NEW = 14


class OracleDrafter:
    """Knows each row's plain greedy continuation and puts it on one branch of every level among decoys:
    deep accepted paths through trees with siblings. `good=False` ranks the decoys above the truth."""

    def __init__(self, prompts, continuations, depth=4, decoys=2, good=True):
        self.prompts, self.continuations = prompts, continuations
        self.depth, self.decoys, self.good = depth, decoys, good
        self.max_depth = depth  # reads ctx.lengths only: the loop pipelines its rounds

    def propose(self, ctx: DraftContext) -> DraftTree:
        rows = []
        for b, length in enumerate(ctx.lengths.tolist()):
            done = length - len(self.prompts[b])  # tokens generated so far, the root included
            truth = self.continuations[b][done : done + self.depth]
            tokens, parents, logp, parent = [], [], [], -1
            for d, t in enumerate(truth):
                level = [t] + [(t + 1 + 7 * k + d) % tiny.VOCAB for k in range(self.decoys)]
                probs = [0.5] + [0.2] * self.decoys if self.good else [0.1] + [0.4] * self.decoys
                first = len(tokens)
                tokens += level
                parents += [parent] * len(level)
                logp += [float(torch.tensor(p).log()) for p in probs]
                parent = first
            rows.append((tokens, parents, logp))
        return padded_tree(rows)


def padded_tree(rows: list[tuple[list[int], list[int], list[float]]]) -> DraftTree:
    """A DraftTree of per-row (tokens, parents, draft log-probabilities), rows padded to the widest."""
    N = max(1, max(len(r[0]) for r in rows))
    pad = lambda xs, v: [x + [v] * (N - len(x)) for x in xs]  # noqa: E731
    return DraftTree(
        tokens=torch.tensor(pad([r[0] for r in rows], 0)),
        parents=torch.tensor(pad([r[1] for r in rows], -1)),
        draft_logprobs=torch.tensor(pad([r[2] for r in rows], float("-inf"))),
    )


def batch(prompts):
    ids, mask = tiny.left_pad(prompts)
    return ids, mask


def plain(model, prompts, **kwargs):
    ids, mask = batch(prompts)
    return model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)


def bole(model, prompts, **kwargs):
    ids, mask = batch(prompts)
    kwargs.setdefault("custom_generate", "hf_bole")
    return model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)


def oracle_for(model, prompts, new=NEW, **kwargs):
    ref = plain(model, prompts, max_new_tokens=new + 8, do_sample=False)
    P = ref.shape[1] - new - 8
    return OracleDrafter(prompts, [ref[b, P:].tolist() for b in range(len(prompts))], **kwargs)


@pytest.fixture(scope="module")
def dense():
    return tiny.build_model("dense")


@pytest.fixture(scope="module")
def moe():
    return tiny.build_model("moe")


@pytest.fixture(scope="module")
def dense_with_mtp(tmp_path_factory):
    """A dense model saved with a random MTP head and loaded back the way a real checkpoint is."""
    model = tiny.build_model("dense")
    mtp = Qwen3_5MTP.for_model(model)
    folder = tmp_path_factory.mktemp("with_mtp")
    save_pretrained_with_mtp(model, mtp, folder)
    return type(model).from_pretrained(folder, attn_implementation="sdpa").to(model.device).eval()


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("rows", [[0], [0, 1], [1, 2, 3], [0, 1, 2, 3]], ids=["B1", "B2", "B3", "B4"])
def test_greedy_matches_plain_oracle(request, kind, rows):
    model = request.getfixturevalue(kind)
    prompts = [PROMPTS[r] for r in rows]
    ref = plain(model, prompts, max_new_tokens=NEW, do_sample=False)
    out = bole(
        model, prompts, max_new_tokens=NEW, do_sample=False, bole_drafter=oracle_for(model, prompts),
        bole_budget=64, return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert out.mean_accepted_tokens > 3.0  # the oracle's branch is accepted 4 deep plus the bonus
    assert out.accept_lengths.shape[0] == len(rows)
    assert out.round_time_ms is None  # not profiled


@pytest.mark.interpreter
def test_greedy_matches_plain_with_the_selection_kernel(dense, monkeypatch):
    """Every round selects with tree_select_nodes's kernel (here under the Triton interpreter, as the GDN kernels)."""
    from hf_bole.kernels.tree_select import kernel as select_kernel

    launches = []
    kernel = select_kernel._select_nodes_fwd
    monkeypatch.setattr(select_kernel, "_select_nodes_fwd", lambda *a: launches.append(1) or kernel(*a))
    prompts = [PROMPTS[r] for r in (0, 1, 3)]
    ref = plain(dense, prompts, max_new_tokens=NEW, do_sample=False)
    out = bole(
        dense, prompts, max_new_tokens=NEW, do_sample=False, bole_drafter=oracle_for(dense, prompts),
        bole_budget=7, bole_cuda_graphs=False, return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    # one launch a round (no graph replays it), the round pipelining drafts past the last one included
    assert len(launches) == out.accept_lengths.shape[1] + 1 > 2


def test_rows_are_capped_at_the_width_of_their_budget(dense, monkeypatch):
    """Every round selects into `select.row_width` of its budget and active rows, decided without reading the trees:
    three rows share a budget of 6 at 3 nodes each (width 4)."""
    rounds = []
    select_nodes = loop.select_round

    def select_round(tree, root_tokens, budget, max_nodes_per_row, active=None, safe=None):
        verify = select_nodes(tree, root_tokens, budget, max_nodes_per_row, active, safe)
        rounds.append((budget, int(active.sum()), max_nodes_per_row, int(verify.num_nodes.max())))
        return verify

    monkeypatch.setattr(loop, "select_round", select_round)
    prompts = [PROMPTS[r] for r in (0, 1, 2)]
    lengths = {"max_new_tokens": NEW, "min_new_tokens": NEW}
    ref = plain(dense, prompts, do_sample=False, **lengths)
    out = bole(
        dense, prompts, do_sample=False, bole_drafter=oracle_for(dense, prompts, depth=6), bole_budget=6,
        bole_cuda_graphs=False, **lengths,
    )  # fmt: skip
    assert torch.equal(out, ref)
    assert rounds and all(cap + 1 == select.row_width(6, rows, 7) for _, rows, cap, _ in rounds)
    assert {cap for _, rows, cap, _ in rounds if rows == 3} == {3}
    assert all(widest <= cap + 1 for *_, cap, widest in rounds)


def test_profile_times_every_phase(dense):
    """CUDA events or the host clock per phase, and a profiler range per phase (what eval/profile_round.py reads)."""
    drafter = oracle_for(dense, PROMPTS)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = bole(
            dense, PROMPTS, max_new_tokens=NEW, do_sample=False, bole_drafter=drafter,
            bole_budget=64, bole_profile=True, return_dict_in_generate=True,
        )  # fmt: skip
    times = out.round_time_ms
    assert times["rounds"] == out.accept_lengths.shape[1] + 1  # pipelined: the last round launched is not read
    assert set(times) == {"draft", "select", "verify", "accept", "commit", "host", "rounds"}
    assert all(times[p] > 0 for p in ("draft", "select", "verify", "accept", "commit", "host"))
    host = out.round_host_ms
    assert set(host) == set(times) and host["rounds"] == times["rounds"]
    assert all(host[p] > 0 for p in ("draft", "select", "verify", "accept", "commit", "host"))
    if not torch.empty(0).is_cuda:  # without CUDA the host clock is the only one: the same marks, the same totals
        assert host == times
    ranges = {e.key: e.count for e in prof.key_averages() if e.key.startswith("bole::")}
    assert ranges == {f"bole::{p}": times["rounds"] for p in ("draft", "select", "verify", "accept", "commit", "host")}


def test_rounds_run_without_cudnn_attention(dense):
    """generate runs SDPA without cuDNN (it re-plans per key length); the caller's setting is back afterwards."""
    seen = []

    class Recording(hf_bole.NgramDrafter):
        def propose(self, ctx):
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
            return super().propose(ctx)

    before = torch.backends.cuda.cudnn_sdp_enabled()  # the harness's tests turn it off for the process
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        drafter = Recording(hf_bole.BoleConfig())
        out = bole(dense, PROMPTS[:2], max_new_tokens=NEW, do_sample=False, bole_drafter=drafter)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    assert torch.equal(out, plain(dense, PROMPTS[:2], max_new_tokens=NEW, do_sample=False))
    assert seen and not any(seen)


@pytest.mark.parametrize("good", [True, False])
def test_greedy_matches_plain_budget_and_serial(dense, good):
    """A small budget that cuts the oracle's trees, a bad ranking, and the serial-snapshot verification."""
    ref = plain(dense, PROMPTS, max_new_tokens=NEW, do_sample=False)
    for verify in ("closed_form", "serial"):
        out = bole(
            dense, PROMPTS, max_new_tokens=NEW, do_sample=False, bole_drafter=oracle_for(dense, PROMPTS, good=good),
            bole_budget=5, bole_verify=verify, return_dict_in_generate=True,
        )  # fmt: skip
        assert torch.equal(out.sequences, ref)
        # The round state each scheme keeps: factors (closed form) or per-node snapshots (serial), never both.
        kept, other = ("factors", "snapshots") if verify == "closed_form" else ("snapshots", "factors")
        assert out.peak_transient_bytes[kept] > 0 and out.peak_transient_bytes[other] == 0


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_matches_plain_ngram(request, kind):
    model = request.getfixturevalue(kind)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 4, 3, 4, 3, 4]]
    ref = plain(model, prompts, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(bole(model, prompts, max_new_tokens=NEW, do_sample=False, bole_drafter="ngram"), ref)


def test_release_frees_what_calls_keep(dense_with_mtp):
    """`hf_bole.release(model)` drops the MTP drafter and the graphed caches kept for the next call; that call
    builds them again and decodes the same."""
    from hf_bole.generation import draft, select, verify

    model = dense_with_mtp
    first = bole(model, PROMPTS, max_new_tokens=NEW, do_sample=False, bole_depth=3, bole_topk=3)
    assert model in draft._MTP_DRAFTERS
    verify.graphed_cache(model, 2, 64, "closed_form")  # what a CUDA call keeps (its graphs capture on first use)
    select.graphed_select(model)
    hf_bole.release(model)
    assert model not in draft._MTP_DRAFTERS and model not in verify._KEPT and model not in select._KEPT
    again = bole(model, PROMPTS, max_new_tokens=NEW, do_sample=False, bole_depth=3, bole_topk=3)
    assert torch.equal(again, first) and model in draft._MTP_DRAFTERS


def _in_threads(*calls) -> list:
    """Runs each call in a thread of its own, all at once; returns their results (or what they raised)."""
    results = [None] * len(calls)

    def run(i):
        try:
            results[i] = calls[i]()
        except Exception as e:  # noqa: BLE001 - handed to the test
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    return results


def test_plain_forwards_in_another_thread_are_untouched(dense):
    """While hf_bole generates in one thread, plain forwards of the same model in another give their logits bit for
    bit (tree mode runs a twin of the decoder and never swaps the model's modules), and hf_bole's output stays plain
    greedy's."""
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        expected = dense(ids).logits
    ref = plain(dense, PROMPTS, max_new_tokens=NEW, do_sample=False)
    drafter = oracle_for(dense, PROMPTS)
    done = threading.Event()

    def forwards() -> list:
        seen = []
        with torch.no_grad():
            while not done.is_set() and len(seen) < 1000:
                try:
                    seen.append(torch.equal(dense(ids).logits, expected))
                except Exception as e:  # noqa: BLE001 - handed to the test
                    seen.append(e)
        return seen

    def calls() -> list:
        try:
            return [bole(dense, PROMPTS, max_new_tokens=NEW, do_sample=False, bole_drafter=drafter, bole_budget=64)
                    for _ in range(3)]  # fmt: skip
        finally:
            done.set()

    seen, outs = _in_threads(forwards, calls)
    assert not isinstance(outs, Exception), outs
    assert all(torch.equal(out, ref) for out in outs)
    assert seen and all(s is True for s in seen), [s for s in seen if s is not True][:3]


def test_calls_from_two_threads_match_plain(dense_with_mtp):
    """Two threads generating with one model at once (its MTP drafter and kept state shared: the calls take turns)
    each get plain greedy's output."""
    ref = plain(dense_with_mtp, PROMPTS, max_new_tokens=NEW, do_sample=False)
    def call():
        return bole(dense_with_mtp, PROMPTS, max_new_tokens=NEW, do_sample=False, bole_depth=3, bole_topk=3)

    for out in _in_threads(call, call, call):
        assert not isinstance(out, Exception), out
        assert torch.equal(out, ref)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_greedy_matches_plain_tree_attention(dense, backend, monkeypatch):
    """bole_attention="triton": every full-attention layer of every verify forward attends through tree_attention
    (its torch reference on the CPU, its kernel under the Triton interpreter), and the tokens are plain greedy's."""
    import hf_bole.kernels as kernels

    calls = []
    attention = kernels.tree_attention
    monkeypatch.setattr(kernels, "tree_attention", lambda *a, **k: calls.append(1) or attention(*a, **k))
    prompts = [PROMPTS[r] for r in (0, 1, 3)]
    ref = plain(dense, prompts, max_new_tokens=NEW, do_sample=False)
    hf_bole.release(dense)  # on CUDA: graphs an earlier test captured would replay without calling tree_attention
    out = bole(
        dense, prompts, max_new_tokens=NEW, do_sample=False, bole_drafter=oracle_for(dense, prompts),
        bole_budget=16, bole_attention="triton", return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    layers = dense.config.layer_types.count("full_attention")
    # on CUDA the verify forward replays from a graph, which calls the Python function once, at capture
    rounds = 1 if dense.device.type == "cuda" else out.accept_lengths.shape[1]
    assert len(calls) >= layers * rounds > 0


def test_greedy_matches_plain_compiled(dense):
    """The verify forward through torch.compile (hf_bole's kernels as custom ops in its one graph)."""
    import hf_bole.models.adapter as adapter

    ref = plain(dense, PROMPTS, max_new_tokens=NEW, do_sample=False)
    drafter = oracle_for(dense, PROMPTS)
    out = bole(dense, PROMPTS, max_new_tokens=NEW, do_sample=False, bole_drafter=drafter, bole_compile=True)
    assert torch.equal(out, ref)
    assert tree_twin(dense.get_decoder(), projections=True, norms=False).module in adapter._COMPILED  # not eager


def test_greedy_matches_plain_mtp_compiled(dense_with_mtp, monkeypatch):
    """`bole_compile=True` with the MTP drafter compiles its rounds as well as the verify forward. Traced on a
    counting backend that runs the graphs as traced (inductor's code is exercised on the GPU)."""
    import weakref

    from torch._dynamo.testing import CompileCounter

    import hf_bole.models.adapter as adapter
    from hf_bole.generation import draft

    counter = CompileCounter()
    monkeypatch.setattr(torch, "compile", lambda fn: torch._dynamo.optimize(counter)(fn))
    monkeypatch.setattr(adapter, "_COMPILED", weakref.WeakKeyDictionary())  # not an earlier test's compiled forward
    torch._dynamo.reset()
    model = dense_with_mtp
    ref = plain(model, PROMPTS, max_new_tokens=NEW, do_sample=False)
    out = bole(model, PROMPTS, max_new_tokens=NEW, do_sample=False, bole_depth=3, bole_topk=3, bole_compile=True)
    assert torch.equal(out, ref)
    drafter = draft._MTP_DRAFTERS[model][3, 3, True, True, True]  # (depth, topk, cuda_graphs, compile, fused)
    assert drafter._compiled_round is not None
    assert tree_twin(model.get_decoder(), projections=True, norms=False).module in adapter._COMPILED
    assert counter.frame_count >= 2  # the drafter's rounds and the verify forward
    hf_bole.release(model)


def test_drafter_compiles_on_cuda_only(dense_with_mtp):
    """`compile_drafter` (the default) compiles the MTP drafter's rounds on CUDA only (drafts only propose, so the
    output cannot change); `compile_drafter=False` or another device keeps them eager, `compile=True` compiles them
    anywhere. `fuse_projections` reaches the drafter's head too, each setting its own drafter. Built here without
    running: compiling happens on a drafter's first round."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for config, device, compiled in [
        (BoleConfig(), cuda, True),
        (BoleConfig(), cpu, False),
        (BoleConfig(compile_drafter=False), cuda, False),
        (BoleConfig(compile=True, compile_drafter=False), cpu, True),
        (BoleConfig(fuse_projections=False), cpu, False),
    ]:
        drafter = draft.make_drafter(dense_with_mtp, config, device)
        assert drafter.compile is compiled, (config, device)
        assert drafter.fuse_projections is config.fuse_projections
        key = (config.depth, config.topk, config.cuda_graphs, compiled, config.fuse_projections)
        assert draft._MTP_DRAFTERS[dense_with_mtp][key] is drafter
    assert len(draft._MTP_DRAFTERS[dense_with_mtp]) == 3  # compiled or not, fused or not: the unfused one its own
    hf_bole.release(dense_with_mtp)


def test_greedy_matches_plain_mtp(dense_with_mtp):
    ref = plain(dense_with_mtp, PROMPTS, max_new_tokens=NEW, do_sample=False)
    out = bole(dense_with_mtp, PROMPTS, max_new_tokens=NEW, do_sample=False, bole_depth=3, bole_topk=3)
    assert torch.equal(out, ref)  # the default drafter is the checkpoint's MTP head


@pytest.mark.usefixtures("torch_gdn")  # plain greedy's prefill in fp32 (fla-core's, on a GPU, in tf32)
@pytest.mark.parametrize("drafter", ["oracle", "mtp"])
def test_greedy_matches_plain_with_prefill_chains(dense_with_mtp, drafter, monkeypatch):
    """Prompts prefilled as chains through the verify forward, ragged over one to three chains of 128: the
    output of plain greedy, and the MTP drafter drafts from the chains' hidden states."""
    from tests.generation.test_prefill import long_prompts

    chained = []
    prefill = prefill_module.chain_prefill
    monkeypatch.setattr(prefill_module, "chain_prefill", lambda *a, **k: chained.append(1) or prefill(*a, **k))
    prompts = long_prompts()
    ref = plain(dense_with_mtp, prompts, max_new_tokens=NEW, do_sample=False)
    settings = dict(bole_drafter=oracle_for(dense_with_mtp, prompts)) if drafter == "oracle" else dict(bole_depth=3)
    out = bole(dense_with_mtp, prompts, max_new_tokens=NEW, do_sample=False, bole_prefill="chains",
               return_dict_in_generate=True, **settings)  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert chained == [1]
    assert out.mean_accepted_tokens > (3.0 if drafter == "oracle" else 1.0)
    # Positions other than the count of each row's tokens: chains would not prefill as the plain forward does.
    ids, mask = batch(prompts)
    positions = (mask.cumsum(-1) - 1).clamp(min=0) + 3
    with pytest.raises(ValueError, match="position ids do not number each row's tokens from 0"):
        dense_with_mtp.generate(ids, attention_mask=mask, position_ids=positions, pad_token_id=0, max_new_tokens=2,
                                custom_generate="hf_bole", bole_prefill="chains", **settings)  # fmt: skip
    assert chained == [1]


@pytest.mark.parametrize(
    "mask", [[[1, 1, 1, 1, 0, 0, 0]], [[1, 1, 0, 0, 1, 1, 1]], [[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]]],
    ids=["right", "hole", "mixed"],
)
def test_padding_not_on_the_left(dense, mask):
    """Right padding, or a hole in the mask: the plain prefill decodes as plain `generate` does (the padding goes
    through the GDN layers there, which chains would skip); "chains" refuses the batch, "auto" takes plain."""
    mask = torch.tensor(mask)
    ids = torch.tensor([[5, 17, 33, 2, 41, 9, 60]] * mask.shape[0])
    kwargs = dict(attention_mask=mask, pad_token_id=0, max_new_tokens=NEW, do_sample=False)
    ref = dense.generate(ids, **kwargs)
    for prefill in ("plain", "auto"):
        out = dense.generate(ids, custom_generate="hf_bole", bole_drafter="ngram", bole_prefill=prefill, **kwargs)
        assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="bole_prefill='chains' would not prefill this batch.*padding after"):
        dense.generate(ids, custom_generate="hf_bole", bole_drafter="ngram", bole_prefill="chains", **kwargs)
    with pytest.raises(ValueError, match="position ids do not number"):
        dense.generate(ids[:1], custom_generate="hf_bole", bole_drafter="ngram", bole_prefill="chains",
                       position_ids=torch.arange(7)[None] + 3, max_new_tokens=3)  # fmt: skip


def test_drafter_writing_into_its_context_changes_nothing(dense):
    """A drafter that overwrites the sequences it is handed (and reads them) leaves the output plain greedy's."""

    class Scribbler(hf_bole.NgramDrafter):
        def propose(self, ctx):
            tree = super().propose(ctx)
            for sequence in ctx.sequences:
                sequence.fill_(7)
            return tree

    ref = plain(dense, PROMPTS, max_new_tokens=NEW, do_sample=False)
    out = bole(dense, PROMPTS, max_new_tokens=NEW, do_sample=False, bole_drafter=Scribbler(hf_bole.BoleConfig()))
    assert torch.equal(out, ref)


def test_drafter_sequences_hold_the_prompt_tokens_wherever_the_padding_is(dense):
    """`ctx.sequences` is each row's prompt without its padding (left, right or inside), then its generated tokens."""
    seen = []

    class Recording(hf_bole.NgramDrafter):
        def propose(self, ctx):
            seen.append([s.tolist() for s in ctx.sequences])
            return super().propose(ctx)

    ids = torch.tensor([[5, 17, 33, 2, 41, 9, 60]] * 3)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]])
    out = dense.generate(ids, attention_mask=mask, pad_token_id=0, max_new_tokens=4, do_sample=False,
                         custom_generate="hf_bole", bole_drafter=Recording(hf_bole.BoleConfig()))  # fmt: skip
    first = seen[0]
    assert first == [[33, 2, 41, 9, 60, *out[0, 7:8].tolist()], [5, 17, 41, 9, 60, *out[1, 7:8].tolist()],
                     [5, 17, 33, 2, *out[2, 7:8].tolist()]]  # fmt: skip


def test_inference_mode(dense_with_mtp):
    """Under `torch.inference_mode()` as plain `generate` works there, also for the model's first hf_bole call (what
    it keeps for later calls, and the fused weights, are normal tensors); later calls outside it work, and so does a
    forward with grad."""
    model = dense_with_mtp
    hf_bole.release(model)
    ref = plain(model, PROMPTS, max_new_tokens=NEW, do_sample=False)
    settings = dict(max_new_tokens=NEW, do_sample=False, bole_depth=2, bole_topk=2)
    with torch.inference_mode():
        assert torch.equal(bole(model, PROMPTS, **settings), ref)
        assert torch.equal(bole(model, PROMPTS, bole_drafter="ngram", **settings), ref)
    assert torch.equal(bole(model, PROMPTS, **settings), ref)
    with torch.inference_mode():
        assert torch.equal(bole(model, PROMPTS, **settings), ref)
    # A forward with grad (a weight made an inference tensor could not be saved for backward); no backward itself:
    # fla's GDN backward refuses Triton < 3.7.1 on Hopper.
    logits = model(torch.tensor([PROMPTS[0]])).logits
    assert logits.requires_grad and not any(p.is_inference() for p in model.parameters())


def test_memory_follows_the_tokens_generated_not_max_new_tokens(dense, monkeypatch):
    """`max_new_tokens=100000` and an EOS a few tokens in: the cache and the sequences are sized for the tokens made
    (plus a fixed room), not for max_new_tokens, and the output is plain greedy's."""
    widths = []
    init = writes_module.Writes.__init__
    recorded = lambda self, B, w, *a: widths.append(w) or init(self, B, w, *a)  # noqa: E731
    monkeypatch.setattr(writes_module.Writes, "__init__", recorded)
    probe = plain(dense, PROMPTS, max_new_tokens=12, do_sample=False)
    eos = probe[:, -6].tolist()  # every row stops where it first makes one of these
    ref = plain(dense, PROMPTS, max_new_tokens=100000, do_sample=False, eos_token_id=eos)
    assert ref.shape[1] <= probe.shape[1]
    out = bole(dense, PROMPTS, max_new_tokens=100000, do_sample=False, eos_token_id=eos, bole_drafter="ngram",
               return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert out.past_key_values.capacity <= 1024 and widths and max(widths) <= 1024


@pytest.mark.parametrize("graphed", [False, True])
def test_cache_and_sequences_grow_with_the_tokens(dense, monkeypatch, graphed):
    """With room for 2 tokens up front, the cache and the sequences grow (doubling) in the middle of the call,
    pipelined or not, from graphs (on a CPU recorded calls stand in for CUDA graphs) or not: the output without growth.
    (A recorded verify forward runs the forward's Python again, which makes a new round for a width other than the
    last one's, where a CUDA graph writes into its own: with graphs only the oracle, whose trees keep one width.)"""
    from tests.generation.recorded_graph import recording_capture, recording_queued_capture

    new = 70
    # plain greedy on a CPU; on CUDA the same call without growth (plain decoding there runs fla's kernels, whose
    # float32 rounds differently: over 70 tokens a near-tie may go the other way, which growth has no part in)
    ref = plain(dense, PROMPTS, max_new_tokens=new, do_sample=False)
    if ref.is_cuda:
        ref = bole(dense, PROMPTS, max_new_tokens=new, do_sample=False, bole_drafter=oracle_for(dense, PROMPTS, new=new),
                   bole_budget=64)  # fmt: skip
    monkeypatch.setattr(plan, "INITIAL_ROOM", 2)
    if graphed:
        monkeypatch.setattr(plan, "captures", lambda model, cuda_graphs: True)
        monkeypatch.setattr(graphs, "capture", recording_capture([]))
        monkeypatch.setattr(graphs, "capture_queued", recording_queued_capture([]))
        monkeypatch.setattr(graphs, "KEPT_CAPACITY_STEP", 16)
    for drafter in (oracle_for(dense, PROMPTS, new=new), *(() if graphed else ("ngram",))):  # pipelined, and not
        out = bole(dense, PROMPTS, max_new_tokens=new, do_sample=False, bole_drafter=drafter, bole_budget=64,
                   return_dict_in_generate=True)  # fmt: skip
        assert torch.equal(out.sequences, ref)
        assert out.past_key_values.capacity >= 7 + new


def test_entry_points(dense):
    prompts = PROMPTS[:2]
    ref = plain(dense, prompts, max_new_tokens=6, do_sample=False)
    ids, mask = batch(prompts)
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, bole_drafter="ngram")
    by_name = dense.generate(ids, custom_generate="hf_bole", **common)
    by_callable = dense.generate(ids, custom_generate=hf_bole.generate, **common)
    by_folder = dense.generate(ids, custom_generate=str(REPO), trust_remote_code=True, **common)
    direct = hf_bole.generate(dense, ids, **common)
    for out in (by_name, by_callable, by_folder, direct):
        assert torch.equal(out, ref)


def test_entry_points_honour_generation_config(dense):
    """Tree settings as GenerationConfig attributes, and a typo rejected with a suggestion."""
    from transformers import GenerationConfig

    prompts = PROMPTS[:2]
    config = GenerationConfig(max_new_tokens=5, do_sample=False, pad_token_id=0, bole_drafter="ngram", bole_depth=2)
    ids, mask = batch(prompts)
    out = dense.generate(ids, attention_mask=mask, generation_config=config, custom_generate=hf_bole.generate)
    assert torch.equal(out, plain(dense, prompts, max_new_tokens=5, do_sample=False))
    with pytest.raises(ValueError, match="Did you mean `bole_depth`"):
        bole(dense, prompts, max_new_tokens=3, bole_detph=2)


class Recorder:
    """A streamer that keeps every `put`."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("entry", ["name", "callable"])
def test_stopping_eos_inside_path_and_streamer(dense, entry):
    prompts = PROMPTS[:3]
    greedy = plain(dense, prompts, max_new_tokens=NEW, do_sample=False)
    P = greedy.shape[1] - NEW
    eos = int(greedy[0, P + 4])  # row 0 stops at its 5th token, inside an accepted oracle path
    unused = next(t for t in range(1, tiny.VOCAB) if t not in greedy[:, P:])  # a second EOS id, never produced
    custom = "hf_bole" if entry == "name" else hf_bole.generate
    rec_plain, rec_bole = Recorder(), Recorder()
    ref = plain(dense, prompts, max_new_tokens=NEW, do_sample=False, eos_token_id=[eos, unused], streamer=rec_plain)
    out = bole(
        dense, prompts, max_new_tokens=NEW, do_sample=False, eos_token_id=[eos, unused], streamer=rec_bole,
        bole_drafter=oracle_for(dense, prompts), bole_budget=64, custom_generate=custom,
    )  # fmt: skip
    assert torch.equal(out, ref)
    k = greedy[0, P:].tolist().index(eos)  # row 0 stops at its first `eos`, then holds padding
    assert out[0, P + k] == eos and (out[0, P + k + 1 :] == 0).all()
    assert len(rec_bole.puts) == len(rec_plain.puts) and rec_bole.ended and rec_plain.ended
    for a, b in zip(rec_plain.puts, rec_bole.puts):
        assert a.device == b.device and torch.equal(a, b)  # host tensors, as plain decoding's (CUDA tests too)


@pytest.mark.parametrize("rows", [[0], [0, 1, 2]], ids=["B1", "B3"])
@pytest.mark.parametrize("stop", ["max_new_tokens", "eos", "stop_string"])
def test_pipelined_rounds_match_sequential_ones(dense, stop, rows):
    """With `bole_pipeline` (the default) round r + 1 is drafted before the host streams round r's tokens, and one
    round more than needed is drafted and thrown away; output, streamed steps and rounds are those of rounds run one
    after the other (rows that stop early included: the budget covers every row's whole tree)."""
    prompts = [PROMPTS[r] for r in rows]
    greedy = plain(dense, prompts, max_new_tokens=NEW, do_sample=False)
    P = greedy.shape[1] - NEW
    tokens = greedy[0, P:].tolist()
    last = next(t for j, t in enumerate(tokens) if j >= 9 and t not in tokens[:j])  # new in the 2nd or 3rd round
    kwargs = dict(max_new_tokens=NEW, do_sample=False)
    if stop == "eos":
        kwargs["eos_token_id"] = last
    if stop == "stop_string":
        kwargs.update(stop_strings=[_char(last)], tokenizer=_tokenizer())
    drafter = oracle_for(dense, prompts)
    propose = drafter.propose
    runs = {}
    for pipeline in (True, False):
        events = []
        drafter.propose = lambda ctx: events.append(("propose", ctx.sequences is None)) or propose(ctx)
        streamer = Recorder()
        streamer.put = lambda value: events.append(("put", value.tolist()))  # the prompt, then a step at a time
        out = bole(dense, prompts, bole_drafter=drafter, bole_budget=64, bole_pipeline=pipeline, streamer=streamer,
                   return_dict_in_generate=True, **kwargs)  # fmt: skip
        assert torch.equal(out.sequences, plain(dense, prompts, **kwargs)), pipeline
        runs[pipeline] = (events, out)
    (piped, out), (serial, out_serial) = runs[True], runs[False]
    assert [e for e in piped if e[0] == "put"] == [e for e in serial if e[0] == "put"]
    assert torch.equal(out.accept_lengths, out_serial.accept_lengths) and (out.accept_lengths > 0).any(0).all()
    rounds = out.accept_lengths.shape[1]
    for events, pipelined in ((piped, True), (serial, False)):
        proposes = [i for i, e in enumerate(events) if e[0] == "propose"]
        puts = [i for i, e in enumerate(events) if e[0] == "put"]  # the prompt, the prefill's token, round 1's, ...
        assert len(proposes) == rounds + pipelined
        assert all(events[i][1] == pipelined for i in proposes)  # no sequences on the host when pipelined
        assert (proposes[1] < puts[2]) == pipelined  # round 2 drafted before round 1 streams


def _synchronizing_calls(model, prompts, **kwargs) -> list[str]:
    """`file:line` of every call that made the host wait for the GPU during `bole(model, prompts, **kwargs)`, as
    torch's sync debug mode reports them (an event's synchronize, the loop's one wait a round, is not among them):
    the innermost line of hf_bole's on the stack (torch's default-device mode, which HF_BOLE_TEST_DEVICE sets, is
    the frame the warning itself names)."""
    package = str(Path(hf_bole.__file__).parent)
    calls = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            ours = [f for f in traceback.extract_stack() if f.filename.startswith(package)]
            filename, lineno = (ours[-1].filename, ours[-1].lineno) if ours else (filename, lineno)
            calls.append(f"{Path(filename).name}:{lineno}")

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            bole(model, prompts, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return calls


@pytest.mark.parametrize("rows", [[0], [0, 1, 2]], ids=["B1", "B3"])
def test_pipelined_rounds_do_not_wait_for_the_gpu(dense_with_mtp, rows):
    """A pipelined round launches everything without waiting for the GPU, with one row or several (the forward's
    width comes from the budget, `graphs.row_width`, not from the trees): a longer call adds no synchronising calls,
    only the rounds' event waits; the active rows' upload when a row finishes is pinned and asynchronous."""
    if dense_with_mtp.device.type != "cuda":
        pytest.skip("CUDA streams only: run with HF_BOLE_TEST_DEVICE=cuda")
    prompts = [PROMPTS[r] for r in rows]
    kwargs = dict(do_sample=False, return_dict_in_generate=True)
    bole(dense_with_mtp, prompts, max_new_tokens=4 * NEW, **kwargs)  # kernels compiled, caches and graphs made
    short = _synchronizing_calls(dense_with_mtp, prompts, max_new_tokens=NEW, **kwargs)
    long = _synchronizing_calls(dense_with_mtp, prompts, max_new_tokens=4 * NEW, **kwargs)
    extra = {c for c in long if long.count(c) > short.count(c)}
    assert not extra, f"calls that wait for the GPU every round: {sorted(extra)}"


@pytest.mark.parametrize("pipeline", [True, False])
def test_the_first_token_is_read_behind_the_first_round(dense, pipeline):
    """Pipelined, the prefill's first token reaches the host like a round's tokens: after the first round is queued,
    so the host drafts without waiting for the prefill. Without pipelining it is read first."""
    events = []

    class Drafter:
        max_depth = 2

        def propose(self, ctx):
            events.append("draft")
            B = ctx.next_tokens.shape[0]
            return DraftTree(torch.ones(B, 2, dtype=torch.long), torch.tensor([[-1, 0]] * B), torch.full((B, 2), -1.0))

    class Streamer:
        def put(self, value):
            events.append("token")

        def end(self):
            pass

    prompts = PROMPTS[:1]
    out = bole(dense, prompts, max_new_tokens=NEW, bole_drafter=Drafter(), bole_pipeline=pipeline, streamer=Streamer())
    assert torch.equal(out, plain(dense, prompts, max_new_tokens=NEW))
    # transformers streams the prompt first
    assert events[:3] == (["token", "draft", "token"] if pipeline else ["token", "token", "draft"])


def test_pipelined_custom_drafter_errors(dense):
    """A pipelined drafter's trees are checked a round late, on a host copy, and verified in the meantime in a form
    no kernel trips over: a bad tree still ends in a ValueError naming it."""
    prompts = PROMPTS[:1]

    class Drafter:
        max_depth = 2

        def __init__(self, tokens, parents):
            self.tokens, self.parents = torch.tensor([tokens]), torch.tensor([parents])

        def propose(self, ctx):
            return DraftTree(self.tokens, self.parents, torch.full(self.tokens.shape, -1.0))

    out_of_vocab = Drafter([1, tiny.VOCAB + 5], [-1, 0])
    with pytest.raises(ValueError, match=r"Drafter.propose returned an invalid DraftTree: .*outside the vocabulary"):
        bole(dense, prompts, max_new_tokens=NEW, bole_drafter=out_of_vocab)
    too_deep = Drafter([1, 2, 3], [-1, 0, 1])
    with pytest.raises(ValueError, match=r"node \[0, 2\] lies 3 levels below the root, deeper than .*max_depth = 2"):
        bole(dense, prompts, max_new_tokens=NEW, bole_drafter=too_deep)
    assert torch.equal(  # without pipelining the tree is checked before it is verified
        bole(dense, prompts, max_new_tokens=NEW, bole_drafter=Drafter([1, 2], [-1, 0]), bole_pipeline=False),
        plain(dense, prompts, max_new_tokens=NEW),
    )
    too_deep.max_depth = "2"
    with pytest.raises(ValueError, match=r"Drafter.max_depth must be a positive int .* got '2'"):
        bole(dense, prompts, max_new_tokens=NEW, bole_drafter=too_deep)


@pytest.mark.parametrize("new", [1, 2, 7])
def test_stopping_max_new_tokens_and_min_new_tokens(dense, new):
    prompts = PROMPTS[:2]
    drafter = oracle_for(dense, prompts)
    ref = plain(dense, prompts, max_new_tokens=new, do_sample=False)
    assert torch.equal(bole(dense, prompts, max_new_tokens=new, do_sample=False, bole_drafter=drafter), ref)
    # min_new_tokens masks EOS for a while: a context-dependent logits processor
    greedy = plain(dense, prompts, max_new_tokens=NEW, do_sample=False)
    eos = int(greedy[1, -NEW + 1])
    ref = plain(dense, prompts, max_new_tokens=NEW, min_new_tokens=new + 2, eos_token_id=eos, do_sample=False)
    out = bole(dense, prompts, max_new_tokens=NEW, min_new_tokens=new + 2, eos_token_id=eos, do_sample=False,
               bole_drafter=drafter)  # fmt: skip
    assert torch.equal(out, ref)


def test_repetition_penalty_matches_plain(dense):
    """A processor that reads every node's whole sequence."""
    ref = plain(dense, PROMPTS, max_new_tokens=NEW, repetition_penalty=1.5, do_sample=False)
    out = bole(dense, PROMPTS, max_new_tokens=NEW, repetition_penalty=1.5, do_sample=False, bole_drafter="ngram")
    assert torch.equal(out, ref)


def _tokenizer():
    """A word-level tokenizer over the tiny vocabulary, one distinct character per token."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    tokenizer = Tokenizer(WordLevel({_char(i): i for i in range(tiny.VOCAB)}, unk_token=_char(0)))
    # One character per token, joined without spaces: what stop-string matching expects of a vocabulary.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def _char(i: int) -> str:
    return chr(ord("a") + i) if i < 26 else chr(0x4E00 + i)


class RowBias:
    """A processor that treats batch rows differently: at every third length, token `7 * row + 3` of row `row` wins."""

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] % 3 == 0:
            rows = torch.arange(scores.shape[0], device=scores.device)
            scores = scores.clone()
            scores[rows, 7 * rows + 3] += 100
        return scores


@pytest.mark.parametrize("drafter", ["oracle", "ngram"])
def test_processors_that_treat_rows_differently_match_plain(dense, drafter):
    """A logits processor that reads a row's place in the batch, and `prefix_allowed_tokens_fn`, which is told it:
    each node is scored in its row's place, so greedy output is plain greedy's."""
    allowed = lambda b, ids: list(range(10 * b + 1, 10 * b + 40))  # noqa: E731 - each row its own tokens
    for kwargs in (dict(logits_processor=LogitsProcessorList([RowBias()])), dict(prefix_allowed_tokens_fn=allowed)):
        ref = plain(dense, PROMPTS[:3], max_new_tokens=NEW, do_sample=False, **kwargs)
        P = ref.shape[1] - NEW
        chosen = OracleDrafter(PROMPTS[:3], ref[:, P:].tolist()) if drafter == "oracle" else "ngram"
        out = bole(dense, PROMPTS[:3], max_new_tokens=NEW, do_sample=False, bole_drafter=chosen, bole_budget=64,
                   **kwargs)  # fmt: skip
        assert torch.equal(out, ref)


def test_stopping_stop_strings(dense):
    """Without an EOS criterion plain decoding keeps a stopped row going until every row stops."""
    prompts = PROMPTS[:3]
    greedy = plain(dense, prompts, max_new_tokens=NEW, do_sample=False)
    P = greedy.shape[1] - NEW
    stops = [_char(int(greedy[0, P + 3])), _char(int(greedy[2, P + 6]))]
    tok = _tokenizer()
    kwargs = dict(max_new_tokens=NEW, do_sample=False, stop_strings=stops, tokenizer=tok)
    ref = plain(dense, prompts, **kwargs)
    drafter = oracle_for(dense, prompts)
    # transformers drops `tokenizer=` for a custom_generate callable; hf_bole's hook keeps it for its own.
    for entry in ("hf_bole", hf_bole.generate, str(REPO)):
        out = bole(dense, prompts, bole_drafter=drafter, bole_budget=64, custom_generate=entry, trust_remote_code=True, **kwargs)
        assert torch.equal(out, ref), entry
    ids, mask = batch(prompts)
    direct = hf_bole.generate(dense, ids, attention_mask=mask, pad_token_id=0, bole_drafter=drafter, bole_budget=64, **kwargs)
    assert torch.equal(direct, ref)
    # One criterion built once and passed as `stopping_criteria` (eval/run.py does: transformers 5.17 builds its
    # vocabulary table again in every call) stops the same way, call after call.
    from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

    criteria = StoppingCriteriaList([StopStringCriteria(tok, stops)])
    for _ in range(2):
        out = bole(dense, prompts, bole_drafter=drafter, bole_budget=64, max_new_tokens=NEW, do_sample=False,
                   stopping_criteria=criteria)  # fmt: skip
        assert torch.equal(out, ref)


@pytest.mark.parametrize("longest", [3, 9])
def test_stopping_multi_token_stop_strings(dense, longest):
    """Stop strings spanning several tokens: checked for every new token of a round in one batched call over
    windows of the last tokens (3), or token by token when the longest stop string is longer than the padded
    prompt (9 > 7 + 1: a window would reach before the first column)."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    from hf_bole.generation.stopping import Stopping

    prompts = PROMPTS[:3]
    greedy = plain(dense, prompts, max_new_tokens=NEW, do_sample=False)
    P = greedy.shape[1] - NEW
    text = lambda row, start, n: "".join(_char(int(t)) for t in greedy[row, P + start : P + start + n])  # noqa: E731
    stops = [text(0, 4, 3), text(2, 7, 2), text(1, 2, longest)]  # the last ends at step 2 + longest of row 1
    tok = _tokenizer()
    batched = Stopping([StopStringCriteria(tok, stops)], P).suffix
    assert bool(batched) == (longest <= P + 1)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, stop_strings=stops, tokenizer=tok)
    ref = plain(dense, prompts, **kwargs)
    assert ref.shape[1] < P + NEW  # every row met a stop string (without EOS, rows run on until the last stops)
    out = bole(dense, prompts, bole_drafter=oracle_for(dense, prompts), bole_budget=64, **kwargs)
    assert torch.equal(out, ref)


class RandomDrafter:
    """A bad drafter: the same tree shape every round (depth 3), random distinct sibling tokens, random draft
    probabilities."""

    parents = torch.tensor([-1, -1, -1, 0, 0, 1, 3, 3, 5])

    def __init__(self, vocab):
        self.vocab, self.gen = vocab, torch.Generator(torch.get_default_device()).manual_seed(1)

    max_depth = 3  # reads nothing of the context but its batch size: pipelined

    def propose(self, ctx):
        B = ctx.batch_size
        distinct = lambda n: torch.stack([torch.randperm(self.vocab, generator=self.gen)[:n] for _ in range(B)])  # noqa: E731
        tokens = torch.cat([distinct(3), distinct(2), distinct(1), distinct(2), distinct(1)], dim=1)
        logp = torch.log_softmax(torch.randn(B, 9, generator=self.gen), -1)
        return DraftTree(tokens=tokens, parents=self.parents.expand(B, 9), draft_logprobs=logp)


class ModalDrafter:
    """A good drafter: for every prefix of up to two generated tokens, the target's own three most likely next
    tokens and their probabilities (looked up in a table built once), as a depth-2 tree."""

    def __init__(self, model, prompt):
        self.prompt_len, self.table = len(prompt), {}
        for prefix in [()] + [(a,) for a in range(6)] + [(a, b) for a in range(6) for b in range(6)]:
            probs = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].softmax(-1)
            self.table[prefix] = probs.topk(3)

    def propose(self, ctx):
        rows = []
        for seq in ctx.sequences:
            prefix = tuple(seq[self.prompt_len :].tolist())[:2]
            top = self.table.get(prefix)
            if top is None:  # past the tokens under test: no draft
                rows.append(([0], [-1], [float("-inf")]))
                continue
            tokens, parents, logp = top.indices.tolist(), [-1, -1, -1], top.values.log().tolist()
            for i, t in enumerate(top.indices.tolist()):
                child = self.table.get(prefix + (t,))
                if child is not None:
                    tokens += child.indices.tolist()
                    parents += [i] * 3
                    logp += child.values.log().tolist()
            rows.append((tokens, parents, logp))
        N = max(len(r[0]) for r in rows)
        pad = lambda x, v: x + [v] * (N - len(x))  # noqa: E731
        return DraftTree(
            tokens=torch.tensor([pad(r[0], 0) for r in rows]),
            parents=torch.tensor([pad(r[1], -1) for r in rows]),
            draft_logprobs=torch.tensor([pad(r[2], float("-inf")) for r in rows]),
        )


@pytest.mark.parametrize("drafter", ["modal", "random"])
def test_sampling_keeps_the_distribution(drafter):
    """Chi-square: the joint law of the first three tokens equals plain sampling's (4000 samples each)."""
    torch.manual_seed(0)
    model = tiny.build_model("dense", vocab_size=6)
    d = ModalDrafter(model, sampling.PROMPT) if drafter == "modal" else RandomDrafter(6)
    p_value = sampling.sampling_p_value(model, bole_drafter=d)
    assert p_value > 1e-3, f"sampling with the {drafter} drafter differs from plain sampling (p = {p_value:.2e})"


def test_errors(dense):
    prompts = PROMPTS[:1]
    with pytest.raises(ValueError, match="MTP head.*bole_drafter=.ngram."):
        bole(dense, prompts, max_new_tokens=3)  # built in code: no checkpoint, hence no MTP head
    with pytest.raises(ValueError, match="num_beams=2"):
        bole(dense, prompts, max_new_tokens=3, num_beams=2, bole_drafter="ngram")
    with pytest.raises(ValueError, match="assistant_model"):
        bole(dense, prompts, max_new_tokens=3, assistant_model=dense, bole_drafter="ngram")

    class Broken:
        def propose(self, ctx):
            return DraftTree(tokens=torch.tensor([[1, 2]]), parents=torch.tensor([[1, -1]]),
                             draft_logprobs=torch.zeros(1, 2))  # fmt: skip

    with pytest.raises(ValueError, match="Broken.propose returned an invalid DraftTree"):
        bole(dense, prompts, max_new_tokens=3, bole_drafter=Broken())
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=32)).eval()  # fmt: skip
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM"):
        bole(llama, prompts, max_new_tokens=3, bole_drafter="ngram")


@pytest.mark.parametrize("entry", ["name", "callable"])
def test_bad_requests_are_refused_up_front(dense_with_mtp, entry, caplog):
    """Settings and inputs hf_bole cannot run are named in a ValueError before anything runs, by either entry point,
    and the model decodes as before afterwards."""
    model, prompts = dense_with_mtp, PROMPTS[:1]
    custom = "hf_bole" if entry == "name" else hf_bole.generate
    run = lambda **kwargs: bole(model, prompts, max_new_tokens=3, custom_generate=custom, **kwargs)  # noqa: E731
    # the MTP drafter's attention takes 128 query rows a key head: 2 query heads per key head here
    with pytest.raises(ValueError, match=r"bole_depth=64 is more than.*bole_depth <= 63"):
        run(bole_depth=64, bole_topk=1)
    with pytest.raises(ValueError, match=r"bole_topk=65 is more than.*bole_topk <= 64"):
        run(bole_depth=2, bole_topk=65)
    with pytest.raises(ValueError, match=r"bole_topk=200 exceeds the vocabulary \(97 tokens\)"):
        run(bole_topk=200)
    with pytest.raises(ValueError, match="got the class NgramDrafter: pass an instance"):
        run(bole_drafter=hf_bole.NgramDrafter)
    lookup = GenerationConfig(prompt_lookup_num_tokens=3)
    for kwargs in (dict(prompt_lookup_num_tokens=3), dict(generation_config=lookup), dict(use_mtp=True)):
        with pytest.raises(ValueError, match="drafts with its own drafter: drop (prompt_lookup_num_tokens|use_mtp)"):
            run(**kwargs)
    # other decoding modes are refused, not run as greedy (plain generate fetches them from the Hub)
    with pytest.raises(ValueError, match="penalty_alpha with top_k > 1 asks for contrastive search: drop it"):
        run(penalty_alpha=0.6, top_k=4)
    with pytest.raises(ValueError, match="dola_layers asks for DoLa decoding: drop it"):
        run(dola_layers="low")
    requests.logger.warning_once.cache_clear()  # said once per process: maybe by an earlier test
    with caplog.at_level(logging.WARNING, logger="hf_bole.generation.requests"):
        said = run(cache_implementation="static", do_sample=False)  # runs, saying what it does not use
    assert torch.equal(said, plain(model, prompts, max_new_tokens=3, do_sample=False))
    assert "cache_implementation='static' is not used" in caplog.text
    with pytest.raises(ValueError, match="input_ids has 1 rows of 0 tokens"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3, custom_generate=custom,
                       bole_drafter="ngram")  # fmt: skip

    class OnMeta:
        def propose(self, ctx):
            dtypes = (torch.long, torch.long, torch.float)
            return DraftTree(*(torch.zeros(ctx.batch_size, 2, dtype=d, device="meta") for d in dtypes))

    with pytest.raises(ValueError, match="OnMeta.propose returned an invalid DraftTree: .*meta device"):
        run(bole_drafter=OnMeta())
    assert torch.equal(run(do_sample=False, bole_depth=3), plain(model, prompts, max_new_tokens=3, do_sample=False))


def _offload_map(num_layers: int, on_disk_from: int) -> dict[str, str]:
    """A device map accelerate hooks on CPU: layers from `on_disk_from` on, the final norm and the LM head offloaded
    to disk (weights on the meta device, loaded by their hooks for each call)."""
    return {
        "model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "disk", "lm_head": "disk",
        **{f"model.layers.{i}": "cpu" if i < on_disk_from else "disk" for i in range(num_layers)},
    }  # fmt: skip


@pytest.mark.skipif(torch.empty(0).device.type != "cpu", reason="accelerate offload hooks on CPU")
def test_greedy_matches_plain_under_accelerate_hooks(tmp_path):
    """A model dispatched by accelerate (hooks on every block, the last layers and the LM head offloaded, their
    weights on the meta device) decodes exactly as plain greedy generate of the same model without hooks."""
    from accelerate import dispatch_model

    model = tiny.build_model("dense", num_hidden_layers=8)
    ref = plain(model, PROMPTS, max_new_tokens=NEW, do_sample=False)
    drafter = oracle_for(model, PROMPTS)
    model = dispatch_model(model, _offload_map(8, 5), offload_dir=tmp_path)
    assert model.lm_head.weight.device.type == "meta" and hasattr(model.model.layers[6], "_hf_hook")
    out = bole(model, PROMPTS, max_new_tokens=NEW, do_sample=False, bole_drafter=drafter, bole_budget=64,
               return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert out.mean_accepted_tokens > 3.0


@pytest.mark.skipif(torch.empty(0).device.type != "cpu", reason="accelerate offload hooks on CPU")
def test_greedy_matches_plain_mtp_from_pretrained_device_map(dense_with_mtp, tmp_path):
    """`from_pretrained(..., device_map=...)` with offloaded layers and LM head: the MTP drafter sits where the LM
    head runs and drafts through the hooked embedding and LM head; output equal to plain greedy."""
    ref = plain(dense_with_mtp, PROMPTS, max_new_tokens=NEW, do_sample=False)
    model = type(dense_with_mtp).from_pretrained(
        dense_with_mtp.name_or_path, attn_implementation="sdpa", device_map=_offload_map(4, 2),
        offload_folder=tmp_path,
    ).eval()  # fmt: skip
    assert model.lm_head.weight.device.type == "meta"
    out = bole(model, PROMPTS, max_new_tokens=NEW, do_sample=False, bole_depth=3, bole_topk=3)
    assert torch.equal(out, ref)


def test_spread_model_settings(caplog):
    """A model over two GPUs: CUDA graphs and the drafter's compile off, said once in a warning naming the devices;
    compile refused; a model on one device keeps its settings."""
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    spread = Placement(gpus[0], gpus[1], (gpus[0], gpus[0], gpus[1], gpus[1]))
    with caplog.at_level(logging.WARNING):
        settings = spread_settings(BoleConfig(), spread)
    assert not settings.cuda_graphs and not settings.compile_drafter
    assert "CUDA graphs and the drafter's compile are off: the model spans 2 devices (cuda:0, cuda:1)" in caplog.text
    with pytest.raises(ValueError, match="bole_compile=True.*spread over 2 devices.*drop bole_compile"):
        spread_settings(BoleConfig(compile=True), spread)
    one = Placement(gpus[0], gpus[0], (gpus[0],) * 4)
    assert spread_settings(BoleConfig(compile=True), one) == BoleConfig(compile=True)


@pytest.mark.skipif(
    os.environ.get("HF_BOLE_TEST_DEVICE") != "cuda" or torch.cuda.device_count() < 2,
    reason="needs HF_BOLE_TEST_DEVICE=cuda and two GPUs",
)
@pytest.mark.parametrize("drafter", ["oracle", "mtp"])
def test_greedy_matches_plain_on_two_gpus(dense_with_mtp, drafter):
    """A tiny model split over cuda:0 and cuda:1 by a device_map (accelerate's hooks): generate with hf_bole equals
    plain greedy generate token for token, with every layer's state on its own GPU."""
    half = dense_with_mtp.config.num_hidden_layers // 2
    device_map = {
        "model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1,
        **{f"model.layers.{i}": 0 if i < half else 1 for i in range(2 * half)},
    }  # fmt: skip
    model = type(dense_with_mtp).from_pretrained(
        dense_with_mtp.name_or_path, attn_implementation="sdpa", device_map=device_map
    ).eval()
    assert hf_bole.placement.placement(model).devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    ref = plain(model, PROMPTS, max_new_tokens=NEW, do_sample=False)
    kwargs = dict(bole_depth=3, bole_topk=3) if drafter == "mtp" else dict(bole_drafter=oracle_for(model, PROMPTS))
    out = bole(model, PROMPTS, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences.cpu(), ref.cpu())
    cache = out.past_key_values
    assert cache.devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert cache.layers[0].recurrent_states[0].device == torch.device("cuda", 0)
    assert cache.layers[-1].keys.device == torch.device("cuda", 1)


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("rows", [[0], [0, 1, 2]], ids=["B1", "B3"])
def test_budget_0_is_plain_decoding(dense, monkeypatch, graphed, rows):
    """A budget of 0 verifies the roots alone, one token a round: plain greedy's tokens, from graphs (recorded calls
    on a CPU) or not, and no drafter is made (this model has no MTP head, the default drafter's weights)."""
    from tests.generation.recorded_graph import recording_capture, recording_queued_capture

    monkeypatch.setattr(plan, "captures", lambda model, cuda_graphs: graphed)  # on a CUDA device too
    if graphed:
        monkeypatch.setattr(graphs, "capture", recording_capture([]))
        monkeypatch.setattr(graphs, "capture_queued", recording_queued_capture([]))
    made = []
    monkeypatch.setattr(plan, "make_drafter", lambda *a: made.append(a))
    trees = []  # the trees the greedy tail's graphs read, by their addresses
    tail = commit_module.TailGraphs.__call__
    recorded = lambda self, verify, *a: trees.append(verify) or tail(self, verify, *a)  # noqa: E731
    monkeypatch.setattr(commit_module.TailGraphs, "__call__", recorded)
    prompts = [PROMPTS[r] for r in rows]
    ref = plain(dense, prompts, max_new_tokens=NEW, do_sample=False)
    for _ in range(2):
        out = bole(dense, prompts, max_new_tokens=NEW, do_sample=False, bole_budget=0, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref) and not made
        assert out.accept_lengths.shape[1] == NEW - 1 and out.mean_accepted_tokens == 1.0  # the first: prefill's
    # from graphs, every round of both calls reads one buffer of roots: one tail graph, replayed by the second call
    assert len({id(t.input_ids) for t in trees}) == graphed


@pytest.mark.parametrize("graphed", [False, True])
def test_rounds_of_the_roots_alone_between_trees_keep_the_drafter_in_step(dense_with_mtp, monkeypatch, graphed):
    """Rounds of budget 0 (the MTP drafter takes in the committed tokens and drafts nothing) between rounds that
    draft: plain greedy's tokens, and the drafter's trees those of a drafter that drafted every round."""
    from hf_bole.generation.budget import BudgetResolver
    from hf_bole.generation.drafters import mtp as mtp_module
    from tests.generation.recorded_graph import recording_capture, recording_queued_capture

    if graphed:
        monkeypatch.setattr(plan, "captures", lambda model, cuda_graphs: True)
        monkeypatch.setattr(graphs, "capture", recording_capture([]))
        monkeypatch.setattr(graphs, "capture_queued", recording_queued_capture([]))
        monkeypatch.setattr(mtp_module, "capture", recording_capture([]))
    kvs = list(range(64))
    budgets = [6 * (kv % 2) for kv in kvs]
    every_other = lambda cls, model, config, batch_size: cls(kvs, budgets, batch_size, "test")  # noqa: E731
    monkeypatch.setattr(BudgetResolver, "for_model", classmethod(every_other))
    trees = []
    propose = mtp_module.MTPDrafter.propose
    recorded = lambda self, ctx: trees.append(propose(self, ctx)) or trees[-1]  # noqa: E731
    monkeypatch.setattr(mtp_module.MTPDrafter, "propose", recorded)
    prompts = [PROMPTS[r] for r in (0, 1, 2)]
    ref = plain(dense_with_mtp, prompts, max_new_tokens=NEW, do_sample=False)
    out = bole(dense_with_mtp, prompts, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    widths = [t.tokens.shape[1] for t in trees]
    assert 0 in widths and any(w > 0 for w in widths)
