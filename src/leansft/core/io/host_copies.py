"""Host copies of training tensors, for a checkpoint written while training goes on (``checkpoint.async``).

On CUDA the copies go into pinned host buffers kept from save to save (pinned memory is slow to allocate), queued
on the current stream (``queued`` marks their end, which the writer waits for); on the CPU they are plain clones.
An FSDP state dict's DTensors are copied as torch.distributed.checkpoint's own asynchronous save stages them
(``_create_cpu_state_dict`` / ``_copy_state_dict``: the same sharding, the local shards on the host)."""

from __future__ import annotations

import torch


class HostBuffers:
    """Host copies of device tensors, the buffers kept from save to save."""

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}
        self._state_dict: dict | None = None  # an FSDP state dict's host copy, reused while its layout holds
        self._pinned = False

    def copy(self, name: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if t.device.type == "cpu":
            return t.clone()
        held = self._held.get(name)
        if held is None or held.shape != t.shape or held.dtype != t.dtype:
            held = self._held[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._pinned = True
        return held.copy_(t, non_blocking=True)

    def copy_state_dict(self, state: dict) -> dict:
        """A (DCP) state dict copied to the host, DTensors kept as DTensors with host shards."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        cuda = torch.cuda.is_available()
        if self._state_dict is None or _layout(self._state_dict) != _layout(state):
            self._state_dict = _create_cpu_state_dict(state, pin_memory=cuda)
        self._pinned = self._pinned or cuda
        return _copy_state_dict(state, self._state_dict, non_blocking=cuda)

    def queued(self) -> torch.cuda.Event | None:
        """An event after the copies queued on the current CUDA stream (None where none were)."""
        if not (self._pinned and torch.cuda.is_available()):
            return None
        event = torch.cuda.Event()
        event.record()
        return event


def _layout(state) -> object:
    """The names, shapes and dtypes of a state dict's tensors (the rest as it is): whether a host copy still fits."""
    if isinstance(state, dict):
        return {k: _layout(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_layout(v) for v in state]
    if torch.is_tensor(state):
        return (tuple(state.shape), state.dtype)
    return None
