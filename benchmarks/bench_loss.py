"""Chunked loss vs. full logits: peak memory of live tensors and time of forward + backward.

Issue 5's target shape is 16,384 tokens x 151,936 vocab x 896 hidden in fp32. The full-logits side of
that needs ~30 GB (logits, log-softmax and their gradient, 10 GB each), more than the 24 GB dev
machine has, so by default both sides run at 4,096 tokens; pass --tokens 16384 on a bigger machine.

    .venv/bin/python benchmarks/bench_loss.py [--tokens 4096] [--vocab 151936] [--hidden 896] [--chunk 1024]
"""

from __future__ import annotations

import argparse
import time

import torch

from leansft.core.metrics.memtrack import TensorMemoryTracker
from leansft.core.model.loss import chunked_loss, full_logits_loss


def measure(fn, hidden, weight, labels):
    hidden.grad = weight.grad = None
    with TensorMemoryTracker() as tr:
        t0 = time.perf_counter()
        loss, _ = fn(hidden, weight, labels)
        loss.backward()
        dt = time.perf_counter() - t0
    return tr.peak, dt, float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--chunk", type=int, default=1024)
    args = ap.parse_args()
    torch.manual_seed(0)
    hidden = (torch.randn(1, args.tokens, args.hidden) * 0.1).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.tokens))
    chunked = measure(lambda h, w, y: chunked_loss(h, w, y, args.chunk), hidden, weight, labels)
    full = measure(full_logits_loss, hidden, weight, labels)
    print(f"{args.tokens:,} tokens x {args.vocab:,} vocab x {args.hidden} hidden, fp32, CPU")
    print(f"{'':14s} {'peak GB':>9s} {'seconds':>9s} {'loss':>12s}")
    print(f"{'chunked':14s} {chunked[0] / 1e9:9.2f} {chunked[1]:9.2f} {chunked[2]:12.2f}")
    print(f"{'full logits':14s} {full[0] / 1e9:9.2f} {full[1]:9.2f} {full[2]:12.2f}")
    print(f"memory ratio full/chunked: {full[0] / chunked[0]:.1f}x   time ratio chunked/full: {chunked[1] / full[1]:.2f}x")


if __name__ == "__main__":
    main()
