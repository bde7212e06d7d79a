"""`leansft export`: any run, checkpoint or model out as a Hugging Face folder or one GGUF file.

A run folder means its newest intact checkpoint; a checkpoint is rebuilt from its own config.yaml (base
model, LoRA settings) and its weights, LoRA merged; anything else ``train`` takes as ``model`` (a model
folder such as OUTPUT_DIR/final, a .gguf file, a ``pkg:`` path, a Hub id) is read as it is. A GGUF file is the
Hugging Face folder ``--to hf`` writes, converted by llama.cpp's converter (``core/gguf/write.py``).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import torch

from leansft.core import distributed
from leansft.core.config import load_config
from leansft.core.data.masking import ChatTemplate, resolve_template, stop_token_ids
from leansft.core.data.tokenizer import load_tokenizer
from leansft.core.data.vision.family import trains_images
from leansft.core.data.vision.processing import ImageProcessing
from leansft.core.errors import LeanSFTError
from leansft.core.gguf.write import convert
from leansft.core.io import checkpoint_files as ckpt
from leansft.core.io.export_target import check_out
from leansft.core.io.hf_export import export
from leansft.core.model.forward import LossModule
from leansft.core.model.loading import load_model, merged_plain_model, resolve_model_path
from leansft.core.model.qlora import dequantised_base
from leansft.core.paths import default_cache_dir, resolve_package_path
from leansft.core.progress import phase
from leansft.recipe.builders import build_model, model_location
from leansft.recipe.checkpointer import agreed_checkpoint
from leansft.recipe.modelfile import write_modelfile
from leansft.recipe.system_prompt import trained_system_prompt

log = logging.getLogger("leansft")


def checkpoint_of(source: str) -> Path | None:
    """The checkpoint a run folder (its newest intact one) or a checkpoint folder means; None for a model."""
    path = Path(source)
    if (path / "checkpoints").is_dir():
        found = agreed_checkpoint(path, "auto", distributed.Storage.one_folder(), sharded=False)
        if found is None:
            raise LeanSFTError("the run has no checkpoint to export", file=source)
        path = found
    return path if (path / "state.json").is_file() else None


def checkpoint_config(path: Path, trust_remote_code: bool = False, base_model: str | None = None):
    """A checkpoint's config.yaml as export reads it: data, never a source of code or downloads. Its
    ``trust_remote_code`` is the caller's (the command line's), not the file's; the model (and tokenizer) it names
    must be on this machine (a local path, a ``pkg:`` file, or a Hub id already in the Hugging Face cache, i.e. what
    ``train`` fetched here) unless ``base_model`` names the model to read instead."""
    cfg = load_config(str(path / "config.yaml"))
    cfg.trust_remote_code = trust_remote_code
    if base_model:
        cfg.model = base_model
    else:
        cfg.model = _on_this_machine(cfg.model, "model", path)
    if cfg.tokenizer:
        cfg.tokenizer = _on_this_machine(cfg.tokenizer, "tokenizer", path)
    log.info("the checkpoint's base model: %s%s", cfg.model,
             " (--base-model)" if base_model else " (as its config.yaml names it)")
    return cfg


def _on_this_machine(spec: str, what: str, checkpoint: Path) -> str:
    """``spec`` where it is on this machine (a Hub id as the folder of its cached snapshot); else a refusal."""
    if spec.startswith("pkg:") or Path(spec).exists():
        return spec
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(spec, "config.json" if what == "model" else "tokenizer_config.json")
    except Exception:  # noqa: BLE001 - not even a valid Hub id
        cached = None
    if isinstance(cached, str):
        return str(Path(cached).parent)
    raise LeanSFTError(f"the checkpoint's config.yaml names the {what} '{spec}', which is neither a path here nor "
                       "in this machine's Hugging Face cache; an export fetches nothing a checkpoint names",
                       file=str(checkpoint / "config.yaml"),
                       hint=f"pass --base-model with the {what} to read (a local folder, or a Hub id to fetch)")


def load_source(source: str, checkpoint: Path | None = None, trust_remote_code: bool = False,
                base_model: str | None = None, cfg=None):
    """(model with LoRA merged, tokenizer, chat template, config or None) from a run, checkpoint or model folder.
    ``checkpoint``: ``checkpoint_of(source)`` where the caller found it already (it verifies every file), and
    ``cfg`` its ``checkpoint_config``; ``trust_remote_code`` and ``base_model``: the command line's."""
    path = checkpoint or checkpoint_of(source)
    if path is not None:
        cfg = cfg or checkpoint_config(path, trust_remote_code, base_model)
        model_path = model_location(cfg)
        model, _ = build_model(cfg, torch.device("cpu"), False, model_path)
        ckpt.load_weights(path, LossModule(model))
        if cfg.training.method == "qlora":  # the adapters merged into the dequantised 4-bit base
            model = merged_plain_model(model, model_path, cfg.training.lora, cfg.trust_remote_code,
                                       dequantised_base(model))
        tokenizer = load_tokenizer(cfg.tokenizer or model_path, cfg.trust_remote_code)
        template = resolve_template(tokenizer, cfg.data.template)
        log.info("reading checkpoint %s", path)
    else:  # what train takes as model: a folder, a .gguf (converted once), pkg:, a Hub id
        folder = resolve_model_path(source, default_cache_dir())
        if Path(folder).is_dir() and not (Path(folder) / "config.json").is_file():
            if (Path(folder) / "adapter_config.json").is_file():
                raise LeanSFTError("LoRA adapters alone (exported with training.lora.merge_on_export: false); "
                                   "leansft reads the run folder or one of its checkpoints instead, LoRA merged",
                                   file=source, hint="the run folder it came from (OUTPUT_DIR, with checkpoints/), or "
                                                     "PEFT's AutoPeftModelForCausalLM.from_pretrained on this folder")
            raise LeanSFTError("not a run, checkpoint or model folder (no checkpoints/, state.json or config.json)",
                               file=source)
        cfg, model = None, load_model(folder, torch.float32, trust_remote_code=trust_remote_code)
        tokenizer = load_tokenizer(folder, trust_remote_code)
        template = resolve_template(tokenizer, None) if tokenizer.chat_template else None
    if hasattr(model, "peft_config"):
        model = model.merge_and_unload()
    return model.eval(), tokenizer, template, cfg


