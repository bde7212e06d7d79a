"""Where a recipe step's device time goes: two steps of a shape (benchmarks/gpu_shapes.py) under torch.profiler,
after warm-up steps, as the recipe runs them (``train_step`` with its batches prepared ahead and pinned).

Shares of the steps' wall time: bf16 GEMMs, fp32 GEMMs (TF32 included: a GEMM whose inputs are not half precision,
told by the op's recorded input dtypes), attention, the optimizer, other kernels (elementwise, reductions, copies),
and idle (the device running nothing: wall time minus the union of kernel intervals, so launch gaps and host waits
show there). A row (part "profile") goes to
results.jsonl with the shares, ``idle_share`` among them, and the top kernels.

    python3 benchmarks/profile_gpu.py [--shape 0.5b] [--steps 2] [--warmup 3] [--tokens 16384]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from gpu_shapes import make_model, run_overrides, write_chats  # noqa: E402
from recipe_parts import build_parts  # noqa: E402
from results import emit, sync  # noqa: E402

WORK = Path(os.environ.get("LEANSFT_BENCH_WORK", "runs")) / "profile_gpu"  # where its models and data go
GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "_scaled_mm", "addmm_"}
ATTENTION = ("flash", "fmha", "attention", "attn", "varlen")
OPTIMIZER = ("adam", "multi_tensor", "foreach")


def kind_of(ev, dtypes: list[str]) -> str:
    """An aten op's kind: GEMMs by their inputs' dtype (bf16/fp16: tensor cores; else fp32 or TF32), attention,
    the optimizer, or other (elementwise, reductions, copies)."""
    name = ev.name.removeprefix("aten::").lower()
    if any(k in name for k in ATTENTION):
        return "attention"
    if any(k in name for k in OPTIMIZER):
        return "optimizer"
    if name in GEMM_OPS:
        return "bf16_gemm" if any("BFloat16" in d or "Half" in d for d in dtypes) else "fp32_gemm"
    return "other"


def recorded_dtypes(prof) -> dict[int, list[str]]:
    """Each CPU op's input dtypes by its id (``record_shapes``): torch 2.13's events carry them, torch 2.11's only
    the profiler's raw events do."""
    return {e.correlation_id(): list(e.dtypes()) for e in prof.profiler.kineto_results.events()
            if e.device_type() == torch.autograd.DeviceType.CPU}


def union_us(spans: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return busy


def build(over: list[str]):
    """What ``train()`` builds before its loop, with the recipe's own builders (``recipe_parts``)."""
    parts = build_parts(over)
    return parts.engine(), parts.batches(ahead=True), parts.window()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--compile", default="false")
    ap.add_argument("--examples", type=int, default=1000)
    args = ap.parse_args(argv)
    from leansft.recipe.train import train_step

    cuda = torch.cuda.is_available()
    model = make_model(args.shape, WORK / f"model-{args.shape}", "cuda" if cuda else "cpu")
    over = run_overrides(args.shape, model, write_chats(WORK / "chats.jsonl", args.examples), WORK,
                         compiled=args.compile == "true", precision="bf16" if cuda else "fp32",
                         steps=1000, tokens=args.tokens)
    engine, steps, window = build(over)
    with steps:
        for i in range(args.warmup):
            batches, _ = next(steps)
            train_step(engine, batches, window.count(batches), i + 1)
        sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts, record_shapes=True) as prof:
            t0 = time.perf_counter()
            for i in range(args.steps):
                batches, _ = next(steps)
                train_step(engine, batches, window.count(batches), args.warmup + i + 1)
            sync()
            wall_us = 1e6 * (time.perf_counter() - t0)
    kinds, names, spans = defaultdict(float), defaultdict(float), []
    dtypes = recorded_dtypes(prof)
    for ev in prof.events():
        if cuda and ev.device_type == torch.autograd.DeviceType.CUDA:  # a kernel: when the device was busy
            spans.append((ev.time_range.start, ev.time_range.end))
            continue
        if not ev.name.startswith("aten::"):
            continue
        dur = ev.self_device_time_total if cuda else ev.self_cpu_time_total  # its own kernels / its own time
        if dur > 0:
            kinds[kind_of(ev, getattr(ev, "input_dtypes", None) or dtypes.get(ev.id, []))] += dur
            names[ev.name[:80]] += dur
    busy = union_us(spans) if cuda else sum(kinds.values())  # the CPU miniature: little meaning, same code
    if cuda:  # kernels launched by no aten op (a compiled layer's Triton kernels) are "other" too
        kinds["other"] = max(0.0, busy - sum(v for k, v in kinds.items() if k != "other"))
    shares = {f"{k}_share": round(v / wall_us, 4) for k, v in kinds.items()}
    top = [f"{n} {1e-3 * d / args.steps:.1f} ms" for n, d in sorted(names.items(), key=lambda kv: -kv[1])[:10]]
    return emit("profile", shape=args.shape, steps=args.steps, compiled=args.compile == "true",
                ms_per_step=round(wall_us / 1e3 / args.steps, 2), idle_share=round(max(0.0, 1 - busy / wall_us), 4),
                **shares, top=top)


if __name__ == "__main__":
    main()
