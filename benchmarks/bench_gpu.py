"""The recipe as ``leansft train`` runs it, and its bare loop, on the same batches: real tokens/s, MFU, peak memory
and recompiles after the warm-up, per shape (benchmarks/gpu_shapes.py), eager and with compiled layers.

- recipe: ``leansft.recipe.train.train`` on a random model of the shape and synthetic chats (bfd rows of
  ``--tokens``), timed from the end of step ``--warmup`` to the end of the last step (the device synchronised at
  both ends): every step's whole loop, with its batches, logging, throughput counting and progress. The end-of-run
  checkpoint is left out (a benchmark's, not a user's, choice: it is outside the steps either way).
- bare loop: the same model, loss module, optimizer and batches (collated and pinned beforehand), and nothing else:
  forward, backward, clip, step; one synchronisation at each end of the timed steps.

The ratio recipe / bare loop is the recipe's own overhead. MFU: useful FLOPs (core/metrics/flops.py) over the
datasheet's dense bf16 peak. Each row goes to results.jsonl (part "bench").

    python3 benchmarks/bench_gpu.py [--shapes 0.5b,1.5b] [--compile false,true] [--steps 8] [--warmup 3]
        [--tokens 16384]
    .venv/bin/python benchmarks/bench_gpu.py --shapes tiny --compile false --steps 2 --warmup 1 --tokens 512
        (the CPU miniature the test suite runs)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_shapes import SHAPES, make_model, run_overrides, write_chats  # noqa: E402
from recipe_parts import build_parts  # noqa: E402
from results import emit, sync  # noqa: E402
from timing import recipe_steps_timed  # noqa: E402

WORK = Path(os.environ.get("LEANSFT_BENCH_WORK", "runs")) / "bench_gpu"  # where its models and data go


def peak_gb() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if torch.cuda.is_available() else None


def reset() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()


def run_recipe(over: list[str], warmup: int, steps: int) -> dict:
    """``train()`` as ``leansft train`` runs it, timed over its steps after the warm-up (``timing.py``)."""
    from leansft.core.config import load_config
    from leansft.core.metrics.flops import device_peak_flops
    from leansft.recipe.train import train

    with recipe_steps_timed(warmup, warmup + steps, skip_checkpoints=True) as seen:
        train(load_config(None, over + [f"training.max_steps={warmup + steps}"]))
    peak = device_peak_flops(torch.device("cuda"), None) if torch.cuda.is_available() else None
    return {"real_tokens_per_s": seen["real_tokens"] / seen["seconds"],
            "mfu": seen["flops"] / seen["seconds"] / peak if peak else None,
            "recompiles": seen["recompiles"], "graph_breaks": seen["graph_breaks"]}


def run_bare(over: list[str], warmup: int, steps: int) -> dict:
    """The same model, loss module, optimizer and batches as the recipe's, in a loop of nothing else."""
    from leansft.core.metrics.flops import device_peak_flops
    from leansft.core.model.compile import compile_counts
    from leansft.core.model.grad_clip import clip_gradients
    from leansft.core.model.loading import trainable_parameters
    from leansft.core.model.loss import normalise
    from leansft.recipe.builders import build_optimizer

    parts = build_parts(over)
    cfg, device, model, module, amp = parts.cfg, parts.device, parts.model, parts.module, parts.amp
    opt = build_optimizer(cfg, model, device)
    params = [p for _, p in trainable_parameters(model)]
    window = parts.window()
    source = parts.batches()
    pin = device.type == "cuda"
    steps_ = [[b.pin_memory() if pin else b for b in next(source)[0]] for _ in range(warmup + steps)]
    counts = [window.count(bs) for bs in steps_]
    for i, batches in enumerate(steps_):
        if i == warmup:
            sync()
            t0, c0 = time.perf_counter(), compile_counts()
        for b in batches:
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                normalise(module(b.to(device)), counts[i].weight).backward()
        clip_gradients(params, cfg.training.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    t1, c1 = time.perf_counter(), compile_counts()
    tokens, flops = sum(c.real for c in counts[warmup:]), sum(c.flops for c in counts[warmup:])
    peak = device_peak_flops(device, None)
    return {"real_tokens_per_s": tokens / (t1 - t0), "mfu": flops / (t1 - t0) / peak if peak else None,
            "recompiles": c1["frames"] - c0["frames"], "graph_breaks": c1["graph_breaks"] - c0["graph_breaks"]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0.5b,1.5b")
    ap.add_argument("--compile", default="false,true")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--bare", default="true", help="false: the recipe alone")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    rows = []
    for shape in args.shapes.split(","):
        model = make_model(shape, WORK / f"model-{shape}", "cuda" if cuda else "cpu")
        data = write_chats(WORK / "chats.jsonl", args.examples)
        for comp in args.compile.split(","):
            over = run_overrides(shape, model, data, WORK / shape, compiled=comp == "true",
                                 precision="bf16" if cuda else "fp32", steps=args.warmup + args.steps,
                                 tokens=args.tokens)
            for bare in ((False, True) if args.bare == "true" else (False,)):
                reset()
                try:
                    r = (run_bare if bare else run_recipe)(over, args.warmup, args.steps)
                except Exception as err:  # noqa: BLE001 - one failed run is reported; the others still run
                    rows.append(emit("bench", shape=shape, method=SHAPES[shape][7], compiled=comp == "true",
                                     bare_loop=bare, error=f"{type(err).__name__}: {str(err)[:300]}"))
                    continue
                rows.append(emit("bench", shape=shape, method=SHAPES[shape][7], compiled=comp == "true", bare_loop=bare,
                                 tokens_per_micro_batch=args.tokens, steps=args.steps, warmup=args.warmup,
                                 real_tokens_per_s=round(r["real_tokens_per_s"], 1),
                                 mfu=None if r["mfu"] is None else round(r["mfu"], 4), peak_gb=peak_gb(),
                                 recompiles=r["recompiles"], graph_breaks=r["graph_breaks"]))
    ok = [r for r in rows if "error" not in r]
    print("\n| shape | method | compiled | loop | real tok/s | MFU | peak GB | recompiles |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in ok:
        mfu = "" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(f"| {r['shape']} | {r['method']} | {r['compiled']} | {'bare' if r['bare_loop'] else 'recipe'} | "
              f"{r['real_tokens_per_s']:,.0f} | {mfu} | {r['peak_gb'] or ''} | {r['recompiles']} |")
    for a in ok:
        b = next((x for x in ok if x["bare_loop"] and not a["bare_loop"] and x["shape"] == a["shape"]
                  and x["compiled"] == a["compiled"]), None)
        if b:
            print(f"{a['shape']} compiled={a['compiled']}: recipe / bare loop "
                  f"{a['real_tokens_per_s'] / b['real_tokens_per_s']:.2f}x")
    return rows


if __name__ == "__main__":
    main()
