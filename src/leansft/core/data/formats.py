"""Convert raw rows of every common SFT format to one form: a list of ``{"role", "content"}`` messages.

Formats: alpaca, sharegpt, messages (OpenAI style), prompt_completion, text. ``auto`` looks at the
keys of the first row, says which format it picked, and refuses to guess when several fit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from leansft.core.data.media import (IMAGE_PLACEHOLDER, ImageRefs, image_part, merge_text_parts, placeholder_parts,
                                     resolve, row_images)
from leansft.core.errors import DataError

MESSAGE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                 "tool": "tool", "function": "tool", "ipython": "tool"}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",  # a tool result (LLaMA-Factory / glaive)
    "function_call": "assistant",  # an assistant tool call: value is {"name": ..., "arguments": ...} as JSON
}


@dataclass
class Conversation:
    """One training example before tokenisation. ``text`` is set (and ``messages`` empty) for plain text.
    ``tools``: the row's tool definitions, OpenAI style (``{"type": "function", "function": {...}}``). ``images``:
    for a vision model's data only, each ``{"type": "image"}`` content part's file, data URI or base64 text."""

    messages: list[dict] = field(default_factory=list)
    text: str | None = None
    row: int = 0
    tools: list[dict] | None = None
    images: list[str] = field(default_factory=list)  # image references in order of appearance (``media.py``)

    @property
    def has_assistant(self) -> bool:
        return self.text is not None or any(m["role"] == "assistant" for m in self.messages)


class _Row:
    """Field access on one raw row that raises errors naming file, row and field."""

    def __init__(self, row: dict[str, Any], file: str, number: int, images: ImageRefs | None = None) -> None:
        self.row, self.file, self.number = row, file, number
        self.images = images  # where image parts are kept (a vision model's data), else None: they are refused

    def error(self, field_name: str, message: str) -> DataError:
        return DataError(message, file=self.file, row=self.number, field=field_name)

    def get(self, key: str, *, required: bool = True, types: tuple[type, ...] = (str,)) -> Any:
        if key not in self.row or self.row[key] is None:
            if required:
                raise self.error(key, "missing")
            return None
        value = self.row[key]
        if not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise self.error(key, f"expected {names}, got {type(value).__name__}")
        return value

    def text(self, key: str, *, required: bool = True, allow_empty: bool = False) -> str | None:
        value = self.get(key, required=required)
        if value is not None and not allow_empty and not value.strip():
            raise self.error(key, "empty content")
        return value


def _text_of_parts(r: _Row, where: str, parts: list, role: str = "user") -> str | list[dict]:
    """OpenAI-style content parts ``[{"type": "text", "text": ...}]`` joined. Image parts, where the row's images
    are kept (``_Row.images``), make the content a list of ``{"type": "text"}`` and ``{"type": "image"}`` parts as
    chat templates read them (``media.image_part``); any other part is refused."""
    out: list[dict] = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            out.append({"type": "text", "text": part})
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif r.images is not None and (found := image_part(part))[0]:
            if role != "user":
                raise r.error(f"{where}[{j}]", f"an image in a {role} message: only user messages may hold images "
                                               "(an answer's image cannot be generated, nor trained on)")
            ref = found[1]
            if ref is None:
                r.images.placeholders += 1  # its file is in the row's images column
            elif not isinstance(ref, str) or not ref.strip():
                raise r.error(f"{where}[{j}]", "an image part without a file, data URI or base64 text")
            else:
                r.images.given.append(ref)
            out.append({"type": "image"})
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise r.error(f"{where}[{j}]", f"unsupported content part {kind!r} "
                                           f"({TEXT_ONLY if r.images is None else 'images and text only'})")
    if any(p["type"] == "image" for p in out):
        return merge_text_parts(out)
    return "".join(p["text"] for p in out)


def _check_content(r: _Row, where: str, role: str, content: Any) -> str | list[dict]:
    if isinstance(content, list):
        content = _text_of_parts(r, where, content, role)
    elif isinstance(content, str) and r.images is not None and IMAGE_PLACEHOLDER in content:
        content = placeholder_parts(content, role, lambda why: r.error(where, why), r.images)
    if isinstance(content, list):  # text and images
        return content
    if not isinstance(content, str):
        raise r.error(where, f"expected str, got {type(content).__name__}")
    if not content.strip() and role in ("user", "assistant"):
        raise r.error(where, "empty content")
    return content


def _json_value(r: _Row, where: str, value: Any) -> Any:
    """A JSON string parsed (tools columns and tool-call arguments often arrive as strings)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value) if value.strip() else None
    except json.JSONDecodeError as err:
        raise r.error(where, f"invalid JSON: {err.msg} (column {err.colno})") from None


