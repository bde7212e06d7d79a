"""`leansft show-mask`: each example's tokens with the loss-carrying ones highlighted (and as JSON)."""

from __future__ import annotations

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
