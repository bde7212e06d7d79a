"""Checkpoints written in the background while training goes on (``checkpoint.async``).

A save first copies what the checkpoint holds out of the training tensors (``stage``: the trainable weights and
the optimizer state into host memory, pinned and reused across saves on CUDA, the copies queued on the
current stream and waited for by the writer; plain copies on the CPU), with the generators', scheduler's and
loop's state, then returns: the next steps run while a thread writes the files into ``.tmp-step-N``, lists
them in the manifest and renames the folder into place (``checkpoint_files``), exactly as a synchronous save.
A kill at any moment leaves the previous checkpoints and, once renamed, the complete new one; a resumed run
removes the unfinished folder. At most one save is in flight: the next waits for it. Used on one process
(the collectives of a multi-rank save stay on the training thread), as torchtitan and torchtune stage theirs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from leansft.core.errors import LeanSFTError
from leansft.core.io import checkpoint_files as ckpt

log = logging.getLogger("leansft")


@dataclass
class Staged:
    """A checkpoint's content, copied out of training: what ``write_files`` takes."""

    step: int
    weights: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]
    rng: tuple[dict[str, torch.Tensor], dict]
    state: dict
    config: dict
    copied: torch.cuda.Event | None = None  # the device-to-host copies' end, where they were queued on CUDA


class HostBuffers:
    """Host copies of device tensors, kept from save to save (pinned memory is slow to allocate)."""

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}

    def copy(self, name: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type == "cpu":
            return t.clone()
        held = self._held.get(name)
        if held is None or held.shape != t.shape or held.dtype != t.dtype:
            held = self._held[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return held.copy_(t, non_blocking=True)


def stage(step: int, root, optimizer, scheduler, state: dict, config: dict, buffers: HostBuffers) -> Staged:
    """Everything one process's checkpoint holds, copied (the weights and optimizer state into ``buffers``)."""
    model = {k: buffers.copy(f"model/{k}", v) for k, v in ckpt._model_state(root).items()}
    opt, opt_meta = ckpt._optimizer_state(root, optimizer)
    opt = {k: buffers.copy(f"optim/{k}", v) for k, v in opt.items()}
    copied = None
    if torch.cuda.is_available() and any(v.is_pinned() for v in (*model.values(), *opt.values())):
        copied = torch.cuda.Event()
        copied.record()
    rng_tensors, rng_meta = ckpt._rng_state()
    full = {**state, "step": step, "scheduler": scheduler.state_dict(), "sharded": False, "world_size": 1}
    return Staged(step, (model, opt, opt_meta), ({k: v.clone() for k, v in rng_tensors.items()}, rng_meta),
                  full, config, copied)


def write(folder: Path, staged: Staged) -> Path:
    """The staged checkpoint into ``folder/step-N``, atomically (any thread)."""
    final, tmp = folder / f"{ckpt.PREFIX}{staged.step}", folder / f".tmp-{ckpt.PREFIX}{staged.step}"
    if staged.copied is not None:
        staged.copied.synchronize()
    ckpt.fresh_tmp(tmp)
    try:
        ckpt.write_files(tmp, staged.weights, staged.rng, staged.state, staged.config)
        ckpt.put_in_place(tmp, final)
    except BaseException:
        ckpt._remove_if_ours(tmp)
        raise
    return final


class BackgroundSave:
    """One save in flight: ``start`` hands a staged checkpoint to a writer thread (``then``: what to do after, as
    pruning), ``wait`` blocks until it is written and raises what the write raised."""

    def __init__(self, root) -> None:
        self._root = root  # the model + loss module (a full disk's message says how much a checkpoint needs)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step = 0
        self._folder: Path | None = None

    def start(self, folder: Path, staged: Staged, then) -> None:
        self.wait()
        self._error, self._step, self._folder = None, staged.step, folder

        def run() -> None:
            t0 = time.perf_counter()
            try:
                path = write(folder, staged)
                then(path, time.perf_counter() - t0)
            except BaseException as err:  # noqa: BLE001 - raised on the training thread at the next wait
                self._error = err

        self._thread = threading.Thread(target=run, name=f"leansft-save-step-{staged.step}", daemon=True)
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
