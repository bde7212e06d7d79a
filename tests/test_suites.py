"""Suites of the user's own (eval.suites, eval --suite): scoring, the before/after table, forgetting warned; the
benchmarks (ifbench, mmlu, mtbench) inside a run, before and after."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from helpers import run_config
from test_benchmark_suites import write_mmlu

from leansft.core.config import SuiteConfig
from leansft.recipe import suites
from leansft.recipe.suites import qa
from leansft.tools.cli import main

QUESTIONS = ["Give three tips for staying healthy.", "What are the three primary colors?",
             "Describe the structure of an atom.", "How can we reduce air pollution?"]


def test_the_metrics():
    assert qa.score("exact_match", "  Paris.\n", "paris.") == 1.0 and qa.score("exact_match", "Paris", "Lyon") == 0
    assert qa.score("contains", "It is Paris, France.", "paris") == 1.0
    assert qa.rouge_l("the cat sat", "the cat sat on the mat") == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert qa.rouge_l("The cat, sat!", "the cat sat") == 1.0  # words, not punctuation or case
    assert qa.rouge_l("", "") == 1.0 and qa.rouge_l("a", "") == 0.0


def test_eval_scores_given_responses_on_a_fixed_sample(tmp_path, capsys):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": q, "answer": f"answer {i}"}) + "\n" for i, q in enumerate(QUESTIONS)))
    responses = tmp_path / "r.jsonl"
    responses.write_text("".join(json.dumps({"response": f"The answer {i}." if i % 2 else "no"}) + "\n"
                                 for i in range(4)))
    out = tmp_path / "scores.json"
    assert main(["eval", "none", "--suite", str(data), "--metric", "contains", "--responses", str(responses),
                 "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["score"] == 0.5 and [it["score"] for it in result["items"]] == [0, 1, 0, 1]
    assert "qa: contains 0.500" in capsys.readouterr().out
    suite = SuiteConfig(name="qa", data=str(data), limit=2)
    picked = [it["prompt"] for it in suites.load_items(suite, seed=0)[0]]
    assert picked == [it["prompt"] for it in suites.load_items(suite, seed=0)[0]] and len(picked) == 2


def test_a_file_of_your_own_named_like_a_benchmark_stays_your_own():
    from types import SimpleNamespace

    from leansft.tools.cli import suite_configs

    args = SimpleNamespace(suite=["evals/ifbench.jsonl,mmlu=/data/mmlu"], metric="contains", limit=None,
                           max_new_tokens=None, shots=5, judge_url=None, judge_model=None)
    own, mmlu = suite_configs(args)
    assert (own.name, own.kind, own.data, own.answer_tokens) == ("ifbench", "qa", "evals/ifbench.jsonl", 64)
    assert (mmlu.kind, mmlu.data, mmlu.shots) == ("mmlu", "/data/mmlu", 5)


def test_a_limit_spreads_over_strata_and_is_fixed_by_the_seed():
    from leansft.recipe.suites.sampling import spread_sample

    items = [{"i": i, "stratum": "abc"[i % 3] if i < 30 else "d"} for i in range(90)]
    picked = spread_sample(items, 8, seed=0)
    assert {it["stratum"] for it in picked} == set("abcd") and len(picked) == 8
    assert picked == spread_sample(items, 8, seed=0) and picked != spread_sample(items, 8, seed=1)
    assert [it["i"] for it in picked] == sorted(it["i"] for it in picked)  # file order kept
    assert spread_sample(items, None, seed=0) == items


@pytest.mark.slow
def test_a_destructive_lora_run_warns_of_forgetting_and_reports_before_and_after(tmp_path, tiny_run_assets,
                                                                                 caplog):
    """References are the base model's own greedy answers (a score of 1 before training); twenty LoRA steps at a
    learning rate that wrecks the model: the score falls, the log warns, report.md and the model card show the
    before/after table with IFBench, MMLU and MT-Bench beside it (MT-Bench's answers side by side, no judge)."""
    from leansft.recipe.train import train

    asked = tmp_path / "asked.jsonl"
    asked.write_text("".join(json.dumps({"prompt": q, "answer": "-"}) + "\n" for q in QUESTIONS))
    base = tmp_path / "base.json"
    assert main(["eval", tiny_run_assets["model"], "--suite", str(asked), "--max-new-tokens", "8",
                 "--json", str(base)]) == 0
    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps({"prompt": it["prompt"], "answer": it["response"]}) + "\n"
                           for it in json.loads(base.read_text())[0]["items"]))
    mmlu = write_mmlu(tmp_path / "mmlu", test=3)
    cfg = run_config(tmp_path, tiny_run_assets, "training.max_steps=20", "training.learning_rate=0.3",
                     "training.method=lora", "training.warmup_steps=0", "eval.suites_every=10",
                     "checkpoint.export=true", "batching.gradient_accumulation=1",
                     f"eval.suites=[{{name: own, data: {own}, metric: exact_match, max_new_tokens: 8}}, "
                     f"{{name: ifbench, limit: 3, max_new_tokens: 8}}, "
                     f"{{name: mmlu, data: {mmlu}, shots: 5, limit_between: 2}}, "
                     f"{{name: mtbench, limit: 2, max_new_tokens: 8}}]")
    with caplog.at_level(logging.WARNING, logger="leansft"):
        train(cfg)
    run = Path(cfg.output_dir)
    records = suites.read_results(run)
    assert [(r["suite"], r["step"]) for r in records] == [(n, s) for s in (0, 10, 20)
                                                          for n in ("own", "ifbench", "mmlu", "mtbench")]
    own_runs = [r for r in records if r["suite"] == "own"]
    assert own_runs[0]["score"] == 1.0 and own_runs[-1]["score"] < 1.0 and own_runs[-1]["forgetting"]
    assert "forgetting: suite own" in caplog.text
    report, card = (run / "report.md").read_text(), (run / "final" / "README.md").read_text()
    for text in (report, card):
        assert "| own | exact_match | 4 | 1.000 (step 0) |" in text
        assert "| ifbench | prompt_strict | 3 |" in text and "| mmlu | accuracy | 6 |" in text
        assert "| mtbench | answers (no judge) | 2 | n/a (step 0) | n/a (step 20) | n/a |" in text
        assert "- ifbench at step 20: prompt_loose" in text
    assert "### mtbench: answers before (step 0) and after (step 20)" in report
    mmlu = [r for r in records if r["suite"] == "mmlu"]
    assert all(it["prompt"].count("\nAnswer:") == 6 for it in mmlu[0]["items"])  # five worked examples, the question
    assert [(r["n"], r["subset"]) for r in mmlu] == [(6, False), (2, True), (6, False)]  # limit_between: 2 between
    assert {it["prompt"] for it in mmlu[1]["items"]} < {it["prompt"] for it in mmlu[0]["items"]}
    logged = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "suite_own" in r]
    assert [r["step"] for r in logged] == [0, 10, 20]
    assert ["suite_mmlu" in r for r in logged] == [True, False, True] and "suite_mmlu_sample" in logged[1]


def test_batched_greedy_answers_are_the_answers_one_at_a_time(tiny_run_assets):
    """Left-padded batches of prompts of other lengths answer as each prompt alone does (positions follow the
    padding; the tiny fp32 model has no near ties here)."""
    import transformers as tf

    from leansft.core.data.masking import resolve_template
    from leansft.core.inference.generation import generate, generate_greedy

    model = tf.AutoModelForCausalLM.from_pretrained(tiny_run_assets["model"])
    tok = tf.AutoTokenizer.from_pretrained(tiny_run_assets["model"])
    template = resolve_template(tok, None)
    prompts = [q * n for n in (1, 3) for q in QUESTIONS]  # 8 prompts, short and long
    alone = generate(model, tok, template, prompts, max_new_tokens=12, temperature=0.0)
    assert generate_greedy(model, tok, template, prompts, max_new_tokens=12, batch_size=3) == alone
    assert generate_greedy(model, tok, template, prompts, max_new_tokens=12, batch_tokens=64) == alone  # by length
