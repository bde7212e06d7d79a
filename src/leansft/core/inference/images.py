"""A prompt about pictures for a vision model: the user message with its images as the template renders them,
each placeholder expanded and the special tokens added as the model's processor does, and the vision tower's
inputs for ``generate``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from leansft.core.batching.vision import VisionInputs
from leansft.core.data.masking import IGNORE_INDEX, ChatTemplate
from leansft.core.data.vision.encode import ProcessorSpecials, expand_images
from leansft.core.data.vision.family import vision_family
from leansft.core.data.vision.images import open_image
from leansft.core.data.vision.processing import ImageProcessing
from leansft.core.errors import LeanSFTError
from leansft.core.model.vision_forward import image_inputs


def user_message(text: str, images: int) -> dict:
    """A user message with ``images`` pictures before its text, as vision templates read it."""
    return {"role": "user", "content": [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": text}]}


def image_prompt(model, tokenizer, template: ChatTemplate, settings, messages: list[dict], images: list[str],
                 processing: ImageProcessing) -> tuple[list[int], dict]:
    """(prompt ids ending in the generation prompt, the further inputs of ``generate``) for the conversation
    ``messages``, whose image parts are ``images`` in order (paths, relative to the working directory)."""
    family = vision_family(model.config)
    pixels = processing([open_image(p, Path.cwd(), file="--image", row=0) for p in images])
    if family.expand == "text":  # the processor's image sequence in the text, then tokenised (Gemma 3)
        text = settings.render(tokenizer, template, messages)
        text = text.replace(family.image_token, family.image_text(tokenizer, model.config))
        ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int64)
    else:
        ids = np.asarray(settings.ids(tokenizer, template, messages), np.int64)
        try:
            ids, _ = expand_images(ids, np.full(len(ids), IGNORE_INDEX), int(model.config.image_token_id),
                                   family.tokens_per_image(pixels.grid, model.config))
        except ValueError as err:
            raise LeanSFTError(f"the chat template and the images disagree: {err}", field="--image") from None
    ids, _ = ProcessorSpecials.of(tokenizer).add(ids)  # as the processor adds them (LLaVA-1.5's <s>)
    input_ids = torch.as_tensor(ids)[None]
    vision = VisionInputs(pixels.pixel_values, torch.from_numpy(pixels.grid), [len(images)])
    return ids.tolist(), image_inputs(model, input_ids, vision)
