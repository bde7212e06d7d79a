"""Load model configs and models: a local folder, a config.json, a .gguf file, or a Hub id.

A model read from GGUF is dequantised by transformers; it is converted once into a plain Hugging
Face folder next to the cache (config without ``quantization_config``, safetensors weights), so later
runs load it like any other local model.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from leansft.core.data.vision.family import trains_images
from leansft.core.errors import ModelError
from leansft.core.gguf.read import complete_from_gguf
from leansft.core.paths import HUB_HINT, default_cache_dir, hub_unreachable, made_once, resolve_package_path
from leansft.core.progress import phase

log = logging.getLogger("leansft")


def load_model_config(spec: str, trust_remote_code: bool = False):
    """A transformers config of any model ``train`` takes (``pkg:`` too); wraps every failure in a
    ``ModelError`` naming ``spec``."""
    spec = resolve_package_path(spec)
    path = Path(spec)
    try:
        if path.is_file() and path.suffix == ".gguf":
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name,
                                              trust_remote_code=trust_remote_code)
        if path.is_file():
            return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        return AutoConfig.from_pretrained(spec, local_files_only=path.exists() or hub_unreachable(),
                                          trust_remote_code=trust_remote_code)
    except Exception as err:
        raise ModelError(f"cannot load model config: {type(err).__name__}: {str(err)[:300]}", file=spec,
                         hint=None if path.exists() else HUB_HINT) from None


GGUF_CONVERSION = "3"  # bumped when a conversion changes: folders converted before are not reused (2: rope
# scaling; 3: the pre-tokenizer the file names)


def gguf_to_hf(gguf: Path, cache_dir: Path) -> Path:
    """Convert a .gguf model once into a Hugging Face folder under ``cache_dir``; return the folder."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{GGUF_CONVERSION}".encode()).hexdigest()[:16]
    out = cache_dir / "models" / f"{gguf.stem}-{key}"
    if (out / "config.json").exists():
        return out
    with made_once(out.parent / f".{out.name}.lock", f"{out.name} from {gguf.name}"):
        if (out / "config.json").exists():  # made by the process this one waited for
            return out
        with phase(f"converting {gguf.name} into a Hugging Face folder (once): {out}"), \
                torch.random.fork_rng():  # building the model draws random init; keep the caller's RNG untouched
            return _convert_gguf(gguf, out)


def _convert_gguf(gguf: Path, out: Path) -> Path:
    try:
        src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                   trust_remote_code=False)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    except Exception as err:
        raise ModelError(f"cannot read GGUF model: {type(err).__name__}: {str(err)[:300]}", file=str(gguf)) from None
    complete_from_gguf(gguf, src, tok)  # the rotary scaling and pre-tokenizer transformers missed, or refused
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(src.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))  # this process's own name
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep other users of a shared cache out
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").is_file():  # else another process converted it first: theirs is the same
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_path(spec: str, cache_dir: Path) -> str:
    """A loadable model location: ``pkg:`` resolved, a .gguf converted once into a cached HF folder."""
    spec = resolve_package_path(spec)
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return str(gguf_to_hf(path, cache_dir))
    return spec


def load_model(spec: str, dtype: torch.dtype = torch.float32, cache_dir: Path | None = None,
               trust_remote_code: bool = False, device: torch.device | None = None):
    """A causal LM in ``dtype``; any failure becomes a ``ModelError`` naming ``spec``.

    ``device``: the weights are read straight onto it, a tensor at a time (transformers' ``device_map``), instead
    of the whole model being built in host memory first and moved there (a 7B model in fp32: 28 GB of host
    memory, on every data-parallel rank at once)."""

    spec = resolve_model_path(spec, Path(cache_dir or default_cache_dir()))
    path = Path(spec)
    place = {"device_map": {"": str(device)}} if device is not None else {}
    try:
        with phase(f"loading {spec} ({str(dtype).removeprefix('torch.')})"):
            auto = AutoModelForCausalLM
            if path.is_dir() and trains_images(load_model_config(spec, trust_remote_code)):
                from transformers import AutoModelForImageTextToText as auto  # vision tower + language model
            return auto.from_pretrained(spec, dtype=dtype, local_files_only=path.exists() or hub_unreachable(),
                                        trust_remote_code=trust_remote_code, **place)
    except Exception as err:
        where = "local model" if path.exists() else "model (no local path of that name; tried the Hub)"
        raise ModelError(f"cannot load {where}: {type(err).__name__}: {str(err)[:300]}", file=spec,
                         hint=None if path.exists() else HUB_HINT) from None


