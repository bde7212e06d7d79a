"""The vision-language architectures leansft trains, and what each needs to know about its image tokens.

An architecture is supported when its ids, masks and batches have been checked against the model's own processor
and a per-example run (``tests/test_vision.py``); any other model with a vision tower is refused by name, never
trained as if it were text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from leansft.core.errors import ModelError


@dataclass(frozen=True)
class VisionFamily:
    """What an architecture's processor and model do with images.

    ``image_token``: what the chat template writes once per image. ``expand``: how the processor turns it into the
    model's image tokens: ``repeat`` (Qwen2-VL: the token itself, repeated once per merged patch of its image, so
    the ids are expanded after tokenising) or ``text`` (Gemma 3: replaced in the rendered text by a fixed sequence,
    ``image_text``, before tokenising). ``packs``: whether packed rows are exact (Gemma 3's image tokens attend to
    each other both ways, which varlen causal attention cannot do: its batches are padded). ``type_ids``: the
    keyword under which the model takes the image-token mask (None: it takes none, as LLaVA). ``grid``: whether its
    processor gives each image's patch grid (``image_grid_thw``: M-RoPE). ``tower``/``projector``: parameter-name
    prefixes of the vision encoder and the projector. ``template``: a built-in template to train with where the
    shipped one ends no answer with a stop token (LLaVA-1.5's renders prompts for inference only)."""

    name: str
    image_token: str
    expand: str = "repeat"
    packs: bool = True
    type_ids: str | None = "mm_token_type_ids"
    grid: bool = True
    tower: str = "model.visual."
    projector: str = "model.visual.merger."
    template: str | None = None

    def part(self, name: str) -> str:
        """Which part a parameter (or module) name belongs to: tower, projector or language."""
        name = name.removeprefix("base_model.model.")  # under PEFT
        if name.startswith(self.projector):
            return "projector"
        return "tower" if name.startswith(self.tower) else "language"

    def tokens_per_image(self, grid: np.ndarray, config) -> np.ndarray:
        """The model's image tokens for each image: from its (t, h, w) patch grid and the patch merge (Qwen2-VL),
        or the fixed count of the config (Gemma 3's ``mm_tokens_per_image``; LLaVA's patches of one resized image,
        with a CLIP tower's class token where ``vision_feature_select_strategy`` is ``full``)."""
        grid = np.asarray(grid, np.int64).reshape(-1, 3)
        if not self.grid:
            fixed = getattr(config, "mm_tokens_per_image", None)
            if fixed is None:
                vc = config.vision_config
                fixed = (vc.image_size // vc.patch_size) ** 2 + int(
                    config.vision_feature_select_strategy == "full" and vc.model_type == "clip_vision_model")
            return np.full(len(grid), int(fixed), np.int64)
        merge = int(config.vision_config.spatial_merge_size)
        return grid.prod(axis=-1) // (merge * merge)

    def image_text(self, tokenizer, config) -> str | None:
        """``expand == "text"``: what the processor puts in place of each ``image_token`` in the rendered text."""
        if self.expand != "text":
            return None
        soft = tokenizer.convert_ids_to_tokens(int(config.image_token_id))
        eoi = tokenizer.convert_ids_to_tokens(int(config.eoi_token_index))
        return f"\n\n{self.image_token}{soft * int(config.mm_tokens_per_image)}{eoi}\n\n"


QWEN2_VL = VisionFamily("Qwen2-VL", "<|image_pad|>")
SUPPORTED: dict[str, VisionFamily] = {
    "qwen2_vl": QWEN2_VL,
    "qwen2_5_vl": VisionFamily("Qwen2.5-VL", "<|image_pad|>"),
    "gemma3": VisionFamily("Gemma 3", "<start_of_image>", expand="text", packs=False, type_ids="token_type_ids",
                           grid=False, tower="model.vision_tower.", projector="model.multi_modal_projector."),
    "llava": VisionFamily("LLaVA", "<image>", type_ids=None, grid=False, tower="model.vision_tower.",
                          projector="model.multi_modal_projector.", template="llava"),
}


def is_vision_model(config) -> bool:
    """Whether the model has a vision tower (a ``vision_config``, as every transformers VLM config has)."""
    return getattr(config, "vision_config", None) is not None


def trains_images(config) -> bool:
    """Whether leansft trains this model with images: a vision model of a supported family. Another vision model
    (Llama 4, Mistral 3, LLaVA-NeXT, ...) trains on text as before, its images refused by the data's converter."""
    return is_vision_model(config) and getattr(config, "model_type", None) in SUPPORTED


def vision_family(config) -> VisionFamily:
    """The family of a vision model's config, or a ``ModelError`` naming an unsupported architecture."""
    kind = getattr(config, "model_type", "?")
    if kind not in SUPPORTED:
        names = ", ".join(sorted({f.name for f in SUPPORTED.values()}))
        raise ModelError(f"vision-language architecture '{kind}' is not supported yet (supported: {names}): its "
                         "image tokens, masks and batches have not been checked",
                         hint="train a supported model, or drop the images to fine-tune its language model on text "
                              "(docs/vision.md)")
    return SUPPORTED[kind]
