"""One training step two ways, paired: the same batch, one process, the two ways alternating.

Why: on a shared machine whose speed drifts 2x within minutes (benchmarks/README.md), separate runs cannot
resolve a change of a few percent; steps on the same batch, alternating A/B then B/A, can. The two ways are
switches of leansft's own code paths, flipped between steps of one engine (built as ``profile_step.py`` builds
it, i.e. as ``leansft train`` does):

- ``onednn``: fp32 products through oneDNN on a CPU where MKL alone runs AVX2 code (linear layers, LoRA's frozen
  base, the loss head; ``core/onednn_linear.py``) vs MKL everywhere; "on" takes oneDNN even where the process
  loaded the MKL shim (``core/mkl_kernels.py``), where leansft itself keeps MKL;
- ``onednn-head``: the same for the loss head's products only (``core/loss.py``);
- ``bf16-head-grads``: under CPU bf16 autocast where oneDNN keeps fp32 products, the loss head's two gradient
  products in bf16 (``core/loss.py``'s ``gradient_dtype``) vs fp32 products as its logits.

Both ways train the same model in turn (each step is a real update), so losses are not compared here;
the tests hold the paths' results to each other.

    .venv/bin/python benchmarks/pair_step.py --switch onednn --workload smollm2 --method full [--pairs 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def switch(name: str):
    """A function ``on(bool)`` that turns the named path on or off from the next step."""
    from leansft.core import loss, onednn_linear

    state = {"on": True}
    could = onednn_linear.mkl_runs_avx2  # "on" runs oneDNN where MKL alone would run AVX2, even with the MKL shim
    if name == "onednn":  # the rule every oneDNN path asks (``applies`` asks it too)
        onednn_linear.onednn_pays = lambda: state["on"] and could()
    elif name == "onednn-head":
        def head(*a) -> bool:
            return state["on"] and could() and onednn_linear.eligible(*a)

        loss.onednn_linear = types.SimpleNamespace(applies=head, mm_t=onednn_linear.mm_t)
    elif name == "bf16-head-grads":
        chosen = loss.gradient_dtype
        loss.gradient_dtype = lambda device: chosen(device) if state["on"] else None
    else:
        raise SystemExit(f"unknown switch {name!r}")
    return lambda on: state.update(on=on)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", choices=["onednn", "onednn-head", "bf16-head-grads"], required=True)
    ap.add_argument("--workload", choices=["fair", "smollm2"], default="smollm2")
    ap.add_argument("--method", choices=["lora", "full"], default="full", help="smollm2 only (fair: full)")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--pairs", type=int, default=8)
    args = ap.parse_args()
    if args.pairs < 1:
        raise SystemExit("--pairs: at least 1")
    from leansft.tools.allocator import reexec_with_malloc_settings

    reexec_with_malloc_settings(["train"])  # what `leansft train` runs under (profile_step loads the MKL shim)
    import profile_step

    from leansft.core.onednn_linear import mkl_runs_avx2
    from leansft.recipe.train import train_step

    if not mkl_runs_avx2():
        print("MKL takes AVX-512 here on its own, or the CPU has none (core/onednn_linear.py): both ways run MKL")
    set_on = switch(args.switch)  # before the build: the layers are swapped as the machine's rule says
    engine, steps, window, _ = profile_step.build(profile_step.overrides(args.workload, args.precision, "false",
                                                                         args.method))
    step_no = 0
    for _ in range(2):  # warm-up: allocator growth, lazy init
        batches, _ = next(steps)
        step_no += 1
        train_step(engine, batches, window.count(batches).weight, step_no)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.pairs):
        batches, _ = next(steps)
        weight = window.count(batches).weight
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            set_on(on)
            step_no += 1
            t0 = time.perf_counter()
            train_step(engine, batches, weight, step_no)
            times[on].append(time.perf_counter() - t0)
        print(f"pair {i}: on {times[True][-1] * 1e3:,.0f} ms, off {times[False][-1] * 1e3:,.0f} ms, "
              f"ratio {times[True][-1] / times[False][-1]:.3f}", flush=True)
    ratios = [a / b for a, b in zip(times[True], times[False])]
    name = f"{args.workload} {args.method}" if args.workload == "smollm2" else args.workload
    print(f"{args.switch}, {name} {args.precision}: on/off fastest {min(times[True]) / min(times[False]):.3f}, "
          f"median of pairs {statistics.median(ratios):.3f}, total {sum(times[True]) / sum(times[False]):.3f} "
          f"({args.pairs} pairs)")


if __name__ == "__main__":
    main()