def row_tools(r: _Row, key: str = "tools") -> list[dict] | None:
    """Tool definitions: a list of function schemas, or a JSON string of one; bare ``{name, parameters}``
    schemas are wrapped as OpenAI's ``{"type": "function", "function": ...}``."""
    value = _json_value(r, key, r.row.get(key))
    if not value:
        return None
    if not isinstance(value, list):
        raise r.error(key, f"expected a list of tool definitions, got {type(value).__name__}")
    out = []
    for i, item in enumerate(value):
        fn = item.get("function", item) if isinstance(item, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise r.error(f"{key}[{i}]", "expected a function schema with a 'name'")
        out.append({"type": "function", "function": fn})
    return out


def _tool_call(r: _Row, where: str, call: Any) -> dict:
    """``{"function": {"name", "arguments"}}`` or ``{"name", "arguments"}``; arguments as an object (templates
    serialise them themselves), parsed when given as a JSON string."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise r.error(where, "expected a tool call with a function name")
    args = _json_value(r, f"{where}.arguments", fn.get("arguments", {}))
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args if args is not None else {}}}
    if isinstance(call, dict) and call.get("id") is not None:
        out["id"] = call["id"]
    return out


def _reasoning_of(msg: dict) -> dict:
    """Thinking under any of the names datasets use, as ``reasoning_content`` (what chat templates read)."""
    for key in ("reasoning_content", "reasoning", "thinking"):
        if isinstance(msg.get(key), str) and msg[key].strip():
            return {"reasoning_content": msg[key]}
    return {}


def _loss_flag(r: _Row, where: str, msg: dict) -> dict:
    """``"train": false`` or ``"weight": 0``: no loss on the message (``{"train": False}``); a ``weight``
    between 0 and 1 scales its tokens' loss (``{"weight": w}``); 1 or ``"train": true`` is the default."""
    train, weight = msg.get("train"), msg.get("weight")
    if train is not None and not isinstance(train, bool):
        raise r.error(f"{where}.train", f"expected true or false, got {train!r}")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float))
                               or not 0 <= weight <= 1):
        raise r.error(f"{where}.weight", f"expected a number from 0 to 1, got {weight!r}")
    if train is False or weight == 0:
        return {"train": False}
    return {"weight": float(weight)} if weight is not None and weight != 1 else {}


