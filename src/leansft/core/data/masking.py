"""Render conversations with the tokenizer's own chat template and build the assistant-only loss mask.

How assistant tokens are found:
1. A template with ``{% generation %}`` markers reports the character spans of assistant output.
2. Otherwise each assistant turn i is located by rendering ``messages[:i]`` with the generation prompt
   and ``messages[:i+1]`` without; the text the turn adds is its span. Every rendering must be a
   prefix of the next and of the whole conversation; where a template rewrites earlier turns (Qwen3's
   own drops old thinking), each assistant turn becomes an example of its own, rendered from
   ``messages[:i+1]`` exactly as at inference, with loss on that turn only (``multi_turn``).
Either way the whole conversation is tokenised once (batched, fast tokenizer) and character spans are
mapped to tokens by offsets. Span edges are then normalised the same way for both paths: leading and
trailing whitespace-only tokens are dropped, so the loss covers the content and the end-of-turn
token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``...) but not the newline a template writes after it.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import get_args

import numpy as np
from tokenizers import Tokenizer

# transformers' own rendering steps, called directly: apply_chat_template copies the whole conversation on
# every call, which made rendering each turn's prefix quadratic in the number of turns
from transformers.utils.chat_template_utils import (
    _alias_reasoning_fields,
    _compile_jinja_template,
    _plain_template_data,
    _render_with_assistant_indices,
)

from leansft.core.config import LossOn, MultiTurn, Reasoning
from leansft.core.data.builtin_templates import BUILTIN_TEMPLATES
from leansft.core.data.formats import Conversation
from leansft.core.errors import TemplateError

IGNORE_INDEX = -100
WINDOW_MIN_TURNS = 3  # from this many assistant turns, spans are found in linear time (``_window_spans``)
KINDS = ("context", "target", "thinking", "tool_call", "tool_result")  # what show-mask tells apart
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_EMPTY_THINK = re.compile(r"\s*<think>\s*</think>\s*")  # the empty reasoning block Qwen3-style templates insert
_LEADING_THINK = re.compile(r"\s*<think>(.*?)</think>\s*", re.S)  # thinking written into an answer's content


def _trained(message: dict) -> bool:
    """Per-message flags: ``"train": false`` or ``"weight": 0`` on an assistant message means no loss."""
    return message.get("train", True) is not False and message.get("weight", 1) != 0


class Encoded(tuple):
    """One example: ``(input_ids, labels)``, unpacked as a pair. ``weights``: per-token loss weights
    (float32) when a message carries a fractional ``weight``, else None (every target weighs 1)."""

    weights: np.ndarray | None

    def __new__(cls, ids: np.ndarray, labels: np.ndarray, weights: np.ndarray | None = None) -> Encoded:
        self = super().__new__(cls, (ids, labels))
        self.weights = weights
        return self


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    source: str

    @property
    def has_generation_markers(self) -> bool:
        return bool(_GENERATION_TAG.search(self.source))


def resolve_template(tokenizer, template: str | None) -> ChatTemplate:
    """``None``/``auto``: the tokenizer's own; a built-in name; a .jinja path; or an inline Jinja string."""
    if template in (None, "", "auto", "tokenizer"):
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, dict):
            own = own.get("default") or next(iter(own.values()), None)
        if not own:
            raise TemplateError(
                f"tokenizer '{getattr(tokenizer, 'name_or_path', '?')}' has no chat template",
                field="template",
                hint=f"choose one explicitly: template: {' | '.join(BUILTIN_TEMPLATES)} | path/to/template.jinja",
            )
        return ChatTemplate("tokenizer", own)
    if template in BUILTIN_TEMPLATES:
        return ChatTemplate(template, BUILTIN_TEMPLATES[template])
    if "{{" in template or "{%" in template:
        return ChatTemplate("inline", template)
    path = Path(template)
    if path.suffix in (".jinja", ".j2", ".txt") or path.is_file():
        if not path.is_file():
            raise TemplateError("template file not found", file=template, field="template")
        return ChatTemplate(str(path), path.read_text(encoding="utf-8"))
    raise TemplateError(
        f"unknown template '{template}'",
        field="template",
        hint=f"use auto, one of {', '.join(BUILTIN_TEMPLATES)}, or a .jinja file",
    )


