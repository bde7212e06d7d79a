"""`leansft show-mask`: each example's tokens with the loss-carrying ones highlighted, in the terminal,
as JSON, or as one self-contained HTML page."""

from __future__ import annotations

import html
from collections import defaultdict

import numpy as np
from rich.console import Console
from rich.text import Text

from leansft.core.config import DataConfig
from leansft.core.data.dataset import TokenizedDataset
from leansft.core.data.formats import convert_row, detect_format
from leansft.core.data.masking import IGNORE_INDEX, KINDS, ChatEncoder, ChatTemplate
from leansft.core.data.sources import read_rows

STYLES = {"context": "dim", "target": "bold green", "thinking": "bold magenta", "tool_call": "bold cyan",
          "tool_result": "yellow"}
LEGEND = "loss: answer green, thinking magenta, tool call cyan; no loss: tool result yellow, other context dim"


def example_kinds(tokenizer, template: ChatTemplate, cfg: DataConfig, data: TokenizedDataset, n: int
                  ) -> list[np.ndarray]:
    """Token kinds (``KINDS``) of the first ``n`` examples, from their source rows rendered again; an
    example whose row cannot be matched shows plain loss/context."""
    shown = range(min(n, len(data)))
    kinds = [np.where(data.example(i)[1] != IGNORE_INDEX, 1, 0).astype(np.int8) for i in shown]
    encoder = ChatEncoder(tokenizer, template, cfg.loss_on, cfg.reasoning, cfg.multi_turn,
                          cfg.special_tokens_in_content)
    for si, src in enumerate(cfg.sources):
        wanted: dict[int, list[int]] = defaultdict(list)  # row -> the shown examples made from it
        for i in shown:
            if data.source[i] == si:
                wanted[int(data.rows[i])].append(i)
        fmt = src.format
        for number, row in read_rows(src.path, src.split):
            if not wanted:
                break
            if fmt == "auto":
                fmt = detect_format(row, src.path, number)
            if number not in wanted:
                continue
            conv = convert_row(row, fmt, src.path, number, images=data.store.images is not None)
            for ids, _, k in encoder.explain(conv):  # (with images: no match, their tokens expanded since)
                for i in wanted[number]:
                    if np.array_equal(data.example(i)[0], ids):
                        kinds[i] = k
            del wanted[number]
    return kinds


MAX_SPLIT = 8  # tokens one character's bytes may span (4 UTF-8 bytes; byte-fallback pieces of a grapheme)


def char_groups(tokenizer, ids: list[int]) -> list[tuple[int, int, str]]:
    """``(first, end, text)`` runs of tokens decoded together: one token where it decodes to whole characters,
    else the fewest consecutive tokens whose bytes make whole characters (Hindi, Thai, emoji and byte-fallback
    pieces split a character's bytes across tokens, and decoding them one by one prints U+FFFD)."""
    out, i = [], 0
    while i < len(ids):
        end, text = i + 1, tokenizer.decode(ids[i : i + 1])
        if "\ufffd" in text:
            for j in range(i + 2, min(i + MAX_SPLIT, len(ids)) + 1):
                joined = tokenizer.decode(ids[i:j])
                if "\ufffd" not in joined:
                    end, text = j, joined
                    break
        out.append((i, end, text))
        i = end
    return out


def stop_summary(tokenizer, template: ChatTemplate) -> str:
    """Which stop tokens end assistant turns for this tokenizer and template (the contract's end of the loss)."""
    stops = ChatEncoder(tokenizer, template).stops
    return f"stop tokens (template '{template.name}'): {stops.describe()}"


def stop_tokens(tokenizer, labels: list[int]) -> list[str]:
    """The last loss token of each loss span: the stop token that ends each trained turn."""
    on = [x != IGNORE_INDEX for x in labels] + [False]
    return [tokenizer.convert_ids_to_tokens(labels[j]) for j in range(len(labels)) if on[j] and not on[j + 1]]


