"""SIGINT/SIGTERM ask for a clean stop: the current step finishes, a checkpoint is saved."""

from __future__ import annotations

import logging
import signal

log = logging.getLogger("leansft")


def _install(handler) -> dict:
    """``handler`` for SIGINT and SIGTERM; returns the handlers it replaced (none off the main thread)."""
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    return old


def _restore(old: dict) -> None:
    for sig, handler in old.items():
        signal.signal(sig, handler)


class StopFlag:
    def __init__(self) -> None:
        self.requested = False
        self._old: dict = {}

    def __enter__(self) -> StopFlag:
        self._old = _install(self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # second signal: give up at once
            raise KeyboardInterrupt
        self.requested = True
        log.warning("signal %s: finishing this step, saving a checkpoint, then stopping", signum)

    def __exit__(self, *exc) -> None:
        _restore(self._old)


class Stopped(BaseException):
    """A stop signal outside the training steps (loading, verifying, exporting): nothing in flight to save. A
    BaseException, as KeyboardInterrupt is, so that no ``except Exception`` on the way (verify turns a failing
    forward into a failed check) can swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopAnywhere:
    """Around a whole run: SIGINT/SIGTERM raise ``Stopped`` (inside the step loop ``StopFlag`` takes over), so a
    signal during start-up ends the run with its message and exit code instead of a bare 143 or a traceback."""

    def __enter__(self) -> StopAnywhere:
        self._old = _install(self._raise)
        return self

    @staticmethod
    def _raise(signum, frame) -> None:
        raise Stopped(signum)

    def __exit__(self, *exc) -> None:
        _restore(self._old)
