"""Long work a person can see: a bar with an ETA on a terminal, plain log lines elsewhere.

``phase(what)`` logs the start of a piece of work at once and its end with the time it took, so a log never sits
silent through model conversion, the pre-flight check, an evaluation or a checkpoint. ``track(items, total, what)``
wraps a loop with a known length: on a terminal a transient rich bar (count, ETA, and what ``info`` says), and
when output goes to a file or a pipe a line every ``EVERY_S`` seconds. Only rank 0 speaks under torchrun.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator

log = logging.getLogger("leansft")

EVERY_S = 10.0  # seconds between plain progress lines


def plural(n: int, word: str) -> str:
    """``1 step``, ``2 steps``, with thousands separators."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _speaks() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    """``what...`` now, ``what: done in N s`` at the end (INFO; rank 0)."""
    if _speaks():
        log.info("%s...", what)
    t0 = time.perf_counter()
    yield
    if _speaks():
        log.info("%s: done in %.1f s", what, time.perf_counter() - t0)


def console():
    """The one rich console every part prints through (rich's own, ``rich.get_console()``): log lines, bars and
    tables on one console, so a live bar stays below the lines printed while it runs instead of over them."""
    from rich import get_console

    return get_console()


def _terminal() -> bool:
    return console().is_terminal


def track(items: Iterable, total: int | None, what: str, info: Callable[[], str] | None = None) -> Iterator:
    """Yield ``items``, showing how far the loop got out of ``total`` (None: unknown)."""
    if not _speaks():
        yield from items
        return
    if _terminal():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = [TextColumn(what), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn()]
        with Progress(*columns, transient=True, console=console()) as bar:
            task = bar.add_task(what, total=total, info="")
            for item in items:
                yield item
                bar.update(task, advance=1, info=info() if info else "")
        return
    t0 = last = time.perf_counter()
    for i, item in enumerate(items, 1):
        yield item
        now = time.perf_counter()
        if now - last >= EVERY_S:
            last = now
            eta = f", about {(now - t0) / i * (total - i):.0f} s left" if total else ""
            log.info("%s: %d%s%s%s", what, i, f"/{total}" if total else "", eta,
                     f" ({info()})" if info else "")
