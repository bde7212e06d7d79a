"""Before step 1 of a vision run: the loss of a few examples (images included) in one batch, packed or padded as
the run batches them, against each example run alone through the plain model, as transformers runs it (its own
attention, positions and image placement)."""

from __future__ import annotations

import numpy as np
import torch

from leansft.core.batching.collate import collate_packed, collate_padded
from leansft.core.batching.vision import vision_inputs
from leansft.core.data.dataset import TokenizedDataset
from leansft.core.data.masking import IGNORE_INDEX
from leansft.core.errors import ModelError
from leansft.core.model.attention import plain_attention
from leansft.core.model.forward import LossModule
from leansft.core.model.loss import PLAIN, HeadPrecision
from leansft.core.model.vision_forward import image_inputs

TOLERANCE = 1e-4  # relative, on the summed loss in fp32 (the packed and plain runs differ by rounding alone)


def probe_examples(data: TokenizedDataset, tokens: int, most: int = 4) -> np.ndarray:
    """Up to ``most`` examples that fit one micro-batch together, those with the most images first."""
    images = np.array([len(data.store.images.refs[e]) for e in data.index])
    order = np.argsort(-images, kind="stable")
    picked, used = [], 0
    for i in order[: most * 4]:
        if used + data.lengths[i] <= tokens and len(picked) < most:
            picked.append(int(i))
            used += int(data.lengths[i])
    return np.sort(np.asarray(picked, np.int64))


def plain_loss(model, data: TokenizedDataset, i: int, device) -> torch.Tensor:
    """Summed loss of example ``i`` alone, through the model's own forward (``labels``: its mean, rescaled)."""
    ids, labels = data.example(i)
    vision = vision_inputs(data, [i], [0], [len(ids)]).to(device)
    input_ids = torch.as_tensor(ids, dtype=torch.long, device=device)[None]
    lab = torch.as_tensor(labels, dtype=torch.long, device=device)[None]
    with plain_attention(model):
        out = model(input_ids=input_ids, labels=lab, use_cache=False, **image_inputs(model, input_ids, vision))
    return out.loss.float() * (lab[:, 1:] != IGNORE_INDEX).sum()


@torch.no_grad()
def verify_vision(model, data: TokenizedDataset, tokens: int, precision: HeadPrecision = PLAIN,
                  pad: int | None = None) -> str:
    """A line saying what was checked; a ``ModelError`` where the batch's loss is not the per-example one. ``pad``:
    the pad id of a padded run (its batches are checked), else the packed ones are."""
    picked = probe_examples(data, tokens)
    device = next(model.parameters()).device
    batch = (collate_padded(data, picked, pad) if pad is not None else
             collate_packed(data, picked, np.zeros(len(picked), np.int64), data.lengths[picked])).to(device)
    batched = float(LossModule(model, precision=precision)(batch))
    alone = float(sum(plain_loss(model, data, int(i), device) for i in picked))
    gap = abs(batched - alone) / max(abs(alone), 1e-12)
    images = sum(len(data.store.images.refs[data.index[i]]) for i in picked)
    kind = "padded" if pad is not None else "packed"
    if gap > TOLERANCE:
        raise ModelError(f"{kind} examples with images give a loss {batched:.6g}, each alone {alone:.6g} (relative gap "
                         f"{gap:.2e}): {kind} batches are not exact for this model", field="batching.strategy",
                         hint="report it; training.verify: skip trains anyway")
    return (f"{len(picked)} {kind} examples with {images} images: loss {batched:.6g} = each alone {alone:.6g} "
            f"(relative gap {gap:.1e})")
