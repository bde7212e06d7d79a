"""The training steps' progress: a live bar (step, loss, lr, tokens/s, ETA) on a terminal; elsewhere a plain line
every ``core.progress.EVERY_S`` seconds, so a log is never silent between ``log_every`` lines."""

from __future__ import annotations

import logging
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from leansft.core.progress import EVERY_S, console

log = logging.getLogger("leansft")


class ProgressBar:
    def __init__(self, total: int, done: int, enabled: bool) -> None:
        self.bar, self.enabled, self.total, self.first = None, enabled, total, done
        if enabled and console().is_terminal:
            self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console(),
                                transient=True)
            self.task = self.bar.add_task("train", total=total, completed=done, info="")
        self.t = self.started = self.said = time.perf_counter()

    def __enter__(self) -> ProgressBar:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def update(self, step: int, loss: float, lr: float, tokens: int, logged: bool = False) -> None:
        """``tokens``: real tokens of the step just done (all ranks); the rate is over that step's time.
        ``logged``: the step's metrics line is printed anyway (then no plain progress line repeats it)."""
        now = time.perf_counter()
        rate, self.t = tokens / max(now - self.t, 1e-9), now
        info = f"loss {loss:.4f}  lr {lr:.2e}  {rate:,.0f} tok/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif logged:
            self.said = now
        elif self.enabled and now - self.said >= EVERY_S:
            self.said = now
            left = (now - self.started) / max(step - self.first, 1) * (self.total - step)
            log.info("step %d/%d  %s  about %.0f s left", step, self.total, info, left)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
