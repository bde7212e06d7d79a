"""The model's own image processor: pixels and patch grids for a list of images; and the model's processor class
whole (``model_processor``), against which the data's ids are checked before training.

``AutoImageProcessor`` gives the torchvision-backed processor where torchvision is installed and the PIL one
otherwise (the same arithmetic); leansft does not go through ``AutoProcessor`` because Qwen2-VL's demands a video
processor that needs torchvision. The processor's text side (one placeholder repeated per merged patch) is
``encode.expand_images``, checked against the model's processor class on each run's first examples.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from leansft.core.errors import ConfigError, ModelError


@dataclass
class Pixels:
    pixel_values: torch.Tensor  # [patches, channels * patch area * temporal patch]
    grid: np.ndarray  # [images, 3]: (t, h, w) patches of each image


class ImageProcessing:
    """``min_pixels``/``max_pixels``: the resolution limits (None: as the model ships them)."""

    def __init__(self, model_path: str, min_pixels: int | None = None, max_pixels: int | None = None) -> None:
        from transformers import AutoImageProcessor

        if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
            raise ConfigError(f"vision.min_pixels {min_pixels} is above vision.max_pixels {max_pixels}",
                              field="vision.min_pixels")
        self.folder = model_path  # the model's own folder: its processor settings (``processor_config.json``) too
        limits = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        try:
            self.processor = AutoImageProcessor.from_pretrained(model_path, **limits)
        except Exception as err:
            raise ModelError(f"cannot load the model's image processor: {type(err).__name__}: {str(err)[:300]}",
                             file=model_path, hint="a vision model's folder holds preprocessor_config.json") from None
        if limits and self.limits == (None, None):
            raise ConfigError("vision.min_pixels / max_pixels: this model's processor resizes every image to one size",
                              field="vision.max_pixels")

    @property
    def limits(self) -> tuple[int | None, int | None]:
        """(min, max) pixels of a resized image where the processor resizes within limits (Qwen2-VL), else
        (None, None): every image to one size (Gemma 3)."""
        size = self.processor.size
        if "shortest_edge" not in size or "longest_edge" not in size:
            return None, None
        return int(size["shortest_edge"]), int(size["longest_edge"])

    def save(self, folder: Path) -> None:
        """The image processor's settings, and the model's processor settings where it ships them (LLaVA's patch
        size and feature strategy, which ``AutoProcessor`` needs to expand ``<image>``; their chat template left out:
        the exported tokenizer's is the one trained with)."""
        self.processor.save_pretrained(folder)
        shipped = Path(self.folder) / "processor_config.json"
        if shipped.is_file():
            settings = json.loads(shipped.read_text())
            settings.pop("chat_template", None)
            (folder / shipped.name).write_text(json.dumps(settings, indent=2))

    def __call__(self, images: list[Image.Image]) -> Pixels:
        out = self.processor(images=images, return_tensors="pt")
        grid = out.get("image_grid_thw")  # without one (Gemma 3), a row of zeros per image
        grid = grid.numpy().astype(np.int64) if grid is not None else np.zeros((len(out["pixel_values"]), 3), np.int64)
        return Pixels(out["pixel_values"], grid)


def _without_video(cls):
    """``cls`` (a processor class) constructed without a video processor: its constructor checks each part's class,
    and where torchvision is missing the video processors' lookup fails even for ``None``. Images and text only."""

    class ImagesAndText(cls):
        def check_argument_for_proper_class(self, name, arg):
            if name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(name, arg)

    ImagesAndText.__name__ = ImagesAndText.__qualname__ = cls.__name__
    return ImagesAndText


def model_processor(folder: str, tokenizer, config, image_processor=None):
    """The model's own processor class (transformers' mapping from its ``model_type``) over its image processor and
    ``tokenizer``, with the settings its ``processor_config.json`` holds (and the image sequence length of its
    config where the class takes one); built without a video processor where its constructor asks for one.
    ``image_processor``: one loaded already from ``folder``. Raises what construction raised (the caller says what
    was not checked)."""
    import transformers
    from transformers import AutoImageProcessor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    if not name:
        raise ModelError(f"transformers names no processor class for '{getattr(config, 'model_type', '?')}'")
    cls = getattr(transformers, name)
    takes = inspect.signature(cls.__init__).parameters
    settings = {}
    shipped = Path(folder) / "processor_config.json"
    if shipped.is_file():
        settings = {k: v for k, v in json.loads(shipped.read_text()).items() if k in takes
                    and k not in ("chat_template", "image_processor", "tokenizer", "video_processor")}
    if "image_seq_length" in takes and "image_seq_length" not in settings and hasattr(config, "mm_tokens_per_image"):
        settings["image_seq_length"] = int(config.mm_tokens_per_image)
    parts = {"image_processor": image_processor or AutoImageProcessor.from_pretrained(folder), "tokenizer": tokenizer}
    if "video_processor" in takes:
        cls, parts["video_processor"] = _without_video(cls), None
    return cls(**parts, **settings)
