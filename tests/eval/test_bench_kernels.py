"""eval/bench_kernels.py's floor: the larger of a verify's matmul time at the GPU's peaks and its bytes at the copy rate."""

from __future__ import annotations

import pytest

from eval.bench_kernels import peak_tflops, verify_floor


def test_verify_floor():
    peaks = peak_tflops("NVIDIA H100 80GB HBM3", None)
    # H = 32, B = 16, T = 64, the 9B layer's heads and dims, trees of depth <= 8, at 3000 GB/s
    floor = verify_floor(16, 64, 16, 32, 128, 128, 8, peaks, 3000.0)
    assert floor["floor_ms"] == max(floor["floor_flop_ms"], floor["floor_byte_ms"])
    assert 0.020 < floor["floor_ms"] < 0.030  # bytes bound: q, k, v, the 16 x 32 fp32 states, o and u
    assert floor["floor_byte_ms"] > floor["floor_flop_ms"]
    # twice the batch, twice of everything
    double = verify_floor(32, 64, 16, 32, 128, 128, 8, peaks, 3000.0)
    assert double["floor_ms"] == pytest.approx(2 * floor["floor_ms"])
    with pytest.raises(SystemExit, match="--peak-tflops"):
        peak_tflops("NVIDIA A100-SXM4-80GB", None)
    assert peak_tflops("any", "312,156") == (312.0, 156.0)
