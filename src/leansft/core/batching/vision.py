"""A packed batch's images: the vision tower's input for the pictures of its examples, in the order their
placeholders appear, read again from the files the data was prepared from (``core/data/vision``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from leansft.core.data.dataset import TokenizedDataset
from leansft.core.data.vision.prepare import ImageTable
from leansft.core.errors import ConfigError


@dataclass
class VisionInputs:
    """A batch's images: the vision tower's input and each image's (t, h, w) patch grid, in the order their
    placeholders appear; ``images_per_piece``: how many images each packed piece holds."""

    pixel_values: torch.Tensor | None
    grid: torch.Tensor  # [images, 3] int64
    images_per_piece: list[int]

    def to(self, device) -> VisionInputs:
        pv = None if self.pixel_values is None else self.pixel_values.to(device, non_blocking=True)
        return VisionInputs(pv, self.grid.to(device), self.images_per_piece)

    def pin_memory(self) -> VisionInputs:
        pv = None if self.pixel_values is None else self.pixel_values.pin_memory()
        return VisionInputs(pv, self.grid, self.images_per_piece)


def vision_inputs(data: TokenizedDataset, example, start, length) -> VisionInputs:
    """The images of a packed batch's pieces (example index, first token, token count): whole examples only."""
    stored = data.index[np.asarray(example, np.int64)]
    whole = data.store.lengths[stored]
    if (np.asarray(start) != 0).any() or (np.asarray(length) != whole).any():
        raise ConfigError("an example with images was split or cut: its image tokens would lose their image",
                          field="batching.strategy", hint="use batching.strategy bfd (examples whole)")
    table: ImageTable = data.store.images
    pixels = table.pixels(stored)
    grid = torch.from_numpy(pixels.grid) if pixels is not None else torch.zeros((0, 3), dtype=torch.int64)
    return VisionInputs(None if pixels is None else pixels.pixel_values, grid, [len(table.refs[e]) for e in stored])
