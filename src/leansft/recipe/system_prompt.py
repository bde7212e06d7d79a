"""The system prompt a run trained with: ``chat``, ``generate``, the samples and the Ollama Modelfile give the model
the prompt it learned under, not the tokenizer's default one (SmolLM2's "You are a helpful AI assistant..." made
a model trained as "Bolt" answer as a generic assistant)."""

from __future__ import annotations

import json
from pathlib import Path

DOMINANT = 0.5  # more than this share of the training conversations opened with it


def dominant_system_prompt(report: dict) -> tuple[str, float] | None:
    """(text, share of conversations) of the system prompt most training conversations opened with, from a data
    report (``data_report.json``), or None where none did (or the report predates the count)."""
    counts: dict[str, int] = {}
    conversations = 0
    for src in report.get("sources", []):
        conversations += int(src.get("template", {}).get("conversations", 0))
        for text, n in src.get("system_prompts", []):
            counts[text] = counts.get(text, 0) + int(n)
    if not counts or not conversations:
        return None
    text, n = max(counts.items(), key=lambda kv: kv[1])
    return (text, n / conversations) if n / conversations > DOMINANT else None


def run_folder_of(source: str) -> Path | None:
    """The run folder behind ``source``: the run itself, one of its checkpoints, or its exported ``final/``."""
    path = Path(source)
    for run in (path, path.parent.parent if path.parent.name == "checkpoints" else None,
                path.parent if path.name == "final" else None):
        if run is not None and (run / "data_report.json").is_file() and (run / "config.yaml").is_file():
            return run
    return None


def trained_system_prompt(source: str) -> tuple[str, float] | None:
    """The dominant training system prompt of the run behind ``source`` (see ``dominant_system_prompt``)."""
    run = run_folder_of(source)
    if run is None:
        return None
    try:
        return dominant_system_prompt(json.loads((run / "data_report.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
