"""Which parts of a vision-language model train: the language model always; the vision tower and the projector
where ``vision.train_vision_tower`` / ``train_projector`` say so (frozen by default, the common recipe)."""

from __future__ import annotations

import torch

from leansft.core.data.vision.family import VisionFamily


def trained_parts(vcfg) -> set[str]:
    """The parts ``vision`` config trains: the language model always, the tower and projector where asked."""
    return {"language"} | ({"tower"} if vcfg.train_vision_tower else set()) | (
        {"projector"} if vcfg.train_projector else set())


def freeze_untrained(model, family: VisionFamily, vcfg) -> int:
    """Full fine-tuning: the frozen parts' parameters stop requiring gradients; returns how many."""
    keep = trained_parts(vcfg)
    n = 0
    for name, p in model.named_parameters():
        if family.part(name) not in keep:
            p.requires_grad_(False)
            n += 1
    return n


def lora_targets(model, family: VisionFamily, vcfg, targets) -> list[str]:
    """The linear layers LoRA adapts on a vision model: ``targets`` (all-linear or names) in the trained parts only,
    never the output layer, as full module names (peft matches a name by its suffix)."""
    keep = trained_parts(vcfg)
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or family.part(name) not in keep or name.endswith("lm_head"):
            continue
        if targets == "all-linear" or name.rsplit(".", 1)[-1] in targets:
            out.append(name)
    return out
