"""Images in conversations, as the formats carry them, for a vision model's data.

Three forms, all ending as content parts ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` (what chat
templates of vision models read) and the images' references in order of appearance:

- parts with the image in them: ``{"type": "image", "image": REF}`` (also ``"path"`` or ``"url"`` for REF), or
  OpenAI's ``{"type": "image_url", "image_url": {"url": REF}}``;
- parts without it (``{"type": "image"}``) and the row's ``images`` column, in order (TRL's and Hugging Face's
  vision datasets);
- ``<image>`` placeholders in the text and the row's ``images`` column (ShareGPT, LLaMA-Factory).

REF is a file path (relative to the data file), a ``data:image/...;base64,`` URI or bare base64: nothing is ever
downloaded (``core/vision/images.py`` reads them). Counts that disagree are refused, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

IMAGE_PLACEHOLDER = "<image>"


@dataclass
class ImageRefs:
    """What one row's messages said about images while they were converted."""

    given: list[str] = field(default_factory=list)  # references inside image parts
    placeholders: int = 0  # image parts without one (``<image>`` or a bare ``{"type": "image"}``)


def image_part(part: Any) -> tuple[bool, str | None]:
    """(whether ``part`` is an image part, its reference or None where the part holds none)."""
    if not isinstance(part, dict):
        return False, None
    kind = part.get("type")
    if kind == "image_url" or (kind is None and "image_url" in part):
        url = part.get("image_url")
        return True, url.get("url") if isinstance(url, dict) else url
    if kind == "image":
        for key in ("image", "path", "url"):
            if part.get(key) not in (None, ""):
                return True, part[key]
        return True, None
    return False, None


def merge_text_parts(parts: list[dict]) -> list[dict]:
    """Adjacent text parts joined, empty ones dropped: the parts a template renders, no more."""
    out: list[dict] = []
    for p in parts:
        if p["type"] == "text":
            if not p["text"]:
                continue
            if out and out[-1]["type"] == "text":
                out[-1] = {"type": "text", "text": out[-1]["text"] + p["text"]}
                continue
        out.append(p)
    return out


def placeholder_parts(text: str, role: str, error: Callable[[str], Exception], refs: ImageRefs) -> list[dict]:
    """``text`` with its ``<image>`` placeholders as image parts (counted in ``refs``)."""
    if role != "user":
        raise error(f"an {IMAGE_PLACEHOLDER} placeholder in a {role} message: only user messages may hold images")
    pieces = text.split(IMAGE_PLACEHOLDER)
    parts: list[dict] = [{"type": "text", "text": pieces[0]}]
    for piece in pieces[1:]:
        parts += [{"type": "image"}, {"type": "text", "text": piece}]
    refs.placeholders += len(pieces) - 1
    return merge_text_parts(parts)


def row_images(row: dict[str, Any], error: Callable[[str, str], Exception]) -> list[str]:
    """The row's ``images`` (or ``image``) column: a list of references (or one)."""
    for key in ("images", "image"):
        value = row.get(key)
        if value in (None, "", []):
            continue
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, dict):  # {"path": ...} / {"bytes": ...} as datasets' Image feature writes them
                item = item.get("path") or item.get("bytes")
            if not isinstance(item, str) or not item.strip():
                raise error(key, f"image {i} is not a file path, data URI or base64 text ({type(item).__name__})")
            items[i] = item
        return list(items)
    return []


def resolve(refs: ImageRefs, beside: list[str], error: Callable[[str], Exception]) -> list[str]:
    """The conversation's image references, in order: the parts' own, or the ``images`` column's, one per
    placeholder. Mixed forms and counts that disagree are refused."""
    if refs.given and (refs.placeholders or beside):
        raise error("images both inside the messages' parts and beside them (an images column or placeholders): "
                    "use one form per row")
    if refs.given:
        return list(refs.given)
    if refs.placeholders != len(beside):
        raise error(f"{refs.placeholders} image placeholder{'s' if refs.placeholders != 1 else ''} "
                    f"({IMAGE_PLACEHOLDER} or an image part without its file) but {len(beside)} "
                    f"image{'s' if len(beside) != 1 else ''} beside the messages: they must agree")
    return list(beside)
