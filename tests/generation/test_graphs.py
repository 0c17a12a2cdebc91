"""CUDA graphs (`hf_bole.generation.graphs`): captures behind queued work, which models are captured, and replay
against plain decoding on a GPU."""

from __future__ import annotations

import pytest
import torch

from hf_bole import BoleCache
from hf_bole.generation import graphs as graphs_module
from hf_bole.generation.graphs import ShapeGraphs
from hf_bole.models import graph_unsafe_experts, tree_forward
from hf_bole.placement import Placement
from tests.models.tiny import batch_trees, build_model, prefill

PROMPTS = [[5, 17, 33, 2, 41, 9, 60], [71, 3, 28, 44], [13]]


@pytest.mark.skipif(not torch.empty(0).is_cuda, reason="CUDA graphs need a GPU (HF_BOLE_TEST_DEVICE=cuda)")
def test_shape_graphs_capture_behind_queued_work_in_one_pool():
    """`ShapeGraphs` made anew per call (as a `_Writes` is for a longer call): they capture while earlier work is still
    queued without waiting for it, replay what eager calls give (a running count updated in place), and share one memory
    pool across calls, so reserved memory stops growing."""
    count = torch.zeros(64, dtype=torch.long)
    expected = torch.zeros(64, dtype=torch.long)

    def run(x):
        count.add_(x)
        return count * 2

    reserved = []
    for call in range(12):
        graphs = ShapeGraphs(run)
        for step in range(4):
            x = torch.arange(64) + 100 * call + step
            busy = torch.randn(2048, 2048)
            torch.cuda.set_sync_debug_mode("error")  # a wait for the GPU raises
            try:
                for _ in range(4):  # queued work the capture need not wait for
                    busy = busy @ busy / 64
                out = graphs(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            expected += x
            assert torch.equal(out, expected * 2)
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[2]


@pytest.mark.skipif(not torch.empty(0).is_cuda, reason="CUDA graphs need a GPU (HF_BOLE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("verify, kind", [("closed_form", "dense"), ("serial", "dense"), ("closed_form", "moe")])
def test_cuda_graphs_generate_matches_plain(verify, kind):
    """Greedy output with replayed verify forwards equals plain generate, over two calls that share the cache; a
    mixture of experts under transformers' batched_mm experts is captured too (grouped_mm only in bf16, whose
    near-ties would make this comparison flaky: the end-to-end runs of the 35B-A3B shape on a GPU cover it)."""
    model = build_model(kind)
    if kind == "moe":
        model.set_experts_implementation("batched_mm")
        assert graphs_module.captures(model, cuda_graphs=True)
    ids = torch.tensor([[0, 0, 5, 17, 33, 2], [71, 3, 28, 44, 9, 60], [0, 0, 0, 0, 0, 13]])
    mask = (ids != 0).long()
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    for _ in range(2):
        out = model.generate(
            ids, custom_generate="hf_bole", bole_drafter="ngram", bole_cuda_graphs=True, bole_verify=verify, **kwargs
        )
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # One row: its forward keeps its budget's width, without reading the widest row kept.
    one = {**kwargs, "attention_mask": mask[1:2]}
    single = model.generate(ids[1:2], custom_generate="hf_bole", bole_drafter="ngram", bole_verify=verify, **one)
    torch.testing.assert_close(single, model.generate(ids[1:2], **one), rtol=0, atol=0)


@pytest.mark.skipif(not torch.empty(0).is_cuda, reason="CUDA graphs need a GPU (HF_BOLE_TEST_DEVICE=cuda)")
def test_cuda_graphs_budget_0_matches_plain():
    """Rounds of the roots alone (budget 0) replayed from CUDA graphs, over two calls that share the cache: plain
    greedy's tokens, one a round."""
    model = build_model("dense")
    ids = torch.tensor([[0, 0, 5, 17, 33, 2], [71, 3, 28, 44, 9, 60], [0, 0, 0, 0, 0, 13]])
    kwargs = dict(attention_mask=(ids != 0).long(), do_sample=False, max_new_tokens=24, pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    for _ in range(2):
        out = model.generate(ids, custom_generate="hf_bole", bole_budget=0, return_dict_in_generate=True, **kwargs)
        torch.testing.assert_close(out.sequences, expected, rtol=0, atol=0)
        assert out.mean_accepted_tokens == 1.0


def test_eager_experts_are_not_captured(monkeypatch):
    """transformers' "eager" experts loop over the experts hit, reading the routing on the host, and so does torch's
    grouped_mm outside bf16: models (and MTP layers) running them verify and draft without graphs; "grouped_mm" (the
    default) in bf16 and "batched_mm" are captured."""
    moe = build_model("moe")
    assert not graph_unsafe_experts(build_model("dense"))
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    cases = (
        ("grouped_mm", torch.bfloat16, False), ("grouped_mm", torch.float32, True),
        ("batched_mm", torch.float32, False), ("eager", torch.float32, True),
    )  # fmt: skip
    for implementation, dtype, unsafe in cases:
        moe.set_experts_implementation(implementation)
        moe.to(dtype)
        assert bool(graph_unsafe_experts(moe)) == unsafe
        if unsafe:
            assert implementation in graph_unsafe_experts(moe)[0]
        monkeypatch.setattr(graphs_module, "placement", lambda model: Placement(gpus[0], gpus[0], (gpus[0],) * 4))
        assert graphs_module.captures(moe, cuda_graphs=True) != unsafe
        # the experts blocks are found once per model; their implementation and dtype are read at every call
        monkeypatch.setattr(moe, "named_modules", lambda *a, **k: pytest.fail("modules walked again"))
        assert bool(graph_unsafe_experts(moe)) == unsafe
        # over two GPUs (device_map) never: a graph is captured on one device's stream
        monkeypatch.setattr(graphs_module, "placement", lambda model: Placement(gpus[0], gpus[1], (*gpus, *gpus)))
        assert not graphs_module.captures(moe, cuda_graphs=True)
        monkeypatch.undo()
    # what the "eager" experts would read while a graph captures (the reason they are refused)
    cache = BoleCache(moe.config, batch_size=3, max_cache_len=64)
    prefill(moe, cache, PROMPTS)
    parents = batch_trees([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 0, 0]])
    tree_forward(moe, cache, torch.ones_like(parents), parents)
    reads = []
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self, _o=torch.Tensor.__bool__: reads.append(1) or _o(self))
    tree_forward(moe, cache, torch.ones_like(parents), parents)
    monkeypatch.undo()
    assert reads
