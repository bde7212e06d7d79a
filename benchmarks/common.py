"""What several benchmarks share; imports no other benchmark (they import it, never each other in a circle)."""

from __future__ import annotations

import time

import torch


def measured_peak(dtype: torch.dtype, n_max: int = 2048, budget_s: float = 2.0) -> float:
    """Dense matmul FLOP/s of this device in ``dtype`` (square n x n, best of several). The size grows from
    256 while one multiply stays well inside the time budget: a CPU without bf16 units emulates bf16 ~100x
    slower than fp32, where a 2048 multiply alone would take minutes."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def once(a, b) -> float:
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        return time.perf_counter() - t0

    n = 256
    while True:
        a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
        first = once(a, b)
        if n >= n_max or first * 8 > budget_s:  # the next size would take 8x as long
            break
        n *= 2
    best = min([first] + [once(a, b) for _ in range(max(1, min(10, int(budget_s / max(first, 1e-6)))))])
    return 2 * n**3 / best
