"""Load model configs and models from a local folder, a config.json, a .gguf file, or a Hub id."""

from __future__ import annotations

from pathlib import Path

from leansft.errors import ModelError


def load_config(spec: str):
    """A transformers config; wraps every failure in a ``ModelError`` naming ``spec``."""
    from transformers import AutoConfig

    path = Path(spec)
    try:
        if path.is_file() and path.suffix == ".gguf":
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        if path.is_file():
            return AutoConfig.from_pretrained(str(path))
        return AutoConfig.from_pretrained(spec, local_files_only=path.exists())
    except Exception as err:
        raise ModelError(f"cannot load model config: {type(err).__name__}: {str(err)[:300]}", file=spec) from None
