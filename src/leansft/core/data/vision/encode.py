"""A conversation with images as ids and labels: the chat template renders one placeholder per image (the text
encoder's masks, unchanged), then each placeholder is repeated once per merged patch of its image, as the model's
processor does. Image tokens never carry loss: they sit in user messages, and a placeholder with a label is
refused. The special tokens the processor's tokenizer adds around a rendering (LLaVA-1.5's ``<s>``: a processor
tokenises with them unless the text starts with the BOS token) are added alike, at training and at inference."""

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
    ids = np.repeat(ids, repeat)
    return ids, np.where(ids == image_id, IGNORE_INDEX, np.repeat(labels, repeat))


@dataclass(frozen=True)
class ProcessorSpecials:
    """The tokens a vision processor's tokenizer call adds around a rendered chat: ``prefix`` and ``suffix`` as
    ``add_special_tokens=True`` adds them, except where the text already starts with the BOS token (``bos``), as
    transformers' ``ProcessorMixin.apply_chat_template`` decides."""

    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    bos: int | None = None

    @classmethod
    def of(cls, tokenizer) -> ProcessorSpecials:
        plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
        full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
        bos = tokenizer.bos_token_id if tokenizer.bos_token is not None else None
        for i in range(len(full) - len(plain) + 1):
            if full[i:i + len(plain)] == plain:
                return cls(tuple(full[:i]), tuple(full[i + len(plain):]), bos)
        return cls((), (), bos)

    def add(self, ids: np.ndarray, labels: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """``ids`` as the processor tokenises their text (the added tokens carry no loss)."""
        if (not self.prefix and not self.suffix) or (self.bos is not None and len(ids) and ids[0] == self.bos):
            return ids, labels
        ids = np.concatenate([np.asarray(self.prefix, np.int64), ids, np.asarray(self.suffix, np.int64)])
        if labels is not None:
            labels = np.concatenate([np.full(len(self.prefix), IGNORE_INDEX, np.int64), labels,
                                     np.full(len(self.suffix), IGNORE_INDEX, np.int64)])
        return ids, labels


class TextExpandingEncoder(ChatEncoder):
    """The ChatEncoder of a family whose processor expands images in the text (Gemma 3): every rendering carries the
    processor's image sequence in place of each image token, so tokens, spans and masks are those of the text the
    model reads."""

    def __init__(self, tokenizer, template, image_token: str, image_text: str, *options) -> None:
        self._image = (image_token, image_text)  # before ChatEncoder's own renderings (stop tokens, probes)
        if template.has_generation_markers:
            raise TemplateError("a template with {% generation %} markers cannot be expanded for images here",
                                field="data.template", hint="use the model's own chat template")
        super().__init__(tokenizer, template, *options)

    def _jinja(self, chat: list[dict], tools: list | None, gen_prompt: bool) -> str:
        return super()._jinja(chat, tools, gen_prompt).replace(*self._image)


class VisionEncoder:
    """``text``: the ChatEncoder of the model's tokenizer and template (content parts go to the template as they
    are); ``placeholder``: the id of the token the template writes per image; ``image_id``: the model's image token
    (``config.image_token_id``), which never carries loss."""

    def __init__(self, text: ChatEncoder, family: VisionFamily, placeholder: int, image_id: int, config) -> None:
        self.text, self.family, self.config = text, family, config
        self.placeholder, self.image_id = placeholder, image_id
        self.specials = ProcessorSpecials.of(text.tok)

    def encode(self, conv, grids: np.ndarray, file: str) -> list[VisionExample]:
        """The examples of ``conv`` whose images have patch grids ``grids`` ([images, 3])."""
        if conv.text is not None:
            raise DataError("a plain-text row in a vision model's data: use messages", row=conv.row, file=file)
        counts = self.family.tokens_per_image(grids, self.config) if len(grids) else np.zeros(0, np.int64)
        examples = self.text.encode([conv])[0]
        out = []
        for j, enc in enumerate(examples):
            ids, labels = (np.asarray(a, np.int64) for a in enc)
            self._check(enc, ids, labels, conv, file)
            ids, labels = self.specials.add(ids, labels)
            k = int((ids == self.placeholder).sum())
            if k > len(counts):
                raise TemplateError(f"the chat template wrote {k} image placeholders for {len(counts)} images",
                                    row=conv.row, file=file)
            if k < len(counts) and j == len(examples) - 1 and _trained_after(conv, k):
                raise TemplateError(f"the chat template rendered {k} of the conversation's {len(counts)} images: the "
                                    "answers would be trained without the others", row=conv.row, file=file,
                                    hint="use the model's own chat template")
            if self.family.expand == "repeat":
                ids, labels = expand_images(ids, labels, self.placeholder, counts[:k])
            elif int((ids == self.image_id).sum()) != int(counts[:k].sum()):  # expanded in the text already
                raise TemplateError(f"{int((ids == self.image_id).sum())} image tokens for {k} images of "
                                    f"{int(counts[0]) if len(counts) else 0} tokens each", row=conv.row, file=file)
            out.append(VisionExample(ids, labels, k))
        return out

    def _check(self, enc: Encoded, ids: np.ndarray, labels: np.ndarray, conv, file: str) -> None:
        if enc.weights is not None:
            raise DataError("message loss weights between 0 and 1 are not supported with images yet", row=conv.row,
                            file=file, field="weight", hint="use weight 0 or 1 (train: false/true)")
        if (labels[(ids == self.placeholder) | (ids == self.image_id)] != IGNORE_INDEX).any():
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
