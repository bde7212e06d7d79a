"""Stop a run that has stopped learning, naming the step and the likely cause.

Checked after every step: the gradient norm is exactly 0 for ``PATIENCE`` steps in a row (nothing
learns; with the loss at ln(vocab) the model has collapsed to a uniform distribution), or the loss
jumps above ``spike_factor`` times its running mean (a divergence the schedule will not undo).
"""

from __future__ import annotations

import math

from leansft.core.errors import LeanSFTError

PATIENCE = 3
WARMUP = 5  # steps before the running mean is trusted for spikes
HINT = "lower training.learning_rate (or raise warmup), check the data of these steps, or use fp32"


class DivergenceGuard:
    def __init__(self, vocab_size: int, spike_factor: float | None) -> None:
        self.uniform = math.log(vocab_size)
        self.spike_factor = spike_factor
        self.mean: float | None = None
        self.seen = 0
        self.dead = 0

    def check(self, step: int, loss: float, grad_norm: float) -> None:
        self.dead = self.dead + 1 if grad_norm == 0.0 else 0
        if self.dead >= PATIENCE:
            at_uniform = abs(loss - self.uniform) <= 1e-2 * self.uniform
            cause = (f"the loss sits at ln(vocab) = {self.uniform:.3f}: the model predicts a uniform distribution "
                     "(collapsed)" if at_uniform else f"loss {loss:.4f}")
            raise LeanSFTError(f"the run stopped learning at step {step}: gradient norm 0 for {PATIENCE} steps; "
                               f"{cause}", hint=HINT)
        if self.spike_factor and self.seen >= WARMUP and loss > self.spike_factor * self.mean:
            raise LeanSFTError(f"loss spike at step {step}: {loss:.4f} is over {self.spike_factor:g}x its running mean "
                               f"{self.mean:.4f}", hint=HINT + "; or raise training.loss_spike_factor")
        self.mean = loss if self.mean is None else 0.9 * self.mean + 0.1 * loss
        self.seen += 1
