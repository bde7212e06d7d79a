"""Export a plain Hugging Face model folder: config, safetensors, tokenizer, chat template."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from leansft.core.data.masking import stop_token_ids
from leansft.core.errors import ModelError
from leansft.core.io.export_target import MARKER, fresh_folder, marker, replace_with
from leansft.core.paths import plain_file_mode


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


def export(model, tokenizer, template, folder: Path, cfg, source: str | None = None, images=None) -> Path:
    """Write ``folder``: into a fresh temporary folder beside it, then renamed into place (``export_target``), with
    leansft's marker file. The caller decides whether ``folder`` may be replaced (``export_target.check_out``).
    LoRA is merged when ``training.lora.merge_on_export``; else the folder holds the adapters as PEFT saves them
    (``AutoPeftModelForCausalLM`` applies them to the base they name) and a generation_config.json with the
    template's stop tokens, which PEFT does not read by itself. ``source``: what was exported, for the marker.
    ``images``: a vision model's image processor (``core/vision/processing.py``), saved beside the tokenizer so
    ``AutoProcessor`` loads the folder."""
    if hasattr(model, "peft_config") and cfg.training.lora.merge_on_export:
        model = model.merge_and_unload()
    with fresh_folder(folder) as tmp:
        impl = model.config._attn_implementation
        model.config._attn_implementation = "sdpa"  # the export must load without leansft
        try:
            model.save_pretrained(tmp, safe_serialization=True)
        finally:
            model.config._attn_implementation = impl
        tokenizer.chat_template = template.source or None  # no template: none written (not an empty one)
        tokenizer.save_pretrained(tmp)
        if images is not None:
            images.save(tmp)
        sentencepiece = Path(getattr(tokenizer, "vocab_file", None) or "")
        if sentencepiece.suffix == ".model" and sentencepiece.is_file() and not (tmp / sentencepiece.name).exists():
            shutil.copy(sentencepiece, tmp / sentencepiece.name)  # transformers 5 no longer writes it; converters need it
        gen = getattr(model, "generation_config", None)  # adapters alone too: the base's own may not stop at turn end
        if gen is not None:
            gen.eos_token_id = stop_token_ids(tokenizer, template)
            gen.save_pretrained(tmp)
        (tmp / MARKER).write_text(marker(source))
        readable(tmp)
        replace_with(tmp, folder)
    return folder


def readable(folder: Path) -> None:
    """Give every file, and the folder, the mode a plain write would (``plain_file_mode``): transformers writes the
    weights through a private temporary file (0600), and the folder comes from mkdtemp (0700), which a server
    running as another user could not read."""
    mode = plain_file_mode()
    os.chmod(folder, mode | (mode & 0o444) >> 2)  # r -> x: a folder anyone may read, anyone may enter
    for f in folder.rglob("*"):
        if f.is_file():
            os.chmod(f, mode)
        elif f.is_dir():
            os.chmod(f, mode | (mode & 0o444) >> 2)
