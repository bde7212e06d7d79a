"""A value the host read from a device tensor once, kept with the tensor it came from.

Reading a CUDA tensor back makes the host wait for the device. Batches read what they need (segment lengths, target
positions) while still on the host, as they move to the device, and hand those values to the code that would
otherwise read them back (the attention of every layer, the loss)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class HostRead:
    """A value read on the host from a tensor when the batch moved to the device (``to``), valid only for that
    very tensor, unchanged: a tensor put in its place or edited in place makes readers read from it again."""
    value: Any
    source: weakref.ref
    version: int

    @staticmethod
    def of(value, tensor: torch.Tensor) -> HostRead:
        return HostRead(value, weakref.ref(tensor), tensor._version)

    def get(self, tensor: torch.Tensor):
        return self.value if self.source() is tensor and tensor._version == self.version else None
