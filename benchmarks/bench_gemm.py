"""The GPU's matrix-product ceilings, measured: bf16, fp32 (IEEE) and TF32, square products, CUDA events, the
median of ``--repeat`` after warm-ups, random data (zeros run faster). The MFU figures elsewhere use the datasheet's
dense bf16 peak (core/metrics/flops.py); these say what this card delivers.

    python3 benchmarks/bench_gemm.py [--size 8192] [--repeat 10]      (--size 256 on the CPU: the miniature)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from results import emit  # noqa: E402


def timed_ms(fn, repeat: int) -> float:
    cuda = torch.cuda.is_available()
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = args.size
    for name, dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp32", torch.float32, False),
                              ("tf32", torch.float32, True)):
        if dev == "cpu" and tf32:
            continue
        was = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
            ms = timed_ms(lambda a=a, b=b: a @ b, args.repeat)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = was
        emit("gemm", dtype=name, size=n, ms=round(ms, 4), tflops=round(2 * n**3 / ms / 1e9, 1))


if __name__ == "__main__":
    main()
