"""The output layer and loss alone, side by side: time (forward + backward), peak memory, and the loss and gradients
against an fp64 reference of the same inputs. What decides leansft's default head on CUDA.

Variants, as a bf16-autocast run with fp32 master weights hands them the final hidden states and the head weight
(both fp32):

- ``chunked_fp32``: leansft's chunked head with the plain policy (fp32 products: what ran before);
- ``chunked_bf16``: the same with ``TENSOR_CORES`` (bf16 products, fp32 accumulation and results): the default;
- ``liger``: Liger-Kernel's fused linear cross-entropy on bf16 inputs (where liger-kernel imports, on CUDA);
- ``full_logits``: the whole [tokens, vocab] logits under autocast, then cross-entropy (what a model's own loss does).

    python3 benchmarks/bench_head.py [--shapes 0.5b,1.5b,8b] [--tokens 16384] [--chunk 1024,4096] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from results import emit, sync  # noqa: E402

from leansft.core.model.loss import PLAIN, TENSOR_CORES, chunked_loss, full_logits_loss, liger_loss  # noqa: E402

HEADS = {"tiny": (64, 4096), "0.5b": (896, 151936), "1.5b": (1536, 151936), "8b": (4096, 128256)}  # hidden, vocab


def variants(device: torch.device, chunks: list[int]) -> dict:
    """name -> (loss function of (hidden, weight, labels), chunk size or None)."""
    def chunked(policy, chunk):
        return lambda h, w, y: chunked_loss(h, w, y, chunk, precision=policy)[0]

    out = {"chunked_fp32": (chunked(PLAIN, chunks[0]), chunks[0])}
    out |= {"chunked_bf16" if i == 0 else f"chunked_bf16_{c}": (chunked(TENSOR_CORES, c), c)
            for i, c in enumerate(chunks)}
    out["full_logits"] = (lambda h, w, y: full_logits_loss(h, w, y)[0], None)
    try:
        import liger_kernel  # noqa: F401

        if device.type == "cuda":
            out["liger"] = (lambda h, w, y: liger_loss(h, w, y, low=torch.bfloat16)[0], None)
    except ImportError:
        pass
    return out


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0.5b,1.5b,8b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunk", default="1024,4096", help="chunk sizes of the chunked head (the first for fp32)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for shape in args.shapes.split(","):
        hidden, vocab = HEADS[shape]
        g = torch.Generator(device=device).manual_seed(0)
        h0 = torch.randn(1, args.tokens, hidden, device=device, generator=g)
        w0 = torch.randn(vocab, hidden, device=device, generator=g) * hidden**-0.5
        y = torch.randint(0, vocab, (1, args.tokens), device=device, generator=g)
        hd, wd = (x.double().requires_grad_() for x in (h0, w0))
        ref, _ = full_logits_loss(hd, wd, y)  # fp64: the reference
        ref.backward()
        ref_loss, ref_h, ref_w = float(ref.detach()), hd.grad, wd.grad
        del hd, wd, ref
        for name, (fn, chunk) in variants(device, [int(c) for c in args.chunk.split(",")]).items():
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()

            def step(h=h, w=w, fn=fn):
                h.grad = w.grad = None
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = fn(h, w, y)
                loss.backward()
                return loss

            try:
                step()
                sync()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                times = []
                for _ in range(args.repeat):
                    sync()
                    t0 = time.perf_counter()
                    loss = step()
                    sync()
                    times.append(1e3 * (time.perf_counter() - t0))
                peak = (torch.cuda.max_memory_allocated() - base) / 1e9 if device.type == "cuda" else None
            except Exception as err:  # noqa: BLE001 - a variant that cannot run here is reported, not fatal
                emit("head", shape=shape, variant=name, error=f"{type(err).__name__}: {str(err)[:200]}")
                continue
            ms = statistics.median(times)
            flops = 6 * args.tokens * hidden * vocab  # logits, grad of hidden, grad of weight
            emit("head", shape=shape, variant=name, chunk=chunk, tokens=args.tokens, hidden=hidden, vocab=vocab,
                 ms=round(ms, 3),
                 tflops=round(flops / ms / 1e9, 1), peak_gb=None if peak is None else round(peak, 2),
                 loss_rel_err=abs(float(loss) - ref_loss) / abs(ref_loss), grad_h_rel_err=rel(h.grad, ref_h),
                 grad_w_rel_err=rel(w.grad, ref_w))
            del h, w
        del ref_h, ref_w


if __name__ == "__main__":
    main()
