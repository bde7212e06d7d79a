"""Honest throughput: the step's global token counts and a window that turns them into rates.

Each rank counts its micro-batches on the host (``ThroughputWindow.count``: known from the batches alone); the
training step sums them over ranks on the device and reads them back with its loss, once (``train_step``), so
tokens/s, padding share and MFU are the whole job's, not one rank's times the world size, and counting costs the
step no wait of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from leansft.core.metrics.flops import attended_squares, device_peak_flops, peak_memory_bytes, step_flops, token_flops


@dataclass
class StepCounts:
    """One optimizer step over all ranks."""

    targets: int = 0  # tokens that carry loss
    weight: float = 0.0  # the sum of their loss weights: the normaliser (= targets unless messages are weighted)
    real: int = 0  # real tokens computed
    slots: int = 0  # tensor slots computed (real + padding)
    examples: int = 0  # examples begun (a split example counts once)
    flops: float = 0.0

    def __iadd__(self, other: StepCounts) -> StepCounts:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))
        return self

    FIELDS = ("targets", "weight", "real", "slots", "examples", "flops")

    def as_list(self) -> list[float]:
        return [float(getattr(self, k)) for k in self.FIELDS]

    @classmethod
    def from_list(cls, values: list[float]) -> StepCounts:
        t, w, r, s, e, f = values
        return cls(int(round(t)), w, int(round(r)), int(round(s)), int(round(e)), f)


class ThroughputWindow:
    """Counts steps since the last log line; ``record()`` returns the rates and starts a new window.

    Rates are over the time spent inside those steps (``add_time``), not the wall time since the last
    line: evaluation, sample generation and checkpoints between lines (step 0's eval and samples
    before the first step among them) would otherwise show as a slow step. The run's wall time is
    in ``RunTotals``."""

    def __init__(self, model, device: torch.device, peak_flops: float | None, world: int) -> None:
        self.device, self.world = device, world
        self.body_flops, self.head_flops = token_flops(model)
        text = model.config.get_text_config()  # a vision model: its language model's
        self.layers, self.hidden = text.num_hidden_layers, text.hidden_size
        self.peak = device_peak_flops(device, peak_flops)
        self._reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def _reset(self) -> None:
        self.seconds, self.counts = 0.0, StepCounts()

    def add_time(self, seconds: float) -> None:
        """Time one step of the window took (its batches, forward, backward and update)."""
        self.seconds += seconds

    def count(self, batches) -> StepCounts:
        """This rank's counts of one step's micro-batches, on the host (``train_step`` sums them over ranks)."""
        c = StepCounts()
        for b in batches:
            c += StepCounts(b.target_tokens, b.target_weight, b.real_tokens, int(b.input_ids.numel()),
                            b.examples_begun, step_flops(self.body_flops, self.layers, self.hidden, b.real_tokens,
                                                         attended_squares(b) / getattr(b, "context", (0, 1))[1],
                                                         self.head_flops, b.target_tokens))  # a split row: 1/N each
        return c

    def add(self, step: StepCounts) -> None:
        """A step's global counts (``train_step``'s), added to the window."""
        self.counts += step

    def record(self) -> dict:
        dt = max(self.seconds, 1e-9)
        c = self.counts
        out = {"real_tokens_per_s": c.real / dt, "target_tokens_per_s": c.targets / dt,
               "padding_share": 1.0 - c.real / max(c.slots, 1), "peak_memory_bytes": peak_memory_bytes(self.device),
               "mfu": c.flops / dt / (self.peak * self.world) if self.peak else None}
        self._reset()
        return out


@dataclass
class RunTotals:
    """The whole run's figures, over every process of it (a resumed run carries on from its checkpoint's): wall
    time of ``train()`` calls, time inside training steps, tokens, and run-average rates = tokens / time in steps."""

    started: float = field(default_factory=time.perf_counter)
    wall_before: float = 0.0  # the earlier processes' wall time, up to the checkpoint resumed from

    def wall(self) -> float:
        return self.wall_before + time.perf_counter() - self.started

    def record(self, state) -> dict:
        """The totals record of ``state`` (``recipe.checkpointer.TrainState``: global counts and step time)."""
        busy = max(state.step_seconds, 1e-9)
        return {"step": state.step, "run_wall_s": self.wall(), "run_step_s": state.step_seconds,
                "run_real_tokens": state.tokens_seen, "run_target_tokens": state.target_tokens_seen,
                "run_real_tokens_per_s": state.tokens_seen / busy,
                "run_target_tokens_per_s": state.target_tokens_seen / busy}
