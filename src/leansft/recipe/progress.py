"""A live progress bar (step, loss, lr, tokens/s) on a terminal; nothing elsewhere (log lines suffice)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class ProgressBar:
    def __init__(self, total: int, done: int, enabled: bool) -> None:
        console = Console()
        self.bar = None
        if enabled and console.is_terminal:
            self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console,
                                transient=True)
            self.task = self.bar.add_task("train", total=total, completed=done, info="")
        self.t = time.perf_counter()

    def __enter__(self) -> ProgressBar:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def update(self, step: int, loss: float, lr: float, tokens: int) -> None:
        """``tokens``: real tokens of the step just done (all ranks); the rate is over that step's time."""
        now = time.perf_counter()
        rate, self.t = tokens / max(now - self.t, 1e-9), now
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=f"loss {loss:.4f}  lr {lr:.2e}  {rate:,.0f} tok/s")

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
