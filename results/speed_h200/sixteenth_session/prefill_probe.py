"""What a prompt's prefill costs on the 9B shape at batch 1: transformers' eager forward over the prompt (what
hf_bole's generate runs today) against the prompt as chains of at most 128 nodes through the verify forward
replayed from CUDA graphs, each chain committed whole. Medians of 7 warm calls, synchronised; the last position's
hidden state compared between the two.

    python results/speed_h200/sixteenth_session/prefill_probe.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from eval.shapes import build_model, shape_config  # noqa: E402
from hf_bole.cache import BoleCache  # noqa: E402
from hf_bole.generation.graphs import VerifyGraphs  # noqa: E402
from hf_bole.models import attention_backends, cache_argument  # noqa: E402


def timed(fn, reps: int = 7) -> tuple[float, object]:
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), out


@torch.no_grad()
def main():
    device = torch.device("cuda")
    model = build_model(shape_config("9B"), device, torch.bfloat16)
    decoder = model.get_decoder()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for P in (128, 512, 1024):
        prompt = torch.randint(0, 248000, (1, P), device=device)
        cache = BoleCache.for_model(model, 1, max_cache_len=P + 256)
        graphs = VerifyGraphs(model, cache, "closed_form")

        def plain():
            cache.reset()
            out = decoder(input_ids=prompt, use_cache=True, **{cache_argument(type(decoder).forward): cache})
            return out.last_hidden_state[:, -1]

        def chains():
            cache.reset()
            for start in range(0, P, 128):
                ids = prompt[:, start : start + 128]
                n = ids.shape[1]
                parents = (torch.arange(n, device=device) - 1)[None]
                out = graphs(ids, parents)
                cache.commit(torch.arange(n, device=device)[None], check_values=False)
            return out.hidden_states[:, -1]

        with attention_backends():
            t_plain, h_plain = timed(plain)
            t_chain, h_chain = timed(chains)
        diff = (h_plain.float() - h_chain.float()).abs().max().item()
        scale = h_plain.float().abs().max().item()
        same = bool((model.lm_head(h_plain).argmax(-1) == model.lm_head(h_chain).argmax(-1)).all())
        print(f"P {P:5d}: eager prefill {t_plain:7.2f} ms, chains through graphs {t_chain:7.2f} ms, "
              f"last hidden max diff {diff:.3g} of {scale:.3g}, same next token {same}", flush=True)


if __name__ == "__main__":
    main()