def _message_list(r: _Row, key: str, items: Any, role_key: str, content_key: str, roles: dict[str, str]) -> list[dict]:
    if not isinstance(items, list):
        raise r.error(key, f"expected a list of messages, got {type(items).__name__}")
    if not items:
        raise r.error(key, "empty list of messages")
    out = []
    for i, msg in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(msg, dict):
            raise r.error(where, f"expected an object, got {type(msg).__name__}")
        if role_key not in msg:
            raise r.error(f"{where}.{role_key}", "missing")
        raw_role = msg[role_key]
        if not isinstance(raw_role, str) or raw_role.lower() not in roles:
            raise r.error(f"{where}.{role_key}", f"unknown role {raw_role!r}; expected one of {sorted(roles)}")
        role = roles[raw_role.lower()]
        if raw_role.lower() == "function_call":  # sharegpt: the value is the call itself
            call = _json_value(r, f"{where}.{content_key}", msg.get(content_key))
            calls = [_tool_call(r, f"{where}.{content_key}", call)]
            out.append({"role": "assistant", "content": "", "tool_calls": calls, **_loss_flag(r, where, msg)})
            continue
        calls = msg.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list):
                raise r.error(f"{where}.tool_calls", f"expected a list, got {type(calls).__name__}")
            calls = [_tool_call(r, f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
            text = msg.get(content_key)
            text = _text_of_parts(r, f"{where}.{content_key}", text, role) if isinstance(text, list) else (text or "")
            out.append({"role": role, "content": text, "tool_calls": calls, **_reasoning_of(msg),
                        **_loss_flag(r, where, msg)})
            continue
        if content_key not in msg or msg[content_key] is None:
            raise r.error(f"{where}.{content_key}", "missing")
        content = _check_content(r, f"{where}.{content_key}", role, msg[content_key])
        if role == "system" and not content.strip():
            continue  # an empty system prompt says nothing; templates render it oddly
        new = {"role": role, "content": content}
        for extra in ("name", "tool_call_id"):
            if msg.get(extra) is not None:
                new[extra] = msg[extra]
        if role == "assistant":
            new.update(**_reasoning_of(msg), **_loss_flag(r, where, msg))
        out.append(new)
    return out


def from_alpaca(r: _Row) -> Conversation:
    instruction = r.text("instruction")
    extra = r.text("input", required=False, allow_empty=True)
    output = r.text("output")
    system = r.text("system", required=False, allow_empty=True)
    prompt = instruction if not extra or not extra.strip() else f"{instruction}\n\n{extra}"
    messages = [{"role": "system", "content": system}] if system and system.strip() else []
    history = r.get("history", required=False, types=(list,))
    for i, pair in enumerate(history or []):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise r.error(f"history[{i}]", "expected a [user, assistant] pair of strings")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    return Conversation(messages=messages)


def from_sharegpt(r: _Row) -> Conversation:
    key = "conversations" if "conversations" in r.row else "conversation"
    items = r.get(key, types=(list,))
    messages = _message_list(r, key, items, "from", "value", SHAREGPT_ROLES)
    system = r.text("system", required=False, allow_empty=True)
    if system and system.strip() and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return Conversation(messages=messages, tools=row_tools(r))


def from_messages(r: _Row) -> Conversation:
    key = "messages" if "messages" in r.row else "conversations"
    items = r.get(key, types=(list,))
    return Conversation(messages=_message_list(r, key, items, "role", "content", MESSAGE_ROLES), tools=row_tools(r))


def from_prompt_completion(r: _Row) -> Conversation:
    prompt = r.get("prompt", types=(str, list))
    completion = r.get("completion", types=(str, list))
    roles = MESSAGE_ROLES
    if isinstance(prompt, str):
        _check_content(r, "prompt", "user", prompt)
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = _message_list(r, "prompt", prompt, "role", "content", roles)
    if isinstance(completion, str):
        _check_content(r, "completion", "assistant", completion)
        messages.append({"role": "assistant", "content": completion})
    else:
        messages += _message_list(r, "completion", completion, "role", "content", roles)
    system = r.text("system", required=False, allow_empty=True)
    if system and system.strip() and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return Conversation(messages=messages)


def from_text(r: _Row) -> Conversation:
    return Conversation(text=r.text("text"))


CONVERTERS: dict[str, Callable[[_Row], Conversation]] = {
    "alpaca": from_alpaca,
    "sharegpt": from_sharegpt,
    "messages": from_messages,
    "prompt_completion": from_prompt_completion,
    "text": from_text,
}
FORMATS = ("auto", *CONVERTERS)


def _matches(row: dict[str, Any]) -> list[str]:
    keys = set(row)
    found = []
    if {"instruction", "output"} <= keys:
        found.append("alpaca")
    for key in ("conversations", "conversation", "messages"):
        items = row.get(key)
        if isinstance(items, list) and items and isinstance(items[0], dict):
            found.append("sharegpt" if "from" in items[0] else "messages")
    if {"prompt", "completion"} <= keys:
        found.append("prompt_completion")
    if "text" in keys:
        found.append("text")
    return sorted(set(found))


def detect_format(row: dict[str, Any], file: str, number: int) -> str:
    """Pick the format from one row's keys; zero or several matches is an error."""
    found = _matches(row)
    if len(found) == 1:
        return found[0]
    keys = ", ".join(sorted(map(str, row))) or "(none)"
    if not found:
        raise DataError(
            f"cannot detect the data format from keys [{keys}]",
            file=file,
            row=number,
            hint=f"pass format explicitly, one of {', '.join(CONVERTERS)}",
        )
    raise DataError(
        f"ambiguous data format: keys [{keys}] fit {' and '.join(found)}",
        file=file,
        row=number,
        hint="pass format explicitly",
    )


# LLaMA-Factory's and ShareGPT's multimodal rows: the media beside the messages, `<image>` placeholders in the text
MEDIA_KEYS = ("images", "image", "videos", "video", "audios", "audio")
TEXT_ONLY = ("the model reads text alone; images need a vision-language model (Qwen2-VL, Qwen2.5-VL, Gemma 3: "
             "docs/vision.md), video and audio are not supported")


def convert_row(row: dict[str, Any], fmt: str, file: str, number: int, images: bool = False) -> Conversation:
    """Convert one raw row; ``fmt`` must be a concrete format (resolve ``auto`` first). A row carrying media is
    refused: trained as text, its ``<image>`` placeholders would be learned as words and its images never seen.
    ``images``: for a vision model, whose rows may hold images (``core/data/media.py``; video and audio are still
    refused)."""
    if fmt not in CONVERTERS:
        raise DataError(f"unknown format '{fmt}'; expected one of {', '.join(FORMATS)}", file=file, field="format")
    beside = row_images(row, lambda key, why: DataError(why, file=file, row=number, field=key)) if images else []
    for key in MEDIA_KEYS:
        media = row.get(key)
        if images and key in ("images", "image"):
            continue
        if media not in (None, "", [], {}):
            n = len(media) if isinstance(media, list) else 1
            raise DataError(f"the row has {n} {key.rstrip('s')}{'s' if n != 1 else ''} ({TEXT_ONLY})", file=file,
                            row=number, field=key,
                            hint="leave the media out (and their <image> placeholders) to train on the text, or "
                                 "drop these rows (data.on_bad_row: skip)")
    kept = ImageRefs() if images else None
    try:
        conv = CONVERTERS[fmt](_Row(row, file, number, kept))
    except DataError as err:
        looks = [f for f in _matches(row) if f != fmt]
        if len(looks) != 1:
            raise
        raise DataError(err.message, file=err.file, row=err.row, field=err.field,
                        hint=f"the rows look like '{looks[0]}', not '{fmt}': use format {looks[0]} (or auto)") from None
    conv.row = number
    if images:
        conv.images = resolve(kept, beside, lambda why: DataError(why, file=file, row=number, field="images"))
    return conv


def map_columns(row: dict[str, Any], columns: dict[str, str], file: str, number: int) -> dict[str, Any]:
    """``row`` with its columns renamed to a format's keys (``columns: {prompt: question, completion: answer}``:
    a ``question,answer`` CSV read as prompt_completion); the other columns are left as they are."""
    missing = [c for c in columns.values() if c not in row]
    if missing:
        raise DataError(f"no column {missing[0]!r} (data columns: {', '.join(map(str, row)) or 'none'})",
                        file=file, row=number, field="columns")
    renamed = set(columns.values())
    out = {k: v for k, v in row.items() if k not in renamed}
    out.update({key: row[column] for key, column in columns.items()})
    return out