def print_examples(tokenizer, data: TokenizedDataset, n: int, console: Console | None = None,
                   kinds: list[np.ndarray] | None = None, show: bool = True) -> list[dict]:
    """Print the first ``n`` examples coloured by token kind (``show``); return them as ``{row, input_ids, labels,
    stop_tokens}`` (show-mask's JSON)."""
    console = console or Console(quiet=not show)
    out = []
    for i in range(min(n, len(data))):
        ids, labels = (a.tolist() for a in data.example(i))
        out.append({"row": int(data.rows[i]), "input_ids": ids, "labels": labels,
                    "stop_tokens": stop_tokens(tokenizer, labels)})
        kind = kinds[i] if kinds else [int(x != IGNORE_INDEX) for x in labels]
        text = Text()
        for a, b, piece in char_groups(tokenizer, ids):  # a character split across tokens: underlined, whole
            k = max(kind[a:b], key=lambda k: k != 0)  # a loss kind where one of the tokens carries loss
            text.append(piece, style=STYLES[KINDS[k]] + (" underline" if b - a > 1 else ""))
        n_t = sum(1 for x in labels if x != IGNORE_INDEX)
        console.rule(f"example {i} (row {data.rows[i]}): {len(ids)} tokens, {n_t} carry loss, turns end with "
                     f"{', '.join(out[-1]['stop_tokens']) or '-'}")
        console.print(text)
    console.print(LEGEND)
    return out


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>leansft show-mask</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; }}
.ex {{ border-top: 1px solid #ccc; padding: .6em 0; }}
.toks {{ font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.7; }}
.t {{ border-right: 1px dotted #bbb; }}
.t:hover {{ outline: 1px solid #333; }}
.multi {{ text-decoration: underline dotted; }}
.loss, .target {{ background: #c8f0c8; }}
.thinking {{ background: #ead1f5; }}
.tool_call {{ background: #c6e6f5; }}
.tool_result {{ background: #fbefc0; color: #555; }}
.ctx {{ color: #777; }}
.cut {{ color: #aaa; text-decoration: line-through; }}
.trunc {{ color: #b00; }}
.hidden {{ display: none; }}
</style></head><body>
<h1>leansft show-mask</h1>
<p>{summary}. Loss: <span class="target">answer</span> <span class="thinking">thinking</span>
<span class="tool_call">tool call</span>; no loss: <span class="tool_result">tool result</span>
<span class="ctx">context</span>. Hover a token for its index and id; a dotted underline is one character whose bytes
span several tokens.
<label>show <select id="filter" onchange="filterExamples()">
<option value="all">all examples</option><option value="noloss">examples with no loss</option>
<option value="truncated">truncated examples</option></select></label></p>
{examples}
<script>
function filterExamples() {{
  var f = document.getElementById("filter").value;
  document.querySelectorAll(".ex").forEach(function (e) {{
    var show = f === "all" || (f === "noloss" && e.dataset.loss === "0") || (f === "truncated" && e.dataset.truncated === "1");
    e.classList.toggle("hidden", !show);
  }});
}}
</script></body></html>
"""


def _token_class(label: int, kind: str) -> str:
    return ("loss " if label != IGNORE_INDEX else "") + ("ctx" if kind == "context" else kind)


def _html_piece(a: int, b: int, piece: str, ids: list[int], labels: list[int], kind: list[str], cut: int) -> str:
    """Tokens ``a..b`` (one, or several that share a character's bytes: dotted underline, each listed on hover)."""
    j = next((j for j in range(a, b) if labels[j] != IGNORE_INDEX), a)  # a loss token's class where one has loss
    cls = _token_class(labels[j], kind[j]) if a < cut else "cut"
    which = f"#{a} id {ids[a]}" if b - a == 1 else f"#{a}-{b - 1} ids {', '.join(map(str, ids[a:b]))} (one character)"
    return (f'<span class="t {cls}{" multi" if b - a > 1 else ""}" title="{which}{"" if a < cut else " (cut off)"}">'
            f"{html.escape(piece)}</span>")


def html_page(tokenizer, data: TokenizedDataset, n: int, max_length: int | None = None,
              kinds: list[np.ndarray] | None = None, stops: str = "") -> str:
    """One self-contained page (inline CSS and script, nothing fetched) of the first ``n`` examples."""
    parts, total_loss = [], 0
    shown = min(n, len(data))
    for i in range(shown):
        ids, labels = (a.tolist() for a in data.example(i))
        truncated = max_length is not None and len(ids) > max_length
        cut = max_length if truncated else len(ids)  # tokens from here on are cut off: no loss, shown struck out
        n_loss = sum(1 for x in labels[:cut] if x != IGNORE_INDEX)
        total_loss += n_loss
        kind = [KINDS[k] for k in kinds[i]] if kinds else ["target" if x != IGNORE_INDEX else "context"
                                                              for x in labels]
        spans = "".join(_html_piece(a, b, piece, ids, labels, kind, cut) for a, b, piece in char_groups(tokenizer, ids))
        note = f' <span class="trunc">truncated at {max_length}</span>' if truncated else ""
        ends = html.escape(", ".join(stop_tokens(tokenizer, labels)) or "-")
        parts.append(f'<div class="ex" id="ex{i}" data-loss="{n_loss}" data-truncated="{int(truncated)}">'
                     f"<h3>example {i} (row {int(data.rows[i])}): {len(ids)} tokens, {n_loss} carry loss, turns end "
                     f"with {ends}{note}</h3>"
                     f'<div class="toks">{spans}</div></div>')
    summary = f"{shown} of {len(data)} examples, {total_loss:,} loss tokens" + html.escape(stops and f"; {stops}")
    return _PAGE.format(summary=summary, examples="\n".join(parts))
