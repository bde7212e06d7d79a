"""The vision-language architectures leansft trains, and what each needs to know about its image tokens.

An architecture is supported when its ids, masks and packed forward have been checked against the model's own
processor and a per-example run (``tests/test_vision.py``); any other model with a vision tower is refused by
name, never trained as if it were text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from leansft.core.errors import ModelError


@dataclass(frozen=True)
class VisionFamily:
    """``image_token``: the placeholder the template writes once per image and the processor repeats once per
    merged patch; ``merge``: the config key of the patch merge (tokens per image = patches / merge**2)."""

    name: str
    image_token: str
    video_token: str
    tower: str = "model.visual."  # parameter-name prefixes: the vision encoder (projector included) ...
    projector: str = "model.visual.merger."  # ... and the projector inside it

    def part(self, name: str) -> str:
        """Which part a parameter (or module) name belongs to: tower, projector or language."""
        name = name.removeprefix("base_model.model.")  # under PEFT
        if name.startswith(self.projector):
            return "projector"
        return "tower" if name.startswith(self.tower) else "language"

    def tokens_per_image(self, grid: np.ndarray, merge: int) -> np.ndarray:
        """Placeholder tokens of each image from its (t, h, w) patch grid."""
        return np.asarray(grid, np.int64).prod(axis=-1) // (merge * merge)


QWEN2_VL = VisionFamily("Qwen2-VL", "<|image_pad|>", "<|video_pad|>")
SUPPORTED: dict[str, VisionFamily] = {"qwen2_vl": QWEN2_VL,
                                      "qwen2_5_vl": VisionFamily("Qwen2.5-VL", "<|image_pad|>", "<|video_pad|>")}


def is_vision_model(config) -> bool:
    """Whether the model has a vision tower (a ``vision_config``, as every transformers VLM config has)."""
    return getattr(config, "vision_config", None) is not None


def vision_family(config) -> VisionFamily:
    """The family of a vision model's config, or a ``ModelError`` naming an unsupported architecture."""
    kind = getattr(config, "model_type", "?")
    if kind not in SUPPORTED:
        names = ", ".join(sorted({f.name for f in SUPPORTED.values()}))
        raise ModelError(f"vision-language architecture '{kind}' is not supported yet (supported: {names}): its "
                         "image tokens, masks and packed forward have not been checked",
                         hint="train a supported model, or drop the images to fine-tune its language model on text "
                              "(docs/vision.md)")
    return SUPPORTED[kind]


def merge_size(config) -> int:
    return int(config.vision_config.spatial_merge_size)
