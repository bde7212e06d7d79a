"""The learning-rate schedule as a plain function of the step: the optimizer's ``LambdaLR`` and the report's plot
(which draws every step's rate, warm-up included, however seldom the run logged) read the same numbers."""

from __future__ import annotations

import math
from collections.abc import Callable


def warmup_steps(training, total: int) -> int:
    """``training.warmup_steps``, else ``warmup_ratio`` of the run's steps."""
    return training.warmup_steps or int(training.warmup_ratio * total)


def lr_lambda(schedule: str, warmup: int, total: int) -> Callable[[int], float]:
    """The learning rate's factor at a step (0-based: the first optimizer step uses ``f(0)``)."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress

    return f
