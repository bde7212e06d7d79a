"""A run's first conversations against the model's own processor class, before any training: the ids leansft made
for each equal what the processor makes of the template's rendering and its images, special tokens included (a
processor adds them unless the rendering starts with the BOS token). Judged against transformers' processor, not
against leansft's own expansion; what differs is refused, naming the row, the token and both ids."""

from __future__ import annotations

import logging

import numpy as np

from leansft.core.data.masking import ChatTemplate
from leansft.core.data.vision.encode import VisionEncoder, VisionExample
from leansft.core.data.vision.processing import ImageProcessing, model_processor
from leansft.core.errors import TemplateError

log = logging.getLogger("leansft")


class ProcessorCheck:
    """Called with each prepared conversation; compares the first ``with_images`` that hold images and the first
    ``without`` that hold none (a conversation made into one example: the common case)."""

    def __init__(self, processing: ImageProcessing, encoder: VisionEncoder, template: ChatTemplate,
                 with_images: int = 2, without: int = 1) -> None:
        self.encoder, self.template, self.tok = encoder, template, encoder.text.tok
        self.left = {True: with_images, False: without}
        self.checked = 0
        try:
            self.processor = model_processor(processing.folder, self.tok, encoder.config, processing.processor)
        except Exception as err:  # noqa: BLE001 - said, and the run goes on with its own checks
            self.processor = None
            log.warning("vision: the ids are not compared with the model's processor class (it could not be built: "
                        "%s: %s)", type(err).__name__, str(err)[:200])

    def __call__(self, conv, images: list, examples: list[VisionExample], file: str) -> None:
        has = bool(images)
        if self.processor is None or len(examples) != 1 or self.left[has] <= 0:
            return
        self.left[has] -= 1
        text = self.tok.apply_chat_template(self.template.as_parts(conv.messages), tools=conv.tools, tokenize=False,
                                            chat_template=self.template.source)
        starts = self.tok.bos_token is not None and text.startswith(self.tok.bos_token)
        ref = np.asarray(self.processor(text=[text], images=[images] if has else None,
                                        add_special_tokens=not starts)["input_ids"][0], np.int64)
        ours = examples[0].ids
        if not np.array_equal(ours, ref):
            differ = np.flatnonzero(ours[: len(ref)] != ref[: len(ours)])
            at = int(differ[0]) if len(differ) else min(len(ours), len(ref))
            name = type(self.processor).__name__
            shown = lambda ids: repr(self.tok.convert_ids_to_tokens(int(ids[at]))) if at < len(ids) else "the end"  # noqa: E731
            raise TemplateError(f"the ids differ from {name}'s at token {at} (leansft: {shown(ours)}, {name}: "
                                f"{shown(ref)}; {len(ours)} against {len(ref)} tokens): the model would be trained on "
                                "other ids than it reads", row=conv.row, file=file,
                                hint="report it with the model's name; leansft refuses what it cannot train exactly")
        self.checked += 1
