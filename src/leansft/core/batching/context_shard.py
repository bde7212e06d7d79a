"""A packed row's share for one rank of a context-parallel group (``core/model/context_parallel``).

The row is padded to a multiple of the group's size (the padding is a segment of its own, with no loss) and cut
into equal contiguous shares. A share keeps the row's ``cu_seqlens`` (attention runs over the whole row) and its
own tokens' position ids (the positions inside each example, computed before the split). Its labels run one token
past its tokens: the loss pairs a token with the next one's label, and a share's last token predicts the next
share's first, as in one process. Counting only each share's own targets, the ranks count every token once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from leansft.core.batching.collate import PackedBatch
from leansft.core.data.masking import IGNORE_INDEX


def context_shard(batch: PackedBatch, rank: int, size: int) -> PackedBatch:
    """``rank``'s share of ``batch`` (one row) split over ``size`` ranks; the batch itself where ``size`` is 1."""
    if size == 1:
        return batch
    total = batch.input_ids.shape[1]
    pad = -total % size
    ids, labels, positions, weights = batch.input_ids, batch.labels, batch.position_ids, batch.weights
    cu = batch.cu_seqlens
    if pad:
        ids = F.pad(ids, (0, pad), value=int(ids[0, -1]))
        labels = F.pad(labels, (0, pad), value=IGNORE_INDEX)
        positions = torch.cat([positions, torch.arange(pad, dtype=positions.dtype).unsqueeze(0)], dim=1)
        weights = None if weights is None else F.pad(weights, (0, pad))
        cu = torch.cat([cu, cu.new_tensor([total + pad])])
    share = (total + pad) // size
    a, b = rank * share, (rank + 1) * share
    after = F.pad(labels, (0, 1), value=IGNORE_INDEX)  # the last share's last token predicts nothing
    return PackedBatch(
        ids[:, a:b].contiguous(), after[:, a:b + 1].contiguous(), positions[:, a:b].contiguous(), cu,
        max(batch.max_seqlen, pad), batch.examples, batch.starts,
        None if weights is None else F.pad(weights, (0, 1))[:, a:b + 1].contiguous(),
        context=(rank, size), padding=max(0, b - max(a, total)))
