"""Checkpoints written in the background while training goes on (``checkpoint.async``), on one rank or many.

A save first copies what this rank gives the checkpoint out of the training tensors (``checkpoint_files.
take_snapshot`` with ``HostBuffers``: the trainable weights and optimizer state, or an FSDP rank's shards, into host
memory), with the generators', scheduler's and loop's state, then returns: the next steps run while a thread on
every rank writes the files into ``.tmp-step-N``, lists them in the manifest and renames the folder into place
(``checkpoint_files.write_snapshot``) exactly as a synchronous save does. On several ranks that thread's
collectives (the ranks agreeing that every part is written before any rename; DCP's planning) run on a gloo process
group of their own (``distributed.side_group``), as torchtitan runs DCP's asynchronous save. A kill at any moment
leaves the previous checkpoints and, once renamed, the complete new one; a resumed run removes the unfinished
folder. At most one save is in flight: the next waits for it, and the last is awaited before the run ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from leansft.core.errors import LeanSFTError
from leansft.core.io import checkpoint_files as ckpt


class BackgroundSave:
    """One save in flight: ``start`` runs a write on a thread (``then``: what to do after, as pruning), ``wait``
    blocks until it is done and raises what it raised."""

    def __init__(self, root) -> None:
        self._root = root  # the model + loss module (a full disk's message says how much a checkpoint needs)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step = 0
        self._folder: Path | None = None

    def start(self, step: int, folder: Path, write: Callable[[], Path], then: Callable[[Path, float], None]) -> None:
        self.wait()
        self._error, self._step, self._folder = None, step, folder

        def run() -> None:
            t0 = time.perf_counter()
            try:
                then(write(), time.perf_counter() - t0)
            except BaseException as err:  # noqa: BLE001 - raised on the training thread at the next wait
                self._error = err

        self._thread = threading.Thread(target=run, name=f"leansft-save-step-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the save in flight (if any) is written; its error, raised here."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        err, self._error = self._error, None
        if err is not None:
            if isinstance(err, LeanSFTError):
                raise err
            raise ckpt.not_written(self._step, self._folder, *ckpt._why_not_written(err, self._root, self._folder)
                                   ) from err
