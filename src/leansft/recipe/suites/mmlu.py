"""MMLU: four-way multiple choice scored by the answer letters' log-likelihoods, the prompt as lm-eval's ``mmlu``
task writes it (0-shot, or the subject's first N ``dev`` questions as worked examples), on raw text without the
chat template, as lm-eval runs it by default. The data is a local folder in the Hub's ``cais/mmlu`` layout
(SUBJECT/test-*.parquet and SUBJECT/dev-*.parquet, as ``hf download cais/mmlu`` leaves it) or the
original release's (test/SUBJECT_test.csv, dev/SUBJECT_dev.csv); without one, the Hub's cais/mmlu where the
machine reaches the Hub or has it cached (``hub_data``)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from leansft.core.config import SuiteConfig
from leansft.core.errors import DataError, LeanSFTError
from leansft.recipe.suites.hub_data import snapshot
from leansft.recipe.suites.sampling import spread_sample

LETTERS = ("A", "B", "C", "D")
WHERE = ("mmlu needs its data as a local folder: `hf download cais/mmlu --repo-type dataset "
         "--local-dir DIR` on a machine with the Hub, then eval.suites: [{name: mmlu, data: DIR}] or --suite mmlu=DIR")


def _parquet(folder: Path, split: str) -> dict[str, list[dict]]:
    import pyarrow.parquet as pq

    by_subject: dict[str, list[dict]] = {}
    for path in sorted(folder.glob(f"*/{split}-*.parquet")):
        if path.parent.name in ("all", "auxiliary_train"):
            continue
        try:
            rows = pq.read_table(path, columns=["question", "choices", "answer"]).to_pylist()
        except (OSError, ValueError, KeyError) as e:  # not parquet, or not MMLU's columns
            raise DataError(f"expected MMLU's columns question, choices, answer ({type(e).__name__})",
                            file=str(path)) from None
        for number, row in enumerate(rows, 1):
            choices, answer = row["choices"], row["answer"]
            if not (isinstance(row["question"], str) and isinstance(choices, list) and len(choices) == 4
                    and all(isinstance(c, str) for c in choices) and answer in (0, 1, 2, 3)):
                raise DataError("expected a question, four choices and an answer 0-3", file=str(path), row=number)
            by_subject.setdefault(path.parent.name, []).append(
                {"question": row["question"], "choices": choices, "answer": int(answer)})
    return by_subject


def _csv(folder: Path, split: str) -> dict[str, list[dict]]:
    by_subject: dict[str, list[dict]] = {}
    for path in sorted((folder / split).glob(f"*_{split}.csv")):
        subject = path.name[: -len(f"_{split}.csv")]
        with path.open(newline="", encoding="utf-8") as fh:
            for number, row in enumerate(csv.reader(fh), 1):
                if len(row) != 6 or row[5].strip() not in LETTERS:
                    raise DataError("expected question, four choices and the answer letter", file=str(path),
                                    row=number)
                by_subject.setdefault(subject, []).append(
                    {"question": row[0], "choices": row[1:5], "answer": LETTERS.index(row[5].strip())})
    return by_subject


def read(folder: str | None) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """Test and dev questions by subject: from ``folder``, else the Hub's cais/mmlu (its cache first)."""
    if folder and not Path(folder).is_dir():
        raise LeanSFTError(f"{WHERE} ({folder} is not a folder)")
    root = Path(folder) if folder else snapshot("cais/mmlu", ["*/test-*.parquet", "*/dev-*.parquet"],
                                                ["all/*", "auxiliary_train/*"], WHERE)
    for reader in (_parquet, _csv):
        test = reader(root, "test")
        if test:
            return test, reader(root, "dev")
    raise LeanSFTError(f"no MMLU test questions under {root}. " + WHERE)


def question_text(q: dict) -> str:
    """lm-eval's doc_to_text for mmlu."""
    c = q["choices"]
    return f"{q['question'].strip()}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"


def context(subject: str, q: dict, shots: list[dict]) -> str:
    """The description, the worked examples, the question: what lm-eval's mmlu feeds the model."""
    head = f"The following are multiple choice questions (with answers) about {' '.join(subject.split('_'))}.\n\n"
    worked = "".join(f"{question_text(s)} {LETTERS[s['answer']]}\n\n" for s in shots)
    return head + worked + question_text(q)


def load_items(suite: SuiteConfig, seed: int) -> tuple[list[dict], dict]:
    test, dev = read(suite.data)
    items = []
    for subject, questions in test.items():
        shots = dev.get(subject, [])[: suite.shots]
        if len(shots) < suite.shots:
            raise LeanSFTError(f"mmlu with {suite.shots} shots needs {suite.shots} dev questions of {subject}; "
                               f"{len(shots)} under {suite.data}")
        items.extend({"subject": subject, "stratum": subject, "context": context(subject, q, shots),
                      "answer": q["answer"]} for q in questions)
    return spread_sample(items, suite.limit, seed), {}


def score(items: list[dict], logprobs: list[list[tuple[float, bool]]]) -> dict:
    scored = []
    for item, lls in zip(items, logprobs):
        values = [ll for ll, _ in lls]
        pick = int(np.argmax(values))
        scored.append({"subject": item["subject"], "prompt": item["context"], "loglikelihoods": values,
                       "pick": LETTERS[pick], "answer": LETTERS[item["answer"]],
                       "score": float(pick == item["answer"])})
    return {"metric": "accuracy", "scores": {"accuracy": float(np.mean([s["score"] for s in scored]))},
            "items": scored}


def requests(items: list[dict]) -> list[tuple[str, list[str]]]:
    return [(item["context"], [f" {letter}" for letter in LETTERS]) for item in items]
