"""A conversation with images as ids and labels: the chat template renders one placeholder per image (the text
encoder's masks, unchanged), then each placeholder is repeated once per merged patch of its image, as the model's
processor does. Image tokens never carry loss: they sit in user messages, and a placeholder with a label is
refused."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from leansft.core.data.masking import IGNORE_INDEX, ChatEncoder, Encoded
from leansft.core.errors import DataError, TemplateError
from leansft.core.data.vision.family import VisionFamily


@dataclass
class VisionExample:
    ids: np.ndarray  # int64, placeholders expanded
    labels: np.ndarray  # int64, -100 where no loss
    images: int  # the conversation's first ``images`` images are this example's


def expand_images(ids: np.ndarray, labels: np.ndarray, image_id: int, counts: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``ids``/``labels`` with the k-th ``image_id`` repeated ``counts[k]`` times (no loss on any of them)."""
    at = np.flatnonzero(ids == image_id)
    if len(at) != len(counts):
        raise ValueError(f"{len(at)} image placeholders for {len(counts)} images")
    repeat = np.ones(len(ids), np.int64)
    repeat[at] = counts
    return np.repeat(ids, repeat), np.where(np.repeat(ids, repeat) == image_id, IGNORE_INDEX, np.repeat(labels, repeat))


class VisionEncoder:
    """``text``: the ChatEncoder of the model's tokenizer and template (content parts go to the template as they
    are); ``image_id``: the placeholder's token id."""

    def __init__(self, text: ChatEncoder, family: VisionFamily, image_id: int, merge: int) -> None:
        self.text, self.family, self.image_id, self.merge = text, family, image_id, merge

    def encode(self, conv, grids: np.ndarray, file: str) -> list[VisionExample]:
        """The examples of ``conv`` whose images have patch grids ``grids`` ([images, 3])."""
        if conv.text is not None:
            raise DataError("a plain-text row in a vision model's data: use messages", row=conv.row, file=file)
        counts = self.family.tokens_per_image(grids, self.merge) if len(grids) else np.zeros(0, np.int64)
        examples = self.text.encode([conv])[0]
        out = []
        for j, enc in enumerate(examples):
            ids, labels = (np.asarray(a, np.int64) for a in enc)
            self._check(enc, ids, labels, conv, file)
            k = int((ids == self.image_id).sum())
            if k > len(counts):
                raise TemplateError(f"the chat template wrote {k} image placeholders for {len(counts)} images",
                                    row=conv.row, file=file)
            if k < len(counts) and j == len(examples) - 1 and _trained_after(conv, k):
                raise TemplateError(f"the chat template rendered {k} of the conversation's {len(counts)} images: the "
                                    "answers would be trained without the others", row=conv.row, file=file,
                                    hint="use the model's own chat template")
            ids, labels = expand_images(ids, labels, self.image_id, counts[:k])
            out.append(VisionExample(ids, labels, k))
        return out

    def _check(self, enc: Encoded, ids: np.ndarray, labels: np.ndarray, conv, file: str) -> None:
        if enc.weights is not None:
            raise DataError("message loss weights between 0 and 1 are not supported with images yet", row=conv.row,
                            file=file, field="weight", hint="use weight 0 or 1 (train: false/true)")
        if (labels[ids == self.image_id] != IGNORE_INDEX).any():
            raise TemplateError("an image placeholder would carry loss (it sits inside a trained span)", row=conv.row,
                                file=file)


def _trained_after(conv, k: int) -> bool:
    """Whether an assistant message follows the (k+1)-th image: the whole rendering should have held it."""
    seen = 0
    for m in conv.messages:
        if isinstance(m.get("content"), list):
            seen += sum(p.get("type") == "image" for p in m["content"])
        if m["role"] == "assistant" and seen > k:
            return True
    return False
