"""CUDA graph capture as the round uses it (`bole_cuda_graphs=True`): `capture` for the verify forward, selection and
a greedy round's tail (`verify.VerifyGraphs`, `select.SelectGraphs`, `commit.TailGraphs`), `capture_queued` for
graphs captured behind queued work (`ShapeGraphs`: the token writes; `commit.CommitGraphs`: the prefill chains'
commits), and `captures`, whether a model's verify forwards replay at all. A graph is captured once per shape and kept
across `generate` calls together with the cache whose addresses it holds.
"""

from __future__ import annotations

import torch

from hf_bole.models import family_of, graph_unsafe_experts
from hf_bole.placement import placement
from hf_bole.tensor_parallel import tensor_parallel

# Kept caches' capacities and the kept token writes' widths are rounded up to this many slots, so that calls of
# similar lengths share one cache, one set of writes and their graphs.
KEPT_CAPACITY_STEP = 512


def captures(model, cuda_graphs: bool) -> bool:
    """Whether verify forwards of `model` replay from CUDA graphs: asked for (`bole_cuda_graphs`), on one CUDA
    device (not spread over several by a device_map: a graph is captured on one device's stream), not sharded by
    tensor parallelism (its collectives are not captured yet, issue 60), of a family whose forward a graph can hold
    (`Family.cuda_graphs`), and no mixture-of-experts layers whose experts implementation routes tokens with
    data-dependent shapes (`graph_unsafe_experts`: transformers' "eager"; its default "grouped_mm" is captured)."""
    if not cuda_graphs or not family_of(model.config).cuda_graphs:
        return False
    place = placement(model)
    if place.spans_devices or place.input_device.type != "cuda" or tensor_parallel(model).size > 1:
        return False
    return not graph_unsafe_experts(model)


def capture(run, device: torch.device, pool=None, warm_up: bool = True) -> tuple[torch.cuda.CUDAGraph, object]:
    """Captures `run()` into a CUDA graph drawing on memory `pool`; returns the graph and what the captured call
    returned (its output buffers, filled by each replay). With `warm_up`, `run` is called once eagerly on a side
    stream first, so that autotuning and first-use costs stay out of the capture: it must be safe to run twice
    (without, it must have run eagerly before). The captured work has not run yet: replay the graph."""
    if warm_up:
        side = _side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Only this thread's calls are held to the capture's rules: another thread's plain forward of the model (a
    # cudaMalloc, a synchronisation) would fail during the capture otherwise.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = run()
    return graph, out


# device -> a graph of one tiny kernel, kept so that its memory pool outlives the graphs `capture_queued` makes there
# and shares with them: a pool per graph would stay reserved after its graph is gone, until the allocator's cache is
# emptied, and torch (2.11) keeps a pool's count of graphs for pinned memory apart from the pool itself (a
# `torch.cuda.MemPool` held here trips its assertion once the last graph that used it is gone).
_ANCHORS: dict[torch.device, torch.cuda.CUDAGraph] = {}


def capture_queued(run, device: torch.device) -> tuple[torch.cuda.CUDAGraph, object]:
    """Captures `run()` like `capture` without warming up, while earlier work may still be queued: on a side stream,
    with no wait for the GPU and no emptying of the allocator's cache, which `torch.cuda.graph` does on entry (a
    round in flight drained, memory handed back to the driver, in the middle of a call). `run` must have run eagerly
    before; only this thread's calls are held to the capture's rules. The captured work has not run yet: replay
    the graph."""
    if device not in _ANCHORS:
        _ANCHORS[device], _ = _capture_on_side_stream(lambda: torch.zeros(1, device=device), device, None)
    return _capture_on_side_stream(run, device, _ANCHORS[device].pool())


# device -> the one side stream that warm-ups and `capture_queued` run on there. The caching allocator hands a freed
# block out again only on the stream it was allocated on: with a new stream (one of torch's 32 pooled ones, in turn)
# per capture, the shared pool grew by a segment at every capture of every call (2 MiB a call in
# `test_shape_graphs_capture_behind_queued_work_in_one_pool` on an H200). torch.cuda.graph, too, keeps one capture
# stream.
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def _capture_on_side_stream(run, device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(_side_stream(device)):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = run()
        finally:
            graph.capture_end()
    return graph, out


class ShapeGraphs:
    """`run(*inputs)` replayed from a CUDA graph per input shape, captured in the middle of a `generate` call (the
    token writes of `writes.Writes`, kept across calls while they fit): the first call of a shape runs eagerly, which
    pays first-use costs such as cached index ranges, the second captures (`capture_queued`, no wait for the GPU),
    later ones copy their inputs in and replay. Returns `run`'s outputs, the graph's buffers from the second call on:
    valid until the next call."""

    def __init__(self, run):
        self.run = run
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], object]] = {}
        self._seen: set[tuple] = set()

    def __call__(self, *inputs: torch.Tensor):
        key = tuple((x.shape, x.dtype) for x in inputs)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen.add(key)
                return self.run(*inputs)
            static = tuple(x.clone() for x in inputs)
            graph, out = capture_queued(lambda: self.run(*static), inputs[0].device)
            entry = self._graphs[key] = (graph, static, out)
        else:
            for buffer, value in zip(entry[1], inputs):
                buffer.copy_(value)
        entry[0].replay()
        return entry[2]
