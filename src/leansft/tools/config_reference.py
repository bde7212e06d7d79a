"""Every config key with its default and meaning, read from the pydantic models (``leansft config --defaults``,
and the table in docs/config.md, which ``python -m leansft.tools.config_reference`` regenerates)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args, get_origin

from pydantic import BaseModel

from leansft.core.config import RunConfig

START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"


def _model_of(annotation) -> type[BaseModel] | None:
    """The config model a field holds, itself or as the items of a list (``data.sources``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        return item if isinstance(item, type) and issubclass(item, BaseModel) else None
    return None


def rows(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default as YAML would write it, meaning) for every leaf key, in the models' order."""
    out = []
    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        key = prefix + (field.alias or name)
        if sub is not None and get_origin(field.annotation) is list:
            out.append((key, "[]", field.description or ""))
            out += rows(sub, key + "[].")
        elif sub is not None:
            out += rows(sub, key + ".")
        else:
            if field.is_required():
                shown = "(required)"
            else:
                default = field.get_default(call_default_factory=True)
                shown = json.dumps(list(default) if isinstance(default, tuple) else default)
            out.append((key, shown, field.description or ""))
    return out


def table() -> str:
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | `{d}` | {m.replace('|', '/')} |" for k, d, m in rows()]
    return "\n".join(lines)


def text() -> str:
    """The terminal form: one key a line, default and meaning beside it."""
    width = max(len(k) for k, _, _ in rows())
    return "\n".join(f"{k:<{width}}  {d:<14}  {m}" for k, d, m in rows())


def write_docs(path: Path = Path(__file__).parents[3] / "docs" / "config.md") -> None:
    doc = path.read_text()
    path.write_text(doc[: doc.index(START) + len(START)] + "\n" + table() + "\n" + doc[doc.index(END):])


if __name__ == "__main__":
    write_docs()
