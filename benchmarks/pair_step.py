"""One CPU speed-up on and off, step by step on the same batches: the side-by-side figure docs/cpu.md quotes.

Builds the run as ``leansft train`` does with the switch's speed-up on (``profile_step.build``), then times pairs
of steps, on and off in alternating order, on the same micro-batches:

- ``fused-layers``: ``cpu.fused_layers`` (core/cpu/fused_layers.py) vs the layers as shipped (the fused layers run
  transformers' and peft's code inside ``as_shipped()``);
- ``bf16-head``: ``cpu.bf16_head`` (core/cpu/bf16_head.py) vs the plain head (bf16 runs only).

    .venv/bin/python benchmarks/pair_step.py --switch fused-layers --workload smollm2 --method lora [--pairs 8]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", choices=["fused-layers", "bf16-head"], required=True)
    ap.add_argument("--workload", choices=["fair", "smollm2"], default="smollm2")
    ap.add_argument("--method", choices=["lora", "full"], default="lora", help="smollm2 only (fair: full)")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--pairs", type=int, default=8)
    args = ap.parse_args()
    if args.pairs < 1:
        raise SystemExit("--pairs: at least 1")
    import profile_step

    from leansft.core.model.as_shipped import as_shipped
    from leansft.core.model.loss import PLAIN
    from leansft.recipe.train import train_step

    over = profile_step.overrides(args.workload, args.precision, "false", args.method,
                                  fused="true" if args.switch == "fused-layers" else "false")
    if args.switch == "bf16-head":
        over.append("cpu.bf16_head=true")
    engine, steps, window, _ = profile_step.build(over)
    module = engine.loss_module
    chosen = module.precision

    def step_with(on: bool, batches, counts, step_no) -> float:
        module.precision = chosen if on or args.switch != "bf16-head" else PLAIN
        off_layers = as_shipped() if (not on and args.switch == "fused-layers") else contextlib.nullcontext()
        t0 = time.perf_counter()
        with off_layers:
            train_step(engine, batches, counts, step_no)
        return time.perf_counter() - t0

    step_no = 0
    for _ in range(2):  # warm-up: allocator growth, lazy init
        batches, _ = next(steps)
        step_no += 1
        step_with(True, batches, window.count(batches), step_no)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.pairs):
        batches, _ = next(steps)
        counts = window.count(batches)
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            step_no += 1
            times[on].append(step_with(on, batches, counts, step_no))
        print(f"pair {i}: on {times[True][-1] * 1e3:,.0f} ms, off {times[False][-1] * 1e3:,.0f} ms, "
              f"ratio {times[True][-1] / times[False][-1]:.3f}", flush=True)
    ratios = [a / b for a, b in zip(times[True], times[False], strict=True)]
    name = f"{args.workload} {args.method}" if args.workload == "smollm2" else args.workload
    print(f"{args.switch}, {name} {args.precision}: on/off fastest {min(times[True]) / min(times[False]):.3f}, "
          f"median of pairs {statistics.median(ratios):.3f}, total {sum(times[True]) / sum(times[False]):.3f} "
          f"({args.pairs} pairs)")


if __name__ == "__main__":
    main()
