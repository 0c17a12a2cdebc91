"""How long the host spends in each CUDA graph launch of hf_bole's rounds, and whether the GPU waits for it.

The twenty-first session's kernel log (house model, batch 8, `profile_b8/`) showed the GPU idle for 0.6 ms right
before the first kernel of every round's drafting graph, and 0.45 ms before the verify graph's, while the profiler
counted `cudaGraphLaunch` at 363 us a call on the host (490 us eager). The profiler's own tracing of graph nodes may
inflate that; this script measures without it. Arguments: eval/run.py's (the first batch size and dataset; `bole`
mode). Per graph launched from a round (named by the function that replays it), it prints the median host time of
`CUDAGraph.replay` inside generate, then for each graph in isolation: the launch's host time when the GPU is idle,
back to back (replays queued behind each other) and the GPU time of one replay.

    python results/speed_h200/twenty_first_session/graph_launch.py --datasets mbpp --num-prompts 8 \\
        --max-new-tokens 128 --batch-sizes 8
"""

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import hf_bole  # noqa: E402
from eval import run  # noqa: E402
from eval.modes import make_modes  # noqa: E402


def main(argv: list[str]) -> None:
    args = run.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    run.set_backends(args)
    model, tokenizer, label = run.load_target(args, device, torch.bfloat16)
    _, prompts = next(iter(run.load_prompt_sets(args, model, tokenizer).items()))
    generation = run.generation_kwargs(args, model, tokenizer)
    B = args.batch_sizes[0]
    batch = list(range(min(B, len(prompts))))
    (mode,) = make_modes("bole", B, args)
    hf_bole.warmup(model, len(batch), verify=mode.verify or "closed_form", compile=mode.compile)
    for _ in range(2):  # captures every graph the rounds replay
        run.run_batch(model, tokenizer, prompts, batch, mode, args, generation, [])

    replay, launches, graphs = torch.cuda.CUDAGraph.replay, defaultdict(list), {}

    def timed(graph):
        caller = sys._getframe(1).f_code.co_name
        start = time.perf_counter()
        replay(graph)
        launches[caller].append(time.perf_counter() - start)
        graphs.setdefault(caller, graph)

    torch.cuda.CUDAGraph.replay = timed
    try:
        record = run.run_batch(model, tokenizer, prompts, batch, mode, args, generation, [])
    finally:
        torch.cuda.CUDAGraph.replay = replay
    print(f"\n{label}, batch {B}, {torch.cuda.get_device_name(device)}, torch {torch.__version__}; "
          f"{sum(len(t) for t in record['tokens']) / record['seconds']:.1f} tokens/s in the timed call")  # fmt: skip
    print("| graph (replayed from) | launches | host us a launch in generate | idle GPU: host us | "
          "back to back: host us | GPU us a replay |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for caller, times in launches.items():
        graph, idle, queued = graphs[caller], [], []
        for _ in range(20):
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            idle.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(20):
            start = time.perf_counter()
            graph.replay()
            queued.append(time.perf_counter() - start)
        end.record()
        torch.cuda.synchronize()
        median = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
        print(f"| {caller} | {len(times)} | {median(times):.0f} | {median(idle):.0f} | {median(queued):.0f} | "
              f"{begin.elapsed_time(end) * 1e3 / 20:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