@dataclass
class _Example:
    """One text to tokenise: a whole conversation, or (per-turn expansion) the context of one turn."""

    conv: int  # index of the conversation in the batch
    text: str
    spans: list[tuple[int, int, int]]  # (first char, end char, message index) of each assistant turn
    chat: list[dict] | None = None  # the messages as the template saw them


def _reasoning(message: dict) -> str | None:
    """An assistant message's thinking: ``reasoning_content``, or a leading ``<think>...</think>`` in content."""
    if message["role"] != "assistant":
        return None
    if message.get("reasoning_content"):
        return str(message["reasoning_content"]).strip() or None
    lead = _LEADING_THINK.match(str(message.get("content") or ""))
    return lead.group(1).strip() or None if lead else None


class ChatEncoder:
    """Turns conversations into ``(input_ids, labels)`` arrays; labels are unshifted, -100 = no loss.

    ``reasoning``: keep (thinking rendered and trained) or drop (removed before rendering: answers only).
    ``multi_turn``: auto (one example per conversation; per assistant turn where the template rewrites
    earlier turns), single (refuse such templates), per_turn (always one example per assistant turn).
    ``stats`` counts what was rendered: tool calls, tool results, thinking, per-turn expansion.
    """

    def __init__(self, tokenizer, template: ChatTemplate, loss_on: LossOn = "assistant",
                 reasoning: Reasoning = "keep", multi_turn: MultiTurn = "auto") -> None:
        for name, value, kind in (("loss_on", loss_on, LossOn), ("reasoning", reasoning, Reasoning),
                                  ("multi_turn", multi_turn, MultiTurn)):
            allowed = get_args(kind)
            if value not in allowed:
                raise TemplateError(f"unknown {name} '{value}'", field=f"data.{name}")
        self.tok = tokenizer
        self.template = template
        self.loss_on, self.reasoning, self.multi_turn = loss_on, reasoning, multi_turn
        self.stats: Counter = Counter()
        self._blank: dict[int, bool] = {}
        self._compiled = _compile_jinja_template(template.source)
        self._kwargs = _plain_template_data(dict(tokenizer.special_tokens_map))
        # what Template.render merges into every context (its globals, a ChainMap, copied once instead of per call)
        self._context = {**dict(self._compiled.globals), **self._kwargs}
        # The Rust tokenizer itself, without any truncation/padding a tokenizer.json may carry: what
        # tokenizer(text, add_special_tokens=False) runs, minus the Python-side conversion of its output.
        self._backend = tokenizer.backend_tokenizer
        if self._backend.truncation is not None or self._backend.padding is not None:  # a copy without them
            self._backend = Tokenizer.from_str(self._backend.to_str())
            self._backend.no_truncation()
            self._backend.no_padding()
        self._special = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special
        }

    # -- rendering -------------------------------------------------------------------------------
    def _for_template(self, conv: Conversation) -> list[dict]:
        """The messages as the template sees them (what ``apply_chat_template`` passes): no None values,
        reasoning aliased; thinking removed when ``reasoning: drop``. (Conversations from ``formats`` hold
        plain JSON types already, so transformers' defensive deep copy is not needed.)"""
        chat = []
        for m in conv.messages:
            m = {k: v for k, v in m.items() if v is not None and k not in ("train", "weight")}
            if self.reasoning == "drop" and m["role"] == "assistant":
                m.pop("reasoning_content", None)
                lead = _LEADING_THINK.match(m.get("content") or "")
                if lead:
                    m["content"] = m["content"][lead.end():]
            chat.append(m)
        return _alias_reasoning_fields(chat)

    def _jinja(self, chat: list[dict], tools: list | None, gen_prompt: bool) -> str:
        """``Template.render(messages=..., tools=..., add_generation_prompt=..., **special tokens)``, with the
        template's globals merged once per encoder instead of once per call."""
        t = self._compiled
        ctx = t.new_context({**self._context, "messages": chat, "tools": tools, "documents": None,
                             "add_generation_prompt": gen_prompt}, shared=True)
        return t.environment.concat(t.root_render_func(ctx))

    def _render(self, chat: list[dict], tools: list | None, gen_prompt: bool, row: int) -> str:
        """One rendering, exactly as ``tokenizer.apply_chat_template(chat, tools=tools, tokenize=False)`` gives
        it, without its per-call copy of the whole conversation (which made prefix rendering quadratic)."""
        try:
            return self._jinja(chat, tools, gen_prompt)
        except Exception as err:
            raise TemplateError(f"chat template '{self.template.name}' failed: {type(err).__name__}: {err}",
                                row=row) from None

    def _check_tools(self, text: str, defs: list[dict] | None, row: int) -> None:
        """Tool definitions given to a template that does not render them are an error, not a silent drop."""
        missing = [d["function"]["name"] for d in defs or [] if d["function"]["name"] not in text]
        if missing:
            raise TemplateError(
                f"chat template '{self.template.name}' does not render the tool definitions (e.g. "
                f"'{missing[0]}' is missing): the model would be trained on tool calls without the tools",
                row=row, field="tools",
                hint="use the model's own chat template with tool support, or drop the tools column")

    def _marker_examples(self, k: int, chat: list[dict], tools: list | None) -> list[_Example]:
        """Spans from ``{% generation %}`` markers (one rendering)."""
        try:
            text, spans = _render_with_assistant_indices(
                compiled_template=self._compiled, messages=chat, tools=tools, documents=None,
                add_generation_prompt=False, **self._kwargs)
        except Exception as err:
            raise TemplateError(f"chat template '{self.template.name}' failed: {type(err).__name__}: {err}") from None
        turns = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
        same = len(turns) == len(spans)
        return [_Example(k, text, [(c0, c1, turns[j] if same else -1) for j, (c0, c1) in enumerate(spans)])]

    def _prefix_examples(self, k: int, chat: list[dict], tools: list | None, row: int
                         ) -> tuple[str, list[_Example]]:
        """Each assistant turn i is the text ``messages[:i+1]`` adds to ``messages[:i]`` + generation prompt.

        Every rendering must be a prefix of the whole conversation's; where the template rewrites earlier
        turns, ``multi_turn: auto`` makes one example per turn, rendered as it is at inference."""
        full = self._render(chat, tools, False, row)
        turns = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
        if len(turns) >= WINDOW_MIN_TURNS and self.multi_turn != "per_turn":
            spans = self._window_spans(chat, tools, full)
            if spans is not None:
                return full, [_Example(k, full, spans)]
        spans, through, broken = [], [], None
        for ai in turns:
            before = self._render(chat[:ai], tools, True, row)
            text = full if ai + 1 == len(chat) else self._render(chat[: ai + 1], tools, False, row)
            if not text.startswith(before):
                self._refuse(row, ai, chat, "the generation prompt does not match the assistant turn")
            end = len(text)
            if not full.startswith(text):
                # Templates that close the conversation differently (Phi-3 appends eos, gpt-oss ends the last
                # turn with <|return|> instead of <|end|>) agree with the full rendering up to past the content:
                # the turn's span ends where the two renderings part. Text changed before the content end
                # (an earlier turn rewritten) breaks the prefix property.
                content = str(chat[ai].get("content") or "").strip()
                p = text.find(content, len(before)) if content else -1
                shared = len(os.path.commonprefix([text, full]))
                end = shared if p >= 0 and shared >= p + len(content) else -1
                if end < 0 and broken is None:
                    broken = ai
            spans.append((len(before), end, ai))
            through.append(text)
        expand = self.multi_turn == "per_turn" and len(turns) > 1
        if broken is not None and not expand:
            if self.multi_turn == "single":
                self._refuse(row, broken, chat, "rendering later turns changes this turn's text "
                                                "(the template rewrites earlier turns)")
            expand = True
        if not expand:
            return full, [_Example(k, full, spans)]
        # one example per assistant turn: its context as the template renders it at inference, loss on it alone
        return full, [_Example(k, text, [(c0, len(text), ai)]) for (c0, _, ai), text in zip(spans, through)]

    def _window_spans(self, chat: list[dict], tools: list | None, full: str) -> list[tuple[int, int, int]] | None:
        """The prefix method's spans in time linear in the number of turns, or None where this cannot vouch
        for them (the caller then renders every prefix).

        Each message's text is what it adds to a short window (the system message, then the messages from
        the previous one, or from the previous user message for templates that insist on starting with
        one). Those pieces, laid end to end after the first message's true rendering, must give back the
        whole conversation's rendering character for character; any mismatch (a template that rewrites
        earlier turns, closes the last turn differently, or needs more context) returns None."""
        h = 1 if chat and chat[0]["role"] == "system" else 0
        if len(chat) <= h + 1 or chat[h]["role"] == "assistant":
            return None
        head, spans = chat[:h], []

        def render(messages: list[dict], gen: bool) -> str:
            return self._jinja(messages, tools, gen)

        try:
            first = render(chat[: h + 1], False)
            if not full.startswith(first):
                return None
            pos, last_user = len(first), h if chat[h]["role"] == "user" else None
            for k in range(h + 1, len(chat)):
                for start in dict.fromkeys(j for j in (k - 1, last_user) if j is not None):
                    try:
                        before = render(head + chat[start:k], False)
                        after = render(head + chat[start : k + 1], False)
                        prompt = render(head + chat[start:k], True) if chat[k]["role"] == "assistant" else before
                        break
                    except Exception:  # e.g. a template that wants a user message first
                        continue
                else:
                    return None
                if not (after.startswith(before) and after.startswith(prompt) and prompt.startswith(before)):
                    return None
                piece = after[len(before):]
                if not full.startswith(piece, pos):
                    return None
                if chat[k]["role"] == "assistant":
                    spans.append((pos + len(prompt) - len(before), pos + len(piece), k))
                elif chat[k]["role"] == "user":
                    last_user = k
                pos += len(piece)
        except Exception:
            return None
        return spans if pos == len(full) else None

    def _refuse(self, row: int, ai: int, chat: list[dict], which: str) -> None:
        turn = sum(1 for m in chat[: ai + 1] if m["role"] == "assistant")
        raise TemplateError(
            f"chat template '{self.template.name}' breaks the prefix property at assistant turn {turn} "
            f"(message {ai}): {which}", row=row, field=f"messages[{ai}]",
            hint="data.multi_turn: auto (the default) trains such templates one turn at a time; or pass a training "
                 "template (template: path/to/train.jinja, e.g. one with {% generation %} markers)")

    # -- token spans -----------------------------------------------------------------------------
    def _is_blank(self, token_id: int) -> bool:
        if token_id not in self._blank:
            self._blank[token_id] = token_id not in self._special and not self.tok.decode([token_id]).strip()
        return self._blank[token_id]

    @staticmethod
    def _content_start(text: str, c0: int, c1: int, message: dict | None) -> int:
        """Move a span's start to the message content, past scaffolding the template inserts before it
        (an empty ``<think></think>`` block, say). Real thinking keeps its loss. An empty reasoning block
        at the span's start is skipped first, so an answer whose text also occurs inside the scaffold
        ("think", a newline) is not found there."""
        if message is None or _reasoning(message):
            return c0
        content = str(message.get("content") or "").strip()
        scaffold = _EMPTY_THINK.match(text, c0, c1)
        start = scaffold.end() if scaffold else c0
        p = text.find(content, start, c1) if content else -1
        return p if p > c0 else start

    def _labels(self, ids: np.ndarray, offsets: np.ndarray, ex: _Example, messages: list[dict], row: int
                ) -> Encoded:
        """Tokens starting at or after a span's start and ending by its end carry loss (a token that
        straddles the end belongs to what follows, e.g. the next turn's header)."""
        starts, ends = offsets[:, 0], np.maximum.accumulate(offsets[:, 1]) if len(offsets) else offsets[:, 1]
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
        weights = None
        spans = ex.spans[-1:] if self.loss_on == "last_assistant" else ex.spans
        for c0, c1, ai in spans:
            message = ex.chat[ai] if ai >= 0 else None
            if message is not None and not _trained(messages[ai]):
                continue
            begin = self._content_start(ex.text, c0, c1, message)
            lo, hi = int(np.searchsorted(starts, begin, "left")), int(np.searchsorted(ends, c1, "right"))
            if 0 < lo and starts[lo - 1] >= c0 and offsets[lo - 1, 1] > begin:
                lo -= 1  # a token that carries the content's first character with a space before it ("▁It")
            while lo < hi and self._is_blank(int(ids[lo])):
                lo += 1
            while hi > lo and self._is_blank(int(ids[hi - 1])):
                hi -= 1
            labels[lo:hi] = ids[lo:hi]
            if ai >= 0 and messages[ai].get("weight", 1) != 1:
                weights = np.ones(len(ids), dtype=np.float32) if weights is None else weights
                weights[lo:hi] = messages[ai]["weight"]
            if message is not None:
                self._count_turn(ex.text, begin, c1, starts[lo:hi], message, ai, row)
        return Encoded(ids, labels, weights)

    def _count_turn(self, text: str, c0: int, c1: int, token_starts: np.ndarray, message: dict, ai: int,
                    row: int) -> None:
        """Counts for reports; thinking the template does not render is an error, not a silent drop."""
        self.stats["assistant_turns"] += 1
        self.stats["tool_call_turns"] += bool(message.get("tool_calls"))
        thinking = _reasoning(message)
        if thinking is None:
            return
        at = text.find(thinking, c0, c1)
        if at < 0:
            raise TemplateError(
                f"chat template '{self.template.name}' does not render the thinking of message {ai} "
                f"(reasoning_content or a leading <think> block): the model would learn answers without their "
                f"reasoning", row=row, field=f"messages[{ai}]",
                hint="use a template that renders reasoning (the model's own, e.g. Qwen3's), or data.reasoning: drop "
                     "to train the answers only")
        self.stats["thinking_turns"] += 1
        self.stats["thinking_tokens"] += int(((token_starts >= at) & (token_starts < at + len(thinking))).sum())

    # -- the batch -------------------------------------------------------------------------------
    def _examples(self, k: int, conv: Conversation, chat: list[dict]) -> tuple[str, list[_Example]]:
        """(the whole conversation rendered, its examples with their loss spans)."""
        tools = _plain_template_data(conv.tools) if conv.tools else None
        try:
            if self.loss_on == "all":
                full = self._render(chat, tools, False, conv.row)
                return full, [_Example(k, full, [])]
            if self.template.has_generation_markers and self.multi_turn != "per_turn":
                found = self._marker_examples(k, chat, tools)
                return found[0].text, found
            return self._prefix_examples(k, chat, tools, conv.row)
        except TemplateError as err:
            if err.row is None:
                raise TemplateError(err.message, row=conv.row, field=err.field, hint=err.hint) from None
            raise

    def encode(self, convs: list[Conversation]) -> list[list[Encoded]]:
        """Encode a batch: for each conversation its examples (one, or one per assistant turn where the
        template rewrites history). Text conversations get loss on every token and a closing eos."""
        out: list[list[Encoded]] = [[] for _ in convs]
        text_idx = [i for i, c in enumerate(convs) if c.text is not None]
        if text_idx:
            enc = self.tok([convs[i].text for i in text_idx], add_special_tokens=True)
            eos = self.tok.eos_token_id
            for i, ids in zip(text_idx, enc["input_ids"]):
                if eos is not None and (not ids or ids[-1] != eos):
                    ids = ids + [eos]
                arr = np.asarray(ids, dtype=np.int32)
                out[i].append(Encoded(arr, arr.copy()))
        examples: list[_Example] = []
        expanded: dict[int, str] = {}  # conversation -> its single rendering, to count what expansion costs
        for i, conv in enumerate(convs):
            if conv.text is not None:
                continue
            chat = self._for_template(conv)
            full, found = self._examples(i, conv, chat)
            self._check_tools(full, conv.tools, conv.row)
            self.stats["conversations"] += 1
            self.stats["tool_results"] += sum(m["role"] == "tool" for m in chat)
            if len(found) > 1:
                expanded[i] = full
            for ex in found:
                ex.chat = chat
            examples.extend(found)
        encoded = self._backend.encode_batch([e.text for e in examples], add_special_tokens=False)
        for ex, e in zip(examples, encoded):
            ids = np.fromiter(e.ids, dtype=np.int32, count=len(e.ids))
            if self.loss_on == "all":
                out[ex.conv].append(Encoded(ids, ids.copy()))
                continue
            offsets = np.fromiter(chain.from_iterable(e.offsets), dtype=np.int64, count=2 * len(ids)).reshape(-1, 2)
            conv = convs[ex.conv]
            out[ex.conv].append(self._labels(ids, offsets, ex, conv.messages, conv.row))
        if expanded:
            singles = self._backend.encode_batch(list(expanded.values()), add_special_tokens=False)
            for i, single in zip(expanded, singles):
                self.stats["per_turn_conversations"] += 1
                self.stats["per_turn_examples"] += len(out[i])
                self.stats["per_turn_extra_tokens"] += sum(len(ids) for ids, _ in out[i]) - len(single.ids)
        return out

    # -- what each token is, for show-mask -------------------------------------------------------
    def explain(self, conv: Conversation) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``(input_ids, labels, kinds)`` of each example of ``conv``; ``kinds`` indexes ``KINDS``: thinking,
        tool-call text and tool results told apart from other loss and context tokens (for display only)."""
        encoded = self.encode([conv])[0]
        if conv.text is not None:
            return [(ids, labels, np.full(len(ids), KINDS.index("target"), np.int8)) for ids, labels in encoded]
        chat = self._for_template(conv)
        _, found = self._examples(0, conv, chat)
        out = []
        for ex, (ids, labels) in zip(found, encoded):
            starts = np.array([s for s, _ in self._backend.encode(ex.text, add_special_tokens=False).offsets])
            kinds = np.where(labels != IGNORE_INDEX, KINDS.index("target"), KINDS.index("context")).astype(np.int8)

            def mark(kind: str, a: int, b: int, loss: bool) -> None:
                hit = (starts >= a) & (starts < b) & ((labels != IGNORE_INDEX) == loss)
                kinds[hit] = KINDS.index(kind)

            at = 0
            for ai, m in enumerate(chat):
                if m["role"] == "tool":  # templates write results raw or as a JSON string
                    for form in (str(m.get("content", "")), json.dumps(str(m.get("content", "")))[1:-1]):
                        p = ex.text.find(form, at) if form.strip() else -1
                        if p >= 0:
                            mark("tool_result", p, p + len(form), False)
                            at = p + len(form)
                            break
            for c0, c1, ai in ex.spans:
                m = chat[ai] if ai >= 0 else {}
                if m.get("tool_calls"):
                    mark("tool_call", c0, c1, True)
                    content = str(m.get("content") or "").strip()
                    p = ex.text.find(content, c0, c1) if content else -1
                    if p >= 0:
                        mark("target", p, p + len(content), True)
                thinking = _reasoning(m) if m else None
                p = ex.text.find(thinking, c0, c1) if thinking else -1
                if p >= 0:
                    mark("thinking", p, p + len(thinking), True)
            out.append((ids, labels, kinds))
        return out