def apply_lora(model, lora_cfg, targets: list[str] | None = None):
    """Wrap ``model`` with peft LoRA adapters (DoRA, rsLoRA, the init and modules_to_save as configured);
    only the adapters (and modules_to_save) train. ``targets``: the adapted layers' full names, where not
    ``lora_cfg.target_modules`` as peft reads it (a vision model's language model alone)."""
    from peft import LoraConfig, get_peft_model

    init = True if lora_cfg.init == "default" else lora_cfg.init
    cfg = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                     target_modules=targets if targets is not None else lora_cfg.target_modules, task_type="CAUSAL_LM", use_dora=lora_cfg.use_dora,
                     use_rslora=lora_cfg.use_rslora, init_lora_weights=init,
                     modules_to_save=lora_cfg.modules_to_save or None)
    try:
        model = get_peft_model(model, cfg)
    except (ValueError, TypeError, NotImplementedError) as err:  # e.g. an option this layer type cannot take
        raise ModelError(f"peft cannot apply this LoRA configuration: {err}", field="training.lora") from None
    keep_autocast_inputs(model)
    return model


def merged_plain_model(trained, spec: str, lora_cfg, trust_remote_code: bool = False,
                       base: Iterable[tuple[str, torch.Tensor]] = ()):
    """A plain fp32 model: ``spec`` loaded afresh, ``base`` ((name, weight) pairs, copied in one at a time, from
    any device) put in place of its own weights, and the adapters of ``trained`` (a PEFT model) merged in by PEFT's
    own merge, so DoRA and rsLoRA merge as they trained. For a base the run held otherwise than as loaded: 4-bit
    (QLoRA: ``base`` is ``quant.dequantised_base``) or bf16 (``core/model/bf16_base.py``: no ``base``, the adapters merge
    into the fp32 weights as loaded)."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    plain = load_model(spec, torch.float32, trust_remote_code=trust_remote_code)
    own = plain.state_dict()
    with torch.no_grad():
        for name, weight in base:
            if name not in own or own[name].shape != weight.shape:
                raise ModelError(f"cannot map the trained base's {name} {tuple(weight.shape)} onto the plain model",
                                 file=spec)
            own[name].copy_(weight)
            del weight  # before the next is made
    plain = apply_lora(plain, lora_cfg)
    set_peft_model_state_dict(plain, {k: v.float().cpu() for k, v in get_peft_model_state_dict(trained).items()})
    return plain.merge_and_unload().eval()


def keep_autocast_inputs(model) -> None:
    """Stop peft casting a plain LoRA layer's input to the adapter's fp32 dtype.

    Under bf16 autocast the input of o_proj/down_proj-like layers is bf16: peft casts it to fp32 for
    ``lora_A``, whose autocast casts it straight back (two copies forward, two backward, per layer, ~8% of a
    SmolLM2 LoRA step on the CPU). bf16 -> fp32 -> bf16 is exact both ways, so skipping it changes no bit.
    Only where the input reaches ``lora_A`` unchanged (no dropout, no DoRA-like variant); without autocast
    every activation of this fp32 model is fp32 already, so nothing needed the cast."""
    from peft.tuners.lora import LoraLayer

    for m in model.modules():
        if isinstance(m, LoraLayer) and adapters_take_input_as_is(m):
            m.cast_input_dtype_enabled = False


def adapters_take_input_as_is(layer) -> bool:
    """A peft LoRA layer whose adapters see the layer's input unchanged: no dropout, no DoRA-like variant."""
    return not getattr(layer, "lora_variant", None) and all(
        isinstance(d, torch.nn.Identity) for d in layer.lora_dropout.values())


def trainable_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
