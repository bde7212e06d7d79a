"""The forwards of a vision-language model. Packed: the vision tower once per batch (its own attention keeps each
image apart), the image features put in place of the placeholders, M-RoPE positions made for each example as it
runs alone (``get_rope_index`` of the model), and the language model's varlen attention (``core/model/attention``)
so examples never see each other. Padded: the model's own forward. Loss and gradients equal each example run
alone through the plain model (``tests/test_vision.py``)."""

from __future__ import annotations

import torch

from leansft.core.batching.vision import VisionInputs, vision_inputs
from leansft.core.data.dataset import TokenizedDataset
from leansft.core.data.vision.family import vision_family
from leansft.core.errors import ModelError
from leansft.core.model.attention import PACKED_SAFE, remember_segment_sizes, segment_sizes


def vision_model(model):
    """The model's multimodal core (vision tower + language model, no output layer), through PEFT wrappers."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    if inner is None or not hasattr(inner, "get_image_features"):
        raise ModelError(f"{type(base).__name__} has no multimodal core with get_image_features")
    return inner


def mm_token_types(inner, input_ids: torch.Tensor) -> torch.Tensor:
    """1 on the model's image tokens, 0 elsewhere (what the processor returns as ``mm_token_type_ids``, Gemma 3's
    ``token_type_ids``)."""
    return (input_ids == inner.config.image_token_id).int()


def image_inputs(model, input_ids: torch.Tensor, vision: VisionInputs) -> dict:
    """The keywords the model's own forward (and ``generate``) takes the images by, for ``input_ids``."""
    inner = vision_model(model)
    family = vision_family(inner.config)
    out = {family.type_ids: mm_token_types(inner, input_ids)} if family.type_ids else {}
    if vision.pixel_values is not None:
        out["pixel_values"] = vision.pixel_values
        if family.grid:
            out["image_grid_thw"] = vision.grid
    return out


def example_positions(inner, input_ids: torch.Tensor, sizes: list[int], vision: VisionInputs) -> torch.Tensor:
    """[3, 1, T] M-RoPE positions, each piece's computed as if it ran alone."""
    out, at, img = [], 0, 0
    types = mm_token_types(inner, input_ids)
    for size, n in zip(sizes, vision.images_per_piece, strict=True):
        ids = input_ids[:, at : at + size]
        grid = vision.grid[img : img + n] if n else None
        if n:
            pos, _ = inner.get_rope_index(ids, types[:, at : at + size], image_grid_thw=grid)
        else:
            pos = torch.arange(size, device=input_ids.device).view(1, 1, -1).expand(3, 1, -1)
        out.append(pos)
        at, img = at + size, img + n
    return torch.cat(out, dim=2)


def image_features(inner, vision: VisionInputs, grid: bool):
    """The vision tower's output for the batch's images, run without the language model's packing arguments
    (``grid``: the tower takes each image's patch grid, as Qwen2-VL's does; LLaVA's takes the pixels alone)."""
    if vision.pixel_values is None:
        return None
    if grid:
        return inner.get_image_features(vision.pixel_values, vision.grid, return_dict=True)
    return inner.get_image_features(vision.pixel_values, return_dict=True)


def packed_vision_forward(model, batch) -> torch.Tensor:
    """Final hidden states [1, T, H] of a packed batch with images."""
    inner = vision_model(model)
    family = vision_family(inner.config)
    if not family.packs and batch.vision.pixel_values is not None:
        raise ModelError(f"{family.name} cannot be packed exactly with images: its batches with images are padded")
    impl = inner.language_model.config._attn_implementation
    if impl not in PACKED_SAFE:
        raise ModelError(f"attention implementation '{impl}' would let packed examples attend to each other")
    remember_segment_sizes(batch.segment_sizes)
    sizes = segment_sizes(batch.cu_seqlens)
    vision = batch.vision
    features = image_features(inner, vision, family.grid)
    positions = example_positions(inner, batch.input_ids, sizes, vision) if family.grid else batch.position_ids
    images = {"mm_encoder_outputs": {"image": features}} if features is not None else {}
    types = {family.type_ids: mm_token_types(inner, batch.input_ids)} if family.type_ids else {}
    out = inner(input_ids=batch.input_ids, position_ids=positions, **images, **types, use_cache=False,
                cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens,
                max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen)
    return out.last_hidden_state


def padded_vision_forward(model, batch) -> torch.Tensor:
    """Final hidden states [B, L, H] of a padded batch with images (right padding): the model's own forward, which
    places the images and makes each row's positions (and Gemma 3's image attention) from its own inputs."""
    out = vision_model(model)(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                              **image_inputs(model, batch.input_ids, batch.vision))
    return out.last_hidden_state


def vision_generation_inputs(model, data: TokenizedDataset, i: int, prompt: list[int]) -> dict:
    """What ``model.generate`` needs besides the ids to answer example ``i``'s prompt about its images."""
    vision = vision_inputs(data, [i], [0], [int(data.lengths[i])])
    return image_inputs(model, torch.as_tensor([prompt], dtype=torch.long), vision)
