"""`rms_norm` and `gated_rms_norm` against float64 and against transformers' Qwen3.5 norm modules: rows of one
stride, strided views of a projection (read in place), a copied layout, dtypes and their roundings, bad input."""

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from hf_bole.kernels.rmsnorm import _rows, gated_rms_norm, naive_gated_rms_norm, naive_rms_norm, rms_norm
from hf_bole.kernels.utils import is_interpreter
from tests.kernels.trees import BACKENDS, backend_device

EPS = 1e-6


def _ulps(dtype) -> int:
    """How many units in the last place a half-precision output may be off: 1 (the mean's summation order), but the
    interpreter (triton 3.9) casts float32 to bfloat16 by truncation, at each of the gated norm's three roundings."""
    return 4 if is_interpreter() and dtype == torch.bfloat16 else 1


def _close_in_ulps(out: torch.Tensor, gold: torch.Tensor) -> bool:
    ulp = torch.finfo(gold.dtype).eps * gold.float().abs().clamp_min(1e-3)
    return bool(((out.float() - gold.float()).abs() <= _ulps(gold.dtype) * ulp).all())


def _inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=gen) * 2 + 0.5).to(dtype)
    gate = torch.randn(*shape, generator=gen).to(dtype)
    weight = (torch.randn(shape[-1], generator=gen) * 0.3).to(dtype)
    return x, gate, weight


def _views(device):
    """(name, x) pairs: a contiguous block, a projection's column slice (one stride), a q view split from its gate
    (two strides), a transposed block (two strides) and a permuted one (three: copied)."""
    gen = torch.Generator().manual_seed(0)
    proj = torch.randn(2, 5, 3 * 64 + 40, generator=gen).to(device)  # [B, N, q|gate per head ... | other]
    heads = proj[..., : 3 * 64].view(2, 5, 3, 64)
    return [
        ("contiguous", torch.randn(4, 7, 48, generator=gen).to(device)),
        ("column slice", proj[..., 40:104]),
        ("q of q|gate", heads[..., :32]),
        ("transposed", torch.randn(6, 3, 32, generator=gen).to(device).transpose(0, 1)),
        ("permuted", torch.randn(4, 3, 2, 32, generator=gen).to(device).permute(2, 1, 0, 3)),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(3, 16), (2, 5, 4, 256), (7, 1000), (1, 1, 2048)])
def test_matches_float64(backend, shape):
    x, gate, weight = _inputs(shape, torch.float32, seed=shape[-1])
    device = backend_device(backend)
    out = rms_norm(x.to(device), weight.to(device), EPS)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    gold = naive_rms_norm(x.double(), weight.double(), EPS)
    torch.testing.assert_close(out.cpu().double(), gold, rtol=1e-5, atol=1e-5)
    out = gated_rms_norm(x.to(device), gate.to(device), weight.to(device), EPS)
    gold = naive_gated_rms_norm(x.double(), gate.double(), weight.double(), EPS)
    torch.testing.assert_close(out.cpu().double(), gold, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_read_in_place(backend):
    device = backend_device(backend)
    for name, x in _views(device):
        weight = torch.linspace(-0.5, 0.5, x.shape[-1], device=device)
        gate = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device)
        torch.testing.assert_close(rms_norm(x, weight, EPS), naive_rms_norm(x, weight, EPS), msg=name)
        torch.testing.assert_close(
            gated_rms_norm(x, gate.transpose(0, 1).contiguous().transpose(0, 1), weight, EPS),
            naive_gated_rms_norm(x, gate, weight, EPS),
            msg=name,
        )


def test_rows_keep_views_and_copy_the_rest():
    views = dict(_views("cpu"))
    for name in ("contiguous", "column slice", "q of q|gate", "transposed"):
        x = views[name]
        same, inner, outer, stride = _rows(x)
        assert same is x, name
        r = torch.arange(x.numel() // x.shape[-1])
        starts = (r // inner) * outer + (r % inner) * stride  # every row's first element, in storage order of x
        rows = x.reshape(-1, x.shape[-1])
        flat = x.as_strided((x.untyped_storage().nbytes() // x.element_size(),), (1,), 0)
        assert torch.equal(flat[starts + x.storage_offset()], rows[:, 0]), name
    copied, inner, outer, stride = _rows(views["permuted"])
    assert copied.is_contiguous() and (inner, outer, stride) == (24, 0, 32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights", ["same", "float32"])
def test_matches_the_model_modules(backend, dtype, weights):
    """Against transformers' own modules on half-precision activations, with weights in their dtype (the gated
    norm's `weight * normalised` then rounds to it) or in float32 (it does not): the same roundings, so equal up to
    the last bit of a few entries (the mean's summation order)."""
    x, gate, _ = _inputs((6, 9, 128), dtype, seed=3)
    norm, gated = Qwen3_5RMSNorm(128, eps=EPS), Qwen3_5RMSNormGated(128, eps=EPS)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
        gated.weight.normal_(1, 0.3)
    if weights == "same":
        norm, gated = norm.to(dtype), gated.to(dtype)
    device = backend_device(backend)
    for out, gold in [
        (rms_norm(x.to(device), norm.weight.to(device), EPS), norm(x)),
        (gated_rms_norm(x.to(device), gate.to(device), gated.weight.to(device), EPS), gated(x, gate)),
    ]:
        out = out.cpu()
        assert out.dtype == dtype and _close_in_ulps(out, gold)
        if _ulps(dtype) == 1:
            assert (out == gold).float().mean() > 0.95


def test_bad_input_says_what():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"`weight` must have shape \[D\], x's last dim = \(8,\), got \(7,\)"):
        rms_norm(x, torch.ones(7), EPS)
    with pytest.raises(ValueError, match="`gate` must have shape x's shape"):
        gated_rms_norm(x, torch.ones(3, 4), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="`x` must have dtype in"):
        rms_norm(x.long(), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="all inputs must be on one device, got x on cpu, weight on meta"):
        rms_norm(x, torch.ones(8, device="meta"), EPS)
