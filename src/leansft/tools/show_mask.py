"""`leansft show-mask`: each example's tokens with the loss-carrying ones highlighted, in the terminal,
as JSON, or as one self-contained HTML page."""

from __future__ import annotations

import html

from rich.console import Console
from rich.text import Text

from leansft.core.data.dataset import TokenizedDataset
from leansft.core.data.masking import IGNORE_INDEX


def print_examples(tokenizer, data: TokenizedDataset, n: int, console: Console | None = None) -> list[dict]:
    """Print the first ``n`` examples (loss tokens bold green); return them as ``{row, input_ids, labels}``."""
    console = console or Console()
    out = []
    for i in range(min(n, len(data))):
        ids, labels = (a.tolist() for a in data.example(i))
        out.append({"row": int(data.rows[i]), "input_ids": ids, "labels": labels})
        text = Text()
        for t, lab in zip(ids, labels):
            text.append(tokenizer.decode([t]), style="bold green" if lab != IGNORE_INDEX else "dim")
        n_t = sum(1 for x in labels if x != IGNORE_INDEX)
        console.rule(f"example {i} (row {data.rows[i]}): {len(ids)} tokens, {n_t} carry loss (green)")
        console.print(text)
    return out


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>leansft show-mask</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; }}
.ex {{ border-top: 1px solid #ccc; padding: .6em 0; }}
.toks {{ font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.7; }}
.t {{ border-right: 1px dotted #bbb; }}
.t:hover {{ outline: 1px solid #333; }}
.loss {{ background: #c8f0c8; }}
.ctx {{ color: #777; }}
.trunc {{ color: #b00; }}
.hidden {{ display: none; }}
</style></head><body>
<h1>leansft show-mask</h1>
<p>{summary}. Loss tokens are green; hover a token for its index and id.
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


def html_page(tokenizer, data: TokenizedDataset, n: int, max_length: int | None = None) -> str:
    """One self-contained page (inline CSS and script, nothing fetched) of the first ``n`` examples."""
    parts, total_loss = [], 0
    shown = min(n, len(data))
    for i in range(shown):
        ids, labels = (a.tolist() for a in data.example(i))
        n_loss = sum(1 for x in labels if x != IGNORE_INDEX)
        total_loss += n_loss
        truncated = max_length is not None and len(ids) > max_length
        spans = "".join(
            f'<span class="t {"loss" if lab != IGNORE_INDEX else "ctx"}" title="#{j} id {t}">'
            f"{html.escape(tokenizer.decode([t]))}</span>"
            for j, (t, lab) in enumerate(zip(ids, labels)))
        note = f' <span class="trunc">truncated at {max_length}</span>' if truncated else ""
        parts.append(f'<div class="ex" id="ex{i}" data-loss="{n_loss}" data-truncated="{int(truncated)}">'
                     f"<h3>example {i} (row {int(data.rows[i])}): {len(ids)} tokens, {n_loss} carry loss{note}</h3>"
                     f'<div class="toks">{spans}</div></div>')
    summary = f"{shown} of {len(data)} examples, {total_loss:,} loss tokens"
    return _PAGE.format(summary=summary, examples="\n".join(parts))
