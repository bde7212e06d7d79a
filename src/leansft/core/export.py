"""Export a plain Hugging Face model folder: config, safetensors, tokenizer, chat template."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from leansft.core.generation import stop_token_ids


def full_state_dict(sharded_root) -> dict:
    """The whole model's weights gathered from FSDP shards onto the CPU (a collective: call on every rank)."""
    sd = get_model_state_dict(sharded_root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("model."): v for k, v in sd.items()}


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
    gen = getattr(model, "generation_config", None)  # adapters alone too: the base's own may not stop at turn end
    if gen is not None:
        gen.eos_token_id = stop_token_ids(tokenizer, template)
        gen.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    os.rename(tmp, folder)
    return folder
