"""Random trees of every kind, as parent arrays in topological order, GDN inputs on them, and the backends the
kernel tests run on."""

from __future__ import annotations

import pytest
import torch

# "triton": the compiled kernel on a GPU, the interpreter on the CPU; "torch": the torch path on the CPU.
BACKENDS = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton", marks=pytest.mark.interpreter)]


def backend_device(backend: str) -> str:
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def star(n: int) -> list[int]:
    return [-1] + [0] * (n - 1)


def random_tree(n: int, max_depth: int, branching: float, gen: torch.Generator) -> list[int]:
    """Each new node hangs off a random earlier node whose depth is below max_depth; `branching` near 1
    prefers recent nodes (deep and narrow), near 0 any node (bushy)."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        while True:
            if torch.rand(1, generator=gen).item() < branching:
                p = i - 1 - int(torch.randint(0, min(i, 3), (1,), generator=gen))
            else:
                p = int(torch.randint(-1, i, (1,), generator=gen))
            d = 0 if p < 0 else depth[p] + 1
            if d <= max_depth:
                break
        parents.append(p)
        depth.append(d)
    return parents


def make_parents(kind: str, n: int, batch: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        if kind == "chain":
            rows.append(chain(n))
        elif kind == "star":
            rows.append(star(n))
        elif kind == "deep":
            rows.append(random_tree(n, max_depth=16, branching=0.9, gen=gen))
        elif kind == "bushy":
            rows.append(random_tree(n, max_depth=4, branching=0.1, gen=gen))
        elif kind == "mixed":
            rows.append(random_tree(n, max_depth=8, branching=0.5, gen=gen))
        else:
            raise ValueError(kind)
    return torch.tensor(rows, dtype=torch.int64)


def path_to(parents: torch.Tensor, b: int, i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = int(parents[b, i])
    return path[::-1]


def gdn_inputs(B, T, HK, H, K, V, dtype=torch.float32, device="cpu", seed=0):
    """Inputs shaped like a Qwen3.5 GDN layer's: raw q/k (normalised in the kernel), gates in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, HK, K, generator=gen)
    k = torch.randn(B, T, HK, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen) + 2.0)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen) * 0.5
    cast = lambda x: x.to(dtype=dtype, device=device)  # noqa: E731
    return cast(q), cast(k), cast(v), g.to(device), beta.to(device), h0.to(device)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    assert not torch.isnan(x).any(), "NaN in output"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()
