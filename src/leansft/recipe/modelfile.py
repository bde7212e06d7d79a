"""An Ollama ``Modelfile`` beside an exported GGUF: ``ollama create NAME -f OUT.Modelfile`` then runs the model with
its stop tokens and the system prompt it trained with. The chat template is not repeated: Ollama reads it from the
GGUF (``tokenizer.chat_template``)."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("leansft")

HEADER = "# written by leansft export"  # a Modelfile with another first line is the user's: never replaced


def modelfile_path(gguf: Path) -> Path:
    return gguf.with_suffix(".Modelfile")


def modelfile_text(gguf: Path, stops: list[str], system: str | None) -> str:
    lines = [f"{HEADER}: ollama create {gguf.stem} -f {modelfile_path(gguf).name}", f"FROM ./{gguf.name}"]
    lines += [f'PARAMETER stop "{s}"' for s in stops if s and not any(c in s for c in '"\n\\')]
    if system and '"""' not in system:
        lines.append(f'SYSTEM """{system}"""')
    return "\n".join(lines) + "\n"


def write_modelfile(gguf: Path, stops: list[str], system: str | None) -> Path | None:
    """Write ``GGUF-stem.Modelfile`` beside ``gguf``; None (and a warning) where a file of that name that leansft
    did not write is there."""
    path = modelfile_path(gguf)
    if path.exists() and not path.read_text(encoding="utf-8", errors="replace").startswith(HEADER):
        log.warning("%s exists and leansft did not write it: left as it is (no Ollama Modelfile written)", path)
        return None
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(modelfile_text(gguf, stops, system), encoding="utf-8")
    tmp.replace(path)
    return path
