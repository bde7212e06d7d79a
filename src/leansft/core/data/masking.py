"""Render conversations with the tokenizer's own chat template and build the assistant-only loss mask.

How assistant tokens are found:
1. A template with ``{% generation %}`` markers reports the character spans of assistant output.
2. Otherwise each assistant turn i is located by rendering ``messages[:i]`` with the generation prompt
   and ``messages[:i+1]`` without; the text the turn adds is its span. Every rendering must be a
   prefix of the next and of the whole conversation, or the template rewrites earlier turns and we
   refuse (a training template is needed).
Either way the whole conversation is tokenised once (batched, fast tokenizer) and character spans are
mapped to tokens by offsets. Span edges are then normalised the same way for both paths: leading and
trailing whitespace-only tokens are dropped, so the loss covers the content and the end-of-turn
token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``...) but not the newline a template writes after it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from leansft.core.data.builtin_templates import BUILTIN_TEMPLATES
from leansft.core.data.formats import Conversation
from leansft.core.errors import TemplateError

IGNORE_INDEX = -100
LossOn = Literal["assistant", "last_assistant", "all"]
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_EMPTY_THINK = re.compile(r"\s*<think>\s*</think>\s*")  # the empty reasoning block Qwen3-style templates insert


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


class ChatEncoder:
    """Turns conversations into ``(input_ids, labels)`` arrays; labels are unshifted, -100 = no loss."""

    def __init__(self, tokenizer, template: ChatTemplate, loss_on: LossOn = "assistant") -> None:
        if loss_on not in ("assistant", "last_assistant", "all"):
            raise TemplateError(f"unknown loss_on '{loss_on}'", field="loss_on")
        self.tok = tokenizer
        self.template = template
        self.loss_on = loss_on
        self._blank: dict[int, bool] = {}
        # The Rust tokenizer itself, without any truncation/padding a tokenizer.json may carry: what
        # tokenizer(text, add_special_tokens=False) runs, minus the Python-side conversion of its output.
        self._backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self._backend.no_truncation()
        self._backend.no_padding()
        self._special = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special
        }

    # -- rendering -------------------------------------------------------------------------------
    def _apply(self, convs: list[list[dict]], gen_prompt: bool, tools: list | None) -> list[str]:
        return self.tok.apply_chat_template(convs, chat_template=self.template.source, tokenize=False,
                                            add_generation_prompt=gen_prompt, tools=tools)

    def _render(self, convs: list[list[dict]], gen_prompt: bool, rows: list[int],
                tools: list[list | None] | None = None) -> list[str]:
        """Render each conversation (with its row's tool definitions, if any); errors name the row."""
        out: list[str] = [""] * len(convs)
        tools = tools or [None] * len(convs)
        plain = [i for i, c in enumerate(convs) if c and not tools[i]]
        try:
            if plain:
                for i, t in zip(plain, self._apply([convs[i] for i in plain], gen_prompt, None)):
                    out[i] = t
            for i, c in enumerate(convs):
                if c and tools[i]:  # one tool list per call: conversations with tools render one by one
                    (out[i],) = self._apply([c], gen_prompt, tools[i])
        except Exception:
            # Find the conversation that fails so the error can name its row.
            for i, c in enumerate(convs):
                try:
                    if c:
                        self._apply([c], gen_prompt, tools[i])
                except Exception as err:
                    raise TemplateError(
                        f"chat template '{self.template.name}' failed: {type(err).__name__}: {err}", row=rows[i]
                    ) from None
            raise
        return out

    def _check_tools(self, texts: list[str], tools: list[list | None], rows: list[int]) -> None:
        """Tool definitions given to a template that does not render them are an error, not a silent drop."""
        for text, defs, row in zip(texts, tools, rows):
            missing = [d["function"]["name"] for d in defs or [] if d["function"]["name"] not in text]
            if missing:
                raise TemplateError(
                    f"chat template '{self.template.name}' does not render the tool definitions (e.g. "
                    f"'{missing[0]}' is missing): the model would be trained on tool calls without the tools",
                    row=row, field="tools",
                    hint="use the model's own chat template with tool support, or drop the tools column")

    def _marker_spans(self, chats: list[list[dict]], tools: list[list | None]
                      ) -> tuple[list[str], list[list[tuple[int, int, int]]]]:
        texts: list[str] = [""] * len(chats)
        spans: list = [[] for _ in chats]
        # conversations without tools in one call; each with tools on its own (one tool list per call)
        groups = [[i for i, d in enumerate(tools) if not d]] + [[i] for i, d in enumerate(tools) if d]
        try:
            for group in filter(None, groups):
                t, sp = render_jinja_template(
                    conversations=[chats[i] for i in group], chat_template=self.template.source,
                    return_assistant_tokens_mask=True, add_generation_prompt=False, tools=tools[group[0]],
                    **self.tok.special_tokens_map,
                )
                for i, text, span in zip(group, t, sp):
                    texts[i], spans[i] = text, span
        except Exception as err:
            raise TemplateError(f"chat template '{self.template.name}' failed: {type(err).__name__}: {err}") from None
        out = []
        for chat, chat_spans in zip(chats, spans):
            turns = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
            same = len(turns) == len(chat_spans)
            out.append([(c0, c1, turns[k] if same else -1) for k, (c0, c1) in enumerate(chat_spans)])
        return texts, out

    def _diff_spans(self, chats: list[list[dict]], rows: list[int], tools: list[list | None]
                    ) -> tuple[list[str], list[list[tuple[int, int, int]]]]:
        full = self._render(chats, False, rows, tools)
        jobs = [(ci, ai) for ci, chat in enumerate(chats) for ai, m in enumerate(chat) if m["role"] == "assistant"]
        job_rows = [rows[ci] for ci, _ in jobs]
        before = self._render([chats[ci][:ai] for ci, ai in jobs], True, job_rows, [tools[ci] for ci, _ in jobs])
        # the last message's turn renders as the whole conversation: reuse it instead of rendering again
        inner = [k for k, (ci, ai) in enumerate(jobs) if ai + 1 < len(chats[ci])]
        inner_text = self._render([chats[jobs[k][0]][: jobs[k][1] + 1] for k in inner], False,
                                  [job_rows[k] for k in inner], [tools[jobs[k][0]] for k in inner])
        through = [full[ci] for ci, _ in jobs]
        for k, text in zip(inner, inner_text):
            through[k] = text
        spans: list[list[tuple[int, int, int]]] = [[] for _ in chats]
        for (ci, ai), b, t in zip(jobs, before, through):
            turn = sum(1 for m in chats[ci][: ai + 1] if m["role"] == "assistant")
            end = len(t)
            if t.startswith(b) and not full[ci].startswith(t):
                # Templates that close the conversation differently (Phi-3 appends eos, gpt-oss ends the last
                # turn with <|return|> instead of <|end|>) agree with the full rendering up to past the content:
                # the turn's span ends where the two renderings part. Text changed before the content end
                # (an earlier turn rewritten) is still refused.
                content = str(chats[ci][ai].get("content") or "").strip()
                p = t.find(content, len(b)) if content else -1
                shared = len(os.path.commonprefix([t, full[ci]]))
                if p >= 0 and shared >= p + len(content):
                    end = shared
            if not t.startswith(b) or not full[ci].startswith(t[:end]):
                which = "the generation prompt does not match the assistant turn" if not t.startswith(b) else (
                    "rendering later turns changes this turn's text (the template rewrites earlier turns)"
                )
                raise TemplateError(
                    f"chat template '{self.template.name}' breaks the prefix property at assistant turn {turn} "
                    f"(message {ai}): {which}",
                    row=rows[ci],
                    field=f"messages[{ai}]",
                    hint="pass a training template (template: path/to/train.jinja, e.g. one with {% generation %} "
                    "markers) that renders every turn the same way whatever follows",
                )
            spans[ci].append((len(b), end, ai))
        return full, spans

    # -- token spans -----------------------------------------------------------------------------
    def _is_blank(self, token_id: int) -> bool:
        if token_id not in self._blank:
            self._blank[token_id] = token_id not in self._special and not self.tok.decode([token_id]).strip()
        return self._blank[token_id]

    @staticmethod
    def _content_start(text: str, c0: int, c1: int, message: dict | None) -> int:
        """Move a span's start to the message content, past scaffolding the template inserts before it
        (an empty ``<think></think>`` block, say). Real reasoning (``reasoning_content``) keeps its loss.
        An empty reasoning block at the span's start is skipped first, so an answer whose text also
        occurs inside the scaffold ("think", a newline) is not found there."""
        if message is None or message.get("reasoning_content"):
            return c0
        content = str(message.get("content") or "").strip()
        scaffold = _EMPTY_THINK.match(text, c0, c1)
        start = scaffold.end() if scaffold else c0
        p = text.find(content, start, c1) if content else -1
        return p if p > c0 else start

    def _labels(
        self, ids: np.ndarray, offsets: np.ndarray, text: str, chat: list[dict], spans: list[tuple[int, int, int]]
    ) -> np.ndarray:
        """Tokens starting at or after a span's start and ending by its end carry loss (a token that
        straddles the end belongs to what follows, e.g. the next turn's header)."""
        starts, ends = offsets[:, 0], np.maximum.accumulate(offsets[:, 1]) if len(offsets) else offsets[:, 1]
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
        if self.loss_on == "last_assistant":
            spans = spans[-1:]
        for c0, c1, ai in spans:
            c0 = self._content_start(text, c0, c1, chat[ai] if ai >= 0 else None)
            lo, hi = int(np.searchsorted(starts, c0, "left")), int(np.searchsorted(ends, c1, "right"))
            while lo < hi and self._is_blank(int(ids[lo])):
                lo += 1
            while hi > lo and self._is_blank(int(ids[hi - 1])):
                hi -= 1
            labels[lo:hi] = ids[lo:hi]
        return labels

    def encode(self, convs: list[Conversation]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Encode a batch. Text conversations get loss on every token and a closing eos."""
        out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(convs)
        chat_idx = [i for i, c in enumerate(convs) if c.text is None]
        text_idx = [i for i, c in enumerate(convs) if c.text is not None]
        if text_idx:
            enc = self.tok([convs[i].text for i in text_idx], add_special_tokens=True)
            eos = self.tok.eos_token_id
            for i, ids in zip(text_idx, enc["input_ids"]):
                if eos is not None and (not ids or ids[-1] != eos):
                    ids = ids + [eos]
                arr = np.asarray(ids, dtype=np.int32)
                out[i] = (arr, arr.copy())
        if chat_idx:
            chats = [convs[i].messages for i in chat_idx]
            rows = [convs[i].row for i in chat_idx]
            tools = [convs[i].tools for i in chat_idx]
            if self.template.has_generation_markers:
                texts, spans = self._marker_spans(chats, tools)
            else:
                texts, spans = self._diff_spans(chats, rows, tools)
            self._check_tools(texts, tools, rows)
            for k, (i, e) in enumerate(zip(chat_idx, self._backend.encode_batch(texts, add_special_tokens=False))):
                ids = np.fromiter(e.ids, dtype=np.int32, count=len(e.ids))
                if self.loss_on == "all":
                    out[i] = (ids, ids.copy())
                    continue
                offsets = np.array(e.offsets, dtype=np.int64).reshape(-1, 2)
                out[i] = (ids, self._labels(ids, offsets, texts[k], chats[k], spans[k]))
        return out  # type: ignore[return-value]
