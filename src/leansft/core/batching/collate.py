"""Batches from the cached token arrays, without Python loops over tokens.

Packed: rows of pieces become one flat sequence per micro-batch with ``position_ids`` restarting at 0
per piece, ``cu_seqlens`` (int32) and ``max_seqlen``; labels are the unshifted labels with -100 on the
first token of every piece, so the loss shift never pairs two examples.
Padded (sorted/padded strategies): ordinary [B, L] tensors with an attention mask.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from leansft.core.batching.packing import PackPlan
from leansft.core.data.dataset import TokenizedDataset
from leansft.core.data.masking import IGNORE_INDEX
from leansft.core.host_read import HostRead
from leansft.core.batching.vision import VisionInputs, vision_inputs


class _Targets:
    labels: torch.Tensor
    weights: torch.Tensor | None  # per-token loss weights (float32), None when every target weighs 1
    target_index: HostRead | None  # set by ``to``: see ``host_target_index``

    @property
    def target_tokens(self) -> int:
        """Tokens that carry loss after the shift (a row's first token never does)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def target_weight(self) -> float:
        """The sum of the targets' loss weights: the loss normaliser (``target_tokens`` when unweighted)."""
        if self.weights is None:
            return float(self.target_tokens)
        return float(self.weights[:, 1:][self.labels[:, 1:] != IGNORE_INDEX].double().sum())

    def host_target_index(self) -> torch.Tensor | None:
        """Flat positions (after the shift) whose next-token label is set, found on the host by ``to``: the loss
        gathers them on the device with no data-dependent shape there, i.e. no host sync (``loss.select_targets``).
        None where the labels are not those it was found from."""
        return self.target_index.get(self.labels) if self.target_index is not None else None

    def _moved_targets(self, labels: torch.Tensor, device) -> HostRead:
        index = self.host_target_index()
        if index is None:
            index = self._target_positions()
        return HostRead.of(_to(index, device), labels)

    def _target_positions(self) -> torch.Tensor:
        return torch.nonzero(self.labels[:, 1:].reshape(-1) != IGNORE_INDEX).squeeze(1)

    def _pinned_targets(self, pinned: dict[str, torch.Tensor]) -> dict[str, HostRead]:
        """The target positions found now (on the batch thread) and pinned, valid for the pinned labels."""
        return {"target_index": HostRead.of(self._target_positions().pin_memory(), pinned["labels"])}


@dataclass
class PackedBatch(_Targets):
    input_ids: torch.Tensor  # [1, T]
    labels: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    cu_seqlens: torch.Tensor  # [n + 1] int32
    max_seqlen: int
    examples: np.ndarray  # example index of each piece
    starts: np.ndarray  # first token of each piece inside its example (0 unless split)
    weights: torch.Tensor | None = None  # [1, T]
    target_index: HostRead | None = None
    segment_sizes: HostRead | None = None  # set by ``to``: the pieces' lengths, read on the host from cu_seqlens
    # A context-parallel share of a row (``context_shard``): (this rank's place, ranks); its labels run one token
    # past its tokens (the next share's first label), and ``padding`` tokens at its end only fill the split.
    context: tuple[int, int] = (0, 1)
    padding: int = 0
    vision: VisionInputs | None = None  # a vision model's images (``core/vision/forward.py``)

    @property
    def real_tokens(self) -> int:
        return int(self.input_ids.numel()) - self.padding

    @property
    def examples_begun(self) -> int:
        """Examples whose first piece is here: an example split across micro-batches counts once (a row split over
        a context group: on its first rank)."""
        return int((self.starts == 0).sum()) if self.context[0] == 0 else 0

    def to(self, device) -> PackedBatch:
        """On ``device``, with what the forward and the loss read on the host (segment lengths, target positions)
        read here, from the host's copy. From pinned memory (``pin_memory``) the copies run without the host
        waiting for them."""
        sizes = self.host_segment_sizes() or torch.diff(self.cu_seqlens).tolist()
        labels, cu = _to(self.labels, device), _to(self.cu_seqlens, device)
        return PackedBatch(_to(self.input_ids, device), labels, _to(self.position_ids, device), cu, self.max_seqlen,
                           self.examples, self.starts, None if self.weights is None else _to(self.weights, device),
                           target_index=self._moved_targets(labels, device), segment_sizes=HostRead.of(sizes, cu),
                           context=self.context, padding=self.padding,
                           vision=None if self.vision is None else self.vision.to(device))

    def pin_memory(self) -> PackedBatch:
        """The batch in page-locked host memory (for a CUDA run; done ahead, on the batch thread)."""
        pinned = _pinned(self, "input_ids", "labels", "position_ids", "cu_seqlens", "weights")
        vision = None if self.vision is None else self.vision.pin_memory()
        return dataclasses.replace(self, **pinned, **self._pinned_targets(pinned), vision=vision)

    def host_segment_sizes(self) -> list[int] | None:
        """The pieces' lengths read on the host by ``to`` (None where ``cu_seqlens`` is not what they were read
        from)."""
        return self.segment_sizes.get(self.cu_seqlens) if self.segment_sizes is not None else None


@dataclass
class PaddedBatch(_Targets):
    input_ids: torch.Tensor  # [B, L]
    labels: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    position_ids: torch.Tensor
    examples: np.ndarray
    weights: torch.Tensor | None = None  # [B, L]
    target_index: HostRead | None = None
    vision: VisionInputs | None = None  # a vision model's images, row after row

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def examples_begun(self) -> int:
        return len(self.examples)

    def to(self, device) -> PaddedBatch:
        labels = _to(self.labels, device)
        return PaddedBatch(_to(self.input_ids, device), labels, _to(self.attention_mask, device),
                           _to(self.position_ids, device), self.examples,
                           None if self.weights is None else _to(self.weights, device),
                           target_index=self._moved_targets(labels, device),
                           vision=None if self.vision is None else self.vision.to(device))

    def pin_memory(self) -> PaddedBatch:
        pinned = _pinned(self, "input_ids", "labels", "attention_mask", "position_ids", "weights")
        vision = None if self.vision is None else self.vision.pin_memory()
        return dataclasses.replace(self, **pinned, **self._pinned_targets(pinned), vision=vision)


def _to(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``; from pinned memory without the host waiting for the copy (the pinned block is not
    reused before the copy is done: torch's pinned-memory allocator records the copy's stream)."""
    return t.to(device, non_blocking=t.is_pinned())


def _pinned(batch, *names: str) -> dict[str, torch.Tensor]:
    return {n: getattr(batch, n).pin_memory() for n in names if getattr(batch, n) is not None}


def collate_packed(data: TokenizedDataset, example: np.ndarray, start: np.ndarray, length: np.ndarray) -> PackedBatch:
    """One flat sequence of the given pieces (example index, first token, token count)."""
    length = np.asarray(length, dtype=np.int64)
    cu = np.zeros(len(length) + 1, dtype=np.int64)
    np.cumsum(length, out=cu[1:])
    total = int(cu[-1])
    ids, labels, weights = data.tokens(example, start, length)
    labels[cu[:-1][length > 0]] = IGNORE_INDEX
    positions = np.arange(total) - np.repeat(cu[:-1], length)
    return PackedBatch(
        torch.from_numpy(ids)[None], torch.from_numpy(labels)[None], torch.from_numpy(positions)[None],
        torch.from_numpy(cu.astype(np.int32)), int(length.max()) if len(length) else 0, np.asarray(example),
        np.asarray(start), None if weights is None else torch.from_numpy(weights)[None],
        vision=None if data.store.images is None else vision_inputs(data, example, start, length),
    )


def collate_rows(data: TokenizedDataset, plan: PackPlan, rows: np.ndarray) -> PackedBatch:
    """Packed batch of several plan rows (they are independent, so their pieces simply concatenate)."""
    idx = np.concatenate([np.arange(plan.row_offsets[r], plan.row_offsets[r + 1]) for r in rows])
    return collate_packed(data, plan.example[idx], plan.start[idx], plan.length[idx])


def collate_padded(data: TokenizedDataset, examples: np.ndarray, pad_id: int, max_length: int | None = None) -> PaddedBatch:
    examples = np.asarray(examples, dtype=np.int64)
    lens = data.lengths[examples]
    if max_length is not None:
        lens = np.minimum(lens, max_length)
    width = int(lens.max())
    ids = np.full((len(examples), width), pad_id, dtype=np.int64)
    labels = np.full((len(examples), width), IGNORE_INDEX, dtype=np.int64)
    mask = np.arange(width)[None, :] < lens[:, None]
    ids[mask], labels[mask], weights = data.tokens(examples, np.zeros(len(examples), np.int64), lens)
    if weights is not None:
        weights, flat = np.ones(ids.shape, dtype=np.float32), weights
        weights[mask] = flat
    labels[:, 0] = IGNORE_INDEX
    positions = np.broadcast_to(np.arange(width), ids.shape).copy()
    vision = None if data.store.images is None else vision_inputs(data, examples, np.zeros(len(examples), np.int64),
                                                                     lens)
    return PaddedBatch(torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(mask.astype(np.int64)),
                       torch.from_numpy(positions), examples, None if weights is None else torch.from_numpy(weights),
                       vision=vision)
