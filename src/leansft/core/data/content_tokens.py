"""Special tokens written as text inside messages.

A tokenizer reads the text of its added tokens as the tokens themselves wherever it occurs, so an answer that
quotes ``<|endoftext|>`` puts that very token into the sequence: trained mid-answer, the model learns to stop
there, and ``generate``, llama.cpp and Ollama cut the answer short. A role marker (``<|im_start|>user``) quoted
in an answer teaches the model to open a user turn.

- A stop token (the encoder's stop set: eos, the generation config's eos ids, the template's end of turn, the
  well-known ones the vocabulary has, where the tokenizer reads it as one token) inside the text of a message that
  carries loss is refused, naming row,
  message and token (``on_bad_row: skip`` drops and counts the row). A field that ends with stops is where the
  data's author put the stop: it trains as written.
- Any other special token in a message's text follows ``data.special_tokens_in_content``: ``warn`` (counted in
  the data report, said once per source), ``refuse``, or ``allow``.
- ``escape`` trains every special token written in messages as plain text: the content's special-token text is
  tokenised without special-token matching while the template's own tokens stay tokens. The rendering is done
  with each such token replaced by a placeholder of the same length (Unicode noncharacters, which text never
  holds), so every character offset is the real text's; the real text is then tokenised in pieces cut at the
  template's special tokens (where the tokenizer cuts it anyway: checked on every text, else refused), each piece
  without special-token matching.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from leansft.core.config import SpecialInContent
from leansft.core.data.tokenizer import backend_copy
from leansft.core.errors import TemplateError

MARK, DIGIT0, PAD = "\ufdd0", 0xFDD1, "\ufdef"  # placeholder: MARK, digits (U+FDD1..U+FDEE), PAD to the length
_BASE = 30
_NONCHARACTERS = re.compile("[\ufdd0-\ufdef]")
_FIELDS = ("content", "reasoning_content")
THINKING = {"<think>", "</think>"}  # written in answers' text by design (a leading thinking block)


def _texts(message: dict) -> list[tuple[str, str]]:
    """(field, text) of a message's own words: content (a string or text parts) and reasoning."""
    out = []
    for name in _FIELDS:
        value = message.get(name)
        if isinstance(value, str):
            out.append((name, value))
        elif isinstance(value, list):
            out += [(f"{name}[{j}].text", p["text"]) for j, p in enumerate(value)
                    if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return out


class ContentTokens:
    """Finds special tokens in messages' text, refuses or counts them, and (``escape``) encodes them as text."""

    def __init__(self, tokenizer, backend, stops: list[str], written: set[str], policy: SpecialInContent) -> None:
        """``stops``: the encoder's stop set; ``written``: the added tokens the template writes around messages
        (role markers, turn delimiters: special or not, as DeepSeek's ``<｜User｜>``)."""
        added = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
        special = {t for t, is_special in added.items() if is_special} | (written & set(added))
        # stops the tokenizer reads as tokens wherever they occur (Qwen's vocabulary holds "</s>" as plain text: an
        # answer about HTML's <s>...</s> is text; a stop string that ends the turn's span early is refused there)
        self.stops = {t for t in stops if t in added}
        # escape hides every stop string too (one the tokenizer reads as text would still end the turn's span)
        found = self.stops | special - THINKING | (set(stops) if policy == "escape" else set())
        self.tokens = sorted(found, key=len, reverse=True)
        self.policy = policy
        self.escaping = policy == "escape"  # renderings may hold placeholders (``MARK``)
        self._pattern = re.compile("|".join(map(re.escape, self.tokens))) if self.tokens else None
        self._backend = backend
        self._plain = None  # the backend matching none of ``tokens``, built at the first escaped text
        self._index = {t: k for k, t in enumerate(self.tokens)}
        self._width = max(1, int(np.ceil(np.log(len(self.tokens) + 1) / np.log(_BASE)))) if self.tokens else 1
        self._placeholder = re.compile(f"{MARK}([\ufdd1-\ufdee]{{{self._width}}}){PAD}*")

    # -- checking --------------------------------------------------------------------------------
    def check(self, chat: list[dict], trained: set[int], row: int, stats: Counter) -> list[dict]:
        """``chat`` as the template should see it: refused (stop in trained text, or ``refuse``), counted
        (``warn``), or with its special-token text replaced by placeholders (``escape``)."""
        if self._pattern is None:
            return chat
        escaped, counted = None, Counter()
        for i, m in enumerate(chat):
            for field, text in _texts(m):
                hits = list(self._pattern.finditer(text))
                if not hits:
                    continue
                if self.escaping:
                    if _NONCHARACTERS.search(text):
                        raise TemplateError(f"message {i} holds Unicode noncharacters (U+FDD0-U+FDEF), which "
                                            f"data.special_tokens_in_content: escape uses as placeholders", row=row,
                                            field=f"messages[{i}].{field}", hint="remove them from the data")
                    escaped = escaped if escaped is not None else [dict(x) for x in chat]
                    _set(escaped[i], field, self._pattern.sub(lambda h: self._hide(h.group()), text))
                    continue
                body = before_stops(text, self.stops) if m["role"] == "assistant" else len(text)
                for hit in hits:
                    token = hit.group()
                    if token in self.stops and i in trained and hit.start() < body:
                        what = "assistant message" if m["role"] == "assistant" else "message"
                        raise TemplateError(
                            f"{what} {i} holds the stop token {token!r} inside its {field}: the tokenizer reads that "
                            f"text as the token itself, so the model would learn to stop there and the rest of the "
                            f"answer would carry no loss", row=row, field=f"messages[{i}].{field}",
                            hint="remove or rewrite that text in the data, data.special_tokens_in_content: escape to "
                                 "train it as plain text, or data.on_bad_row: skip to drop such conversations")
                    if hit.start() >= body:  # a stop the data's author put at the end of an answer
                        continue
                    if self.policy == "refuse":
                        raise TemplateError(
                            f"message {i} holds the special token {token!r} in its {field}: the tokenizer reads that "
                            f"text as the control token itself (data.special_tokens_in_content: refuse)", row=row,
                            field=f"messages[{i}].{field}",
                            hint="data.special_tokens_in_content: escape trains it as plain text, allow as the "
                                 "token; or data.on_bad_row: skip to drop such conversations")
                    counted[token] += 1
        if counted and self.policy == "warn":
            stats["special_in_content_conversations"] += 1
            stats.update({f"special {t}": n for t, n in counted.items()})
        return escaped if escaped is not None else chat

    def check_text(self, text: str, row: int, stats: Counter) -> bool:
        """A plain-text row (loss on every token): stops inside it refused, other special tokens by the policy.
        True where it is to be tokenised without special-token matching (``escape``)."""
        chat = self.check([{"role": "assistant", "content": text}], {0}, row, stats)
        return chat[0]["content"] != text

    # -- escaping --------------------------------------------------------------------------------
    def _hide(self, token: str) -> str:
        k, digits = self._index[token], []
        for _ in range(self._width):
            k, d = divmod(k, _BASE)
            digits.append(chr(DIGIT0 + d))
        hidden = MARK + "".join(digits)
        if len(hidden) > len(token):
            raise TemplateError(f"the special token {token!r} is too short to escape "
                                f"(data.special_tokens_in_content: escape)", field="data.special_tokens_in_content")
        return hidden + PAD * (len(token) - len(hidden))

    def plain(self):
        """The backend matching none of the guarded tokens: each marked special, special tokens not matched."""
        if self._plain is None:
            from tokenizers import AddedToken

            self._plain = backend_copy(self._backend)
            self._plain.add_special_tokens([
                AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                           normalized=t.normalized, special=True)
                for t in self._backend.get_added_tokens_decoder().values()
                if not t.special and t.content in self._index])
            self._plain.encode_special_tokens = True
        return self._plain

    def plain_ids(self, text: str) -> list[int]:
        """A plain-text row's ids (with the tokenizer's bos/eos as it adds them), its special-token text as text."""
        return self.plain().encode(text, add_special_tokens=True).ids

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, [n, 2] offsets)`` of a rendering holding placeholders: the template's special tokens as tokens,
        the text between them (placeholders given back their tokens' text) without special-token matching."""
        real = self._placeholder.sub(self._unhide, text)
        if len(real) != len(text) or _NONCHARACTERS.search(real):
            raise TemplateError("the chat template changed the text of a special token written in a message, so "
                                "data.special_tokens_in_content: escape cannot place it", field="data.template")
        cuts = [0]
        for hit in self._pattern.finditer(text):  # placeholders never match: these are the template's own
            cuts += [hit.start(), hit.end()]
        cuts.append(len(real))
        pieces = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
        plain = self.plain().encode_batch([real[a:b] for a, b in pieces], add_special_tokens=False)
        whole = self._backend.encode(real, add_special_tokens=False).ids
        apart = self._backend.encode_batch([real[a:b] for a, b in pieces], add_special_tokens=False)
        if whole != [i for enc in apart for i in enc.ids]:
            raise TemplateError("this tokenizer does not cut text at the template's special tokens (a token that "
                                "strips spaces beside it), so data.special_tokens_in_content: escape cannot "
                                "tokenise the text exactly", field="data.special_tokens_in_content",
                                hint="remove the special-token text from the data, or use warn/allow")
        ids, offsets = [], []
        for (a, _), enc, normal in zip(pieces, plain, apart):
            is_template_token = self._pattern.fullmatch(text, a, _) is not None
            source = normal if is_template_token else enc
            ids += source.ids
            offsets += [(s + a, e + a) for s, e in source.offsets]
        return np.asarray(ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)

    def reveal(self, text: str) -> str:
        """The real text of a rendering that holds placeholders."""
        return self._placeholder.sub(self._unhide, text)

    def _unhide(self, hit: re.Match) -> str:
        k = sum((ord(c) - DIGIT0) * _BASE ** j for j, c in enumerate(hit.group(1)))
        token = self.tokens[k] if k < len(self.tokens) else ""
        return token if len(token) == len(hit.group()) else hit.group()


def _set(message: dict, field: str, text: str) -> None:
    if "[" not in field:
        message[field] = text
        return
    name, j = field.split("[")[0], int(field.split("[")[1].split("]")[0])
    parts = list(message[name])
    parts[j] = {**parts[j], "text": text}
    message[name] = parts


def before_stops(text: str, stops) -> int:
    """Where a text's trailing stops (and the whitespace around them) begin."""
    body = text.rstrip()
    while stop := next((t for t in stops if body.endswith(t)), None):
        body = body[: -len(stop)].rstrip()
    return len(body)


def special_in_content(stats: dict) -> str | None:
    """The data report's line on special tokens written in messages (``warn``), or None."""
    n = stats.get("special_in_content_conversations", 0)
    if not n:
        return None
    found = sorted(((k.removeprefix("special "), v) for k, v in stats.items() if k.startswith("special ")),
                   key=lambda kv: -kv[1])
    shown = ", ".join(f"{t} x{k:,}" for t, k in found[:5]) + (", ..." if len(found) > 5 else "")
    return f"{n:,} conversation{'s write' if n != 1 else ' writes'} special tokens in message text ({shown})"
