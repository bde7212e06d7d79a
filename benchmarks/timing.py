"""Steady-state timing of ``leansft train`` in this process: ``train_step`` wrapped (nothing else of the recipe
changes), the device synchronised at the end of step ``warmup`` and of the last step, so the window holds every
step's whole loop after the warm-up (compilation, allocator growth and lazy set-up left out)."""

from __future__ import annotations

import contextlib
import time

from results import sync


@contextlib.contextmanager
def recipe_steps_timed(warmup: int, last: int, skip_checkpoints: bool = False):
    """Yields a dict that holds, once ``train()`` has run inside the block: ``seconds``, ``real_tokens``, ``flops``
    of steps ``warmup + 1 .. last``, and ``recompiles`` / ``graph_breaks`` in them. ``skip_checkpoints``: the end of
    run's checkpoint is not written (an 8B full fine-tune's takes longer than its steps; it is outside them)."""
    from leansft.core.model.compile import compile_counts
    from leansft.recipe import checkpointer
    from leansft.recipe import train as recipe

    seen: dict = {"real_tokens": 0, "flops": 0.0}
    real_step, real_save = recipe.train_step, checkpointer.Checkpointer.save

    def timed(engine, batches, counts, step, stop=None):
        out = real_step(engine, batches, counts, step, stop)
        if step > warmup:
            seen["real_tokens"] += out.counts.real
            seen["flops"] += out.counts.flops
        if step in (warmup, last):
            sync()
            seen[step] = (time.perf_counter(), compile_counts())
        return out

    recipe.train_step = timed
    if skip_checkpoints:
        checkpointer.Checkpointer.save = lambda *a, **k: None
    try:
        yield seen
    finally:
        recipe.train_step, checkpointer.Checkpointer.save = real_step, real_save
    if warmup in seen and last in seen:
        (t0, c0), (t1, c1) = seen.pop(warmup), seen.pop(last)
        seen.update(seconds=t1 - t0, recompiles=c1["frames"] - c0["frames"],
                    graph_breaks=c1["graph_breaks"] - c0["graph_breaks"])