def read_paths(source: str, checkpoint: Path | None, cfg) -> list[str]:
    """The local paths an export of ``source`` reads: what it names, the checkpoint, and the base model's folder."""
    paths = [source, resolve_package_path(source) if source.startswith("pkg:") else source]
    if checkpoint is not None:
        paths.append(str(checkpoint))
    if cfg is not None:
        paths += [resolve_package_path(s) for s in (cfg.model, cfg.tokenizer) if s]
    return [p for p in dict.fromkeys(paths) if Path(p).exists()]


def export_source(source: str, to: str, out: str, dtype: str = "f16", overwrite: bool = False,
                  trust_remote_code: bool = False, base_model: str | None = None) -> Path:
    """Export ``source`` to ``out`` (``to``: hf or gguf). Where OUT may be written is checked before anything is
    read (``export_target.check_out``): an earlier export is replaced, anything else only with ``overwrite``."""
    checkpoint = checkpoint_of(source)  # once: finding a run's newest intact checkpoint reads every file
    cfg = checkpoint_config(checkpoint, trust_remote_code, base_model) if checkpoint is not None else None
    target = check_out(out, to, read_paths(source, checkpoint, cfg), overwrite)
    model, tokenizer, template, cfg = load_source(source, checkpoint, trust_remote_code, base_model, cfg)
    chat = template or ChatTemplate("tokenizer", tokenizer.chat_template or "")
    images = None
    if trains_images(model.config):
        if to == "gguf":
            raise LeanSFTError("GGUF for a vision-language model is not supported yet (the language model and its "
                               "mmproj file are two conversions)", file=source,
                               hint="export --to hf, then llama.cpp's convert_hf_to_gguf.py on that folder, once "
                                    "plain and once with --mmproj")
        images = ImageProcessing(_model_folder(source, cfg), cfg.vision.min_pixels if cfg else None,
                                 cfg.vision.max_pixels if cfg else None)
    if to == "gguf":  # the folder --to hf writes, then llama.cpp's converter
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.hf-") as tmp:
            folder = export(model, tokenizer, chat, Path(tmp) / "hf", cfg, source)
            stops = stop_token_ids(tokenizer, template)
            with phase(f"converting to GGUF ({dtype}) with llama.cpp's converter: {target}"):
                written = convert(folder, target, dtype, stops, source)
        trained = trained_system_prompt(source)
        modelfile = write_modelfile(written, [tokenizer.decode([t]) for t in stops], trained[0] if trained else None)
        if modelfile is not None:
            log.info("Ollama: ollama create %s -f %s", written.stem, modelfile)
        return written
    folder = export(model, tokenizer, chat, target, cfg, source, images=images)
    card = model_card_for(source, checkpoint, cfg, folder)
    if card is not None:
        log.info("model card: %s", card)
    return folder


def _model_folder(source: str, cfg) -> str:
    """Where a vision model's image processor is read: the run's base model, else the folder exported."""
    return model_location(cfg) if cfg is not None else resolve_model_path(source, default_cache_dir())


def model_card_for(source: str, path: Path | None, cfg, folder: Path) -> Path | None:
    """The exported folder's model card, as ``final/`` has one: a checkpoint's from its run's records, a model
    folder's own copied; None where there is none to write. ``path``: the checkpoint ``source`` means, if any."""
    from leansft.recipe.model_card import write_model_card
    from leansft.recipe.metrics_log import read_jsonl

    if path is None:
        own = Path(source) / "README.md"
        if own.is_file():
            (folder / "README.md").write_bytes(own.read_bytes())
            return folder / "README.md"
        return None
    run = path.parents[1]  # OUTPUT_DIR/checkpoints/step-N
    if not (run / "data_report.json").is_file():
        return None
    return write_model_card(cfg, run, folder, read_jsonl(run / "metrics.jsonl"), read_jsonl(run / "samples.jsonl"),
                            json.loads((run / "data_report.json").read_text()))
