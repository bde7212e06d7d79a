"""Cleaning steps that work on conversations before tokenisation: PII scrub and duplicate keys.

Length filters need token counts and live in dataset.py, after tokenisation.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter

from leansft.core.data.formats import Conversation

_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
_IPV4 = re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")
_IPV6 = re.compile(r"\b(?:[0-9A-Fa-f]{1,4}:){7}[0-9A-Fa-f]{1,4}\b")
_CARD = re.compile(r"\b(?:\d[ -]?){12,18}\d\b")
_PHONE = re.compile(r"(?<![\w.])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]?\d{3,4}\b")

PLACEHOLDERS = {"email": "[EMAIL]", "card": "[CREDIT_CARD]", "ip": "[IP_ADDRESS]", "phone": "[PHONE]"}


def _luhn_ok(digits: str) -> bool:
    total, parity = 0, len(digits) % 2
    for i, ch in enumerate(digits):
        d = int(ch)
        if i % 2 == parity:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def scrub_text(text: str, counts: Counter) -> str:
    """Replace emails, card-like numbers (Luhn-valid), IP addresses and phone numbers with placeholders."""

    def sub(pattern: re.Pattern, kind: str, s: str, check=None) -> str:
        def repl(m: re.Match) -> str:
            if check is not None and not check(m.group(0)):
                return m.group(0)
            counts[kind] += 1
            return PLACEHOLDERS[kind]

        return pattern.sub(repl, s)

    text = sub(_EMAIL, "email", text)
    text = sub(_CARD, "card", text, lambda s: _luhn_ok(re.sub(r"\D", "", s)))
    text = sub(_IPV4, "ip", text)
    text = sub(_IPV6, "ip", text)
    text = sub(_PHONE, "phone", text)
    return text


def scrub(conv: Conversation, counts: Counter) -> Conversation:
    if conv.text is not None:
        return Conversation(text=scrub_text(conv.text, counts), row=conv.row)
    messages = [{**m, "content": scrub_text(m["content"], counts),
                 **({"reasoning_content": scrub_text(m["reasoning_content"], counts)}
                    if m.get("reasoning_content") else {})} for m in conv.messages]
    return Conversation(messages=messages, row=conv.row, tools=conv.tools)


def content_hash(conv: Conversation) -> int:
    """64-bit hash of the normalised text (case-folded, whitespace collapsed), roles included."""
    if conv.text is not None:
        parts = ["text", conv.text]
    else:  # thinking, tool calls and tool definitions are part of what makes two conversations different
        parts = [f"{m['role']}\x1f{m['content']}\x1f"
                 f"{json.dumps(m['tool_calls'], sort_keys=True) if m.get('tool_calls') else 'null'}"
                 + (f"\x1f{m['reasoning_content']}" if m.get("reasoning_content") else "")
                 for m in conv.messages]
        if conv.tools:
            parts.append(json.dumps(conv.tools, sort_keys=True))
    norm = " ".join("\x1e".join(parts).casefold().split())  # whitespace runs collapsed, ends stripped
    return int.from_bytes(hashlib.blake2b(norm.encode("utf-8"), digest_size=8).digest(), "little", signed=True)
