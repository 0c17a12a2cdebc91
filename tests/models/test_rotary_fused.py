"""Each attention layer's rotary embedding of an eager verify forward as one kernel; transformers' function outside
tree mode, and for calls the kernel does not cover."""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

from hf_bole.cache import BoleCache
from hf_bole.models import adapter
from hf_bole.models import rotary as rotary_module
from hf_bole.models import tree_forward
from tests.models.tiny import build_model, prefill, random_tree_logits

pytestmark = pytest.mark.usefixtures("torch_gdn")


def _count_kernel_calls(monkeypatch) -> list[int]:
    calls = [0]
    original = rotary_module.rotary

    def counted(*args):
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(rotary_module, "rotary", counted)
    return calls


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tree_forward_runs_every_rotary_embedding_through_the_kernel(monkeypatch, kind):
    """One `rotary` call per full-attention layer in a tree forward; a plain forward after it calls none."""
    model = build_model(kind)
    calls = _count_kernel_calls(monkeypatch)
    random_tree_logits(model)
    assert calls[0] == model.config.layer_types.count("full_attention")
    model(torch.tensor([[5, 17, 33]]))
    assert calls[0] == model.config.layer_types.count("full_attention")


def test_compiled_forward_does_not_swap(monkeypatch):
    """`compile=True` leaves the rotary embedding to inductor: the context is not entered."""
    entered = []
    monkeypatch.setattr(adapter, "rotary_fused", lambda: entered.append(1) or contextlib.nullcontext())
    monkeypatch.setattr(adapter, "_compiled", lambda decoder: decoder.forward)  # the same forward, not compiled
    model = build_model("dense")
    cache = BoleCache(model.config, batch_size=1)
    tokens = torch.tensor([[prefill(model, cache, [[5, 17, 33]])[0], 7, 8]])
    tree_forward(model, cache, tokens, torch.tensor([[-1, 0, 0]]), compile=True)
    assert not entered


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_kernel_gives_the_model_rotary_logits(monkeypatch, kind):
    """Through the Triton kernel (the interpreter on the CPU), the tree's logits are the ones transformers' own
    rotary embedding gives (float32: bit for bit per op, so the logits agree to float32 rounding)."""
    model = build_model(kind)
    fused = random_tree_logits(model)
    monkeypatch.setattr(adapter, "rotary_fused", contextlib.nullcontext)
    torch.testing.assert_close(fused, random_tree_logits(model), rtol=1e-6, atol=1e-6)


def test_call_the_kernel_does_not_cover_goes_to_transformers_and_says_so(caplog):
    """Another `unsqueeze_dim` (or mixed dtypes) runs transformers' function, named once in a warning."""
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    q, k = torch.randn(2, 5, 3, 16, generator=gen), torch.randn(2, 5, 1, 16, generator=gen)  # [B, N, heads, D]
    cos, sin = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    with caplog.at_level(logging.WARNING), rotary_module.rotary_fused():
        got = modeling_qwen3_5.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        modeling_qwen3_5.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    gold = rotary_module.modules()[0].apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
    assert all(torch.equal(a, b) for a, b in zip(got, gold))
    assert caplog.text.count("elementwise kernels (unsqueeze_dim=2)") == 1


def test_nested_contexts_restore_the_original(monkeypatch):
    """A context inside another leaves the kernel on until the outer one ends."""
    calls = _count_kernel_calls(monkeypatch)
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    q, k = torch.randn(2, 3, 5, 16, generator=gen), torch.randn(2, 1, 5, 16, generator=gen)  # [B, heads, N, D]
    cos, sin = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 5, 16, generator=gen)
    with rotary_module.rotary_fused():
        with rotary_module.rotary_fused():
            modeling_qwen3_5.apply_rotary_pos_emb(q, k, cos, sin)
        modeling_qwen3_5_moe.apply_rotary_pos_emb(q, k, cos, sin)
        assert calls[0] == 2
    modeling_qwen3_5.apply_rotary_pos_emb(q, k, cos, sin)
    assert calls[0] == 2


def test_other_threads_call_transformers_function(monkeypatch):
    """Inside the context only this thread's calls take the kernel: another thread's go to transformers' function."""
    calls = _count_kernel_calls(monkeypatch)
    gen = torch.Generator(torch.get_default_device()).manual_seed(0)
    q, k = torch.randn(2, 3, 5, 16, generator=gen), torch.randn(2, 1, 5, 16, generator=gen)
    cos, sin = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 5, 16, generator=gen)
    with rotary_module.rotary_fused():
        thread = threading.Thread(target=modeling_qwen3_5.apply_rotary_pos_emb, args=(q, k, cos, sin))
        thread.start()
        thread.join()
        assert calls[0] == 0
        modeling_qwen3_5.apply_rotary_pos_emb(q, k, cos, sin)
    assert calls[0] == 1
