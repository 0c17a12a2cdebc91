"""`rotary` against float64 and bit for bit against transformers' Qwen3.5 `apply_rotary_pos_emb`: partial and full
rotary, other key heads than query heads, one token, the dtypes and their roundings, strided views of the
projections (read in place, one launch), a copied layout, bad input."""

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

from hf_bole.kernels import rotary as module
from hf_bole.kernels.rotary import naive_rotary, rotary
from hf_bole.kernels.utils import is_interpreter
from tests.kernels.trees import BACKENDS, backend_device

# (B, H, Hk, N, D, R): the small test model's heads (D 64, R 16), the 9B's (D 256, R 64) at one token, full rotary,
# more key heads than query heads, a head dim that is no power of two
SHAPES = [(2, 3, 1, 5, 64, 16), (1, 4, 2, 1, 256, 64), (2, 2, 2, 3, 32, 32), (1, 1, 3, 4, 48, 8)]


def _inputs(B, H, Hk, N, D, R, dtype, seed=0):
    """q, k as the attention hands them over (`.transpose(1, 2)` of `[B, N, heads, D]`) and cos, sin as Qwen3.5's
    rotary embedding makes them (each frequency twice, `[B, N, R]`), all in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, N, H, D, generator=gen) * 2).to(dtype).transpose(1, 2)
    k = (torch.randn(B, N, Hk, D, generator=gen) * 2).to(dtype).transpose(1, 2)
    angle = torch.rand(B, N, R // 2, generator=gen) * 60
    cos, sin = (torch.cat([f(angle)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    return q, k, cos, sin


def _to(device, *tensors):
    return [t.to(device) for t in tensors]


def _truncate_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 to bfloat16 by dropping the low 16 bits, as triton 3.x's interpreter casts (no rounding)."""
    return (x.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def _emulate(x, cos, sin, truncate=False):
    """The kernel's arithmetic on `x [B, heads, N, D]`: each product in float32, rounded to x's dtype (to nearest
    even as torch and CUDA cast, or with `truncate` as the interpreter casts to bfloat16), their float32 sum rounded
    again; the dims past R copied."""
    R = cos.shape[-1]
    c, s, f = cos.float().unsqueeze(1), sin.float().unsqueeze(1), x[..., :R].float()
    rot = torch.cat((-f[..., R // 2 :], f[..., : R // 2]), dim=-1)
    rounded = _truncate_bf16 if truncate else (lambda y: y.to(x.dtype))
    y = rounded(rounded(f * c).float() + rounded(rot * s).float())
    return torch.cat([y, x[..., R:]], dim=-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64(backend, shape):
    q, k, cos, sin = _inputs(*shape, torch.float32, seed=shape[-1])
    q_out, k_out = rotary(*_to(backend_device(backend), q, k, cos, sin))
    for out, x in ((q_out, q), (k_out, k)):
        assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    q_gold, k_gold = naive_rotary(q.double(), k.double(), cos.double(), sin.double())
    torch.testing.assert_close(q_out.cpu().double(), q_gold, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out.cpu().double(), k_gold, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernels_rounding_is_torchs(dtype):
    """The arithmetic the kernel does, with round-to-nearest-even casts (a GPU's), gives transformers' result bit for
    bit: why the kernel is exact on CUDA, checked here on the CPU."""
    for shape in SHAPES:
        q, k, cos, sin = _inputs(*shape, dtype, seed=1)
        q_gold, k_gold = apply_rotary_pos_emb(q, k, cos, sin)
        assert torch.equal(_emulate(q, cos, sin), q_gold)
        assert torch.equal(_emulate(k, cos, sin), k_gold)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_transformers(backend, dtype):
    """Bit for bit, except bfloat16 under the interpreter, whose casts truncate: there the kernel equals its own
    arithmetic with truncating casts bit for bit, and is within 3 ulps of |x * cos| + |rotate_half(x) * sin| of
    transformers (each truncation is under 1 ulp of its value and each rounding of transformers' within half of one,
    at most 2 + 1 ulps of that sum together); the dims past R are copied exactly."""
    device = backend_device(backend)
    truncating = is_interpreter() and dtype == torch.bfloat16
    for shape in SHAPES:
        q, k, cos, sin = _inputs(*shape, dtype, seed=2)
        outs = [out.cpu() for out in rotary(*_to(device, q, k, cos, sin))]
        R = cos.shape[-1]
        for out, x, gold in zip(outs, (q, k), apply_rotary_pos_emb(q, k, cos, sin)):
            assert out.dtype == dtype and torch.equal(out[..., R:], x[..., R:])
            if not truncating or torch.equal(out, gold):
                assert torch.equal(out, gold), f"{shape}: {(out != gold).sum()} entries differ"
                continue
            assert torch.equal(out, _emulate(x, cos, sin, truncate=True))
            f = x[..., :R].float()
            scale = (f * cos.float().unsqueeze(1)).abs() + (f.roll(R // 2, -1) * sin.float().unsqueeze(1)).abs()
            err = (out[..., :R].float() - gold[..., :R].float()).abs()
            assert (err <= 3 * torch.finfo(dtype).eps * scale).all()


def _count_copies_and_launches(monkeypatch):
    copies, launches = [], []
    contiguous, kernel = torch.Tensor.contiguous, module.rotary_kernel

    def counted(x, *args, **kwargs):
        copies.append(tuple(x.shape))
        return contiguous(x, *args, **kwargs)

    class Launches:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(torch.Tensor, "contiguous", counted)
    monkeypatch.setattr(module, "rotary_kernel", Launches())
    return copies, launches


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_read_in_place(backend, monkeypatch):
    """q as Qwen3.5 splits it from its gate (`[B, N, H, 2 D]` halves), k as a column slice of a fused projection,
    both transposed to `[B, heads, N, D]`, and cos, sin one batch row expanded: read through their strides, no copy,
    one launch for q and k; a strided last dim is copied and still right."""
    device = backend_device(backend)
    B, H, Hk, N, D, R = 2, 3, 2, 5, 32, 16
    gen = torch.Generator().manual_seed(3)
    q_proj = torch.randn(B, N, H * 2 * D, generator=gen).to(device)
    qkv = torch.randn(B, N, (H + 2 * Hk) * D, generator=gen).to(device)
    q = q_proj.view(B, N, H, 2 * D)[..., :D].transpose(1, 2)
    k = qkv[..., H * D : (H + Hk) * D].view(B, N, Hk, D).transpose(1, 2)
    angle = torch.rand(1, N, R // 2, generator=gen).to(device) * 60
    cos, sin = (torch.cat([f(angle)] * 2, dim=-1).expand(B, N, R) for f in (torch.cos, torch.sin))
    gold = naive_rotary(*(t.contiguous() for t in (q, k, cos, sin)))
    with monkeypatch.context() as patch:  # not monkeypatch.undo(): that would undo conftest's TRITON_INTERPRET too
        copies, launches = _count_copies_and_launches(patch)
        out = rotary(q, k, cos, sin)
    assert copies == [] and len(launches) == (1 if backend == "triton" else 0)
    assert all(torch.equal(x, y) for x, y in zip(out, gold))

    # every other element of a wider last dim: copied (the kernel reads the last dim contiguous)
    wide_q, wide_k = (torch.randn(B, heads, N, 2 * D, generator=gen).to(device) for heads in (H, Hk))
    wide_cos = torch.randn(B, N, 2 * R, generator=gen).to(device)
    args = (wide_q[..., ::2], wide_k[..., 1::2], wide_cos[..., ::2], wide_cos[..., 1::2])
    with monkeypatch.context() as patch:
        _, launches = _count_copies_and_launches(patch)
        out = rotary(*args)
    assert len(launches) == (1 if backend == "triton" else 0)
    gold = naive_rotary(*(t.contiguous() for t in args))
    assert all(torch.equal(x, y) for x, y in zip(out, gold))


def test_bad_input_says_what():
    q, k, cos, sin = _inputs(2, 3, 1, 5, 64, 16, torch.float32)
    with pytest.raises(ValueError, match=r"`q` must have dtype in \(float32, float16, bfloat16\), got float64"):
        rotary(q.double(), k.double(), cos.double(), sin.double())
    with pytest.raises(ValueError, match="`k` must have q's dtype float32, got bfloat16"):
        rotary(q, k.bfloat16(), cos, sin)
    with pytest.raises(ValueError, match="`sin` must have q's dtype float32, got float16"):
        rotary(q, k, cos, sin.half())
    with pytest.raises(ValueError, match=r"`q` must have shape \[B, H, N, D\], got \(3, 5, 64\)"):
        rotary(q[0], k, cos, sin)
    with pytest.raises(ValueError, match=r"`k` must have shape \[B, Hk, N, D\] with q's B, N, D = \(2, 1, 5, 64\)"):
        rotary(q, k[:, :, :4], cos, sin)
    with pytest.raises(ValueError, match=r"`cos` must have shape \[B, N, R\] with q's B, N = \(2, 5, 16\), got"):
        rotary(q, k, cos[:1], sin)
    with pytest.raises(ValueError, match=r"`sin` must have shape \[B, N, R\], cos's shape = \(2, 5, 16\)"):
        rotary(q, k, cos, sin[..., :8])
    with pytest.raises(ValueError, match="must be even and at most D = 64, got R = 15"):
        rotary(q, k, cos[..., :15], sin[..., :15])
    with pytest.raises(ValueError, match="must be even and at most D = 64, got R = 80"):
        rotary(q, k, cos.repeat(1, 1, 5), sin.repeat(1, 1, 5))
    with pytest.raises(ValueError, match="all inputs must be on one device, got q on cpu, k on meta"):
        rotary(q, k.to("meta"), cos, sin)
