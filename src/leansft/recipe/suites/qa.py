"""Suites of the user's own (kind qa): questions with reference answers, the model's greedy answers scored by
exact match, containment or ROUGE-L. Offline by construction: the questions are the user's file, the scoring is
here."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from leansft.core.config import SuiteConfig
from leansft.core.data.sources import jsonl_rows
from leansft.core.errors import DataError


def normalise(text: str) -> str:
    """Trimmed, whitespace collapsed, case folded: what exact_match and contains compare."""
    return " ".join(text.split()).casefold()


def rouge_l(answer: str, reference: str) -> float:
    """ROUGE-L F1 (beta 1) on lower-cased alphanumeric words, as Google's rouge-score tokenises (no stemming)."""
    a, r = (re.sub(r"[^a-z0-9]+", " ", t.lower()).split() for t in (answer, reference))
    if not a or not r:
        return float(a == r)
    prev = [0] * (len(r) + 1)
    for x in a:  # the longest common subsequence, one row at a time
        row = [0]
        for j, y in enumerate(r):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
        prev = row
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(r)
    return 2 * precision * recall / (precision + recall)


def score(metric: str, answer: str, reference: str) -> float:
    if metric == "exact_match":
        return float(normalise(answer) == normalise(reference))
    if metric == "contains":
        return float(normalise(reference) in normalise(answer))
    return rouge_l(answer, reference)


def load_items(suite: SuiteConfig, seed: int) -> tuple[list[dict], dict]:
    """The suite's items ({prompt, reference}); ``limit``: a fixed sample drawn from the seed, in file order."""
    path = Path(suite.data)
    if not path.is_file():
        raise DataError("file not found", file=suite.data, field=f"eval.suites[{suite.name}].data")
    items = []
    for number, row in jsonl_rows(path):
        prompt = row.get("messages")
        prompt = prompt if prompt is not None else row.get("prompt")
        reference = row.get("answer", row.get("reference"))
        if not (isinstance(prompt, str) and prompt.strip() or isinstance(prompt, list) and prompt):
            raise DataError("expected a prompt (a user message) or messages", file=suite.data, row=number,
                            field="prompt")
        if not isinstance(reference, str):
            raise DataError("expected the reference answer as a string", file=suite.data, row=number, field="answer")
        items.append({"prompt": prompt, "reference": reference})
    if not items:
        raise DataError("no items", file=suite.data, field=f"eval.suites[{suite.name}].data")
    if suite.limit is not None and suite.limit < len(items):
        keep = np.sort(np.random.default_rng(seed).choice(len(items), size=suite.limit, replace=False))
        items = [items[i] for i in keep]
    return items, {}


def score_answers(suite: SuiteConfig, items: list[dict], answers: list[str], rendered: list[str]) -> dict:
    scored = [{"prompt": it["prompt"], "rendered": seen, "reference": it["reference"], "response": a,
               "score": score(suite.metric, a, it["reference"])} for it, a, seen in zip(items, answers, rendered)]
    return {"metric": suite.metric, "scores": {suite.metric: float(np.mean([s["score"] for s in scored]))},
            "items": scored}
