"""On a GPU with fla-core importable: do transformers' fla-backed GDN layers agree with its torch reference, and
does a BoleCache decode like a DynamicCache there? (`bash eval/gpu_session.sh fla`)

With fla-core 0.6 on the path, 14 model tests failed on an H200 (2026-11-30). The cause, found afterwards on the
CPU (fla's kernels under the Triton interpreter): hf_bole's recurrence seam passed (query, key, value, g, beta)
positionally to the implementation transformers resolved, and fla-core 0.6's `fused_recurrent_gated_delta_rule`
takes (q, k, v, g, gk, gv, beta, ...), so beta arrived as gk and every plain decode step was wrong (NaN on the CPU)
in any process where hf_bole had wrapped the seams. The seams now pass plain calls on untouched. This prints, per
case, the largest differences (fla's chunk kernel differs from the torch reference by ~1e-3 in fp32 on the GPU:
tf32 dots), then the model-level comparison, which should now agree to that precision.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import DynamicCache  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen  # noqa: E402

from hf_bole import BoleCache  # noqa: E402
from tests.models.tiny import build_model, left_pad  # noqa: E402

CASES = [  # B, T, H, K, V, dtype: the test models' heads, then Qwen3.5's, then a bf16 prefill
    (3, 7, 4, 16, 16, torch.float32), (3, 1, 4, 16, 16, torch.float32), (3, 7, 4, 128, 128, torch.float32),
    (3, 1, 4, 128, 128, torch.float32), (2, 40, 3, 128, 128, torch.bfloat16),
]  # fmt: skip


def implementation(fn):
    """The function transformers' kernel decorator resolved (fla's, or the torch reference itself)."""
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    return cells.get("implementation", fn)


def kernels(device: str) -> None:
    chunk, recurrent = qwen.torch_chunk_gated_delta_rule, qwen.torch_recurrent_gated_delta_rule
    print("chunk:", implementation(chunk).__module__, " recurrent:", implementation(recurrent).__module__)
    for B, T, H, K, V, dtype in CASES:
        q, k = (torch.randn(B, T, H, K, device=device, dtype=dtype) for _ in range(2))
        v = torch.randn(B, T, H, V, device=device, dtype=dtype)
        g, beta = -0.5 * torch.rand(B, T, H, device=device), torch.rand(B, T, H, device=device, dtype=dtype)
        h0 = torch.randn(B, H, K, V, device=device)
        for name, fn in (("chunk", chunk), ("recurrent", recurrent)):
            for init in (None, h0):
                kw = dict(g=g, beta=beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
                kept = None if init is None else init.clone()
                o1, s1 = fn(q, k, v, **kw)
                o2, s2 = inspect.unwrap(fn)(q, k, v, **kw)
                moved = init is not None and not torch.equal(kept, init)
                print(
                    f"{name:9s} B{B} T{T} H{H} K{K} {str(dtype)[6:]:8s} initial state {'yes' if init is not None else 'no '}"
                    f" | o {(o1.float() - o2.float()).abs().max():.1e} of {o2.float().abs().max():.1e}"
                    f" | state {(s1.float() - s2.float()).abs().max():.1e} | initial state written: {moved}",
                    flush=True,
                )


@torch.no_grad()
def model_level(device: str) -> None:
    torch.set_default_device(device)
    model = build_model()
    ids, mask = left_pad([[5, 17, 33, 2, 41, 9, 60], [71, 3, 28, 44], [13]])

    def logits(cache):
        out = model(ids, attention_mask=mask, past_key_values=cache)
        steps, m = [out.logits], mask
        for _ in range(3):
            m = torch.cat([m, torch.ones(3, 1, dtype=m.dtype)], 1)
            out = model(out.logits[:, -1:].argmax(-1), attention_mask=m, past_key_values=cache)
            steps.append(out.logits)
        return torch.cat(steps, 1)

    first = logits(DynamicCache(config=model.config))  # the first call: fla autotunes here
    again = logits(DynamicCache(config=model.config))
    bole = logits(BoleCache(model.config, batch_size=3))
    for wrapped in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        setattr(qwen, wrapped, inspect.unwrap(getattr(qwen, wrapped)))  # the torch reference from here on
    reference = logits(DynamicCache(config=model.config))
    for name, x in (("fla, DynamicCache, 1st call", first), ("fla, DynamicCache, 2nd call", again), ("fla, BoleCache", bole)):
        per_position = (x - reference).abs().amax((0, 2))
        print(f"{name:28s} vs torch reference, max |logit difference| per position:",
              " ".join(f"{d:.1e}" for d in per_position.tolist()), flush=True)  # fmt: skip


if __name__ == "__main__":
    kernels("cuda")
    model_level("cuda")
