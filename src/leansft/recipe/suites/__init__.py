"""Scored suites (``eval.suites``, ``leansft eval --suite``): public benchmarks run offline with their authors'
scoring (IFBench, IFEval, MMLU, MT-Bench) and question sets of the user's own. A run scores the base model before
step 1, every ``eval.suites_every`` steps and after the last; the before/after table carries paired bootstrap
intervals, and a score falling more than ``eval.forgetting_margin`` below the base model's is warned ("forgetting").

Each kind has a module: ``load_items(suite, seed) -> (items, skipped)`` and a scorer; ``run_suite`` drives the
model through a ``Model`` (greedy answers with the chat template, or the choices' log-likelihoods)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from leansft.core.config import SuiteConfig
from leansft.core.errors import LeanSFTError
from leansft.recipe.metrics_log import read_jsonl
from leansft.recipe.suites import instruction_following, mmlu, mtbench, qa

RESULTS = "suites.jsonl"  # in the run folder: one record per suite per time it ran, items included
BOOTSTRAP = 2000
LOADERS = {"qa": qa.load_items, "ifbench": instruction_following.load_items,
           "ifeval": instruction_following.load_items, "mmlu": mmlu.load_items, "mtbench": mtbench.load_items}


@dataclass
class Model:
    """What a suite asks of the model. ``answer(prompts, max_new_tokens)``: greedy answers to user messages or
    message lists through the chat template; ``render(prompt)``: that prompt as the model reads it;
    ``choices(requests)``: per (context, continuations) each continuation's (log-likelihood, greedy), on raw text
    (None where only given answers are scored)."""

    answer: Callable[[list, int], list[str]]
    render: Callable[[object], str]
    choices: Callable[[list[tuple[str, list[str]]]], list[list[tuple[float, bool]]]] | None = None


def load_items(suite: SuiteConfig, seed: int) -> tuple[list[dict], dict]:
    """The items the suite scores (a fixed, spread sample under ``limit``) and what it skips, counted by reason."""
    return LOADERS[suite.kind](suite, seed)


def subset(items: list[dict], limit: int | None, seed: int) -> list[int]:
    """Indices of at most ``limit`` of ``items``, spread over their strata as ``limit`` spreads (all without one)."""
    from leansft.recipe.suites.sampling import spread_sample

    picked = spread_sample([{"k": k, "stratum": it.get("stratum", "")} for k, it in enumerate(items)], limit, seed)
    return [p["k"] for p in picked]


def interval(values: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile bootstrap interval of the mean of ``values`` (paired differences, for a delta)."""
    if len(values) < 2:
        return float(values.mean()), float(values.mean())
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(BOOTSTRAP, len(values)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def run_suite(suite: SuiteConfig, items: list[dict], model: Model, skipped: dict | None = None) -> dict:
    """One suite on the model: its headline score (None for MT-Bench without a judge), every metric its authors
    report, a 95% interval, what was skipped, and each item as the model read it and as it was scored."""
    if suite.kind == "mmlu":
        if model.choices is None:
            raise LeanSFTError("mmlu scores the model's log-likelihoods: it needs a model, not --responses")
        result = mmlu.score(items, model.choices(mmlu.requests(items)))
    elif suite.kind == "mtbench":
        answers, seen = mtbench.answer_both(model, items, suite.answer_tokens)
        result = mtbench.score(suite, items, answers, seen)
    else:
        prompts = [it["prompt"] for it in items]
        answers = model.answer(prompts, suite.answer_tokens)
        rendered = [model.render(p) for p in prompts]
        scorer = qa.score_answers if suite.kind == "qa" else instruction_following.score
        result = scorer(suite, items, answers, rendered)
    values = np.array([it["score"] for it in result["items"] if it.get("score") is not None])
    headline = result["scores"].get(result["metric"])
    low, high = interval(values) if len(values) else (None, None)
    return {"suite": suite.name, "kind": suite.kind, "metric": result["metric"], "n": len(result["items"]),
            "score": headline, "ci95": [low, high], "scores": result["scores"],
            "skipped": {**(skipped or {}), **result.get("skipped", {})}, "items": result["items"],
            **({"judge_failed": result["judge_failed"]} if result.get("judge_failed") else {})}


def before_after(records: list[dict]) -> list[dict]:
    """Per suite: the first (before training) and last score, the delta and its paired bootstrap interval (the
    samples run between them under ``limit_between`` are not the suite whole: left out here)."""
    records = [r for r in records if not r.get("subset")]
    rows = []
    for name in dict.fromkeys(r["suite"] for r in records):
        runs = [r for r in records if r["suite"] == name]
        first, last = runs[0], runs[-1]
        row = {"suite": name, "metric": first["metric"], "n": first["n"], "before": first["score"],
               "before_step": first["step"], "after": last["score"], "after_step": last["step"], "delta": None,
               "delta_ci95": [None, None]}
        if first["score"] is not None and last["score"] is not None:
            pairs = [(a.get("score"), b.get("score")) for a, b in zip(first["items"], last["items"])]
            diff = np.array([b - a for a, b in pairs if a is not None and b is not None])
            row["delta"] = last["score"] - first["score"]
            row["delta_ci95"] = list(interval(diff)) if len(diff) else [None, None]
        rows.append(row)
    return rows


def read_results(run: Path) -> list[dict]:
    """The run's suite records (``RESULTS``), oldest first."""
    return read_jsonl(run / RESULTS)


def num(value: float | None, fmt: str = ".3f") -> str:
    return "n/a" if value is None else format(value, fmt)


def table(records: list[dict]) -> list[str]:
    """The before/after table (Markdown) for report.md and the model card; [] without suites."""
    rows = before_after(records)
    if not rows:
        return []
    lines = ["| suite | metric | items | before | after | change (95% interval) |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        low, high = r["delta_ci95"]
        change = "n/a" if r["delta"] is None else f"{r['delta']:+.3f} ({num(low, '+.3f')} to {num(high, '+.3f')})"
        lines.append(f"| {r['suite']} | {r['metric']} | {r['n']} | {num(r['before'])} (step {r['before_step']}) | "
                     f"{num(r['after'])} (step {r['after_step']}) | {change} |")
    return lines


NOTE = ("(eval.suites: greedy answers scored as each benchmark's authors score them, mmlu by the answer letters' "
        "log-likelihoods, suites of your own against their references; the interval is a paired bootstrap over the "
        "items)")


def section(records: list[dict], answers: bool = True) -> list[str]:
    """The before/after table, every metric of the last time each suite ran, what was skipped, and (``answers``)
    MT-Bench's answers side by side: the suites' part of report.md and the model card ([] without suites)."""
    lines = table(records)
    if not lines:
        return []
    records = [r for r in records if not r.get("subset")]
    lines += ["", NOTE]
    last = {r["suite"]: r for r in records}
    for name, record in last.items():
        others = {k: v for k, v in record.get("scores", {}).items() if k != record["metric"]}
        if others:
            lines.append(f"- {name} at step {record['step']}: " + ", ".join(f"{k} {num(v)}" for k, v in others.items()))
        for reason, count in record.get("skipped", {}).items():
            lines.append(f"- {name}: {count} skipped, {reason}")
    if answers:
        extra = side_by_side(records)
        lines += ["", *extra] if extra else []
    return lines


def side_by_side(records: list[dict], limit: int = 3) -> list[str]:
    """MT-Bench's answers before and after training for the first ``limit`` questions (Markdown), [] without."""
    lines: list[str] = []
    records = [r for r in records if not r.get("subset")]
    for name in dict.fromkeys(r["suite"] for r in records if r.get("kind") == "mtbench"):
        runs = [r for r in records if r["suite"] == name]
        first, last = runs[0], runs[-1]
        lines += [f"### {name}: answers before (step {first['step']}) and after (step {last['step']})", ""]
        for a, b in list(zip(first["items"], last["items"]))[:limit]:
            for turn in (0, 1):
                lines += [f"**{a['category']} {a['question_id']}, turn {turn + 1}:** {_quote(a['questions'][turn])}",
                          "", f"> before: {_quote(a['responses'][turn])}", ">",
                          f"> after: {_quote(b['responses'][turn])}", ""]
    return lines


def _quote(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "…"
