"""Suites of the user's own (``eval.suites``): questions with reference answers, the model's greedy answers scored
before step 1, every ``eval.suites_every`` steps and after the last; the before/after table with paired bootstrap
intervals, and a warning where a score falls below the base model's by more than ``eval.forgetting_margin``.

Offline by construction: the questions are the user's file, the scoring is here (no judge, no download)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np

from leansft.core.config import SuiteConfig
from leansft.core.errors import DataError
from leansft.recipe.metrics_log import read_jsonl

log = logging.getLogger("leansft")
RESULTS = "suites.jsonl"  # in the run folder: one record per suite per time it ran, items included
BOOTSTRAP = 2000


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


def load_items(suite: SuiteConfig, seed: int) -> list[dict]:
    """The suite's items ({prompt, reference}); ``limit``: a fixed sample drawn from the seed, in file order."""
    path = Path(suite.data)
    if not path.is_file():
        raise DataError("file not found", file=suite.data, field=f"eval.suites[{suite.name}].data")
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise DataError("invalid JSON", file=suite.data, row=number) from None
        prompt = row.get("messages") if isinstance(row, dict) else None
        prompt = prompt if prompt is not None else row.get("prompt") if isinstance(row, dict) else None
        reference = row.get("answer", row.get("reference")) if isinstance(row, dict) else None
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
    return items


def interval(values: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile bootstrap interval of the mean of ``values`` (paired differences, for a delta)."""
    if len(values) < 2:
        return float(values.mean()), float(values.mean())
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(BOOTSTRAP, len(values)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def run_suite(suite: SuiteConfig, items: list[dict], answer) -> dict:
    """``answer(prompts, max_new_tokens)`` -> the model's answers; the suite's score and each item's verdict."""
    answers = answer([it["prompt"] for it in items], suite.max_new_tokens)
    scored = [{**it, "response": a, "score": score(suite.metric, a, it["reference"])} for it, a in zip(items, answers)]
    values = np.array([s["score"] for s in scored])
    low, high = interval(values)
    return {"suite": suite.name, "metric": suite.metric, "n": len(scored), "score": float(values.mean()),
            "ci95": [low, high], "items": scored}


def before_after(records: list[dict]) -> list[dict]:
    """Per suite: the first (before training) and last score, the delta and its paired bootstrap interval."""
    rows = []
    for name in dict.fromkeys(r["suite"] for r in records):
        runs = [r for r in records if r["suite"] == name]
        first, last = runs[0], runs[-1]
        diff = np.array([b["score"] - a["score"] for a, b in zip(first["items"], last["items"])])
        rows.append({"suite": name, "metric": first["metric"], "n": first["n"], "before": first["score"],
                     "before_step": first["step"], "after": last["score"], "after_step": last["step"],
                     "delta": last["score"] - first["score"], "delta_ci95": list(interval(diff))})
    return rows


def read_results(run: Path) -> list[dict]:
    """The run's suite records (``RESULTS``), oldest first."""
    return read_jsonl(run / RESULTS)


def table(records: list[dict]) -> list[str]:
    """The before/after table (Markdown) for report.md and the model card; [] without suites."""
    rows = before_after(records)
    if not rows:
        return []
    lines = ["| suite | metric | items | before | after | change (95% interval) |", "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        low, high = r["delta_ci95"]
        lines.append(f"| {r['suite']} | {r['metric']} | {r['n']} | {r['before']:.3f} (step {r['before_step']}) | "
                     f"{r['after']:.3f} (step {r['after_step']}) | {r['delta']:+.3f} ({low:+.3f} to {high:+.3f}) |")
    return lines
