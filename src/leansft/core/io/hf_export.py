"""Export a plain Hugging Face model folder: config, safetensors, tokenizer, chat template."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from leansft.core.errors import ModelError
from leansft.core.inference.generation import stop_token_ids


def gather_full_weights(sharded_root: torch.nn.Module, plain: torch.nn.Module | None) -> None:
    """Copy an FSDP-sharded model's weights into rank 0's plain copy of it, gathered one tensor at a time (a
    collective: call on every rank, ``plain`` None off rank 0). Gathering the whole state dict first would hold a
    second full copy beside ``plain`` in rank 0's host memory (7B in fp32: 2 x 28 GB) at the end of a run."""
    target = plain.state_dict() if plain is not None else None
    unmatched, sharded = [], sharded_root.state_dict()
    for name, tensor in sharded.items():  # the same names, in the same order, on every rank
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        dest = None if target is None else target.get(name.removeprefix("model."))
        if dest is not None and dest.shape == full.shape:
            dest.copy_(full)
        elif target is not None:
            unmatched.append(f"{name} {tuple(full.shape)}")
        del full  # before the next is gathered
    missing = sorted(set(target or ()) - {k.removeprefix("model.") for k in sharded})
    if unmatched or missing:  # raised after the last collective, so no rank is left waiting in one
        raise ModelError("the trained model's weights do not match the plain model built for the export: "
                         + ", ".join(unmatched + [f"{k} (not trained)" for k in missing])[:400])


def export(model, tokenizer, template, folder: Path, cfg) -> Path:
    """Write ``folder`` atomically. LoRA is merged when ``training.lora.merge_on_export``; else the folder holds
    the adapters as PEFT saves them (``AutoPeftModelForCausalLM`` applies them to the base they name) and a
    generation_config.json with the template's stop tokens, which PEFT does not read by itself."""
    if hasattr(model, "peft_config") and cfg.training.lora.merge_on_export:
        model = model.merge_and_unload()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    impl = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"  # the export must load without leansft
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    finally:
        model.config._attn_implementation = impl
    tokenizer.chat_template = template.source
    tokenizer.save_pretrained(tmp)
    sentencepiece = Path(getattr(tokenizer, "vocab_file", None) or "")
    if sentencepiece.suffix == ".model" and sentencepiece.is_file() and not (tmp / sentencepiece.name).exists():
        shutil.copy(sentencepiece, tmp / sentencepiece.name)  # transformers 5 no longer writes it; converters read it
    gen = getattr(model, "generation_config", None)  # adapters alone too: the base's own may not stop at turn end
    if gen is not None:
        gen.eos_token_id = stop_token_ids(tokenizer, template)
        gen.save_pretrained(tmp)
    readable(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    os.rename(tmp, folder)
    return folder


def readable(folder: Path) -> None:
    """Give every file the mode a plain write would (0644 under the usual umask): transformers writes the weights
    through a private temporary file (0600), which a server running as another user could not read."""
    mask = os.umask(0)
    os.umask(mask)
    for f in folder.rglob("*"):
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)
