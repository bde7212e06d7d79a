"""A prompt about pictures for a vision model: the user message with its images as the template renders them,
each placeholder expanded as the model's processor does, and the vision tower's inputs for ``generate``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from leansft.core.data.masking import IGNORE_INDEX, ChatTemplate
from leansft.core.data.vision.encode import expand_images
from leansft.core.data.vision.family import merge_size, vision_family
from leansft.core.data.vision.images import open_image
from leansft.core.data.vision.processing import ImageProcessing
from leansft.core.errors import LeanSFTError


def user_message(text: str, images: int) -> dict:
    """A user message with ``images`` pictures before its text, as vision templates read it."""
    return {"role": "user", "content": [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": text}]}


def image_prompt(model, tokenizer, template: ChatTemplate, settings, messages: list[dict], images: list[str],
                 processing: ImageProcessing) -> tuple[list[int], dict]:
    """(prompt ids ending in the generation prompt, the further inputs of ``generate``) for the conversation
    ``messages``, whose image parts are ``images`` in order (paths, relative to the working directory)."""
    family = vision_family(model.config)
    ids = np.asarray(settings.ids(tokenizer, template, messages), np.int64)
    pixels = processing([open_image(p, Path.cwd(), file="--image", row=0) for p in images])
    image_id = int(model.config.image_token_id)
    try:
        ids, _ = expand_images(ids, np.full(len(ids), IGNORE_INDEX), image_id,
                               family.tokens_per_image(pixels.grid, merge_size(model.config)))
    except ValueError as err:
        raise LeanSFTError(f"the chat template and the images disagree: {err}", field="--image") from None
    input_ids = torch.as_tensor(ids)[None]
    return ids.tolist(), {"pixel_values": pixels.pixel_values, "image_grid_thw": torch.from_numpy(pixels.grid),
                          "mm_token_type_ids": (input_ids == image_id).int()}
