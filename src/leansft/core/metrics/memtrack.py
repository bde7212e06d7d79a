"""Peak memory of live torch tensors on the CPU, where torch keeps no allocator statistics.

A dispatch mode sees every tensor an op takes or creates and keeps a weak reference to its storage; when the
storage dies its bytes come off the count. Views share storage and are counted once. A storage that existed
before the tracker started is counted the first time an op takes or shows it, which is how weights loaded from
disk, which no op creates, come into a run's peak: counting only what ops create and show, a weight that bf16
autocast only casts, or that an embedding only looks up, was never counted; ``exclude`` leaves out the storages
of given tensors (a model's own weights, for the memory of a step above them).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class TensorMemoryTracker(TorchDispatchMode):
    """``with TensorMemoryTracker() as t: ...`` then ``t.peak`` (bytes above the start)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude if t.device.type == "cpu"}
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._count(t)
        return out

    def _count(self, t: torch.Tensor) -> None:
        if t.is_sparse:  # a sparse gradient (``core/tied_embedding.py``): its indices and values hold the memory
            self._count(t._indices())
            self._count(t._values())
            return
        if is_traceable_wrapper_subclass(t):  # a DTensor: its local shards hold the memory, as plain tensors
            for name in t.__tensor_flatten__()[0]:
                if isinstance(inner := getattr(t, name), torch.Tensor):
                    self._count(inner)
            return
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._live or key in self._excluded:
            return
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)


def device_peak_memory(device: torch.device) -> int | None:
    """Peak allocated bytes on an accelerator since the last reset, or None on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None
